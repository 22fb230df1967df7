"""``parallel.fp8``: the block matmuls in float8 for full training (torchao's float8 training).

- which layers (``knapray.worker.float8.float8_layers``) on Flux's and Wan's real blocks, and
  the memory model's count of their weights (``ModelShape.float8_weights``) from the same rule;
- the gradient check in float8 against float64, compiled, on thousands of tokens: the float8
  matmuls' own error is the yardstick (stated: below ``FP8_YARDSTICK``), and no parameter
  outside them (the conditioning path, modulation, norms, embedders, the final layer) is more
  than ``RATIO_BAR`` times worse, as in bf16;
- the config and the pre-flight refuse what cannot run, in one line;
- ``knapray dryrun`` counts it: float8 matmuls, the weights gathered in float8 (tensorwise),
  the one all-reduce of the next step's scales, the memory model within its bound.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from knapray.testing.grad_truth import RATIO_BAR, gradient_errors, small_config

pytest.importorskip("torchao.float8")

REPO = Path(__file__).resolve().parents[2]
BF16_YARDSTICK = 0.03
"""Above the bf16 check's yardstick (1.1e-2 to 2.3e-2 for these families)."""
FP8_YARDSTICK = 0.12
"""The most a float8 matmul's weight gradient may be off float64 (norm-wise): e4m3 keeps 3
mantissa bits (a relative rounding of up to 2^-4 per operand), e5m2 for the output's gradient
2; measured 0.06-0.09 on CPU (docs/parallelism.md)."""


def test_the_float8_layers_are_the_block_linears_over_image_or_all_tokens():
    from knapray.models.families import build_model
    from knapray.planning.costs.memory import ModelShape
    from knapray.worker.float8 import float8_layers

    for family, want in (
        ("flux", {"double_blocks.0.img.qkv", "double_blocks.0.img.proj", "double_blocks.0.img.mlp.fc1",
                  "double_blocks.0.img.mlp.fc2", "single_blocks.0.linear1", "single_blocks.0.linear2"}),
        ("wan", {f"single_blocks.0.{n}" for n in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out",
                                                  "attn2.to_q", "attn2.to_out", "ffn.fc1", "ffn.fc2")}),
    ):
        cfg = small_config(family, 64)
        with torch.device("meta"):
            model = build_model(cfg)
        names = float8_layers(model)
        assert {n for n in names if ".0." in n} == want, names
        # the memory model's count, per block kind, is these layers' weights
        shape = ModelShape.of(cfg)
        per_kind = [sum(model.get_submodule(n).weight.numel() for n in names if n.startswith(f"{kind}.0."))
                    for kind in ("double_blocks", "single_blocks")]
        assert list(shape.float8_weights) == per_kind, (family, shape.float8_weights, per_kind)


@pytest.mark.parametrize("family, scaling", [("flux", "tensorwise"), ("wan", "rowwise")])
def test_compiled_float8_gradients_against_float64(family: str, scaling: str):
    report = gradient_errors(family, "bf16_params", compile=True, side=64, fp8=scaling)
    assert report.tokens > 3000
    # float8 ran (its matmuls above bf16's error: at most 2.3e-2, tests/unit/test_grad_truth.py),
    # within what float8 is, and nothing else worse than its own matmuls by more than the bf16
    # check allows
    assert BF16_YARDSTICK < report.yardstick < FP8_YARDSTICK, report.summary()
    assert report.ratio <= RATIO_BAR, report.summary()


def test_the_config_and_the_preflight_refuse_what_cannot_run():
    from knapray.config.parallel import ParallelConfig
    from knapray.config.run import load_config
    from knapray.driver.preflight import RunError, check_fp8

    with pytest.raises(ValueError, match="parallel.precision must be bf16"):
        ParallelConfig(fp8=True, precision="fp32")
    with pytest.raises(ValueError, match="fp8_scaling"):
        ParallelConfig(fp8=True, fp8_scaling="blockwise")
    with pytest.raises(RunError, match=r"parallel.precision=auto is fp32 on this run \(scaling.use_gpu=false\)"):
        check_fp8(load_config(None, ["parallel.fp8=true"]))
    with pytest.raises(RunError, match="model.lora.base_dtype=fp8 instead"):
        check_fp8(load_config(None, ["parallel.fp8=true", "parallel.precision=bf16", "model.lora.rank=8"]))
    with pytest.raises(RunError, match="no block linear layer"):
        check_fp8(load_config(None, ["parallel.fp8=true", "parallel.precision=bf16", "model.hidden_size=40",
                                     "model.num_heads=4", "model.rope_axes_dim=[2,4,4]"]))
    check_fp8(load_config(None, ["parallel.fp8=true", "parallel.precision=bf16"]))  # a bf16 run passes


@pytest.fixture
def dryrun(capsys):
    from knapray.cli import main

    def run(*args: str) -> SimpleNamespace:
        code = main(["dryrun", *args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out)

    return run


def test_the_dry_run_counts_float8(dryrun):
    """flux_cluster.yaml's width, 2 + 4 blocks, 8 ranks fully sharded (the peak is not judged
    at this depth: docs/gpu.md; the 64-rank runs are in docs/parallelism.md)."""
    base = ["--config", str(REPO / "jobs" / "configs" / "flux_cluster.yaml"), "--world-size", "8", "--json",
            "--set", "model.depth_double=2", "--set", "model.depth_single=4", "--set", "parallel.fsdp=full"]
    runs = {}
    for name, sets in (("bf16", []), ("tensorwise", ["--set", "parallel.fp8=true"])):
        out = dryrun(*base, *sets)
        r = json.loads(out.stdout[out.stdout.index("{"):])
        assert r["syncs"] == [] and [f for f in r["failures"] if not f.startswith("predicted peak")] == [], r
        runs[name] = (r, out.stdout)
    r, text = runs["tensorwise"]
    gathered = {name: next(c["bytes"] for c in run[0]["collectives"] if c["kind"] == "_allgather_base_")
                for name, run in runs.items()}
    measured = {(c["kind"], c["group"]): c["count"] for c in r["collectives"]}
    assert measured == {(c["kind"], c["group"]): c["count"] for c in r["expected"]}
    assert measured[("all_reduce", 8)] == 1  # the next step's float8 scales
    assert measured[("allreduce_", 8)] == 1  # the gradients' norm
    assert "float8 matmuls beside them, parallel.fp8" in text and "float8" not in runs["bf16"][1].split("checks")[1]
    # the image stream's and the single blocks' weights gathered in 1 byte: about a quarter less
    assert 0.65 < gathered["tensorwise"] / gathered["bf16"] < 0.8, gathered


def test_the_gpu_checks_fp8_stage_runs_alone(capsys):
    """``python3 -m knapray.commands.gpu_check --only fp8`` (``make gpu-bench GPU_BENCH_FLAGS='--only fp8'``
    where the bench had no time left for it): that stage alone, no run, no other stage."""
    from knapray.commands.gpu_check import main

    assert main(["--cpu", "--only", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "== fp8: parallel.fp8's gradients" in out and "bf16 / float8: tensorwise" in out
    assert "runs: \n" in out and "== gradients" not in out and "GPU CHECK PASSED" in out
