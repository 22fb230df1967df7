"""LoRA adapters on a knapray model: ``model.lora`` in a run config.

    model:
      pretrained: /ckpt/FLUX.1-dev/transformer
      lora: {rank: 16, alpha: 16, targets: [attention]}

``inject`` puts peft's LoRA layers (``peft.inject_adapter_in_model``) on the linear layers
whose module names match the targets (a family's preset names, ``attention`` and
``all-linear``, or regular expressions over knapray's module names) and freezes everything
else. The model is built on the meta device and injected there, before ``parallelize``
(compile, checkpointing and FSDP2 see the wrapped layers like any other); the base comes
from the pretrained checkpoint (its parameter names are the layout's with ``.base_layer``
in them: ``base_name``) and ``init_adapters`` gives the adapters their first values, the
same on every rank whatever the sharding: ``lora_A`` from a generator seeded by the run's
seed and the parameter's name, ``lora_B`` zeros (so the model starts as the base).

The adapter's scale ``alpha / rank`` is peft's; ``knapray export --lora`` folds it into
``lora_B`` so that diffusers, which reads no alpha from a plain peft state dict, computes
the same (knapray/driver/lora_export.py).
"""

from __future__ import annotations

import hashlib
import math
import re

import torch
from torch import nn

from knapray.models.config import LoraConfig
from knapray.quiet_imports import load_torchao_quietly

ADAPTER = "default"
"""peft's adapter name (one adapter per model)."""
BASE = ".base_layer"


def target_modules(model: nn.Module, cfg: LoraConfig, presets: dict[str, tuple[str, ...]]) -> list[str]:
    """Names of ``model``'s linear layers the targets select (presets expanded); ValueError
    naming a target that selects nothing."""
    linears = [name for name, m in model.named_modules()
               if (isinstance(m, nn.Linear) and not name.endswith(BASE)) or _is_lora_layer(m)]
    chosen: list[str] = []
    for target in cfg.targets:
        patterns = presets.get(target, (target,))
        hits = [n for n in linears if any(re.fullmatch(p, n) for p in patterns)]
        if not hits:
            valid = ", ".join(sorted(presets)) or "none"
            raise ValueError(f"model.lora.targets: {target!r} selects no linear layer of this model "
                             f"(presets: {valid}; or a regular expression over names such as {linears[0]!r})")
        chosen += [n for n in hits if n not in chosen]
    return chosen


def _is_lora_layer(m: nn.Module) -> bool:
    """A linear layer peft wrapped already (another adapter's): it takes more adapters."""
    return hasattr(m, "lora_A") and hasattr(m, "base_layer")


def inject(model: nn.Module, cfg: LoraConfig, presets: dict[str, tuple[str, ...]]) -> list[str]:
    """Wrap the targeted linear layers with peft's LoRA layers (on whatever device the model
    is, the meta device included) and freeze every other parameter; returns the wrapped
    modules' names."""
    load_torchao_quietly()
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    names = target_modules(model, cfg, presets)
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha or cfg.rank, lora_dropout=cfg.dropout,
                              target_modules=names, bias="none", init_lora_weights=False)
    on_meta = any(p.is_meta for p in model.parameters())  # then the adapters too (allocated with the model)
    inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER, low_cpu_mem_usage=on_meta)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return names


def add_named_adapter(model: nn.Module, cfg: LoraConfig, presets: dict[str, tuple[str, ...]], name: str) -> list[str]:
    """Another LoRA adapter, ``name``, beside those the model has (a served run's: several
    adapters of one base, one active at a time, ``use_adapter``), on the layers ``cfg``
    targets, frozen like everything else; returns the wrapped modules' names."""
    load_torchao_quietly()
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    if not name or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == ADAPTER:
        raise ValueError(f"adapter name {name!r}: letters, digits, '.', '_' or '-', and not {ADAPTER!r}")
    names = target_modules(model, cfg, presets)
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha or cfg.rank, lora_dropout=0.0,
                              target_modules=names, bias="none", init_lora_weights=False)
    import warnings

    with warnings.catch_warnings():  # several adapters in one model is the point here
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
        inject_adapter_in_model(peft_cfg, model, adapter_name=name)
    for p in model.parameters():
        p.requires_grad_(False)
    return names


def adapters_of(model: nn.Module) -> list[str]:
    """The adapters the model holds, in the order they came."""
    from peft.tuners.lora import LoraLayer  # peft: loaded by ``inject`` (a model with adapters)

    out: list[str] = []
    for m in model.modules():
        if isinstance(m, LoraLayer):
            out += [n for n in m.lora_A if n not in out]
    return out


def use_adapter(model: nn.Module, name: str | None) -> None:
    """Make adapter ``name`` the active one on every LoRA layer (a layer it does not target
    computes its base alone); None: every layer its base (the adapters off)."""
    from peft.tuners.lora import LoraLayer  # peft: loaded by ``inject`` (a model with adapters)

    if name is not None and name not in adapters_of(model):
        raise ValueError(f"adapter {name!r}: this model holds {adapters_of(model)}")
    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.enable_adapters(name is not None)
            if name is not None:
                m.set_adapter(name if name in m.lora_A else [])


def hold_base_in(model: nn.Module, dtype: torch.dtype, fp8: tuple[str, ...] = ()) -> int:
    """A LoRA model's frozen weight matrices held in ``dtype``, the run's compute dtype (on
    any device, the meta device before ``parallelize`` included): what the forward computes
    with anyway (FSDP's bf16 gathers, autocast's casts), at half the memory of fp32 copies.
    Biases and norm gains stay fp32; adapters are trained in fp32. ``fp8``: module-name
    patterns (the family's ``all-linear`` preset, for ``model.lora.base_dtype: fp8``) whose
    linear layers are held in float8 instead (``knapray.models.fp8``). Returns how many
    parameters it cast plus the layers it replaced (0 for fp32 without ``fp8``, or a model without adapters)."""
    if not has_adapters(model):
        return 0
    from knapray.models.fp8 import FP8, hold_in_fp8

    cast = len(hold_in_fp8(model, fp8, BASE)) if fp8 else 0
    if dtype == torch.float32:
        return cast
    for _, p in model.named_parameters():
        if not p.requires_grad and p.ndim >= 2 and p.dtype not in (dtype, FP8):
            p.data = p.data.to(dtype)
            cast += 1
    return cast


def is_adapter(name: str) -> bool:
    """Is parameter ``name`` a LoRA adapter's (``...lora_A.default.weight``)?"""
    return ".lora_A." in name or ".lora_B." in name


def as_trained(name: str, adapter: str) -> str:
    """Parameter ``name`` of adapter ``adapter`` under the name its run's checkpoint gives it
    (the run trained it as ``default``)."""
    return name.replace(f".lora_A.{adapter}.", f".lora_A.{ADAPTER}.").replace(f".lora_B.{adapter}.",
                                                                          f".lora_B.{ADAPTER}.")


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter(n) for n, _ in model.named_parameters())


def base_name(name: str) -> str:
    """The parameter's name in the model without adapters (what checkpoints of the base use)."""
    return name.replace(BASE + ".", ".")


@torch.no_grad()
def init_adapters(model: nn.Module, cfg: LoraConfig, seed: int) -> None:
    """First values of every adapter parameter (allocated; plain or FSDP2-sharded): lora_B
    zeros, lora_A from ``cfg.init`` drawn whole from a generator seeded by ``seed`` and the
    parameter's name, each rank keeping its rows, so every sharding gives the same adapters."""
    from knapray.distributed.param_rows import shard_rows

    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        local, start, rows = shard_rows(p)
        if ".lora_B." in name:
            local.zero_()
            continue
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        full = torch.empty(p.shape, dtype=torch.float32)
        if cfg.init == "gaussian":
            full.normal_(0.0, 1.0 / cfg.rank, generator=gen)
        else:  # nn.Linear's own: kaiming uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))
            bound = 1.0 / math.sqrt(p.shape[1])
            full.uniform_(-bound, bound, generator=gen)
        local.copy_(full[start : start + rows])


MAX_HEADER_BYTES = 100 * 2**20
"""safetensors' own bound on a header."""


FINGERPRINT_BLOCKS = 16
FINGERPRINT_BLOCK_BYTES = 4096


def base_fingerprint(files: list[str]) -> str:
    """sha256 over a base checkpoint's safetensors files in order: each one's header (names,
    dtypes, shapes, offsets) and 16 blocks of 4 KiB spread evenly over its data (64 KiB read
    per file, whatever its size). What a LoRA checkpoint records of the base it was trained
    on and a resume compares: another architecture changes the headers, other weights of
    the same shapes (another fine-tune of it) the sampled bytes."""
    import os
    import struct

    h = hashlib.sha256()
    for path in files:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 <= n <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"{path}: not a safetensors file (header length {n})")
            h.update(os.path.basename(path).encode() + b"\0" + f.read(n))
            start, data = 8 + n, size - 8 - n
            for i in range(FINGERPRINT_BLOCKS):
                f.seek(start + (data * i) // FINGERPRINT_BLOCKS)
                h.update(f.read(min(FINGERPRINT_BLOCK_BYTES, data)))
    return h.hexdigest()
