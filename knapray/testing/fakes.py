"""What the dry runs (``knapray dryrun``: a training step, ``--sample``: a sampling gang's rank)
share to run full-size models in one process without a GPU: torch's fake process group,
models built on the meta device given fake parameters, batches and step layouts as fake
tensors, and stand-ins of the fused attention and RMSNorm kernels."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch


def fake_world(rank: int, world: int) -> None:
    """This process as ``rank`` of ``world`` over torch's fake process group (every
    collective returns at once); a group made before is destroyed first."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def leave_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():  # the fake world: nothing of it outlives a dry run
        dist.destroy_process_group()


# ---- models, batches and layouts as fake tensors ---------------------------------------------


def to_empty(model: torch.nn.Module, device: torch.device, sharded: bool = False) -> None:
    """Parameters and buffers (meta) as fake tensors on ``device``. FSDP's DTensors move with
    ``to_empty``; plain ones are replaced (swapping a meta parameter into a fake one is
    refused), a tensor shared by several modules (tied embeddings) once."""
    if sharded:
        model.to_empty(device=device)
        return
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in made:
                    empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                    made[id(t)] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else empty
                table[name] = made[id(t)]


def fake_batch(batch, device: torch.device):
    """The batch as fake tensors on ``device`` (the CPU build cannot copy to a fake CUDA device)."""
    return dataclasses.replace(batch, **{
        f.name: torch.empty(v.shape, dtype=v.dtype, device=device)
        for f in dataclasses.fields(batch) for v in (getattr(batch, f.name),) if isinstance(v, torch.Tensor)})


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of a step layout (dataclasses of index tensors, the Ulysses callable) with every
    tensor replaced by ``fn`` of it."""
    from knapray.distributed import BagCrossAttention, UlyssesAttention

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, UlyssesAttention):
        moved = copy.copy(obj)
        moved.layout = map_tensors(obj.layout, fn)
        return moved
    if isinstance(obj, BagCrossAttention):  # Wan: a Ulysses over the image tokens, a layout of the text
        moved = copy.copy(obj)
        moved.image, moved.text = map_tensors(obj.image, fn), map_tensors(obj.text, fn)
        return moved
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def on_device(obj: Any, device: torch.device) -> Any:
    """A step layout with every tensor an empty one of its shape and dtype on ``device``
    (under the fake mode: a fake)."""
    return map_tensors(obj, lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor of a step layout or a batch."""
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(obj, keep)
    return found


# ---- a packed batch of given lengths --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sample:
    text: int
    grid: tuple[int, int, int]
    """Image tokens along (t, h, w)."""

    @property
    def length(self) -> int:
        return self.text + math.prod(self.grid)


def host_batch(samples: list[Sample], cfg, *, targets: bool = True) -> Any:
    """A packed batch of ``samples`` on the host (zero latents: under fake tensors only shapes
    count), with training's regression targets when ``targets``."""
    from knapray.models import pack_samples

    pt, ph, pw = cfg.patch_size
    guidance = {"guidance": 3.5} if getattr(cfg, "guidance_embeds", False) else {}  # FLUX.1-dev's input
    packed = [{"latent": torch.zeros(cfg.in_channels, t * pt, h * ph, w * pw), "text": torch.zeros(s.text, cfg.text_dim),
               "pooled": torch.zeros(cfg.pooled_dim), "timestep": 0.5, **guidance}
              for s in samples for (t, h, w) in (s.grid,)]
    batch = pack_samples(packed, cfg)
    if targets:
        batch.targets = torch.zeros_like(batch.x_img)
    if guidance and batch.guidance is None:  # no samples: no guidance values, but a model that embeds it
        batch.guidance = torch.zeros(0)
    return batch


# ---- attention: the fused kernel's stand-in -------------------------------------------------


class KernelStandIn(torch.autograd.Function):
    """torch's varlen_attn forward op on fake tensors, saving what a fused kernel saves;
    backward returns flash-attn's gradient shapes."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_seqlen):
        with torch.no_grad():
            out, lse, _ = torch.ops.torch_attn._varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, False)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None


@contextlib.contextmanager
def kernel_attention(watch):
    """Route ``knapray.attention.varlen_attention`` (what Ulysses calls) to the stand-in,
    checking q, k, v with ``watch`` first."""
    import knapray.attention as attention
    import torch.nn.attention.varlen  # noqa: F401 - registers torch_attn::_varlen_attn

    original = attention.varlen_attention

    def stand_in(q, k, v, cu_seqlens, max_seqlen, *, backend="auto", scale=None, seq_lens=None):
        attention.check_qkv(q, k, v)
        watch.check_attention(q, k, v)
        if q.shape[0] == 0:
            return (q + k + v) * 0.0
        return KernelStandIn.apply(q, k, v, cu_seqlens, int(max_seqlen))

    attention.varlen_attention = stand_in
    try:
        yield
    finally:
        attention.varlen_attention = original


# ---- RMSNorm: CUDA's fused kernel's stand-in ------------------------------------------------


class RMSNormStandIn(torch.autograd.Function):
    """What ``F.rms_norm`` runs on CUDA with the gain in the input's dtype: torch's fused
    kernel (``aten::_fused_rms_norm``), which saves the input and a per-row fp32 rstd and
    whose backward makes the input's gradient and the gain's, nothing of the input's size in
    fp32. On the CPU torch runs the composite of elementwise ops instead, which saves an fp32
    copy of a bf16 input and makes fp32 temporaries of its size in backward.

    On fake tensors forward allocates the kernel's two outputs (the normalized tensor, rstd
    per row in fp32) and backward is the fused backward's meta function (torch has no CPU
    kernel of it): the two gradients, nothing else. On real tensors forward is torch's own
    ``_fused_rms_norm`` (its CPU kernel) and backward is computed in fp32: what the unit test
    compares with ``F.rms_norm``."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(x):
            # the kernel's outputs and nothing else (fake tensors run _fused_rms_norm through
            # its CPU decomposition, whose fp32 temporaries of the input's size CUDA never makes)
            rows = x.shape[:x.dim() - len(normalized_shape)]
            out = torch.empty_like(x)
            rstd = x.new_empty((*rows, *[1] * len(normalized_shape)),
                               dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
        else:
            with torch.no_grad():
                out, rstd = torch.ops.aten._fused_rms_norm(x, list(normalized_shape), weight, eps)
        ctx.normalized_shape = list(normalized_shape)
        ctx.save_for_backward(x, rstd, weight)  # weight: the module's own gain, not a new tensor
        return out

    @staticmethod
    def backward(ctx, grad):
        from torch._subclasses.fake_tensor import is_fake

        x, rstd, weight = ctx.saved_tensors
        need_x, _, need_w, _ = ctx.needs_input_grad
        if is_fake(x):
            gx, gw = torch.ops.aten._fused_rms_norm_backward(grad, x, ctx.normalized_shape, rstd, weight,
                                                              [need_x, need_w and weight is not None])
            return gx, None, gw, None
        dims = tuple(range(x.dim() - len(ctx.normalized_shape), x.dim()))
        lead = tuple(range(x.dim() - len(ctx.normalized_shape)))
        # rstd is (rows..., 1, ...): broadcast over the normalized dims
        rstd = rstd.view(*x.shape[:len(lead)], *([1] * len(dims)))
        xhat = x.float() * rstd
        g = grad.float()
        gxhat = g * weight.float() if weight is not None else g
        # d/dx of x * rstd: rstd * (g' - xhat * mean(g' * xhat)) over the normalized dims
        gx = rstd * (gxhat - xhat * (gxhat * xhat).mean(dims, keepdim=True)) if need_x else None
        gw = (g * xhat).sum(lead) if need_w and weight is not None else None
        return (gx.to(x.dtype) if gx is not None else None, None,
                gw.to(weight.dtype) if gw is not None else None, None)


def fused_rms_norm(input, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` as CUDA runs it: the fused kernel's stand-in where CUDA calls the
    kernel (no gain, or the gain in the input's dtype, outside autocast), torch's own
    ``F.rms_norm`` otherwise."""
    device = input.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    if (weight is not None and weight.dtype != input.dtype) or autocast:
        return _RMS_NORM(input, normalized_shape, weight, eps)
    return RMSNormStandIn.apply(input, tuple(normalized_shape), weight, eps)


_RMS_NORM = torch.nn.functional.rms_norm


@contextlib.contextmanager
def kernel_rms_norm():
    """``torch.nn.functional.rms_norm`` (what a model calls as ``F.rms_norm``) routed to
    ``fused_rms_norm`` inside the block, restored after."""
    import torch.nn.functional as F

    original = F.rms_norm
    F.rms_norm = fused_rms_norm
    try:
        yield
    finally:
        F.rms_norm = original
