"""FSDP2, activation checkpointing and torch.compile, applied to a finished model of any
family (``MMDiT``, ``FluxTransformer``, ``WanTransformer``: knapray/models/families) from
outside ``models/`` (torchtitan's habit). ``parallelize`` mutates the model in place and
returns a ``ParallelModel`` handle with what the trainer needs after backward.

A balanced step does not call ``model.forward``: it calls ``model.condition``, ``model.embed``,
``model.blocks`` and ``model.head`` (knapray/worker/balanced.py). So every parameter lives in
a child FSDP unit that runs through its module's ``__call__`` exactly once per step; the
model declares them (``model.fsdp_units()``, ``knapray.models.interface.FsdpUnits``):

    embedders    one unit each (the conditioning MLPs, e.g. time_in, guidance_in,
                 vector_in, then img_in, txt_in: their inputs need no grad, so FSDP
                 reduces them in its end-of-backward callback)
    blocks       one unit per block (e.g. double_blocks[i], then single_blocks[i])
    final        one unit, kept gathered from forward into backward

and the root (``fully_shard(model)``) owns no parameter: it is there for FSDP's lazy init
and its end-of-backward callback, and the four stage methods are registered as forward
methods so the first stage call of a step enters through the root. A root that owned
parameters would reduce them when the gradient reached the inputs of ``blocks`` (the first
stage whose inputs need grad), before ``embed``'s backward had run; ``parallelize`` refuses
such a model by name.

Gradients keep the unsharded semantics (knapray/distributed/grads.py): each rank's loss is
its local sum over the GLOBAL token count, so the reference gradient is the SUM over ranks.
FSDP divides by the world size by default; the divide factor is set to 1 and the collectives
to plain SUM (gloo has no PREMUL_SUM). Every rank takes part in every reduce-scatter with the
same buffers: parameters a rank did not use (no text in its chunks, no image tokens) send
zeros, and every unit's forward runs on every rank (also on zero tokens), so the units'
reduce-scatters come in the same order everywhere.

Activation checkpointing and compile replace a block's ``forward`` on the instance (inside
FSDP's hooks, so a recompute finds the block's parameters gathered): parameter names, and so
state dicts, are the same as the plain model's.

Compile: each block class's ``forward`` is compiled once per model, shapes dynamic from the
first call (the token count changes every step): image-token, token and sequence counts as
backed sizes (inductor sizes and splits its reductions by their hints), text-token counts
unbacked (a rank without text does not get graphs of its own), and a block call with 0 or
1 image tokens or tokens runs eagerly (``TEXT_AXES``). Attention stays
eager behind ``torch.compiler.disable`` (one graph break per block; its callable holds the
step's cu_seqlens / Ulysses layout, which would otherwise become guards). Data-dependent
index building (``TokenStreams.from_mask``, RoPE tables) already happens in
``MMDiT.blocks``, outside the compiled blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from knapray.config.parallel import ParallelConfig
from knapray.distributed.grads import allreduce_gradients, clip_by_norm_, global_grad_norm
from knapray.distributed.parallel_dims import ParallelDims
from knapray.models.families import FAMILIES
from knapray.planning.costs.checkpointing import SELECTIVE_KEEPS

FSDP_DTYPES = (torch.float32, torch.bfloat16)
STAGE_METHODS = ("condition", "embed", "blocks", "head")
"""The MMDiT methods a balanced step calls; each enters FSDP through the root."""


class CompileStats:
    """How often torch.compile compiled this model's blocks.

    ``recompiles`` counts compilations of a code object (a block's forward, or its resume
    function after the attention graph break) that this model had compiled before: a guard
    failed, typically a new shape specialization. It belongs in per-step metrics; it should
    stay flat after the first steps."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.compiles = 0
        """First compilations of a code object (one per block class and graph-break piece)."""
        self.recompiles = 0
        self._frames: set[int] = set()
        self._seen: set[tuple[int, int]] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        key = (cid.frame_id, cid.frame_compile_id) if cid is not None else None
        if key is not None and key not in self._seen:  # dynamo may hand one compile over twice
            self._seen.add(key)
            if key[0] in self._frames:
                self.recompiles += 1
            else:
                self._frames.add(key[0])
                self.compiles += 1
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


class _EagerAttention:
    """The step's attention, run outside the compiled graph (a graph break per call): a
    joint-attention callable (``attn(q, k, v)``) or a family's attention ops (Wan's
    ``self_attn`` and ``cross_attn``: ``knapray.models.families.wan.WanAttentionOps``). It
    holds the step's cu_seqlens / Ulysses layout, which would otherwise become guards."""

    __slots__ = ("attn",)

    def __init__(self, attn: Any) -> None:
        self.attn = attn

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _token_output(self.attn(q, k, v))

    def self_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _token_output(self.attn.self_attn(q, k, v))

    def cross_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: Any = None,
                   image: Any = None) -> torch.Tensor:
        return _token_output(self.attn.cross_attn(q, k, v, pad, image=image))


@functools.cache
def _eager_attention() -> type:
    """``_EagerAttention`` with each call behind ``torch.compiler.disable``, made at the first
    compiled call: the decorator imports dynamo, which a process that
    never compiles (the driver, gloo ranks, eager runs) should not pay at import."""
    calls = {name: torch.compiler.disable(getattr(_EagerAttention, name)) for name in ("__call__", "self_attn", "cross_attn")}
    return type("_EagerAttention", (_EagerAttention,), {"__slots__": (), **calls})


def _token_output(out: torch.Tensor) -> torch.Tensor:
    """An attention output (n, H, D) as the compiled rest of the block takes it: dim 0 a
    token axis like the block's own token inputs (``_mark_token_axes``), in row-major strides
    (``_dense``): a bag's exchange may hand back a view whose strides depend on the step's
    split, and the compiled backward of a layer that saves its input (torchao's float8
    linears, ``parallel.fp8``) asserts the strides it was traced with."""
    out = _dense(out)
    _mark_token_axes("out", out)
    return out


def _size_oblivious():
    # Backed sizes (each has a hint: inductor sizes its kernels and splits its reductions
    # by it) that are not specialized to 0 or 1 by dynamo; no duck sizing, so a token count
    # that happens to equal the hidden size at the first call is not tied to it. Both
    # settings exist in torch 2.10, 2.11 and 2.13; a torch without one runs with its default.
    from torch.fx.experimental import _config as fx_config

    wanted = {"backed_size_oblivious": True, "use_duck_shape": False}
    return fx_config.patch(**{k: v for k, v in wanted.items() if hasattr(fx_config, k)})


@functools.cache
def _mark_unbacked() -> Callable:
    """``mark_unbacked(tensor, dim, shape_id)``; where this torch's has no ``shape_id`` (2.10,
    2.11) the axes are left untied (each its own unbacked size: more runtime checks, same
    results)."""
    from torch._dynamo.decorators import mark_unbacked

    if "shape_id" in inspect.signature(mark_unbacked).parameters:
        return mark_unbacked
    return lambda t, dim, shape_id: mark_unbacked(t, dim)


def _dense(x: Any) -> Any:
    """x with every tensor in row-major strides. Dynamo guards on input strides, and an empty
    tensor (a rank without tokens) may carry any (e.g. 0 from an expand), which
    ``contiguous()`` keeps; a copy does not."""
    if isinstance(x, torch.Tensor):
        if x.is_contiguous() and (x.numel() or x.stride() == torch.empty(x.shape, device="meta").stride()):
            return x
        return x.clone(memory_format=torch.contiguous_format)
    if isinstance(x, tuple):
        return tuple(_dense(t) for t in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _dense(getattr(x, f.name)) for f in dataclasses.fields(x)})
    return x


TEXT_AXES = frozenset({"h_txt", "seq_txt", "txt_idx", "ctx", "mods_txt"})
"""Block arguments (and ``TokenStreams`` fields) whose dim 0 counts text tokens: unbacked in
the compiled blocks. A rank often holds no text at all (later chunks of long sequences),
and a backed count would get its own graphs for 0 and for 1 (inductor's kernel choices
guard on ``>= 2``); text carries a small share of a step's work, so its reductions going
unsplit costs little. Every other token axis (image tokens, all tokens, sequences) is
backed (``dynamic=True``): inductor sizes and splits the big reductions by its hint, and
a block call with 0 or 1 of them runs eagerly (``_runs_eagerly``)."""


def _mark_token_axes(name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor) and name in TEXT_AXES:
        _mark_unbacked()(value, 0, shape_id="Nt")
    elif isinstance(value, tuple):
        for item in value:
            _mark_token_axes(name, item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _mark_token_axes(f.name, getattr(value, f.name))


def _runs_eagerly(arguments: dict[str, Any]) -> bool:
    """A block call whose image or token rows number 0 or 1 (an empty rank, a chunk of text
    only, a rank holding a single token): inductor's kernels for backed sizes assume >= 2,
    so such a call would compile a graph of its own. Eagerly, on so few rows, it costs
    nothing (text rows, unbacked, do not count)."""
    rows = [v.shape[0] for n, v in arguments.items() if n in BACKED_TOKEN_ARGS and isinstance(v, torch.Tensor)]
    return any(r < 2 for r in rows)


BACKED_TOKEN_ARGS = frozenset({"h", "h_img", "x"})
"""Block arguments holding the rank's tokens or image tokens (the MMDiT's and Wan's blocks)."""


def _compiled_forward(block: nn.Module, compiled: Callable) -> Callable:
    signature = inspect.signature(type(block).forward)
    eager = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(block, *args, **kwargs)
        if _runs_eagerly(bound.arguments):
            # A rank without tokens still runs every block (FSDP's and Ulysses' collectives
            # need it); eagerly on zero or one rows, it costs nothing and compiles nothing.
            return eager(*args, **kwargs)
        for name, value in bound.arguments.items():
            if name == "attn":
                bound.arguments[name] = _eager_attention()(value)
            else:
                bound.arguments[name] = value = _dense(value)
                _mark_token_axes(name, value)
        with _size_oblivious():
            return compiled(*bound.args, **bound.kwargs)

    return forward


def compute_dtype(precision: str, device: torch.device | str) -> torch.dtype:
    """``parallel.precision`` on ``device``: ``auto`` is bf16 on CUDA and fp32 elsewhere."""
    if precision == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


def _keep_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """``selective``'s policy: an attention kernel's outputs are kept, everything else is
    recomputed (``knapray.planning.costs.checkpointing.SELECTIVE_KEEPS``)."""
    name = getattr(getattr(op, "_schema", None), "name", None)
    return CheckpointPolicy.MUST_SAVE if name in SELECTIVE_KEEPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed_forward(forward: Callable, selective: bool = False) -> Callable:
    options = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_attention)} if selective else {}

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        # Recompute in backward re-runs the block, Ulysses exchanges included (every rank
        # of a bag recomputes the same blocks in the same order); under ``selective`` the
        # attention kernel returns what the forward kept instead of running again.
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)

    return run


def _apply_fsdp(model: nn.Module, mesh, compute_dtype: torch.dtype) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    # Every rank must reduce-scatter the same parameters of a unit in every backward. FSDP2
    # reduces the parameters whose unsharded gradient is not None (torch 2.10 and 2.11:
    # ``FSDPParamGroup.post_backward``); ``set_reduce_scatter_unused_params`` (newer torch)
    # sends zeros for the others. knapray needs neither: every unit's module runs on every
    # rank, also on zero rows (a rank without text runs the text weights on an empty
    # tensor), and a Linear, a norm gain or a gather over zero rows gets a zero gradient,
    # not None. So the method is used where it exists, as a second guarantee, and a torch
    # without it shards any world (tests/dist/test_parallelize.py runs the gloo parity with it
    # hidden).
    unused_ok = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
    units = model.fsdp_units()
    in_units = {id(p) for unit in units for p in unit.parameters()}
    orphans = [n for n, p in model.named_parameters() if id(p) not in in_units]
    if orphans:
        raise ValueError(
            f"parameters {orphans} belong to no FSDP unit (embedders, blocks, final); the root "
            "would reduce them before embed's backward ran. Put them in one of those modules"
        )
    # Parameters are gathered in the compute dtype, gradients reduced in fp32.
    param_dtype = None if compute_dtype == torch.float32 else compute_dtype
    # Embedders take raw fp32 inputs (latents, text features, timestep features) and cast
    # them; everything after them is already in the compute dtype, and RoPE's cos/sin must
    # stay fp32, as in the unsharded bf16 path.
    embed_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    body_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for unit in units.embedders:
        fully_shard(unit, mesh=mesh, mp_policy=embed_mp)
    for block in units.blocks:
        fully_shard(block, mesh=mesh, mp_policy=body_mp)
    # The last unit of forward is the first of backward: resharding it would gather it again.
    fully_shard(units.final, mesh=mesh, mp_policy=body_mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=body_mp)
    for name in STAGE_METHODS:
        register_fsdp_forward_method(model, name)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # summed over ranks, as without FSDP
            module.set_force_sum_reduction_for_comms(True)  # SUM, not PREMUL_SUM (gloo)
            if unused_ok:
                module.set_reduce_scatter_unused_params(True)


@dataclasses.dataclass(eq=False)
class ParallelModel:
    """What the trainer needs from a parallelized model, after backward.

    Call order per step: forward (``balanced_forward``) and ``loss.backward()``, then
    ``reduce_gradients``, then ``clip_grad_norm_``, then the optimizer step. Build the
    optimizer after ``parallelize`` (FSDP replaces parameters by sharded DTensors). State
    dicts: ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``
    works for every mode, with the plain model's parameter names."""

    model: nn.Module
    config: ParallelConfig
    mesh: Any = None
    """The FSDP DeviceMesh, None without FSDP."""
    compile_stats: CompileStats | None = None

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    @property
    def recompiles(self) -> int:
        """Recompilations so far (0 without compile): a number for per-step metrics."""
        return self.compile_stats.recompiles if self.compile_stats is not None else 0

    def after_optimizer_step(self) -> None:
        """What the model needs once its weights changed: with ``parallel.fp8`` under FSDP
        gathering in float8, the next step's scales of every float8 weight, in one pass."""
        if not self.config.fp8:  # every optimizer step of every run comes here: nothing to import
            return
        from knapray.worker.float8 import after_optimizer_step, gathers_in_float8

        if gathers_in_float8(self.config.fp8_scaling, self.sharded):
            after_optimizer_step(self.model)

    def reduce_gradients(self, group: dist.ProcessGroup | None = None) -> None:
        """Sum gradients over ranks. FSDP already did, overlapped with backward (a no-op);
        without FSDP one flat all-reduce over ``group`` (None: the world)."""
        if not self.sharded:
            allreduce_gradients(self.model.parameters(), group=group)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm
        before clipping (a 0-d tensor, the same on every rank). Call after
        ``reduce_gradients``. Sharded gradients: the norm is reduced over the mesh."""
        return clip_grad_norm_(self.model.parameters(), max_norm)

    def nonfinite_gradients(self) -> torch.Tensor:
        """A 0-d float on the gradients' device: 1 if this rank's gradients (its shards under
        FSDP) hold a NaN or an inf, or their norm overflows; else 0. Local work only (no
        collective, no host sync): the trainer sums it over ranks with the step's numbers.
        Call after ``reduce_gradients``."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in self.model.parameters() if p.grad is not None]
        grads = [g for g in grads if g.numel()]
        if not grads:
            return torch.zeros(())
        total = torch.stack(torch._foreach_norm(grads)).sum()  # NaN and inf carry through the sum
        return (~torch.isfinite(total)).to(torch.float32)


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also takes FSDP's DTensor gradients, on their
    local tensors: the squares of a sharded gradient summed over the mesh dimensions it is
    sharded on (``distributed.grads.global_grad_norm``)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = global_grad_norm(grads)
    clip_by_norm_(grads, max_norm, total)
    return total


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Give a model built on the meta device (and parallelized) storage on ``device`` and its
    initial weights: the same values as building it (``MMDiT(cfg)``, ``FluxTransformer(cfg)``)
    on the CPU from the global RNG in the same state (the family's ``initial_values``), each
    parameter generated on the host, then its
    full value (plain parameter) or this rank's shard of it (FSDP's DTensors) copied to
    ``device``. So no rank builds the whole fp32 model on the host or the device: the host
    holds one parameter at a time, the device its shards (Flux: 47 GB otherwise)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    model.to_empty(device=torch.device(device))

    def write(param: nn.Parameter, value: torch.Tensor) -> None:
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds the same full value, so each cuts its own
            # shard (no collective), the same chunk FSDP2 holds.
            local = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                      src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(value)

    model.initial_values(write)


def allow_cached_autograd_functions() -> None:
    """Let AOTAutograd's cache keep graphs that hold a custom ``torch.autograd.Function``
    (knapray's row gathers and permutations, the fp8 base's matmul): torch bypasses the cache
    for them by default (``autograd_function_apply`` is "unsupported"), so every process that
    compiled a block, a restarted or resumed run's included, traced its joint graph again.
    Dynamo traces such a Function's forward and backward into subgraphs of the graph, which
    the cache key hashes, so a changed Function is a different key. The flag is the same in
    torch 2.10, 2.11 and 2.13 (``torch._functorch.config``); a torch without it is left as is."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = True


def guard_empty_y_grids() -> bool:
    """Inductor's 2-D tiled Triton kernels launch on a (x, y, z) grid whose y extent is split
    into z when it passes CUDA's limit: ``y = ceil(y_blocks / z)`` with ``z = ceil(y_blocks /
    65535)``. With no y rows (``ynumel`` 0) z is 0, and torch 2.10/2.11's launcher divides by
    it: ``ZeroDivisionError`` at the launch (fixed upstream after 2.11). knapray's compiled
    blocks meet it on any call without text (text counts are unbacked sizes): seen on an H200
    under torch 2.11 in the double block's text q/k norm, on a sampling warm-up request with
    no text; a training rank whose tokens are all image (later Ulysses chunks) is the same
    call. Where this torch's launcher lacks the guard, its y extent gets it (0 blocks when z
    is 0: the launch does nothing, as it should; a torch whose launcher has the guard keeps
    its expression). Returns whether the grid was wrapped by this call (False: wrapped
    already, or no such grid); the launcher is made in the process that launches, so the
    wrapping applies there."""
    try:
        from torch._inductor.runtime import triton_heuristics
    except ImportError:  # a torch without inductor's runtime: nothing to guard
        return False
    grid = getattr(triton_heuristics, "Grid2DWithYZOverflow", None)
    if grid is None or getattr(grid.generate, "_knapray_guarded", False):
        return False
    unguarded = grid.generate

    def generate(self, *args, **kwargs):
        unguarded(self, *args, **kwargs)
        y = self.y_grid
        if isinstance(y, str) and "y_grid_div_" in y and "y_grid_div_ ==" not in y:
            if getattr(self, "mode", "python") == "python":
                self.y_grid = f"(0 if y_grid_div_ == 0 else {y})"
            else:
                self.y_grid = f"(y_grid_div_ == 0 ? 0 : {y})"

    generate._knapray_guarded = True
    grid.generate = generate
    return True


def specialize_floats() -> None:
    """Dynamo takes the blocks' float attributes as constants (``specialize_float``). A block
    class's forward is compiled once with the module as an input, so each norm's ``eps`` came
    in as a symbolic float; the graph specializes it (``F.layer_norm``, ``rsqrt(... + eps)``),
    which torch's float pass only learns after Dynamo traced and AOTAutograd compiled the
    whole graph: it then restarted the analysis with the floats specialized, and every block
    class was traced and compiled twice (1.2-1.8 s each here, a sixth of a compiled test). The
    graph is the one it compiled the second time. The floats a block reads are its
    configuration (the same on every call), so no recompiles come of it. The setting is the
    same in torch 2.10, 2.11 and 2.13 (``torch._dynamo.config``)."""
    import torch._dynamo.config as dynamo_config

    if hasattr(dynamo_config, "specialize_float"):
        dynamo_config.specialize_float = True


def parallelize(model: nn.Module, parallel: ParallelConfig | None = None, dims: ParallelDims | None = None, *,
                compute_dtype: torch.dtype = torch.float32, mesh=None) -> ParallelModel:
    """Apply compile, activation checkpointing and FSDP (in that order, inside out) to
    ``model`` in place, as ``parallel`` says (default: none of them; its ``fsdp`` as given,
    ``ParallelConfig.for_world`` drops it on one rank), on the devices of ``dims``
    (default: one process; with FSDP it builds the mesh: collective). ``compute_dtype``:
    the dtype FSDP gathers parameters in (the run's precision; gradients are reduced in
    fp32); without FSDP the parameters stay fp32 and autocast computes in it.

    The one way a model is parallelized: training, calibration, memory measurement, the
    dry run, parity and the step benchmark all call it. Call it once, on a model whose
    parameters are on the training device, or on the meta device (then ``materialize``
    it), before building the optimizer and before loading a checkpoint. ``mesh``: FSDP's
    mesh made elsewhere (a sampling bag's group), instead of ``dims``'."""
    cfg = parallel if parallel is not None else ParallelConfig()
    dims = dims if dims is not None else ParallelDims.local()
    if cfg.fsdp != "none" and compute_dtype not in FSDP_DTYPES:
        raise ValueError(f"compute_dtype must be one of {[str(d) for d in FSDP_DTYPES]} with FSDP, "
                         f"got {compute_dtype!r}")
    model_classes = tuple(f.model_cls for f in FAMILIES.values())
    if not isinstance(model, model_classes):
        raise TypeError(f"parallelize takes a family's model ({', '.join(c.__name__ for c in model_classes)}), "
                        f"got {type(model).__name__}")
    stats = None
    if cfg.fp8:  # before compile, checkpointing and FSDP wrap the blocks
        from knapray.worker.float8 import convert

        convert(model, cfg.fp8_scaling, fsdp=cfg.fsdp != "none")
    if cfg.compile:
        stats = CompileStats(cfg.compile_backend)
        allow_cached_autograd_functions()
        specialize_floats()
        guard_empty_y_grids()
        # One compiled function per block class, shared by its blocks (the module is an
        # input, not a guard); isolated so another model's compiles are not counted here.
        # (``isolate_recompiles`` is newer than torch 2.11: left out where it is missing.)
        isolate = {"isolate_recompiles": True}
        if "isolate_recompiles" not in inspect.signature(torch.compile).parameters:
            isolate = {}
        compiled = {
            cls: torch.compile(cls.forward, backend=stats, dynamic=True, **isolate)
            for cls in {type(b) for b in model.fsdp_units().blocks}
        }
    blocks = model.fsdp_units().blocks
    for block, recomputed in zip(blocks, cfg.checkpointed(len(blocks))):
        if cfg.compile:
            block.forward = _compiled_forward(block, compiled[type(block)])
        if recomputed:
            block.forward = _checkpointed_forward(block.forward, selective=cfg.activation_checkpointing == "selective")
    if cfg.fsdp != "none":
        mesh = mesh if mesh is not None else dims.fsdp_mesh(cfg.fsdp)
        _apply_fsdp(model, mesh, compute_dtype)
    else:
        mesh = None
    return ParallelModel(model=model, config=cfg, mesh=mesh, compile_stats=stats)
