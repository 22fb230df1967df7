"""torchao's import-time lines (``knapray.quiet_imports``): a LoRA command where torchao is
installed prints knapray's output first, without torchao's "Failed to load ..._C_*.so" lines
or torch's Enum deprecation warnings, and a model loaded by diffusers without its "Unable to
import `torchao` Tensor objects" line; every other record of those loggers still shows."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from needs import needs

REPO = Path(__file__).resolve().parents[2]


@needs("torchao", "peft")
def test_a_lora_command_prints_no_torchao_import_lines() -> None:
    """Before: ``knapray memory`` of the shipped LoRA config began with two "Failed to load"
    lines and two pytree warnings (torchao 0.18, torch 2.13), peft having imported torchao
    through transformers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_LOGS")}
    proc = subprocess.run([sys.executable, "-m", "knapray.cli", "memory", "--config",
                           str(REPO / "jobs" / "configs" / "flux_dev_lora.yaml")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Failed to load" not in out and "Enum subclass" not in out, out[:3000]
    assert out.startswith("flux-dev-lora: "), out[:3000]


@needs("torchao", "diffusers")
def test_diffusers_loads_a_model_without_its_torchao_line() -> None:
    """Before: every ``knapray sample`` and ``ingest`` with a VAE printed "Unable to import
    `torchao` Tensor objects. This may affect loading checkpoints serialized with `torchao`"
    (diffusers 0.42 on torchao 0.18), when the first model loaded imported diffusers'
    quantizers."""
    code = ("from knapray.corpus.hf import _import; _import('diffusers'); "
            "import diffusers.quantizers.torchao.torchao_quantizer; print('loaded')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_LOGS")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and (proc.stdout + proc.stderr).strip() == "loaded", proc.stdout + proc.stderr


def test_only_the_extension_lines_and_the_lasting_ones_are_dropped(caplog) -> None:
    from knapray.quiet_imports import _Drop, _drop_lasting, _extension_lines_dropped

    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    quantizer = logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer")
    with caplog.at_level(logging.WARNING):
        with _extension_lines_dropped():
            torchao.warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
            torchao.warning("Skipping import of cpp extensions due to incompatible torch version.")
            torchao.warning("a float8 recipe changed")
        torchao.warning("Failed to load /x/_C_cutlass.so after the import")  # outside the import: kept
        _drop_lasting()
        _drop_lasting()  # once only
        pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile", "<enum 'E'>")
        pytree.warning("some other pytree warning")
        quantizer.warning("Unable to import `torchao` Tensor objects. This may affect loading checkpoints "
                          "serialized with `torchao`")
        quantizer.warning("some other quantizer warning")
    assert [r.getMessage() for r in caplog.records] == [
        "a float8 recipe changed", "Failed to load /x/_C_cutlass.so after the import", "some other pytree warning",
        "some other quantizer warning"]
    assert sum(isinstance(f, _Drop) for f in pytree.filters) == sum(isinstance(f, _Drop) for f in quantizer.filters) == 1
    assert not any(isinstance(f, _Drop) for f in torchao.filters)
