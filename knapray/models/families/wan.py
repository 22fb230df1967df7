"""Wan 2.1 text-to-video over packed token batches: the math of diffusers'
``WanTransformer3DModel`` (0.42) behind knapray's stage interface.

A packed sequence's text tokens are not part of its attention: they are embedded once
(``txt_in``: Linear, GELU-tanh, Linear) and are the keys and values of every block's
cross-attention, never updated. Its visual tokens attend to each other (self-attention
with RoPE) and then to all text tokens of their own sequence (cross-attention, no RoPE).
Per block, as diffusers:

    h += gate   · attn1(LN(h) · (1 + scale) + shift)           # RMSNorm on q, k across heads
    h +=          attn2(LN_affine(h), text)                     # LN_affine: cross_attn_norm
    h += c_gate · ffn(LN(h) · (1 + c_scale) + c_shift)          # GELU-tanh

with (shift, scale, gate, c_shift, c_scale, c_gate) = the block's ``scale_shift_table`` +
``time_proj(silu(temb))`` of the sequence. The head: LN(h) · (1 + scale) + shift with
(shift, scale) = the final ``scale_shift_table`` + temb (not its projection), then
``proj_out``.

Where knapray's representation differs from diffusers': the Conv3d patch embedding is a
linear over patchified tokens (its weight kept in the Conv3d's shape (d, C, pt, ph, pw),
whose flattening is knapray's patch feature order); ``proj_out``'s rows are knapray's
patch order (C, pt, ph, pw), diffusers' are (pt, ph, pw, C): ``wan_keys`` permutes them.
RoPE is diffusers' ``WanRotaryPosEmbed`` split (h = w = 2·(head_dim // 6) channels, t the
rest), angles in float64, over each visual token's (frame, row, column) patch index.

``condition`` returns (S, 7·d) per sequence: temb then time_proj(silu(temb)).

Balanced: the blocks take a ``knapray.distributed.BagCrossAttention`` (the executor
builds it from the plan and every sequence's text count): Ulysses over the image queries
and the text keys and values of a bag's sequences. Single-process (``forward``), both
attentions run per sequence on this rank.

Not yet: I2V image conditioning (``image_dim`` / ``added_kv_proj_dim``), Wan 2.2's two
experts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from knapray.attention import AttentionFn, cross_attention, varlen_attention
from knapray.indexing import gather_rows, permute_rows
from knapray.models.blocks import TokenStreams
from knapray.models.config import DiTConfig
from knapray.models.families.flux import flux_rope
from knapray.models.interface import FsdpUnits
from knapray.models.layers import MLP, timestep_embedding
from knapray.models.packing import PackedBatch, patchify
from knapray.models.step_cache import StepCache
from knapray.planning.inference.sampling_memory import ArchSpec

DIFFUSERS_CLASS = "WanTransformer3DModel"
THETA = 10000.0
"""``WanRotaryPosEmbed``'s theta: fixed in diffusers."""
TEXT_LENGTH = 512
"""Wan's text length: ``WanPipeline`` truncates a prompt's umT5 tokens to 512 and pads its
embeddings with zero rows to 512."""
# Wan 2.1's other models (Wan2.1-T2V-14B-Diffusers' text_encoder/ and vae/ config.json): umT5-XXL
# at TEXT_LENGTH tokens, and AutoencoderKLWan's default (Wan 2.1's) in fp32, as WanPipeline
# decodes. What sampling holds besides the transformer.
TEXT_MODELS = (
    ArchSpec.of("UMT5EncoderModel", {"vocab_size": 256384, "d_model": 4096, "d_ff": 10240, "d_kv": 64,
                                     "num_heads": 64, "num_layers": 24, "feed_forward_proj": "gated-gelu",
                                     "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128},
                tokens=TEXT_LENGTH),
)
VAE = ArchSpec.of("AutoencoderKLWan", {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0, "is_residual": False, "in_channels": 3,
    "out_channels": 3, "patch_size": None}, dtype="fp32")
SAMPLE_SHIFT = 5.0
"""Wan's sampling shift (its pipelines' ``flow_shift``: 5.0 at 720p, 3.0 at 480p)."""
FFN_RATIO = 13824 / 5120
"""Wan 2.1's FFN width over its model width (14B: 13824 / 5120; 1.3B: 8960 / 1536 is 5.83)."""


def wan_rope_split(head_dim: int) -> tuple[int, int, int]:
    """(t, h, w) head channels of diffusers' ``WanRotaryPosEmbed``."""
    h = w = 2 * (head_dim // 6)
    return head_dim - h - w, h, w


@dataclasses.dataclass(kw_only=True, slots=True)
class WanConfig(DiTConfig):
    """Wan 2.1 T2V in knapray's field names (defaults: the 14B shape, diffusers' defaults).
    ``depth_single`` counts Wan's blocks (``num_layers``); ``depth_double`` is 0;
    ``rope_axes_dim`` is Wan's split of the head (left out: derived); ``mlp_ratio`` is
    derived from ``ffn_dim``."""

    attention_kind: ClassVar[str] = "cross"

    in_channels: int = dataclasses.field(default=16, metadata={"ge": 1})
    hidden_size: int = dataclasses.field(default=5120, metadata={"ge": 1})
    num_heads: int = dataclasses.field(default=40, metadata={"ge": 1})
    depth_double: int = dataclasses.field(default=0, metadata={"ge": 0})
    depth_single: int = dataclasses.field(default=40, metadata={"ge": 0})
    text_dim: int = dataclasses.field(default=4096, metadata={"ge": 1})
    pooled_dim: int = dataclasses.field(default=0, metadata={"ge": 0})
    rope_axes_dim: tuple[int, ...] = ()
    family: str = "wan"
    ffn_dim: int = dataclasses.field(default=13824, metadata={"ge": 1})
    """FFN hidden width (diffusers' ``ffn_dim``)."""
    freq_dim: int = dataclasses.field(default=256, metadata={"ge": 2})
    """Sinusoidal timestep features (diffusers' ``freq_dim``)."""
    cross_attn_norm: bool = True
    """An affine LayerNorm before cross-attention (else none)."""
    eps: float = 1e-6
    """Epsilon of every LayerNorm and the q/k RMSNorms."""
    rope_max_seq_len: int = dataclasses.field(default=1024, metadata={"ge": 1})
    """RoPE table length per axis in diffusers: no patch index may reach it."""
    text_pad_to: int = dataclasses.field(default=TEXT_LENGTH, metadata={"ge": 0, "le": 1 << 16})
    """Text rows each sequence cross-attends to: its tokens and zero rows up to this many, as
    Wan's pipelines pad umT5 embeddings to 512 (the corpus keeps only the tokens; its
    ``text_pad_to`` says the same). Wan's cross-attention has no mask, so the zero rows are
    keys and values after the text projection: all alike, computed as one key weighted by
    their count. 0: the tokens alone, as a bare ``WanTransformer3DModel`` call."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads == 0 and not tuple(self.rope_axes_dim):
            self.rope_axes_dim = wan_rope_split(self.hidden_size // self.num_heads)
        self.mlp_ratio = self.ffn_dim / self.hidden_size
        DiTConfig.__post_init__(self)
        split = wan_rope_split(self.head_dim)
        fixed = {"depth_double": 0, "pooled_dim": 0, "qk_norm": True, "rope_theta": THETA,
                 "rope_axes_dim": split}
        for name, value in fixed.items():
            if getattr(self, name) != value:
                raise ValueError(f"family wan: {name} must be {value!r} (fixed in Wan 2.1), got {getattr(self, name)!r}")
        if self.text_dim < 1:
            raise ValueError(f"family wan: text_dim must be >= 1 (Wan cross-attends to umT5 tokens), got {self.text_dim}")
        if self.head_dim % 2 or any(a % 2 for a in split):
            raise ValueError(f"family wan: head_dim {self.head_dim} gives RoPE split {split} with an odd part")
        if self.freq_dim % 2:
            raise ValueError(f"family wan: freq_dim must be even, got {self.freq_dim}")
        for name in ("cross_attn_norm",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def condition_dim(self) -> int:
        """``condition``'s (S, 7·d): temb, then the blocks' modulation."""
        return 7 * self.hidden_size

    def to_diffusers(self) -> dict[str, Any]:
        """The ``config.json`` of the equivalent ``WanTransformer3DModel``."""
        return {
            "_class_name": DIFFUSERS_CLASS, "patch_size": list(self.patch_size),
            "num_attention_heads": self.num_heads, "attention_head_dim": self.head_dim,
            "in_channels": self.in_channels, "out_channels": self.in_channels, "text_dim": self.text_dim,
            "freq_dim": self.freq_dim, "ffn_dim": self.ffn_dim, "num_layers": self.depth_single,
            "cross_attn_norm": self.cross_attn_norm, "qk_norm": "rms_norm_across_heads", "eps": self.eps,
            "image_dim": None, "added_kv_proj_dim": None, "rope_max_seq_len": self.rope_max_seq_len,
            "pos_embed_seq_len": None,
        }


DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
}
"""``WanTransformer3DModel.__init__``'s defaults."""


def section_from_diffusers(config: dict[str, Any], where: str) -> dict[str, Any]:
    """Model-section values of a diffusers ``WanTransformer3DModel`` config.json; ValueError
    naming ``where`` and the key for what knapray's Wan cannot be."""
    values = {**DIFFUSERS_DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}
    unknown = sorted(set(values) - set(DIFFUSERS_DEFAULTS))
    if unknown:
        raise ValueError(f"{where}: keys {unknown} are not WanTransformer3DModel's; valid: {sorted(DIFFUSERS_DEFAULTS)}")
    for key in ("num_attention_heads", "attention_head_dim", "in_channels", "text_dim", "freq_dim", "ffn_dim",
                "num_layers", "rope_max_seq_len"):
        if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < 1:
            raise ValueError(f"{where}: {key}={values[key]!r} is not a valid size")
    for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
        if values[key] is not None:
            raise ValueError(f"{where}: {key}={values[key]!r}: an image-conditioned (I2V/FLF2V) Wan; knapray "
                             "reads text-to-video Wan only")
    if values["out_channels"] not in (None, values["in_channels"]):
        raise ValueError(f"{where}: out_channels={values['out_channels']} differs from in_channels={values['in_channels']}")
    if values["qk_norm"] != "rms_norm_across_heads":
        raise ValueError(f"{where}: qk_norm={values['qk_norm']!r}; diffusers' Wan block always normalizes q and k "
                         "across heads, knapray reads only 'rms_norm_across_heads'")
    patch = values["patch_size"]
    if not isinstance(patch, (list, tuple)) or len(patch) != 3:
        raise ValueError(f"{where}: patch_size={patch!r} must be 3 ints (t, h, w)")
    return {
        "in_channels": values["in_channels"], "patch_size": tuple(patch),
        "hidden_size": values["attention_head_dim"] * values["num_attention_heads"],
        "num_heads": values["num_attention_heads"], "depth_single": values["num_layers"],
        "text_dim": values["text_dim"], "ffn_dim": values["ffn_dim"], "freq_dim": values["freq_dim"],
        "cross_attn_norm": bool(values["cross_attn_norm"]), "eps": float(values["eps"]),
        "rope_max_seq_len": values["rope_max_seq_len"],
    }


def condition_fields(cfg: WanConfig) -> tuple[str, ...]:
    return ("timesteps",)


def sample_shift(cfg: WanConfig) -> float:
    return SAMPLE_SHIFT


def sized_config(hidden: int, heads: int, depth_double: int, depth_single: int) -> WanConfig:
    """A Wan of ``depth_double + depth_single`` blocks at width ``hidden`` (Wan 2.1's FFN
    ratio, text padded to 512 as its pipelines do): what calibration times."""
    return WanConfig(in_channels=4, patch_size=(1, 2, 2), hidden_size=hidden, num_heads=heads,
                     depth_single=depth_double + depth_single, text_dim=16,
                     ffn_dim=max(2, round(hidden * FFN_RATIO)), freq_dim=256, text_pad_to=TEXT_LENGTH)


def small_config(width: int) -> WanConfig:
    """Wan's blocks at ``width`` (heads of 32 channels): two blocks, text unpadded."""
    return WanConfig(in_channels=4, patch_size=(1, 2, 2), hidden_size=width, num_heads=width // 32, depth_single=2,
                     text_dim=32, ffn_dim=2 * width, freq_dim=32, text_pad_to=0)


def diffusers_call(ref: nn.Module, cfg: WanConfig, s: Any) -> torch.Tensor:
    """One sequence ``s`` (``latent`` (C, T, H, W), ``text`` (L, text_dim), ``timestep``:
    ``knapray.testing.reference.Inputs``; Wan has no pooled vector or guidance) through
    diffusers' ``WanTransformer3DModel`` ``ref``: timestep t·1000 as the pipeline's scheduler
    gives it, text padded with zero rows to ``cfg.text_pad_to`` as the pipeline pads it ->
    its output patchified as knapray's tokens."""
    text, pad_to = s.text, cfg.text_pad_to
    if pad_to > text.shape[0]:
        text = torch.cat([text, text.new_zeros(pad_to - text.shape[0], text.shape[1])])
    if text.shape[0] == 0:
        raise ValueError("a Wan sequence without text tokens needs text_pad_to > 0 (diffusers attends to no keys)")
    out = ref(hidden_states=s.latent[None], timestep=torch.tensor([s.timestep]).float() * 1000.0,
              encoder_hidden_states=text[None], return_dict=False)[0]
    return patchify(out[0], cfg.patch_size)[0]


# ---- the model ------------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """Wan's Conv3d (kernel = stride = patch) as a linear over patchified tokens; the weight
    keeps the Conv3d's shape (d, C, pt, ph, pw), flattened in knapray's feature order."""

    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.hidden_size, cfg.in_channels, *cfg.patch_size))
        self.bias = nn.Parameter(torch.empty(cfg.hidden_size))
        fan_in = cfg.patch_dim
        nn.init.uniform_(self.weight, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        nn.init.uniform_(self.bias, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.flatten(1), self.bias)  # (N, C·pt·ph·pw) @ (C·pt·ph·pw, d)


class TimeEmbed(nn.Module):
    """temb = fc2(silu(fc1(sinusoid(t·1000)))), and its projection proj(silu(temb)) to 6·d."""

    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.freq_dim = cfg.freq_dim
        self.fc1 = nn.Linear(cfg.freq_dim, d)
        self.fc2 = nn.Linear(d, d)
        self.proj = nn.Linear(d, 6 * d)

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        """timesteps (S,) in [0, 1] -> (S, 7·d): temb, then the blocks' modulation."""
        x = timestep_embedding(timesteps, self.freq_dim).to(self.fc1.weight.dtype)
        temb = self.fc2(F.silu(self.fc1(x)))
        return torch.cat((temb, self.proj(F.silu(temb))), dim=-1)


class WanAttention(nn.Module):
    """q, k, v and output projections; q and k RMS-normalized over all heads together."""

    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads, self.eps = cfg.num_heads, cfg.eps
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d, d) for _ in range(4))
        self.norm_q = nn.Parameter(torch.ones(d))
        self.norm_k = nn.Parameter(torch.ones(d))

    def qkv(self, x: torch.Tensor, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q from x, k and v from ctx), each (n, H, D)."""
        d = x.shape[-1]
        q = F.rms_norm(self.to_q(x), (d,), self.norm_q, self.eps)
        k = F.rms_norm(self.to_k(ctx), (d,), self.norm_k, self.eps)
        v = self.to_v(ctx)
        # (n, d) -> (n, H, D)
        return (t.unflatten(-1, (self.heads, -1)) for t in (q, k, v))


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 at least (diffusers keeps Wan's norms and modulation in fp32 under bf16;
    a float64 model stays float64)."""
    return t if t.dtype == torch.float64 else t.float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan rotation of consecutive pairs (2i, 2i+1) of x (N, H, D) by (N, D/2),
    in x's dtype as diffusers computes it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)  # (N, H, D/2) each
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


class WanBlock(nn.Module):
    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.eps = cfg.eps
        self.attn1 = WanAttention(cfg)
        self.attn2 = WanAttention(cfg)
        self.norm2 = nn.LayerNorm(d, eps=cfg.eps) if cfg.cross_attn_norm else None
        self.ffn = MLP(d, cfg.ffn_dim, d, activation="gelu_tanh")
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, d) / d**0.5)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mod: torch.Tensor, seq_img: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], attn: "WanAttentionOps",
                pad_row: torch.Tensor | None = None) -> torch.Tensor:
        """x (Ni, d) visual tokens, ctx (Nt, d) text tokens, mod (S, 6, d) the sequences' time
        projections, seq_img (Ni,) each visual token's sequence -> x (Ni, d). ``pad_row``:
        (1, d) the embedded zero text row that padding repeats (None: no padding).

        The modulation is added to the table per sequence and indexed per token where it is
        used, so a block keeps (Ni, d) rows of the four it multiplies by, not (Ni, 6, d)."""
        d = x.shape[-1]
        table = (self.scale_shift_table + _wide(mod)).unbind(1)  # 6 x (S, d), fp32
        shift, scale, gate, c_shift, c_scale, c_gate = (gather_rows(t, seq_img) for t in table)
        ln = lambda t: F.layer_norm(_wide(t), (d,), eps=self.eps)  # noqa: E731 - FP32LayerNorm without affine
        y = (ln(x) * (1 + scale) + shift).to(x.dtype)
        q, k, v = self.attn1.qkv(y, y)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        out = self.attn1.to_out(attn.self_attn(q, k, v).flatten(1))
        x = (_wide(x) + out * gate).to(x.dtype)
        # FP32LayerNorm as diffusers': input, weight and bias in fp32 (bf16 parameters too)
        y = x if self.norm2 is None else F.layer_norm(_wide(x), (d,), _wide(self.norm2.weight), _wide(self.norm2.bias),
                                                      self.eps).to(x.dtype)
        pad = None
        if pad_row is None:
            q, k, v = self.attn2.qkv(y, ctx)
        else:  # the padding key and value: the projections of the zero row, one for every sequence
            q, k, v = self.attn2.qkv(y, torch.cat((ctx, pad_row)))
            k, v, pad = k[:-1], v[:-1], (k[-1], v[-1])
        x = x + self.attn2.to_out(attn.cross_attn(q, k, v, pad).flatten(1))
        y = (ln(x) * (1 + c_scale) + c_shift).to(x.dtype)
        return (_wide(x) + _wide(self.ffn(y)) * c_gate).to(x.dtype)


class WanHead(nn.Module):
    """LN(h)·(1 + scale) + shift, (shift, scale) = scale_shift_table + temb; then proj_out."""

    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.eps = cfg.eps
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, d) / d**0.5)
        self.linear = nn.Linear(d, cfg.patch_dim)

    def forward(self, x: torch.Tensor, vec_seq: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        temb = gather_rows(vec_seq[:, :d], seq_index)  # (Ni, d)
        shift, scale = (self.scale_shift_table + temb[:, None, :]).unbind(1)
        y = (F.layer_norm(_wide(x), (d,), eps=self.eps) * (1 + scale) + shift).to(x.dtype)
        return self.linear(y)


class WanAttentionOps(Protocol):
    """The two attentions a Wan block calls: ``_Segments`` (every token of each sequence on
    this rank) or ``knapray.distributed.BagCrossAttention`` (a bag's sequences, Ulysses)."""

    def self_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    def cross_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   pad: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor: ...


class _Segments:
    """Visual tokens of each local sequence and their text tokens, for varlen self- and
    cross-attention over tokens in any order (sorted by sequence, stable); every token of
    each sequence is on this rank."""

    def __init__(self, seq_img: torch.Tensor, seq_txt: torch.Tensor, num_seq: int, pad_to: int = 0) -> None:
        """``pad_to`` > 0: each sequence attends to its text then padding rows up to that
        many (the padding key, given to ``cross_attn``, counts for them)."""
        self.img_order = torch.argsort(seq_img, stable=True)
        self.img_unorder = torch.argsort(self.img_order)
        self.txt_order = torch.argsort(seq_txt, stable=True)
        self.txt_unorder = torch.argsort(self.txt_order)
        self.img_counts = torch.bincount(seq_img, minlength=num_seq).tolist()
        self.txt_counts = torch.bincount(seq_txt, minlength=num_seq).tolist()
        self.pad_counts = [max(pad_to - c, 0) for c in self.txt_counts] if pad_to else None
        self.cu = torch.zeros(num_seq + 1, dtype=torch.int32, device=seq_img.device)
        self.cu[1:] = torch.cumsum(torch.bincount(seq_img, minlength=num_seq), 0)
        self.max_len = max(self.img_counts, default=0)

    def _sort(self, x: torch.Tensor) -> torch.Tensor:
        return permute_rows(x, self.img_order, self.img_unorder)

    def _unsort(self, out_sorted: torch.Tensor) -> torch.Tensor:
        return permute_rows(out_sorted, self.img_unorder, self.img_order)

    def self_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (self._sort(t) for t in (q, k, v))
        return self._unsort(varlen_attention(q, k, v, self.cu, self.max_len, seq_lens=self.img_counts))

    def cross_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   pad: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q (Ni, H, D) visual, k, v (Nt, H, D) text, pad: the padding key and value (H, D)
        -> (Ni, H, D); a sequence with no key gets zeros (diffusers' call is undefined there)."""
        q = self._sort(q)
        k, v = (permute_rows(t, self.txt_order, self.txt_unorder) for t in (k, v))
        pad = pad if self.pad_counts is not None else None
        return self._unsort(cross_attention(q, k, v, self.img_counts, self.txt_counts, pad, self.pad_counts))


class WanTransformer(nn.Module):
    """Wan 2.1 T2V over packed token batches. Submodules ``img_in``, ``txt_in``,
    ``time_in``, ``single_blocks`` (Wan's blocks), ``final``: the units of ``fsdp_units``."""

    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        if not isinstance(cfg, WanConfig):
            raise TypeError(f"WanTransformer takes a WanConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        d = cfg.hidden_size
        self.img_in = PatchEmbed(cfg)
        self.txt_in = MLP(cfg.text_dim, d, d, activation="gelu_tanh")
        self.time_in = TimeEmbed(cfg)
        self.single_blocks = nn.ModuleList(WanBlock(cfg) for _ in range(cfg.depth_single))
        self.final = WanHead(cfg)
        self._pad_row: torch.Tensor | None = None
        """(1, d) the embedded zero text row of the last ``embed`` (with ``text_pad_to``)."""

    @torch.no_grad()
    def initial_values(self, write) -> None:
        """Random initial values (a fresh CPU ``WanTransformer`` from torch's global RNG,
        diffusers-like: PyTorch's default linears, tables N(0, 1/d)); holds one full model
        on the host."""
        fresh = dict(WanTransformer(self.cfg).named_parameters())
        for name, p in self.named_parameters():
            write(p, fresh[name].detach())

    def conditioning_mlps(self) -> list[nn.Module]:
        return [self.time_in]

    def fsdp_units(self) -> FsdpUnits:
        """The time embedding, then the image and text embedders; the blocks; the head."""
        return FsdpUnits(embedders=(self.time_in, self.img_in, self.txt_in), blocks=tuple(self.single_blocks),
                         final=self.final)

    @property
    def param_dtype(self) -> torch.dtype:
        return self.img_in.weight.dtype

    def positions(self, pos: torch.Tensor, seq_index: torch.Tensor, is_text: torch.Tensor) -> torch.Tensor:
        """Wan's RoPE ids are the packed (frame, row, column) ids as they are."""
        return pos

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flux_rope(pos, self.cfg.rope_axes_dim, THETA)

    def condition(self, timesteps: torch.Tensor) -> torch.Tensor:
        """timesteps (S,) in [0, 1] (diffusers' model takes t·1000) -> (S, 7·d), fp32 (at
        least) whatever the compute dtype, as diffusers keeps Wan's modulation: every block
        reads it, so its gradient sums over all of them in fp32."""
        if timesteps.dim() != 1:
            raise ValueError(f"expected timesteps (S,), got {tuple(timesteps.shape)}")
        return _wide(self.time_in(timesteps))

    def embed(self, x_txt: torch.Tensor, x_img: torch.Tensor, is_text: torch.Tensor, *,
              streams: TokenStreams | None = None) -> torch.Tensor:
        """x_txt (Nt, text_dim), x_img (Ni, patch_dim) -> h (N, d) in packed order."""
        streams = streams if streams is not None else TokenStreams.from_mask(is_text)
        dtype = self.param_dtype
        txt = x_txt.to(dtype)
        if self.cfg.text_pad_to:
            # The zero row padding repeats goes through txt_in with the text (one call of the
            # module per step, as FSDP unshards it once); the blocks read it from here.
            txt = self.txt_in(torch.cat((txt, txt.new_zeros(1, txt.shape[1]))))
            txt, self._pad_row = txt[:-1], txt[-1:]
        else:
            txt = self.txt_in(txt)
        return streams.merge(txt, self.img_in(x_img.to(dtype)))

    def blocks(self, h: torch.Tensor, vec_seq: torch.Tensor, seq_index: torch.Tensor, pos: torch.Tensor,
               is_text: torch.Tensor, attn: "WanAttentionOps | AttentionFn | None", *,
               streams: TokenStreams | None = None, cache: StepCache | None = None) -> torch.Tensor:
        """Wan's blocks over the visual tokens of h (N, d); text rows come back unchanged.

        ``attn``: the bag's attentions (``knapray.distributed.BagCrossAttention``, the
        balanced executor's), or anything else (a joint-attention function, None): then
        both attentions run per sequence from ``seq_index``, which needs every token of
        each local sequence on this rank (a single process)."""
        n, d = h.shape
        if vec_seq.dim() != 2 or vec_seq.shape[1] != 7 * d:
            raise ValueError(f"vec_seq must be (S_loc, {7 * d}) (Wan's condition), got {tuple(vec_seq.shape)}")
        streams = streams if streams is not None else TokenStreams.from_mask(is_text)
        ctx, x = streams.split(h)
        seq_txt, seq_img = streams.split(seq_index)
        num_seq = vec_seq.shape[0]
        # The embedded zero row every sequence's padding repeats (text_pad_to minus its tokens),
        # from this step's ``embed``.
        pad_row = None
        if self.cfg.text_pad_to:
            pad_row = self._pad_row
            if pad_row is None:
                raise RuntimeError("WanTransformer.blocks pads text: call embed first (it embeds the padding row)")
        if not hasattr(attn, "cross_attn"):  # no bag attention: every token of each sequence is here
            attn = _Segments(seq_img, seq_txt, num_seq, self.cfg.text_pad_to)
        rope = self.rope(pos.index_select(0, streams.img_idx))
        mod = vec_seq[:, d:].unflatten(1, (6, d))  # (S, 6, d): per sequence, indexed per token in the blocks
        x_in = x
        for i, block in enumerate(self.single_blocks):
            x = block(x, ctx, mod, seq_img, rope, attn, pad_row)
            if i == 0 and cache is not None:  # a sampling step's first-block cache (models/step_cache)
                x_0 = x
                if cache.reuse(x_in, x_0):
                    return streams.merge(ctx, cache.apply(x_0))
        if cache is not None:
            cache.store(x_0, x)
        return streams.merge(ctx, x)

    def head(self, h: torch.Tensor, vec_seq: torch.Tensor, seq_index: torch.Tensor, is_text: torch.Tensor, *,
             streams: TokenStreams | None = None) -> torch.Tensor:
        streams = streams if streams is not None else TokenStreams.from_mask(is_text)
        return self.final(h.index_select(0, streams.img_idx), vec_seq, seq_index.index_select(0, streams.img_idx))

    def forward(self, batch: PackedBatch, attn: AttentionFn | None = None) -> torch.Tensor:
        """Single-process composition -> (Ni, patch_dim)."""
        vec = self.condition(batch.timesteps)
        h = self.embed(batch.x_txt, batch.x_img, batch.is_text)
        h = self.blocks(h, vec, batch.seq_index, batch.pos, batch.is_text, attn)
        return self.head(h, vec, batch.seq_index, batch.is_text)
