"""Measure what ``knapray.planning.costs.memory`` predicts, on the real model.

- ``state_bytes``: parameter, gradient and optimizer-state bytes of the live tensors.
- ``saved_activation_bytes``: bytes of the distinct storages autograd saves during a
  forward (``saved_tensors_hooks``, deduplicated by storage), parameters left out (also
  those FSDP gathers for the forward). DTensors count by their local shard. Under
  non-reentrant checkpointing the checkpoint saves its block's inputs through the same
  hooks and nothing from inside the block, which is what "only block inputs kept" means;
  tensors a checkpointed block takes inside a tuple (RoPE's cos/sin, FLUX.2's shared
  modulation per token) are kept for the recompute by reference, which no hook sees:
  ``held_args_of`` counts them. Checkpointing is applied by the trainer's ``parallelize``.
- ``measure_step``: both, on a packed batch, plus on CUDA the peak allocated during
  forward + backward above what was allocated before it.

``python -m knapray.commands.memory_check --hidden 3072 --heads 24 --depth-double 3 --depth-single 3
--tokens 16384`` compares prediction and measurement on this machine's device (a model and
batch of ``probe_step``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from knapray.models import DiTConfig, MMDiTConfig, PackedBatch
from knapray.planning.costs.checkpointing import SELECTIVE_KEEPS
from knapray.planning.costs.memory import MemoryModel, ModelShape
from knapray.config.parallel import ParallelConfig
from knapray.worker.parallelize import parallelize


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    if hasattr(t, "to_local"):  # an FSDP DTensor: this rank's shard
        t = t.to_local()
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(n for _, n in {_storage_key(t) for t in tensors if t is not None})


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of the parameters, their gradients and the optimizer's state tensors."""
    params = list(model.parameters())
    opt = 0
    if optimizer is not None:
        opt = _distinct_bytes(
            v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
        )
    return {
        "params": _distinct_bytes(params),
        "grads": _distinct_bytes(p.grad for p in params),
        "optimizer": opt,
    }


def saved_activation_bytes(fn: Callable[[], Any], exclude: Iterable[torch.Tensor] = (),
                           kept_ops: frozenset[str] = frozenset(),
                           held_args_of: Iterable[nn.Module] = ()) -> tuple[Any, int]:
    """Run ``fn()`` and return (its result, bytes of the distinct storages it saved for
    backward, leaving out those of ``exclude``, e.g. the parameters). ``kept_ops``: operators
    whose outputs are held beyond the saved tensors (selective checkpointing's cache, which
    no saved-tensor hook sees): their outputs are counted too. ``held_args_of``: modules
    (checkpointed blocks) whose every tensor argument is kept until their backward (a
    non-reentrant checkpoint holds its arguments for the recompute): counted too."""
    skip = {_storage_key(t)[0] for t in exclude}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # A Parameter is a weight, not an activation, even one FSDP gathered for this forward.
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):  # e.g. linear's weight.t()
            return t
        ptr, nbytes = _storage_key(t)
        if ptr not in skip and nbytes:
            saved[ptr] = max(saved.get(ptr, 0), nbytes)
        return t

    def held(module: nn.Module, args: tuple, kwargs: dict) -> None:
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                pack(t)

    handles = [m.register_forward_pre_hook(held, with_kwargs=True) for m in held_args_of]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _OutputsOf(kept_ops, pack):
            out = fn()
    finally:
        for h in handles:
            h.remove()
    return out, sum(saved.values())


class _OutputsOf(TorchDispatchMode):
    """Hands every tensor output of the named operators to ``record`` (nothing if none)."""

    def __init__(self, names: frozenset[str], record: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.names, self.record = names, record

    def __enter__(self):
        return super().__enter__() if self.names else self

    def __exit__(self, *exc):
        return super().__exit__(*exc) if self.names else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name in self.names:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.record(t)
        return out


def cast_batch(batch: PackedBatch, dtype: torch.dtype) -> PackedBatch:
    """The batch with its float features (not timesteps) in ``dtype``, as a model cast to it
    takes them."""
    changes = {
        name: getattr(batch, name).to(dtype)
        for name in ("x_txt", "x_img", "pooled", "targets")
        if getattr(batch, name) is not None
    }
    return dataclasses.replace(batch, **changes)


def measure_step(
    cfg: DiTConfig,
    batch: PackedBatch,
    *,
    dtype: torch.dtype = torch.float32,
    checkpointing: str = "none",
    ac_every: int = 2,
    device: torch.device | str = "cpu",
    optimizer: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """One forward + backward (+ an AdamW step) of ``cfg``'s model (its family's) cast to
    ``dtype`` on ``batch``; returns measured bytes and the memory model's prediction for the
    same tokens, sequences and text tokens. A model that embeds guidance (FLUX.2 [dev]) gets
    one value per sequence when the batch has none."""
    from knapray.models.families import build_model, get_family

    device = torch.device(device)
    torch.manual_seed(seed)
    model = build_model(cfg).to(device=device, dtype=dtype)
    if "guidance" in get_family(cfg.family).condition_fields(cfg) and batch.guidance is None:
        batch = dataclasses.replace(batch, guidance=torch.full((batch.num_sequences,), 4.0))
    # The trainer's own checkpointing (the rule of knapray.planning.costs.checkpointing), so the
    # blocks measured as recomputed are those the memory model counts and training recomputes.
    par = ParallelConfig(activation_checkpointing=checkpointing, ac_every=ac_every)
    parallelize(model, par)
    batch = cast_batch(batch, dtype).to(device)
    params = list(model.parameters())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    kept = SELECTIVE_KEEPS if checkpointing == "selective" else frozenset()
    units = model.fsdp_units()
    recomputed = [b for b, c in zip(units.blocks, par.checkpointed(len(units.blocks))) if c]
    out, saved = saved_activation_bytes(lambda: model(batch), exclude=params, kept_ops=kept, held_args_of=recomputed)
    loss = (out.float() - batch.targets.float()).pow(2).mean()
    loss.backward()
    result: dict[str, Any] = {"activations": saved}
    if cuda:
        torch.cuda.synchronize(device)
        result["cuda_fwd_bwd_peak"] = torch.cuda.max_memory_allocated(device) - base
    opt = None
    if optimizer:
        opt = torch.optim.AdamW(params, lr=1e-4)
        opt.step()
    result.update(state_bytes(model, opt))

    n = int(batch.seq_lens.sum())
    mem = MemoryModel(
        shape=ModelShape.of(cfg), precision="bf16" if dtype == torch.bfloat16 else "fp32",
        checkpointing=checkpointing, ac_every=ac_every, attention="reference" if device.type == "cpu" else "kernel",
    )
    pred = mem.breakdown(n, text_tokens=int(batch.is_text.sum()), sequences=batch.num_sequences)
    # The model measured here is cast to ``dtype`` (no fp32 master copy): its parameters,
    # gradients and AdamW moments are in ``dtype``, AdamW's step counters in fp32.
    shape = mem.shape
    state = shape.num_params * dtype.itemsize
    result["predicted"] = {
        "params": state,
        "grads": state,
        "optimizer": 2 * state + 4 * shape.num_param_tensors,
        "activations": pred.activations,
        # Backward frees each block's activations as its gradients appear: the overlap of
        # the two (for this model's own gradients, in ``dtype``) is never alive at once.
        "fwd_bwd_peak": pred.activations + pred.recompute + pred.backward_working + state
        - mem.backward_overlap(n, state, text_tokens=int(batch.is_text.sum()), sequences=batch.num_sequences),
    }
    result["tokens"] = n
    return result


def probe_step(*, hidden: int, heads: int, depth_double: int, depth_single: int, tokens: int,
               sequences: int) -> tuple[MMDiTConfig, PackedBatch]:
    """A model of that width and depth and a packed batch of ``sequences`` square images of
    about ``tokens`` image tokens in all (16 text tokens each), to ``measure_step``."""
    from knapray.models.packing import pack_samples

    head_dim = hidden // heads
    wide = head_dim * 7 // 16 // 2 * 2  # h and w axes; Flux: 56 of 128
    axes = (head_dim - 2 * wide, wide, wide)
    cfg = MMDiTConfig(
        hidden_size=hidden, num_heads=heads, depth_double=depth_double,
        depth_single=depth_single, rope_axes_dim=axes, text_dim=64, pooled_dim=64,
    )
    side = 2 * max(1, round(math.sqrt(tokens / sequences)))
    gen = torch.Generator().manual_seed(0)
    samples = [
        {"latent": torch.randn(cfg.in_channels, 1, side, side, generator=gen),
         "text": torch.randn(16, cfg.text_dim, generator=gen),
         "pooled": torch.randn(cfg.pooled_dim, generator=gen), "timestep": 0.5}
        for _ in range(sequences)
    ]
    batch = pack_samples(samples, cfg)
    batch.targets = torch.randn_like(batch.x_img)
    return cfg, batch
