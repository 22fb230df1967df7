"""Packed-sequence Flux-style MMDiT (and, with depth_double=0, a plain DiT).

The model never sees process groups. A distributed executor calls the stages itself:

    vec = model.condition(timesteps, pooled)            # (S, d), one row per sequence
    h = model.embed(x_txt, x_img, is_text)              # (N, d), per token
    h = model.blocks(h, vec_loc, seq_index_loc, pos, is_text, attn)
    out_img = model.head(h_home, vec, seq_index, is_text, pos=pos_home)  # routed home again

Each of embed, blocks and head also takes ``streams=TokenStreams``: ``is_text``'s index maps
built on the host, so that a training step never waits for the device.

Every stage but ``attn`` is per token (or per sequence, gathered per token), so the tokens
on a rank may be any chunks of any sequences, in any order, as long as ``seq_index`` points
each token at its sequence's row of ``vec``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from knapray.attention import AttentionFn, LocalAttention
from knapray.models.blocks import DoubleStreamBlock, FinalLayer, SingleStreamBlock, TokenStreams
from knapray.models.config import MMDiTConfig
from knapray.models.interface import FsdpUnits
from knapray.models.layers import MLP, TIME_EMBED_DIM, Modulation, RMSNorm, rope_frequencies, timestep_embedding
from knapray.models.packing import PackedBatch
from knapray.models.step_cache import StepCache


class MMDiT(nn.Module):
    """Flux-style MMDiT over packed token batches; attention is injected per call."""

    def __init__(self, cfg: MMDiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.img_in = nn.Linear(cfg.patch_dim, d)
        self.txt_in = nn.Linear(cfg.text_dim, d) if cfg.text_dim else None
        self.time_in = MLP(TIME_EMBED_DIM, d, d, activation="silu")
        self.vector_in = MLP(cfg.pooled_dim, d, d, activation="silu") if cfg.pooled_dim else None
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.depth_double))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(cfg) for _ in range(cfg.depth_single))
        self.final = FinalLayer(cfg)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float | None = None) -> None:
        """Re-initialize every parameter from torch's global RNG (seed it for identical ranks).

        ``std=None``: DiT/Flux "adaLN-Zero": xavier linears, zero biases, N(0, 0.02) for the
        conditioning MLPs, and zero modulation and output layers, so every block starts as the
        identity. Many gradients are then exactly zero at init.
        ``std=s``: every linear weight and bias ~ N(0, s) and every RMSNorm gain ~ 1 + N(0, s):
        a non-degenerate init where every parameter gets a nonzero gradient (for parity tests).
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                if std is None:
                    nn.init.xavier_uniform_(module.weight)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
                else:
                    nn.init.normal_(module.weight, std=std)
                    if module.bias is not None:
                        nn.init.normal_(module.bias, std=std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
                if std is not None:
                    module.weight.add_(torch.randn_like(module.weight) * std)
        if std is not None:
            return
        for embedder in self.conditioning_mlps():
            nn.init.normal_(embedder.fc1.weight, std=0.02)
            nn.init.normal_(embedder.fc2.weight, std=0.02)
        for module in self.modules():
            if isinstance(module, Modulation):
                module.lin.weight.zero_()
                if module.lin.bias is not None:
                    module.lin.bias.zero_()
        self.final.linear.weight.zero_()
        if self.final.linear.bias is not None:
            self.final.linear.bias.zero_()

    @torch.no_grad()
    def initial_values(self, write: Callable[[nn.Parameter, torch.Tensor], None]) -> None:
        """Initialize a model whose parameters were built elsewhere (on the meta device, then
        sharded and given storage, e.g. ``to_empty``): ``write(param, value)`` receives each
        parameter's initial value as a full fp32 CPU tensor, one at a time (the host holds one
        parameter, not the model).

        The values are those ``MMDiT(cfg)`` draws on the CPU from torch's global RNG in the same
        state (seed it for identical ranks), bit for bit, and the RNG is left where that leaves
        it: the constructor's draws are replayed (every Linear's default init, in construction
        order, then ``init_weights()``'s), only the final value of each parameter is kept."""
        linears = [m for m in self.modules() if isinstance(m, nn.Linear)]  # construction order
        for m in linears:  # nn.Linear's own init in the constructor, overwritten below
            nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        redrawn = {id(fc) for e in self.conditioning_mlps() for fc in (e.fc1, e.fc2)}
        zero = {id(m.lin) for m in self.modules() if isinstance(m, Modulation)} | {id(self.final.linear)}
        for m in self.modules():  # init_weights(), in its order
            if isinstance(m, nn.Linear):
                w = nn.init.xavier_uniform_(torch.empty(m.out_features, m.in_features))
                if id(m) in zero:
                    w.zero_()
                if id(m) not in redrawn:
                    write(m.weight, w)
                if m.bias is not None:
                    write(m.bias, torch.zeros(m.out_features))
            elif isinstance(m, RMSNorm):
                write(m.weight, torch.ones(m.weight.shape))
        for embedder in self.conditioning_mlps():
            for fc in (embedder.fc1, embedder.fc2):
                write(fc.weight, nn.init.normal_(torch.empty(fc.out_features, fc.in_features), std=0.02))

    def conditioning_mlps(self) -> list[nn.Module]:
        """The MLPs of the per-sequence conditioning (timestep, pooled text), which the
        init draws from N(0, 0.02) after the xavier pass (``init_weights``, ``initial_values``)."""
        return [m for m in (self.time_in, self.vector_in) if m is not None]

    def fsdp_units(self) -> FsdpUnits:
        """The conditioning MLPs, then the image and text embedders; the double-stream, then
        the single-stream blocks; the final layer."""
        embedders = [*self.conditioning_mlps(), self.img_in, self.txt_in]
        return FsdpUnits(embedders=tuple(m for m in embedders if m is not None),
                         blocks=(*self.double_blocks, *self.single_blocks), final=self.final)

    def positions(self, pos: torch.Tensor, seq_index: torch.Tensor, is_text: torch.Tensor) -> torch.Tensor:
        """The RoPE ids of whole packed sequences, from the packed (frame, row, column) ids
        (text at (0, 0, 0)): taken as they are. Called at a sequence's home, before its
        tokens are routed (a family whose ids depend on the whole sequence derives them here)."""
        return pos

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (cos, sin), each (N, head_dim/2), of integer positions pos (N, 3)."""
        return rope_frequencies(pos, self.cfg.rope_axes_dim, self.cfg.rope_theta)

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype the inputs (latents, text, pooled and timestep features) are cast to.

        The parameters' dtype: bf16 when they are cast for compute (``.to(torch.bfloat16)``,
        FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``). Under autocast they
        stay fp32 and the first linears produce bf16 activations; either way every block
        then computes in one dtype.
        """
        return self.img_in.weight.dtype

    def condition(self, timesteps: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """timesteps (S,) float, pooled (S, pooled_dim) -> vec (S, d): one vector per sequence.

        vec is fp32 whatever the compute dtype (it is S rows): every block's modulation reads
        it, so its gradient is a sum over all the blocks, accumulated in fp32."""
        s = timesteps.shape[0]
        if timesteps.dim() != 1 or pooled.shape != (s, self.cfg.pooled_dim):
            raise ValueError(
                f"expected timesteps (S,) and pooled (S, {self.cfg.pooled_dim}), "
                f"got {tuple(timesteps.shape)} and {tuple(pooled.shape)}"
            )
        dtype = self.param_dtype
        vec = self.time_in(timestep_embedding(timesteps).to(dtype))
        if self.vector_in is not None:
            vec = vec + self.vector_in(pooled.to(dtype))
        return vec.float()

    def embed(
        self, x_txt: torch.Tensor, x_img: torch.Tensor, is_text: torch.Tensor, *, streams: TokenStreams | None = None
    ) -> torch.Tensor:
        """x_txt (Nt, text_dim), x_img (Ni, patch_dim), is_text (N,) -> h (N, d) in packed order.

        Row j of x_txt goes to the j-th text position of is_text; likewise for x_img.
        ``streams``: ``is_text``'s index maps, built on the host (``TokenStreams.from_host_mask``)
        so that the device is never waited for; None derives them from ``is_text``.
        """
        streams = streams if streams is not None else TokenStreams.from_mask(is_text)
        if streams.txt_idx.shape[0] != x_txt.shape[0] or streams.img_idx.shape[0] != x_img.shape[0]:
            raise ValueError(
                f"is_text marks {streams.txt_idx.shape[0]} text / {streams.img_idx.shape[0]} image tokens, "
                f"but x_txt has {x_txt.shape[0]} rows and x_img {x_img.shape[0]}"
            )
        dtype = self.param_dtype
        h_img = self.img_in(x_img.to(dtype))
        if self.txt_in is not None:
            h_txt = self.txt_in(x_txt.to(dtype))
        elif x_txt.shape[0] == 0:
            h_txt = h_img.new_zeros(0, self.cfg.hidden_size)
        else:
            raise ValueError(f"model has text_dim=0 but got {x_txt.shape[0]} text tokens")
        return streams.merge(h_txt, h_img)

    def blocks(
        self,
        h: torch.Tensor,
        vec_seq: torch.Tensor,
        seq_index: torch.Tensor,
        pos: torch.Tensor,
        is_text: torch.Tensor,
        attn: AttentionFn,
        *,
        streams: TokenStreams | None = None,
        cache: StepCache | None = None,
    ) -> torch.Tensor:
        """Double-stream then single-stream blocks over the local tokens.

        h (N, d); vec_seq (S_loc, d) one row per local sequence; seq_index (N,) long in
        [0, S_loc); pos (N, 3) int64; is_text (N,) bool. ``attn`` is called exactly once per
        block (depth_double + depth_single times), also when N == 0, unless ``cache`` (a
        sampling step's ``StepCache``) has the first block's output reuse the others'.
        ``streams``: as in ``embed``, for these tokens.
        """
        n, d = h.shape
        axes = len(self.cfg.rope_axes_dim)
        if seq_index.shape != (n,) or is_text.shape != (n,) or pos.shape != (n, axes):
            raise ValueError(
                f"for h {tuple(h.shape)} expected seq_index ({n},), is_text ({n},), pos ({n}, {axes}); got "
                f"{tuple(seq_index.shape)}, {tuple(is_text.shape)}, {tuple(pos.shape)}"
            )
        if vec_seq.dim() != 2 or vec_seq.shape[1] != self.cfg.condition_dim:
            raise ValueError(f"vec_seq must be (S_loc, {self.cfg.condition_dim}), got {tuple(vec_seq.shape)}")
        rope = self.rope(pos)
        h_in, h_0 = h, None
        if len(self.double_blocks):
            streams = streams if streams is not None else TokenStreams.from_mask(is_text)
            # Kept split across all double blocks; only q, k, v are merged for attention.
            h_txt, h_img = streams.split(h)
            seq_txt, seq_img = streams.split(seq_index)
            inputs = self.double_inputs(vec_seq, seq_txt, seq_img, h.dtype)
            for i, block in enumerate(self.double_blocks):
                h_txt, h_img = block(h_txt, h_img, *inputs, streams, rope, attn)
                if i == 0 and cache is not None:
                    h_0 = streams.merge(h_txt, h_img)
                    if cache.reuse(h_in, h_0):
                        return cache.apply(h_0)
            h = streams.merge(h_txt, h_img)
        inputs = self.single_inputs(vec_seq, seq_index, h.dtype) if len(self.single_blocks) else ()
        for i, block in enumerate(self.single_blocks):
            h = block(h, *inputs, rope, attn)
            if i == 0 and cache is not None and h_0 is None:
                h_0 = h
                if cache.reuse(h_in, h_0):
                    return cache.apply(h_0)
        if cache is not None:
            cache.store(h_0, h)
        return h

    def double_inputs(self, vec_seq: torch.Tensor, seq_txt: torch.Tensor, seq_img: torch.Tensor,
                      dtype: torch.dtype) -> tuple:
        """What every double-stream block takes besides the tokens: the per-sequence vector
        and each stream's sequence index (each block modulates from them itself). ``dtype``:
        the residual stream's (what a model that hands the blocks per-token tensors casts
        them to: under FSDP the parameters outside a unit's forward are its fp32 shards)."""
        return vec_seq, seq_txt, seq_img

    def single_inputs(self, vec_seq: torch.Tensor, seq_index: torch.Tensor, dtype: torch.dtype) -> tuple:
        """What every single-stream block takes besides the tokens (``double_inputs``)."""
        return vec_seq, seq_index

    def head(
        self, h: torch.Tensor, vec_seq: torch.Tensor, seq_index: torch.Tensor, is_text: torch.Tensor, *,
        streams: TokenStreams | None = None, pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final adaLN norm + linear on the image tokens -> (Ni, patch_dim), packed order.
        ``streams``: as in ``embed`` (a gather by ``img_idx`` instead of a boolean mask,
        whose result size the host would wait for). ``pos``: the tokens' positions, which
        the executor gives every family's head; this one modulates per sequence and reads none."""
        if streams is not None:
            return self.final(h.index_select(0, streams.img_idx), vec_seq, seq_index.index_select(0, streams.img_idx))
        is_img = ~is_text
        return self.final(h[is_img], vec_seq, seq_index[is_img])

    def forward(self, batch: PackedBatch, attn: AttentionFn | None = None) -> torch.Tensor:
        """Single-process composition; ``attn`` defaults to varlen attention over the batch."""
        if attn is None:
            attn = LocalAttention(batch.cu_seqlens, batch.max_seqlen)
        vec = self.condition(batch.timesteps, batch.pooled)
        h = self.embed(batch.x_txt, batch.x_img, batch.is_text)
        h = self.blocks(h, vec, batch.seq_index, batch.pos, batch.is_text, attn)
        return self.head(h, vec, batch.seq_index, batch.is_text)
