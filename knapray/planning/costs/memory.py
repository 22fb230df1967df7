"""Per-GPU memory of one training step of the packed MMDiT, and the largest token budget
that fits a GPU (pure: stdlib only, no torch).

What a rank holds at its peak, by category:

``params``, ``grads``, ``optimizer``
    fp32 master parameters, their fp32 gradients, AdamW's ``exp_avg`` / ``exp_avg_sq``
    (8 B per parameter) and one fp32 ``step`` scalar per parameter tensor; divided by the
    shard group's size under FSDP2 (``full``: the world, ``hybrid``: a node).
``ema``
    ``optim.ema_decay`` > 0: an fp32 shadow of every trained parameter
    (``knapray.worker.ema``: a clone of each shard, so sharded as the parameters are).
``experts``
    Two experts in one run (``flow.expert_boundary``, Wan 2.2 A14B: ``knapray.worker.experts``)
    keep both models resident all run, each sharded as the run shards: two models' ``params``,
    ``optimizer`` and ``ema``. A step trains one of them: ``grads`` (set to None after each
    optimizer step), FSDP's buffers and the activations are the training one's alone.
``autocast_weights``
    ``sharding="none"`` with ``precision="bf16"`` runs under ``torch.autocast`` with fp32
    parameters: every Linear's weight and bias is cast to bf16 once per forward and the
    copy is saved for backward, so 2 B per Linear parameter of every block that is not
    checkpointed (a checkpointed block's copies die with the autocast region and come
    back one block at a time in its recompute). RMSNorm gains are not cast.
``fsdp_buffers``
    FSDP2 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` for bf16): per
    block, ``p`` bytes per parameter for the all-gathered parameters of two blocks (the
    running one and the one prefetched), ``p`` for the running block's unsharded
    gradients and 4 + 4 for the fp32 reduce-scatter inputs of two blocks (one being
    filled, one in flight): ``(3p + 8) x`` the largest block's parameters, ``p`` = 2 (bf16)
    or 4 (fp32); the root module (embedders, final layer) stays gathered all step:
    ``(2p + 4) x`` its parameters. A frozen base (LoRA) has no gradient buffers: two
    blocks gathered, ``2p x`` the last block's parameters at the backward's start, or
    more where a larger double block is gathered after enough activations were freed
    (``MemoryModel._fsdp_bytes``).
``activations``
    What autograd keeps from the forward (derived below; checkpointed blocks keep their
    inputs only).
``recompute``, ``backward_working``
    During backward: the largest checkpointed block recomputed in full, and the gradient
    buffers of the block being differentiated (below).
``step_buffers``
    After backward: ``sharding="none"`` on more than one rank all-reduces the gradients
    through one flat fp32 buffer (``knapray.distributed.grads``), 4 B per parameter. The
    AdamW step on a GPU is fused (``knapray.worker.optim``) and allocates nothing more.

The peak is the larger of two phases: *backward* (state + autocast copies + FSDP buffers
+ activations + gradients, less their ``overlap``: backward frees each block's activations
as its gradients appear, so the most of both alive at once is the larger of the two
sums at the block where they cross, not their total) and *optimizer step* (state + step
buffers; activations are gone). FSDP buffers are 0 for a shard group of one rank.
``knapray dryrun`` measures this peak with torch's memory tracker on fake tensors: the
flux_cluster.yaml step at 64 ranks and the GPU check's three runs (docs/gpu.md).

Activations, per token, compute dtype ``b`` bytes (2 for bf16, 4 for fp32); ``d`` the
width, ``m`` the MLP hidden width, ``H`` heads; ``u = 4`` if ``b < 4`` else 0 (an fp32
copy that, in fp32, is its source); ``q = 1`` with QK-norm, else 0. Counted from
``knapray/models/blocks.py`` as the distinct storages autograd saves (a product saves a
factor only when the other factor needs a gradient: RoPE keeps just cos/sin):

double-stream block (per token of either stream)::

    b*(6d           modulation vectors gathered per token (kept whole by the gate views)
       + 4d         LN1 input, (1+scale1), modulated LN1 output (mul), qkv input
       + A          attention (below)
       + 6d         proj input, proj output, h after attention, (1+scale2), LN2 output, fc1 input
       + 2m + d)    fc1 output (GELU input), GELU output (fc2 input), fc2 output
    + q*(3d*b if b == 4)              qkv output, kept whole by QK-norm's fp32 view of q
    + q*2*(u*d + 4d + 4H)             QK-norm of q and k: fp32 input copy, normed output (fp32:
                                      the gain's product saves it before the cast back), rsqrt
    + 4H + 2*2*4                      attention logsumexp; LN mean and rstd (fp32 on CUDA)

single-stream block::

    b*(3d           modulation vectors (kept whole by the gate view)
       + 4d         LN input, (1+scale), modulated LN output, linear1 input
       + (3d + m)   linear1 output (GELU input; v and QK-norm's views of it)
       + A          attention
       + (d + m)    linear2 input (attention output ++ GELU output)
       + d)         linear2 output
    + q*2*(u*d + 4d + 4H) + 4H + 2*4

FLUX.2's blocks (``ModelShape.gated_mlp``, ``shared_modulation``) keep no modulation
vectors of their own: the shared modulation's per-token tensors (a stream's ``6d``, the
single blocks' ``3d``) are gathered once per step and kept by every block, counted once
outside the blocks. Their SwiGLU MLPs keep fc1's output (``2m``, the gate and value are
views of it), silu(gate) (``m``) and the product (``m``, fc2's input): a double block
``4m + d`` where GELU keeps ``2m + d``; a single block's linear1 output is ``3d + 2m`` and
it keeps silu(gate) (``m``) beside linear2's input. Measured with saved-tensor hooks
(tests/unit/test_memory.py: within 1.5%).

``A`` is what attention keeps: ``4d`` with a kernel (``attention="kernel"``: flash or
torch varlen save q, k, v and the output; Ulysses saves the exchanged q/k/v buffer and
the output, over the bag's whole sequences with H/g heads, i.e. the bag's tokens / g,
which for a balanced plan is this rank's token count: a bag's ranks hold within one token
of each other; a local kernel in a single-stream block saves ``3d``, v being a view of
linear1's output), or on the CPU reference path (``attention="reference"``: per-sequence SDPA on views of
q, k, v, which are saved anyway) ``4d`` in a double block (the streams' concatenated q,
k, v, whose views SDPA saves, and its output) and ``3d`` in a single block.

Flux width (d=3072, m=4d, 24 heads, QK-norm), bf16, kernel: 74d B = 222 KiB per token per
double block, 64d B = 192 KiB per single block (3.47 / 3.00 GiB at 16k tokens).

``precision="bf16"`` counts every activation in bf16, as FSDP2's mixed precision (bf16
parameters, so bf16 norms) computes them. Under ``torch.autocast`` (``sharding="none"``)
CUDA runs LayerNorm in fp32, and the fp32 RMSNorm gain makes q and k fp32 (which also
sends them to the per-sequence SDPA path): by reading the code about 10% more activation
bytes than counted here; not modelled, not measured (``python -m knapray.commands.memory_check`` on
a GPU measures it).

Outside the blocks, per token: the embedders' inputs (``patch_dim*b`` per image token,
``text_dim*b`` per text token), the final layer on image tokens (``4d*b``: LN input,
(1+scale), LN output, linear input; LN stats; its int64 sequence index), RoPE cos/sin in
fp32 (``4D`` with ``D = d/H``), and index tensors shared by all blocks (int64: the embedder
merge's order, the sequence index with single blocks, the stream split / merge orders and
per-stream sequence indices with double blocks: 8 + 8 + 24 B; the head's bool mask, 1 B).
Per sequence (``sequences``): the conditioning MLPs' saved rows and one SiLU'd
conditioning row per modulation call (2 per double block, 1 per single block, 1 final;
FLUX.2's shared modulation 3 and the final 1). With a shared modulation the gradient of
its per-token tensors sums over every block of a kind before it reaches the modulation:
when the base trains, the backward working set holds a stream's ``6d`` (``3d`` with
single blocks only) per token instead of one block's ``2d``.

Activation checkpointing: a checkpointed block keeps only its input (``d*b`` per token);
during backward one checkpointed block at a time is recomputed in full (the largest one
is added). ``selective`` also keeps each attention call's output and fp32 log-sum-exp
(``d*b + 4H`` per query token; Wan's two attentions twice), which its recompute then
does not allocate again. ``every_k`` checkpoints blocks ``k-1, 2k-1, ...`` in execution order (double
then single blocks, torchtitan's convention; ``knapray.planning.costs.checkpointing``, the rule
the trainer applies). The backward working set per token is the
gradient of the widest Linear input (``(d+m)*b``) plus the residual stream's gradient and
a modulation gradient held until its chunk's other grads arrive (``2d*b``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields
from typing import Any

from .checkpointing import AC_MODES, checkpointed_blocks

GIB = 2**30

SHARDING = ("none", "full", "hybrid")
CHECKPOINTING = AC_MODES
PRECISIONS = ("bf16", "fp32")
ATTENTION = ("kernel", "reference")
FP8_MODES = ("off", "tensorwise", "rowwise")
FP8_WORKING_BYTES = 3
"""``parallel.fp8``'s backward working set, bytes per token and unit of 2d + m (the float8
copies of a linear's input and output gradient, each with its transpose, at the widest
linear: in d + m, out d): fitted to ``knapray dryrun`` of flux_cluster.yaml at 64 ranks."""

TIME_EMBED_DIM = 256
"""Width of the timestep features (``knapray.models.layers.TIME_EMBED_DIM``; a test checks
the parameter count against the live model)."""

FP32 = 4
INDEX = 8  # int64

RESERVE_BYTES = 3 * GIB
"""Memory no tensor of the step can use: CUDA context, NCCL communicator buffers,
cuBLAS / attention workspaces (about 1 + 1 + 1 GiB on an 8-GPU H100 node)."""
FRAGMENTATION = 0.10
"""Fraction of what is left lost to the caching allocator's fragmentation: packed batches
change shape every step, so freed blocks rarely fit the next request exactly."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the memory model needs of a model config (``DiTConfig``; plain numbers)."""

    hidden_size: int
    num_heads: int
    depth_double: int
    depth_single: int
    mlp_hidden: int
    """MLP hidden width (``int(hidden_size * mlp_ratio)``)."""
    patch_dim: int
    """Features per image token (``in_channels * prod(patch_size)``)."""
    out_patch_dim: int = 0
    """Features per output token, the head's width (``out_patch_dim``; Wan 2.1 I2V 14B: 64 of
    144); 0: ``patch_dim``."""
    image_dim: int = 0
    """Wan 2.1 I2V's image-context features (``image_dim``): its embedder (two LayerNorms,
    image_dim -> image_dim -> d) and, per block, attn2's image keys and values (two d x d
    linears, an RMSNorm gain); 0: none."""
    text_dim: int = 0
    pooled_dim: int = 0
    qk_norm: bool = True
    guidance_embeds: bool = False
    """A guidance MLP beside the timestep MLP (the flux family's FLUX.1-dev)."""
    cross_attention: bool = False
    """Wan's blocks (``depth_single`` of them): self-attention over the image tokens,
    cross-attention to the text, an FFN, a modulation table; its parameters are counted as
    such, and its activations by image and text tokens (``wan_image_bytes``,
    ``wan_text_bytes``; ``knapray dryrun`` of Wan 2.1 14B's width, 4 blocks, 8 ranks, full and
    LoRA, text- and image-heavy steps: within 5%, docs/gpu.md)."""
    time_dim: int = TIME_EMBED_DIM
    """Sinusoidal timestep features (Wan's ``freq_dim``)."""
    cross_norm: bool = True
    """Wan's affine LayerNorm before cross-attention."""
    biases: bool = True
    """Every linear layer has a bias (``linear_bias``; FLUX.2's have none)."""
    gated_mlp: bool = False
    """SwiGLU MLPs (``gated_mlp``; FLUX.2's): ``fc1`` d -> 2m and ``fc2`` m -> d; a single
    block's ``linear1`` d -> 3d + 2m."""
    text_norm: bool = False
    """An RMSNorm gain over the text features before ``txt_in`` (``text_norm``; Qwen-Image's)."""
    shared_modulation: bool = False
    """No modulation in the blocks (``shared_modulation``; FLUX.2's): one for the whole
    model (the image and text streams' 6·d, the single blocks' 3·d), counted with the
    root; its per-token tensors are gathered once per step and kept by every block."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("qk_norm", "guidance_embeds", "cross_attention", "cross_norm", "biases", "gated_mlp",
                          "shared_modulation", "text_norm"):
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be a bool, got {value!r}")
                continue
            low = 1 if f.name in ("hidden_size", "num_heads", "mlp_hidden", "patch_dim") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{f.name} must be an int >= {low}, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if self.depth_double + self.depth_single < 1:
            raise ValueError("need at least one block (depth_double + depth_single >= 1)")

    @classmethod
    def of(cls, cfg: Any) -> ModelShape:
        """From a model config (``knapray.models.config.DiTConfig``, or anything with its
        field names), read by attribute; ``attention_kind``, ``linear_bias``, ``gated_mlp``
        and ``shared_modulation`` are its family's (Flux.1's when absent)."""
        if isinstance(cfg, ModelShape):
            return cfg
        d = cfg.hidden_size
        patch = getattr(cfg, "patch_dim", None)
        if patch is None:
            patch = cfg.in_channels * math.prod(cfg.patch_size)
        return cls(
            hidden_size=d,
            num_heads=cfg.num_heads,
            depth_double=cfg.depth_double,
            depth_single=cfg.depth_single,
            mlp_hidden=int(d * getattr(cfg, "mlp_ratio", 4.0)),
            patch_dim=int(patch),
            out_patch_dim=int(getattr(cfg, "out_patch_dim", patch)),
            image_dim=int(getattr(cfg, "image_dim", 0)),
            text_dim=getattr(cfg, "text_dim", 0),
            pooled_dim=getattr(cfg, "pooled_dim", 0),
            qk_norm=bool(getattr(cfg, "qk_norm", True)),
            guidance_embeds=bool(getattr(cfg, "guidance_embeds", False)),
            cross_attention=getattr(cfg, "attention_kind", "joint") == "cross",
            time_dim=int(getattr(cfg, "freq_dim", TIME_EMBED_DIM)),
            cross_norm=bool(getattr(cfg, "cross_attn_norm", True)),
            biases=bool(getattr(cfg, "linear_bias", True)),
            gated_mlp=bool(getattr(cfg, "gated_mlp", False)),
            shared_modulation=bool(getattr(cfg, "shared_modulation", False)),
            text_norm=bool(getattr(cfg, "text_norm", False)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_blocks(self) -> int:
        return self.depth_double + self.depth_single

    @property
    def head_width(self) -> int:
        """The output projection's width: ``out_patch_dim``, or ``patch_dim`` when 0."""
        return self.out_patch_dim or self.patch_dim

    # ---- parameters (exact: the modules of knapray/models) ------------------------------

    def _linear(self, i: int, o: int) -> tuple[int, int]:
        return (i * o + o, 2) if self.biases else (i * o, 1)  # (parameters, tensors)

    def _count(self, linears: list[tuple[int, int]], norms: int) -> tuple[int, int, int]:
        """(linear parameters, norm parameters, parameter tensors)."""
        lin = sum(self._linear(i, o)[0] for i, o in linears)
        norm = norms * self.head_dim if self.qk_norm else 0
        return lin, norm, sum(self._linear(i, o)[1] for i, o in linears) + (norms if self.qk_norm else 0)

    @property
    def _mlp_in(self) -> int:
        """Width of the MLP's input projection: m, or a gated MLP's gate and value, 2m."""
        return (2 if self.gated_mlp else 1) * self.mlp_hidden

    @property
    def double_block(self) -> tuple[int, int, int]:
        d, m = self.hidden_size, self.mlp_hidden
        stream = [(d, 3 * d), (d, d), (d, self._mlp_in), (m, d)]
        if not self.shared_modulation:
            stream.insert(0, (d, 6 * d))
        return self._count(stream * 2, 4)

    @property
    def single_block(self) -> tuple[int, int, int]:
        d, m = self.hidden_size, self.mlp_hidden
        if self.cross_attention:  # Wan: two attentions (q, k, v, out), the FFN; q/k norms across
            # heads, the cross-attention LayerNorm's weight and bias, the (1, 6, d) table; I2V:
            # the image context's keys and values and its key norm
            image = 2 if self.image_dim else 0
            lin = sum(self._linear(i, o)[0] for i, o in [(d, d)] * (8 + image) + [(d, m), (m, d)])
            norms = 4 * d + (2 * d if self.cross_norm else 0) + 6 * d + (d if image else 0)
            return lin, norms, 2 * (10 + image) + 4 + (2 if self.cross_norm else 0) + 1 + (1 if image else 0)
        lin = [(d, 3 * d + self._mlp_in), (d + m, d)]
        if not self.shared_modulation:
            lin.insert(0, (d, 3 * d))
        return self._count(lin, 2)

    @property
    def float8_weights(self) -> tuple[int, int]:
        """(double block, single block) weights ``parallel.fp8`` runs in float8 (the rule of
        ``knapray.worker.float8``: block linears over image or all tokens, no modulation, no
        text-only layer): the image stream's q/k/v, projection and MLP; a single block's two
        linears; Wan's self-attention, cross-attention query and output, and its FFN."""
        d, m = self.hidden_size, self.mlp_hidden
        if self.cross_attention:
            return 0, 6 * d * d + 2 * d * m
        return 4 * d * d + d * (self._mlp_in + m), d * (3 * d + self._mlp_in) + (d + m) * d

    @property
    def root(self) -> tuple[int, int, int]:
        """Embedders, the final layer and a shared modulation."""
        d = self.hidden_size
        if self.cross_attention:  # Wan: patch, text MLP, time MLP and its projection, head and its table;
            # I2V: the image embedder's two linears and two LayerNorms
            lin = [(self.patch_dim, d), (self.text_dim, d), (d, d), (self.time_dim, d), (d, d), (d, 6 * d),
                   (d, self.head_width)]
            norms = 2 * d
            if self.image_dim:
                lin += [(self.image_dim, self.image_dim), (self.image_dim, d)]
                norms += 2 * self.image_dim + 2 * d
            return sum(self._linear(i, o)[0] for i, o in lin), norms, 2 * len(lin) + 1 + (4 if self.image_dim else 0)
        lin = [(self.patch_dim, d), (TIME_EMBED_DIM, d), (d, d), (d, 2 * d), (d, self.head_width)]
        if self.text_dim:
            lin.append((self.text_dim, d))
        if self.pooled_dim:
            lin += [(self.pooled_dim, d), (d, d)]
        if self.guidance_embeds:
            lin += [(TIME_EMBED_DIM, d), (d, d)]
        if self.shared_modulation:  # the image and text streams', the single blocks'
            lin += [(d, 6 * d), (d, 6 * d), (d, 3 * d)]
        lin_params, norm_params, tensors = self._count(lin, 0)
        if self.text_norm:  # Qwen-Image's txt_norm: a gain per text feature
            return lin_params, norm_params + self.text_dim, tensors + 1
        return lin_params, norm_params, tensors

    @property
    def shared_modulation_params(self) -> int:
        """Parameters of a shared modulation (counted in ``root``; 0 without one)."""
        d = self.hidden_size
        return sum(self._linear(d, k * d)[0] for k in (6, 6, 3)) if self.shared_modulation else 0

    @property
    def num_params(self) -> int:
        return self._total(0) + self._total(1)

    @property
    def num_linear_params(self) -> int:
        return self._total(0)

    @property
    def num_param_tensors(self) -> int:
        return self._total(2)

    def _total(self, i: int) -> int:
        return (
            self.depth_double * self.double_block[i] + self.depth_single * self.single_block[i] + self.root[i]
        )

    # ---- activations, bytes per token (see the module docstring) -----------------------

    def _attention(self, b: int, attention: str, single: bool = False) -> int:
        d = self.hidden_size
        if attention == "reference":
            # SDPA on views of q, k, v (saved anyway: a single block's are views of linear1's
            # output, a double block's the streams' concatenation) + its output + the output
            # packed back; measured with saved-tensor hooks (tests/unit/test_memory.py)
            return (3 if single else 4) * d * b + FP32 * self.num_heads
        return 4 * d * b + FP32 * self.num_heads

    def attention_kept_bytes(self, b: int) -> int:
        """Per query token, what ``selective`` checkpointing keeps of one attention call:
        the kernel's output (``d`` in the compute dtype) and its fp32 log-sum-exp per head."""
        return self.hidden_size * b + FP32 * self.num_heads

    def _qk_norm(self, b: int) -> int:
        if not self.qk_norm:
            return 0
        up = FP32 if b < FP32 else 0
        # RMSNorm (knapray/models/layers.py) computes in fp32: it saves the fp32 copy of its
        # input (none when the input is fp32), the per-head rsqrt and the fp32 normed tensor
        # the gain multiplies (tests/unit/test_memory.py measures it with saved-tensor hooks).
        return 2 * (up * self.hidden_size + FP32 * self.hidden_size + FP32 * self.num_heads)

    def double_block_bytes(self, b: int, attention: str = "kernel") -> int:
        d, m = self.hidden_size, self.mlp_hidden
        qkv_out = 3 * d * b if self.qk_norm and b == FP32 else 0
        mods = 0 if self.shared_modulation else 6 * d  # shared: gathered once (outside_bytes)
        # the MLP: fc1's output and fc2's input (GELU: 2m; SwiGLU: fc1's 2m, silu(gate), their
        # product: 4m), fc2's output
        mlp = (4 if self.gated_mlp else 2) * m + d
        return (
            b * (mods + 4 * d + 6 * d + mlp) + qkv_out + self._qk_norm(b)
            + self._attention(b, attention) + 2 * 2 * FP32
        )

    def single_block_bytes(self, b: int, attention: str = "kernel") -> int:
        d, m = self.hidden_size, self.mlp_hidden
        mods = 0 if self.shared_modulation else 3 * d
        # linear1's output (3d + m, a gated MLP's 3d + 2m), SwiGLU's silu(gate) (the product
        # goes into linear2's input), linear2's input and output
        mlp = (3 * d + self._mlp_in) + (m if self.gated_mlp else 0) + (d + m) + d
        return (
            b * (mods + 4 * d + mlp) + self._qk_norm(b)
            + self._attention(b, attention, single=True) + 2 * FP32
        )

    def wan_image_bytes(self, b: int) -> int:
        """Per image token, the bytes one Wan block saves (attention as a fused kernel): 11
        tensors of d in the compute dtype (the projections' inputs, v, what the attention
        kernels keep, the output projections' inputs, the cross-attention input), 10 of d in
        fp32 (its FP32LayerNorms' inputs and outputs, the modulation factors, the gated
        residuals), the FFN's hidden twice, RoPE's cos/sin cast to the compute dtype for q and
        k, and its three RMSNorms (self-attention's q and k, cross-attention's q) as CUDA's
        fused kernel runs them (the gain in the input's dtype): each keeps its input and an
        fp32 rstd per row. Counted with saved-tensor hooks on a WanBlock under torch's CPU
        composite RMSNorm (bf16: 84.2·d + 2·m·b + 2·head_dim·b per token; 86·d counted), which
        keeps an fp32 copy of the input and the fp32 normed tensor (8·d) where the fused
        kernel keeps 2·d: 68·d under bf16 (``knapray dryrun`` stands in for the fused kernel)."""
        d, m = self.hidden_size, self.mlp_hidden
        norms = 3 * (b * d + FP32)
        return d * (11 * b + 10 * FP32) + norms + 2 * m * b + 2 * self.head_dim * b + 3 * 8 + FP32

    def wan_text_bytes(self, b: int) -> int:
        """Per text token, the bytes one Wan block saves: its rows (with the padding row)
        into the cross-attention's key and value projections, k before its norm (what the
        fused RMSNorm keeps, with an fp32 rstd) and after it, v: 4 tensors of d in the
        compute dtype (hooks under the CPU's composite norm: 14·d in bf16, whose norm kept
        8·d in fp32 where the fused kernel keeps 2·d)."""
        return 4 * self.hidden_size * b + FP32

    def block_bytes(self, b: int, attention: str = "kernel") -> list[int]:
        """Per-token saved bytes of every block, in execution order."""
        return (
            [self.double_block_bytes(b, attention)] * self.depth_double
            + [self.single_block_bytes(b, attention)] * self.depth_single
        )

    def outside_bytes(self, b: int, image: bool) -> int:
        """Per-token saved bytes outside the blocks: embedder input, final layer (image
        tokens), RoPE cos/sin, shared index tensors."""
        d = self.hidden_size
        shared = INDEX + (INDEX if self.depth_single else 0) + (3 * INDEX if self.depth_double else 0) + 1
        shared += 2 * FP32 * (self.head_dim // 2)  # RoPE cos, sin
        if self.shared_modulation:  # its per-token tensors, kept by every block (its stream's 6d, the single 3d)
            shared += b * ((6 * d if self.depth_double else 0) + (3 * d if self.depth_single else 0))
        if image:
            return self.patch_dim * b + 4 * d * b + 2 * FP32 + INDEX + shared
        if self.cross_attention:  # Wan: the text MLP's hidden twice, and the text rows every block reads
            return self.text_dim * b + 3 * d * b + shared
        return self.text_dim * b + shared

    def sequence_bytes(self, b: int) -> int:
        """Per-sequence saved bytes: conditioning MLPs and the SiLU'd rows every modulation
        (2 per double block, 1 per single block, 1 final; a shared modulation's 3 and the
        final's) feeds its Linear."""
        d = self.hidden_size
        cond = (TIME_EMBED_DIM + 2 * d) * b + d * b
        if self.pooled_dim:
            cond += (self.pooled_dim + 2 * d) * b
        if self.guidance_embeds:
            cond += (TIME_EMBED_DIM + 2 * d) * b
        if self.shared_modulation:
            return cond + d * b * 4
        return cond + d * b * (2 * self.depth_double + self.depth_single + 1)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU bytes by category; ``total`` is the peak over the step's two phases."""

    params: int
    """Every resident model's parameter shards (both experts' with two)."""
    grads: int
    """The training model's gradients."""
    optimizer: int
    """Every resident model's AdamW state."""
    ema: int
    """Every resident model's EMA shadow (0 without ``optim.ema_decay``)."""
    autocast_weights: int
    fsdp_buffers: int
    activations: int
    """Saved by the forward (all blocks, or checkpointed blocks' inputs) + outside blocks."""
    recompute: int
    """One checkpointed block recomputed during backward (0 without checkpointing)."""
    backward_working: int
    step_buffers: int
    tokens: int
    overlap: int = 0
    """Counted in both ``activations`` and ``grads`` but never alive together: backward frees
    each block's activations as its gradients appear (``MemoryModel.breakdown``)."""

    @property
    def backward_peak(self) -> int:
        return (
            self.params + self.grads + self.optimizer + self.ema + self.autocast_weights + self.fsdp_buffers
            + self.activations + self.recompute + self.backward_working - self.overlap
        )

    @property
    def step_peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.ema + self.step_buffers

    @property
    def total(self) -> int:
        return max(self.backward_peak, self.step_peak)

    @property
    def peak_phase(self) -> str:
        return "backward" if self.backward_peak >= self.step_peak else "optimizer step"

    def to_gib(self) -> dict[str, float]:
        out = {  # overlap is subtracted: negative here, so the backward phase is the sum
            f.name: (-1 if f.name == "overlap" else 1) * getattr(self, f.name) / GIB
            for f in fields(self) if f.name != "tokens"
        }
        out["total"] = self.total / GIB
        return out


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """Per-GPU memory of a training step: model shape, parallel layout, precision."""

    shape: ModelShape
    world_size: int = 1
    gpus_per_node: int = 8
    sharding: str = "none"
    """``none`` (replicated), ``full`` (FSDP2 over the world), ``hybrid`` (FSDP2 within a
    node of ``gpus_per_node``, replicated across nodes)."""
    checkpointing: str = "none"
    """``none``, ``full`` (every block), ``selective`` (every block, attention's outputs
    kept) or ``every_k`` (every ``ac_every``-th block)."""
    ac_every: int = 2
    precision: str = "bf16"
    """Compute dtype: ``bf16`` (autocast over fp32 params without sharding, FSDP2 mixed
    precision with it) or ``fp32``."""
    attention: str = "kernel"
    """What attention saves: ``kernel`` (flash / torch varlen, Ulysses: the GPU path) or
    ``reference`` (the per-sequence SDPA path of ``knapray.attention``: CPU)."""
    reserve_bytes: int = RESERVE_BYTES
    fragmentation: float = FRAGMENTATION
    trainable: tuple[int, int] | None = None
    """(parameters, tensors) that train, when not all do: a LoRA run's adapters
    (``knapray.models.families.adapter_counts``). Gradients and AdamW state are theirs alone; the
    frozen base's linear layers are held in the compute dtype (``hold_base_in``), the rest
    of it in fp32, sharded like the rest."""
    fp8: str = "off"
    """``parallel.fp8`` (its ``fp8_scaling``, or ``off``): the float8 copies of each float8
    matmul's operands and their transposes in the backward's working set
    (``FP8_WORKING_BYTES`` per token and unit of 2d + m); with ``tensorwise`` under FSDP the
    float8 layers' weights gathered in 1 byte (``ModelShape.float8_weights``)."""
    fp8_base: bool = False
    """``model.lora.base_dtype: fp8``: the frozen base's block linears held in float8, 1 byte
    a weight plus a 4-byte scale per output row (``knapray.models.fp8``); its embedders and
    final layer in the compute dtype. FSDP still gathers them in the compute dtype."""
    experts: int = 1
    """Models the run keeps resident (``flow.expert_boundary``: 2, Wan 2.2 A14B's high- and
    low-noise transformers, of one architecture): each its parameter shards, AdamW state and
    EMA; the gradients, buffers and activations are the one training's."""
    ema: bool = False
    """``optim.ema_decay`` > 0: an fp32 shadow of each model's trained parameters, sharded."""

    def __post_init__(self) -> None:
        if not isinstance(self.shape, ModelShape):
            object.__setattr__(self, "shape", ModelShape.of(self.shape))
        for name, valid in (
            ("sharding", SHARDING), ("checkpointing", CHECKPOINTING), ("precision", PRECISIONS),
            ("attention", ATTENTION), ("fp8", FP8_MODES),
        ):
            if getattr(self, name) not in valid:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; valid: {', '.join(valid)}")
        if not isinstance(self.ema, bool):
            raise ValueError(f"ema must be a bool, got {self.ema!r}")
        for name in ("world_size", "gpus_per_node", "ac_every", "experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.sharding == "hybrid" and self.world_size % min(self.gpus_per_node, self.world_size):
            raise ValueError(
                f"hybrid sharding needs whole nodes: world size {self.world_size} is not a multiple "
                f"of gpus_per_node={self.gpus_per_node}"
            )
        if not 0 <= self.fragmentation < 1:
            raise ValueError(f"fragmentation must be in [0, 1), got {self.fragmentation!r}")
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {self.reserve_bytes!r}")

    @property
    def shard_size(self) -> int:
        """Ranks one parameter's fp32 state is split over."""
        if self.sharding == "full":
            return self.world_size
        if self.sharding == "hybrid":
            return min(self.gpus_per_node, self.world_size)
        return 1

    @property
    def compute_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4

    def checkpointed(self) -> list[bool]:
        """Per block in execution order: is it checkpointed? (``checkpointed_blocks``: the
        rule the trainer applies.)"""
        return list(checkpointed_blocks(self.checkpointing, self.ac_every, self.shape.num_blocks))

    # ---- pieces -------------------------------------------------------------------------

    def _sharded(self, total: int) -> int:
        return -(-total // self.shard_size)

    def activation_bytes(self, tokens: int, *, text_tokens: int = 0, sequences: int = 0) -> tuple[int, int, int]:
        """(saved by the forward, one block's recompute, backward working set) for a rank
        holding ``tokens`` routed tokens (``text_tokens`` of them text) of ``sequences``
        sequences."""
        if tokens < 0 or not 0 <= text_tokens <= tokens or sequences < 0:
            raise ValueError(
                f"need 0 <= text_tokens <= tokens and sequences >= 0, got tokens={tokens}, "
                f"text_tokens={text_tokens}, sequences={sequences}"
            )
        s, b = self.shape, self.compute_bytes
        d = s.hidden_size
        ckpt = self.checkpointed()
        keep = self._selective_keeps(b)
        outside = (tokens - text_tokens) * s.outside_bytes(b, True) + text_tokens * s.outside_bytes(b, False)
        if s.cross_attention:  # Wan: blocks run on the image tokens; text rows are keys only
            image = tokens - text_tokens
            block = image * s.wan_image_bytes(b) + text_tokens * s.wan_text_bytes(b)
            # a checkpointed block keeps its input (and under selective both attentions' outputs)
            kept = sum(image * (d * b + 2 * keep) if c else block for c in ckpt)
            recompute = block - image * 2 * keep if any(ckpt) else 0
            # A block's backward starts at its FFN, with all it saved recomputed (the peak of
            # image-heavy steps: knapray dryrun of Wan 2.1 14B's width, 4 blocks, 8 ranks, 17-frame
            # clips, LoRA rank 16, at fc2's backward): the block output's gradient in the compute
            # dtype and as the fp32 of the residual sum, the FFN output's gradient in fp32 and cast
            # back, and the gate's gradient in fp32 (bf16: 16·d bytes, the tally of live tensors).
            up = FP32 if b < FP32 else 0  # a cast that in fp32 is its source
            working = image * (b + up + FP32 + (b if up else 0) + FP32) * d
            # The cross-attention's backward on the text rows: the gradient of the stacked keys and
            # values back from the bag (the all-to-all's receive buffer, (Tt, 2, d)) and its
            # reordering, whose views are k's and v's gradients, in the compute dtype while those go
            # back through the norm and the projections: 4·d·b per text token (the peak of the
            # text-heavy step, default mix, LoRA rank 16: at attn2.to_v's backward, the tally of
            # live tensors). A full fine-tune's peak is at a block's end instead, where FSDP's fp32
            # reduce-scatter input of the block just differentiated (in ``fsdp_buffers``) is alive
            # and these are not: the excess over it counts.
            working += max(0, text_tokens * 4 * d * b - self._wan_reduce_scatter_bytes())
            if self.fp8 != "off":
                working += image * FP8_WORKING_BYTES * (2 * d + s.mlp_hidden)
            return kept + outside + sequences * s.sequence_bytes(b), recompute, working
        per_block = s.block_bytes(b, self.attention)
        kept = sum(d * b + keep if c else a for a, c in zip(per_block, ckpt))
        saved = tokens * kept + outside + sequences * s.sequence_bytes(b)
        recompute = tokens * max((a - keep for a, c in zip(per_block, ckpt) if c), default=0)
        working = tokens * (d + s.mlp_hidden + self._modulation_gradient()) * b
        if self.fp8 != "off":
            working += tokens * FP8_WORKING_BYTES * (2 * d + s.mlp_hidden)
        return saved, recompute, working

    def _autocast_bytes(self) -> int:
        if self.precision != "bf16" or self.sharding != "none":
            return 0
        s = self.shape
        lin = [s.double_block[0]] * s.depth_double + [s.single_block[0]] * s.depth_single
        ckpt = self.checkpointed()
        kept = sum(p for p, c in zip(lin, ckpt) if not c) + s.root[0]
        return 2 * (kept + max((p for p, c in zip(lin, ckpt) if c), default=0))

    def _fsdp_bytes(self, kept: list[int] | None = None) -> int:
        """``fsdp_buffers``; ``kept``: what each block keeps until its backward (``_kept``),
        which a frozen base's term weighs against (below)."""
        # A shard group of one rank gathers and reduces nothing: FSDP2's unsharded parameters
        # and gradients are the sharded ones (measured by knapray dryrun at world 1).
        if self.sharding == "none" or self.shard_size == 1:
            return 0
        s = self.shape
        p = self.compute_bytes
        if self.trainable:
            # A frozen base (LoRA): no gradient buffers beside the adapters'. While block k is
            # differentiated FSDP holds it gathered and the one before it prefetched, in the
            # compute dtype, and the blocks after k have freed what they kept: at the backward's
            # start (the last block) where activations peak (knapray dryrun of
            # jobs/configs/flux_dev_lora.yaml), or later where a double block is much larger
            # than the single ones and few single blocks came before it (FLUX.2's double block
            # is two of its single ones: knapray dryrun of jobs/configs/flux2_dev_lora.yaml
            # with 8 + 8 blocks). The excess over the activations counted whole is the term.
            params = [sum(s.double_block[:2])] * s.depth_double + [sum(s.single_block[:2])] * s.depth_single
            kept = kept if kept is not None else [0] * len(params)
            freed = [sum(kept) - done for done in itertools.accumulate(kept)]  # by the blocks after k
            return max(p * (params[k] + params[max(k - 1, 0)]) - freed[k] for k in range(len(params)))
        largest = max(
            sum(s.double_block[:2]) if s.depth_double else 0, sum(s.single_block[:2]) if s.depth_single else 0
        )
        gathered = p * largest  # a gathered block's bytes
        if self.fp8 == "tensorwise":  # its float8 layers' weights gathered in 1 byte
            gathered = max(p * sum(s.double_block[:2]) - (p - 1) * s.float8_weights[0] if s.depth_double else 0,
                           p * sum(s.single_block[:2]) - (p - 1) * s.float8_weights[1] if s.depth_single else 0)
        if s.cross_attention:
            # Wan (knapray dryrun at 8 and 64 ranks): at the peak one block is gathered in the
            # compute dtype and one reduce-scattered in fp32, nothing prefetched beside them
            return gathered + self._wan_reduce_scatter_bytes() + (2 * p + FP32) * sum(s.root[:2])
        # A shared modulation is a unit of its own (FLUX.2's: 15·d² parameters, half a double
        # block), gathered only in forward and in its backward, after every block's
        # (knapray dryrun of jobs/configs/flux2_dev_lora.yaml in fp32 without LoRA, 8 + 48
        # blocks: +19% with it counted as staying gathered, +11% without)
        return 3 * gathered + 8 * largest + (2 * p + FP32) * (sum(s.root[:2]) - s.shared_modulation_params)

    def _wan_reduce_scatter_bytes(self) -> int:
        """Wan under FSDP with its base training: the fp32 reduce-scatter input of one block
        (a gradient per parameter); 0 for a frozen base or a shard group of one rank."""
        if self.sharding == "none" or self.shard_size == 1 or self.trainable:
            return 0
        return FP32 * sum(self.shape.single_block[:2])

    def breakdown(self, tokens: int, *, text_tokens: int = 0, sequences: int = 0) -> MemoryBreakdown:
        """Per-GPU bytes of a step in which this rank holds ``tokens`` routed tokens."""
        s = self.shape
        n = s.num_params
        t, t_tensors = self.trainable or (n, s.num_param_tensors)
        saved, recompute, working = self.activation_bytes(tokens, text_tokens=text_tokens, sequences=sequences)
        allreduce = FP32 * t if self.sharding == "none" and self.world_size > 1 else 0
        grads = FP32 * self._sharded(t)
        if self.trainable:  # fp32 adapters and small base tensors, the base's linears in the compute dtype
            linear = s.num_linear_params
            params = FP32 * self._sharded(n - linear + t) + self.compute_bytes * self._sharded(linear)
            if self.fp8_base:
                blocks = linear - s.root[0]
                # float8 values and fp32 scales (rows bounded by the weights over the width)
                params += (1 - self.compute_bytes) * self._sharded(blocks) + FP32 * self._sharded(
                    -(-blocks // s.hidden_size))
        else:
            params = FP32 * self._sharded(n)
        k = self.experts  # resident models; one trains this step
        return MemoryBreakdown(
            params=k * params,
            grads=grads,
            optimizer=k * (2 * FP32 * self._sharded(t) + FP32 * t_tensors),
            ema=k * FP32 * self._sharded(t) if self.ema else 0,
            autocast_weights=self._autocast_bytes(),
            fsdp_buffers=self._fsdp_bytes(self._kept(tokens, text_tokens)),
            activations=saved,
            recompute=recompute,
            backward_working=working,
            step_buffers=allreduce,
            tokens=tokens,
            overlap=self._overlap(tokens, text_tokens, saved - self._outside_saved(tokens, text_tokens, sequences),
                                  grads),
        )

    def backward_overlap(self, tokens: int, grads: int, *, text_tokens: int = 0, sequences: int = 0) -> int:
        """``MemoryBreakdown.overlap`` for gradients of ``grads`` bytes in all (e.g. a model
        cast to bf16 whole, whose gradients are bf16, not the fp32 of mixed precision)."""
        saved, _, _ = self.activation_bytes(tokens, text_tokens=text_tokens, sequences=sequences)
        return self._overlap(tokens, text_tokens, saved - self._outside_saved(tokens, text_tokens, sequences), grads)

    def _outside_saved(self, tokens: int, text_tokens: int, sequences: int) -> int:
        s, b = self.shape, self.compute_bytes
        return ((tokens - text_tokens) * s.outside_bytes(b, True) + text_tokens * s.outside_bytes(b, False)
                + sequences * s.sequence_bytes(b))

    def _kept(self, tokens: int, text_tokens: int) -> list[int]:
        """Bytes each block keeps until its backward, in execution order."""
        s, b, d = self.shape, self.compute_bytes, self.shape.hidden_size
        ckpt, keep = self.checkpointed(), self._selective_keeps(b)
        if s.cross_attention:
            image = tokens - text_tokens
            block = image * s.wan_image_bytes(b) + text_tokens * s.wan_text_bytes(b)
            return [image * (d * b + 2 * keep) if c else block for c in ckpt]
        return [tokens * (d * b + keep if c else a) for a, c in zip(s.block_bytes(b, self.attention), ckpt)]

    def _modulation_gradient(self) -> int:
        """Per token, the width of the modulation gradient the backward holds: a block's own
        (2d: a chunk's, until its others arrive) or, with a shared modulation whose base
        trains, its per-token tensors' gradient, summed over every block of a kind before it
        reaches the modulation (a stream's 6d through the double blocks, 3d the single)."""
        s = self.shape
        if not s.shared_modulation or self.trainable:  # a block's own; a frozen base sums none
            return 2 * s.hidden_size
        return (6 if s.depth_double else 3) * s.hidden_size

    def _selective_keeps(self, b: int) -> int:
        """Per token and attention call, what a checkpointed block keeps beyond its input."""
        return self.shape.attention_kept_bytes(b) if self.checkpointing == "selective" else 0

    def _overlap(self, tokens: int, text_tokens: int, block_saved: int, grads: int) -> int:
        """Activations + gradients minus the most of both alive at once in backward.

        Backward runs the blocks in reverse: while block k is differentiated, blocks 0..k
        still hold what they saved, and the blocks after k (and the final layer, first in
        backward) have their gradients (sharded ones under FSDP); the embedders' come last.
        The peak of that sum over k is what the backward holds; the rest is overlap."""
        s = self.shape
        if not tokens and not grads:
            return 0
        kept = self._kept(tokens, text_tokens)
        params = [sum(s.double_block[:2])] * s.depth_double + [sum(s.single_block[:2])] * s.depth_single
        total = sum(params) + sum(s.root[:2])
        grad_of = [grads * p // total for p in params]
        final = grads * (s.hidden_size * 2 * s.hidden_size + s.hidden_size * s.head_width) // total
        alive = max(sum(kept[: k + 1]) + sum(grad_of[k + 1:]) + final for k in range(len(kept)))
        return max(0, block_saved + grads - alive)

    def usable_bytes(self, gpu_bytes: int) -> int:
        """What the step may use of a GPU: minus the fixed reserve, minus fragmentation."""
        return int((gpu_bytes - self.reserve_bytes) * (1 - self.fragmentation))

    def max_tokens_per_gpu(self, gpu_bytes: int) -> int:
        """Largest per-GPU token budget whose peak fits ``usable_bytes(gpu_bytes)`` (every
        token counted as an image token, the costlier kind; per-sequence terms left out).
        0 if not even the model state fits. The peak grows with the tokens (piecewise
        linearly: activations overlap the gradients only up to a point): a bisection."""
        usable = self.usable_bytes(gpu_bytes)
        if self.breakdown(0).total > usable:
            return 0
        hi = 1
        while self.breakdown(hi).total <= usable:
            hi *= 2
        lo = hi // 2  # fits; hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.breakdown(mid).total <= usable else (lo, mid)
        return lo

    def fits(self, tokens: int, gpu_bytes: int) -> bool:
        return self.breakdown(tokens).total <= self.usable_bytes(gpu_bytes)


def parse_checkpointing(value: Any, every: int | None = None) -> tuple[str, int]:
    """(mode, k) from ``none`` / ``full`` / ``every_k`` (k from ``every``, default 2) or the
    shorthand ``every_<k>``."""
    text = str(value).strip().lower()
    if text.startswith("every_") and text[6:].isdigit():
        k = int(text[6:])
        if k < 1:
            raise ValueError(f"activation checkpointing {value!r}: k must be >= 1")
        return ("full" if k == 1 else "every_k"), k
    if text not in CHECKPOINTING:
        raise ValueError(
            f"unknown activation checkpointing {value!r}; valid: {', '.join(CHECKPOINTING)} or every_<k>"
        )
    return text, 2 if every is None else every


def memory_model_for_run(
    cfg: Any,
    *,
    world_size: int | None = None,
    gpus_per_node: int | None = None,
    sharding: str | None = None,
    checkpointing: str | None = None,
    ac_every: int | None = None,
    trainable: tuple[int, int] | None = None,
) -> MemoryModel:
    """The memory model of a run config (``knapray.config.run.TrainConfig``); keyword
    arguments override it. Its ``parallel`` section gives sharding, checkpointing and
    precision (``auto``: bf16 on GPUs, ``scaling.use_gpu``, fp32 otherwise), ``scaling`` the
    world size, ``flow.expert_boundary`` two resident experts, ``optim.ema_decay`` the EMA."""
    par = cfg.parallel
    precision = par.precision
    if precision == "auto":
        precision = "bf16" if cfg.scaling.use_gpu else "fp32"
    mode, k = parse_checkpointing(
        checkpointing if checkpointing is not None else par.activation_checkpointing,
        ac_every if ac_every is not None else par.ac_every,
    )
    per_node = gpus_per_node or cfg.balance.gpus_per_node or 8
    world = world_size if world_size is not None else cfg.scaling.num_workers
    sharding = sharding if sharding is not None else par.fsdp
    return MemoryModel(
        shape=ModelShape.of(cfg.model),
        world_size=world,
        gpus_per_node=per_node,
        # One rank shards nothing (``knapray.config.parallel.sharding_of``): autocast over fp32
        sharding="none" if world == 1 else sharding,
        checkpointing=mode,
        ac_every=k,
        precision=precision,
        trainable=trainable,
        fp8_base=bool(trainable) and cfg.model.lora.enabled and cfg.model.lora.base_dtype == "fp8",
        fp8=par.fp8_scaling if par.fp8 else "off",
        experts=2 if cfg.flow.expert_boundary else 1,  # Wan 2.2 A14B's two, both resident
        ema=cfg.optim.ema_decay > 0,
    )
