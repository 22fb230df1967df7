"""Varlen (packed) non-causal attention backends.

Tokens of many sequences are packed along one axis; ``cu_seqlens`` (int32, shape
``(S+1,)``, starting at 0) gives each sequence's boundaries. Attention is full within a
sequence and absent across sequences. All backends take and return ``(N, H, D)``; q, k
and v must share one float dtype and one device (the output has that dtype, or the autocast
dtype under autocast on the ``sdpa`` path, as ``F.scaled_dot_product_attention`` does).

Backends:
- ``flash``: ``flash_attn.flash_attn_varlen_func`` (CUDA, fp16/bf16, if installed).
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch's own flash kernel;
  CUDA, fp16/bf16), bound to torch 2.10's signature (no ``scale``) or 2.11's (``torch_varlen``).
- ``sdpa``: per-sequence ``F.scaled_dot_product_attention``, sequences of equal length
  batched into one call. Runs anywhere, any float dtype; the CPU reference path.
- ``auto``: a fused kernel (``flash``, else ``torch_varlen``) for CUDA fp16/bf16 tensors,
  otherwise ``sdpa``. fp32 q, k, v on CUDA take ``sdpa``: the model hands attention bf16
  tensors under bf16 autocast, so fp32 here means an fp32 run.

A training step chooses per step instead (``choose_backend``, from the lengths the host
knows; ``knapray.distributed.UlyssesAttention`` with ``auto``). On an H100 (torch 2.11,
``knapray bench kernels``, forward + backward) ``sdpa`` (cuDNN) beats ``torch_varlen`` (FA2)
on a few long sequences (4 x 4292 tokens: 429 vs 250 model TFLOP/s) and loses badly on many
short ones of many lengths (24 of 256-1536 tokens: 52 vs 214; cuDNN builds a graph per new
shape). So a step takes ``sdpa`` when a few runs of equal-length sequences, each a shape
seen before (or few new ones), carry most of its attention work (sum of L^2); the fused
varlen kernel otherwise. Where torch can route its flash kernels to FA3 or FA4
(``torch.nn.attention.activate_flash_attention_impl``, torch >= 2.10 for FA4, 2.11 for FA3,
with the ``flash_attn_interface`` / ``flash-attn-4`` package installed), ``activate_flash_impl``
turns it on and every step takes it through ``torch_varlen``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import torch
import torch.nn.functional as F

try:
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except ImportError:
    _flash_varlen = None

_NOT_LOADED = object()
_torch_varlen: Any = _NOT_LOADED
"""``torch.nn.attention.varlen.varlen_attn`` (None where this torch has none), imported at the
first question about a CUDA device (``_varlen_kernel``): the import loads dynamo and
inductor, which a process that never asks (the driver, gloo ranks, a CPU run) should not
pay for (with this and ``worker/parallelize``'s lazy ``torch.compiler.disable``, importing
the trainer went from 2.25 s to 1.8 s here)."""


def _varlen_kernel() -> Callable | None:
    global _torch_varlen
    if _torch_varlen is _NOT_LOADED:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            varlen_attn = None
        _torch_varlen = varlen_attn
    return _torch_varlen


BACKENDS = ("auto", "flash", "torch_varlen", "sdpa")
_HALF_DTYPES = (torch.float16, torch.bfloat16)

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attn(q, k, v) -> out``, all (N, H, D): what the model calls once per block."""


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Concrete backends usable for half-precision tensors on ``device`` (default: CUDA if present)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = torch.device(device).type == "cuda"
    names = []
    if on_cuda and _flash_varlen is not None:
        names.append("flash")
    if on_cuda and _varlen_kernel() is not None:
        names.append("torch_varlen")
    names.append("sdpa")
    return names


def _kernel_usable(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in _HALF_DTYPES


def _resolve_backend(backend: str, q: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; valid: {list(BACKENDS)}")
    if backend == "auto":
        if _kernel_usable(q) and _flash_varlen is not None:
            return "flash"
        if _kernel_usable(q) and _varlen_kernel() is not None:
            return "torch_varlen"
        return "sdpa"
    if backend in ("flash", "torch_varlen"):
        missing = _flash_varlen is None if backend == "flash" else _varlen_kernel() is None
        if missing:
            raise RuntimeError(f"attention backend {backend!r} is not available in this environment")
        if not _kernel_usable(q):
            raise RuntimeError(
                f"attention backend {backend!r} needs CUDA fp16/bf16 tensors, "
                f"got device={q.device} dtype={q.dtype}; use 'sdpa' or 'auto'"
            )
    return backend


@dataclass(frozen=True)
class AttentionChoice:
    """The kernel a step's attention runs on, and why (a step metric)."""

    backend: str
    reason: str


SDPA_MAX_RUNS = 4
"""At most this many runs of adjacent equal-length sequences for a step to take ``sdpa``
(each run is one SDPA call)."""
SDPA_MIN_SHARE = 0.8
"""...and runs of at least two sequences or of at least ``SDPA_LONG`` tokens carry this
share of the step's sum of L^2 (the attention work)."""
SDPA_LONG = 2048
SDPA_MAX_NEW_SHAPES = 1
"""...and at most this many of its (sequences, length) shapes are new to the process (cuDNN
builds a graph per shape: worth it where shapes repeat). Every step's shapes are
remembered, whichever kernel it took (up to ``SEEN_SHAPES_LIMIT``, then forgotten)."""
SEEN_SHAPES_LIMIT = 4096
_SEEN_SHAPES: set[tuple[int, int, int, int]] = set()


def equal_length_runs(seq_lens: Sequence[int]) -> list[tuple[int, int]]:
    """(sequences, length) of each run of adjacent sequences of one length (empty ones
    skipped): the calls ``sdpa`` makes."""
    runs: list[list[int]] = []
    for n in seq_lens:
        if not n:
            continue
        if runs and runs[-1][1] == n:
            runs[-1][0] += 1
        else:
            runs.append([1, int(n)])
    return [(b, n) for b, n in runs]


def choose_backend(seq_lens: Sequence[int], device: torch.device, dtype: torch.dtype, heads: int, head_dim: int,
                   *, remember: bool = True) -> AttentionChoice:
    """The backend a step's attention over ``seq_lens`` (the bag's whole sequences, host
    ints) takes on ``device`` in ``dtype``; pure but for the process's set of shapes seen
    (``remember``: add this step's). Every rank of a bag sees the same lengths, so it
    chooses the same."""
    if not (torch.device(device).type == "cuda" and dtype in _HALF_DTYPES):
        return AttentionChoice("sdpa", f"no fused kernel for {torch.device(device).type} {str(dtype).removeprefix('torch.')}")
    fused = "flash" if _flash_varlen is not None else "torch_varlen" if _varlen_kernel() is not None else None
    impl = flash_impl()
    if impl is not None and _varlen_kernel() is not None:
        return AttentionChoice("torch_varlen", f"{impl} (activate_flash_attention_impl)")
    runs = equal_length_runs(seq_lens)
    work = sum(b * n * n for b, n in runs)
    if not runs or fused is None:
        return AttentionChoice(fused or "sdpa", "no tokens" if not runs else "no fused varlen kernel installed")
    heavy = sum(b * n * n for b, n in runs if b > 1 or n >= SDPA_LONG)
    shapes = {(b, n, heads, head_dim) for b, n in runs}
    new = len(shapes - _SEEN_SHAPES)
    if remember:
        if len(_SEEN_SHAPES) + len(shapes) > SEEN_SHAPES_LIMIT:
            _SEEN_SHAPES.clear()
        _SEEN_SHAPES.update(shapes)
    share = heavy / work
    if len(runs) <= SDPA_MAX_RUNS and share >= SDPA_MIN_SHARE and new <= SDPA_MAX_NEW_SHAPES:
        return AttentionChoice("sdpa", f"{len(runs)} runs of equal length carry {share:.0%} of sum(L^2), "
                                       f"{new} new shape(s)")
    why = (f"{len(runs)} runs of equal length (sdpa at most {SDPA_MAX_RUNS})" if len(runs) > SDPA_MAX_RUNS else
           f"long or repeated lengths carry {share:.0%} of sum(L^2) (sdpa from {SDPA_MIN_SHARE:.0%})"
           if share < SDPA_MIN_SHARE else f"{new} new shapes (sdpa at most {SDPA_MAX_NEW_SHAPES})")
    return AttentionChoice(fused, why)


def flash_impl() -> str | None:
    """The FA3/FA4 implementation torch's flash kernels are routed to (None: torch's own FA2).
    torch 2.11 and later record an activated implementation only when its registration returns
    a handle (2.10 records it either way); torch's own FA3 and FA4 registrations return one in
    2.10, 2.11 and 2.13 (their sources read), so this names what is active in each."""
    try:
        from torch.nn.attention import current_flash_attention_impl
    except ImportError:  # torch without the registry
        return None
    return current_flash_attention_impl()


FLASH_IMPLS = {"FA3": ("flash_attn_interface", (9,)), "FA4": ("flash_attn.cute.interface", (9, 10))}
"""Implementation -> (the module it needs, the compute capabilities it runs on), in the
order they are tried: FA3 is Hopper's own, FA4 Hopper's and Blackwell's."""
FLASH_UNUSABLE: dict[str, str] = {}
"""Implementation -> why its installed package was not used (it failed to load or to
activate: on the H200, FA4 whose cutlass DSL lacked its compiler library raised "No CTK
flavor installed"). torch's FA2 stays; the reason is logged once and shown by the GPU check."""


def restore_flash_impl() -> bool:
    """Back to torch's own FA2 after ``activate_flash_impl``; False where this torch cannot
    (2.10 has no ``restore_flash_attention_impl``: the impl stays)."""
    if flash_impl() is None:
        return True
    try:
        from torch.nn.attention import restore_flash_attention_impl
    except ImportError:
        return False
    restore_flash_attention_impl()
    return True


def activate_flash_impl(device: torch.device | str) -> str | None:
    """Route torch's flash-attention kernels (``varlen_attn``, SDPA's flash path) to FA3 or
    FA4 where the device runs it and its package is installed; returns the one activated,
    or None (torch's FA2 stays). Process-wide; idempotent."""
    import importlib.util

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        from torch.nn.attention import activate_flash_attention_impl, list_flash_attention_impls
    except ImportError:
        return None
    if flash_impl() is not None:
        return flash_impl()
    major = torch.cuda.get_device_capability(device)[0]
    for impl, (module, majors) in FLASH_IMPLS.items():
        if impl not in list_flash_attention_impls() or major not in majors:
            continue
        try:
            if importlib.util.find_spec(module) is None:
                continue
            activate_flash_attention_impl(impl)
        except Exception as e:  # noqa: BLE001 - an optional kernel that does not load never stops a run
            if impl not in FLASH_UNUSABLE:
                FLASH_UNUSABLE[impl] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                import logging

                logging.getLogger(__name__).warning("%s is installed but does not load here (%s): torch's FA2 stays",
                                                    impl, FLASH_UNUSABLE[impl])
            continue
        return impl
    return None


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v must share one (N, H, D) shape, one float dtype and one device.

    No silent promotion: mixed dtypes would either fail inside a kernel or drop a fused
    kernel for the slow path, so they are refused here, naming all three.
    """
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"q, k, v must share one (N, H, D) shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(
            f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
            "cast them to the compute dtype (e.g. a norm returning fp32 under bf16 autocast)"
        )
    if not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    check_qkv(q, k, v)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with S+1 >= 1 entries, got shape {tuple(cu_seqlens.shape)}")


def _bounds(cu_seqlens: torch.Tensor, n_tokens: int) -> list[int]:
    """Host copy of cu_seqlens, checked: starts at 0, non-decreasing, ends at N."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    ok = bounds[0] == 0 and bounds[-1] == n_tokens and all(a <= b for a, b in zip(bounds, bounds[1:]))
    if not ok:
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at N={n_tokens}, got {bounds}"
        )
    return bounds


def _host_bounds(seq_lens: Sequence[int], n_tokens: int) -> list[int]:
    """``_bounds`` from the host's lengths: no tensor made, nothing read back."""
    bounds = [0, *np.cumsum(seq_lens, dtype=np.int64).tolist()]
    if bounds[-1] != n_tokens or min(seq_lens, default=0) < 0:
        raise ValueError(f"seq_lens must be non-negative and sum to N={n_tokens}, got {list(seq_lens)[:8]}")
    return bounds


def _empty_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # (0, H, D). Built from q, k, v rather than torch.empty so the output stays in the
    # autograd graph: backward must reach the collectives that produced q, k, v on every
    # rank, including ranks that hold no tokens.
    return (q + k + v) * 0.0


def _sdpa_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
    seq_lens: Sequence[int] | None = None,
) -> torch.Tensor:
    n_tokens, n_heads, head_dim = q.shape
    # The host's lengths when given: reading cu_seqlens back from a GPU would wait for it.
    bounds = _bounds(cu_seqlens, n_tokens) if seq_lens is None else _host_bounds(seq_lens, n_tokens)
    # Runs of adjacent sequences of one length: each is a view (B, L, H, D) of the packed
    # rows, so SDPA reads q, k, v in place (no gathered copies to save for backward), and
    # the runs' outputs, in order, are the packed output.
    runs: list[tuple[int, int, int]] = []  # (start, sequences, length)
    for start, end in zip(bounds, bounds[1:]):
        length = end - start
        if not length:
            continue
        if runs and runs[-1][2] == length and runs[-1][0] + runs[-1][1] * length == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, length)
        else:
            runs.append((start, 1, length))

    def view(x: torch.Tensor, start: int, n_seqs: int, length: int) -> torch.Tensor:
        # rows [start, start + B*L) -> (B, L, H, D) -> (B, H, L, D): SDPA attends over L
        return x.narrow(0, start, n_seqs * length).reshape(n_seqs, length, n_heads, head_dim).transpose(1, 2)

    pieces = []
    for start, n_seqs, length in runs:
        out = F.scaled_dot_product_attention(*(view(x, start, n_seqs, length) for x in (q, k, v)), scale=scale)
        # (B, H, L, D) -> (B, L, H, D) -> (B*L, H, D)
        pieces.append(out.transpose(1, 2).reshape(n_seqs * length, n_heads, head_dim))
    # The output takes SDPA's dtype: q's, or the autocast dtype under autocast.
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    backend: str = "auto",
    scale: float | None = None,
    seq_lens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Non-causal attention within each packed sequence. q, k, v: (N, H, D) -> (N, H, D).

    ``seq_lens``: the sequences' lengths on the host, if known (``cu_seqlens``' differences);
    the ``sdpa`` path then never reads ``cu_seqlens`` back from the device.

    ``max_seqlen`` is the longest sequence (the fused kernels size their grid with it).
    ``scale`` defaults to ``1/sqrt(D)``. q, k, v must share one float dtype and device
    (``ValueError`` otherwise).
    """
    _check_inputs(q, k, v, cu_seqlens)
    name = _resolve_backend(backend, q)
    if q.shape[0] == 0:
        return _empty_output(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if name == "sdpa":
        return _sdpa_varlen(q, k, v, cu_seqlens, scale, seq_lens)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    max_seqlen = int(max_seqlen)
    if name == "flash":
        return _flash_varlen(
            q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=0.0, softmax_scale=scale, causal=False
        )
    return torch_varlen(q, k, v, cu, max_seqlen, scale)


def torch_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` bound to the signature of the installed torch.

    torch 2.11 takes ``scale`` (keyword-only); torch 2.10's ``varlen_attn(query, key, value,
    cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)`` has none and always
    scales by 1/sqrt(D). There a different scale is folded into q: softmax(q·s·kᵀ) equals
    softmax((q·s·sqrt(D))·kᵀ/sqrt(D)), gradients included."""
    kernel = _varlen_kernel()
    if _varlen_takes_scale(kernel):
        return kernel(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale)
    factor = scale * math.sqrt(q.shape[-1])
    if factor != 1.0:
        q = q * factor
    return kernel(q, k, v, cu, cu, max_seqlen, max_seqlen)


def _varlen_takes_scale(fn: Callable) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: assume the newer API
        return True
    return any(p.name == "scale" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """softmax(Q K^T * scale) V per sequence, in fp32 math, cast back to q's dtype. For tests."""
    _check_inputs(q, k, v, cu_seqlens)
    bounds = _bounds(cu_seqlens, q.shape[0])
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    outs = [q.new_zeros((0,) + tuple(q.shape[1:]))]
    for start, end in zip(bounds, bounds[1:]):
        qs, ks, vs = (x[start:end].float() for x in (q, k, v))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale  # (H, L, L)
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vs).to(q.dtype))
    return torch.cat(outs)


class LocalAttention:
    """``attn(q, k, v)`` callable for single-process runs: varlen attention over fixed boundaries."""

    def __init__(
        self,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        *,
        backend: str = "auto",
        scale: float | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; valid: {list(BACKENDS)}")
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = int(max_seqlen)
        self.backend = backend
        self.scale = scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return varlen_attention(
            q, k, v, self.cu_seqlens, self.max_seqlen, backend=self.backend, scale=self.scale
        )


def cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int], k_lens: list[int],
                    pad: tuple[torch.Tensor, torch.Tensor] | None = None,
                    pad_counts: list[int] | None = None) -> torch.Tensor:
    """Cross-attention of packed queries to packed keys of other lengths: sequence i's
    ``q_lens[i]`` query rows (of q (Nq, H, D)) attend to its ``k_lens[i]`` key rows (of k,
    v (Nk, H, D)), both packed in sequence order -> (Nq, H, D).

    ``pad``: (k_pad, v_pad), each (H, D): one more key per sequence standing for
    ``pad_counts[i]`` identical rows (zero-padded text after its projection), i.e. its
    logit gets + log(count); a count of 0 leaves it out. A sequence with no key at all
    gets zeros. Per-sequence ``F.scaled_dot_product_attention`` (any device and dtype)."""
    if sum(q_lens) != q.shape[0] or sum(k_lens) != k.shape[0] or len(q_lens) != len(k_lens):
        raise ValueError(f"cross_attention: {len(q_lens)} query and {len(k_lens)} key lengths summing to "
                         f"{sum(q_lens)}, {sum(k_lens)} for {q.shape[0]} query and {k.shape[0]} key rows")
    outs = []
    for i, (qi, ki, vi) in enumerate(zip(q.split(q_lens), k.split(k_lens), v.split(k_lens))):
        bias = None
        if pad is not None and pad_counts[i] > 0:
            ki, vi = torch.cat((ki, pad[0][None])), torch.cat((vi, pad[1][None]))
            bias = torch.zeros(1, ki.shape[0], dtype=qi.dtype, device=qi.device)  # (1, keys): every query
            bias[0, -1] = math.log(pad_counts[i])
        if qi.shape[0] == 0 or ki.shape[0] == 0:
            outs.append(_zeros_of(qi, ki, vi))
            continue
        # (n, H, D) -> (1, H, n, D)
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (qi, ki, vi)), attn_mask=bias)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs) if outs else _zeros_of(q, k, v)


def _zeros_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``q`` that depend on q, k and v: the projections that made them get
    a zero gradient rather than none (FSDP reduce-scatters, on every rank, the parameters that
    have one: torch 2.10 and 2.11 skip those without, and a newer torch's zero-filling cannot
    make zeros of ``parallel.fp8``'s float8 weights), as on a rank whose rows are all empty."""
    return q * 0 + (k.sum() + v.sum()) * 0
