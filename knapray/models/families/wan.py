"""Wan 2.1 text-to-video and image-to-video, Wan 2.2 TI2V-5B over packed token batches:
the math of diffusers' ``WanTransformer3DModel`` (0.42) behind knapray's stage interface.

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

``condition`` returns (S, 7·d) per sequence: temb then time_proj(silu(temb)) (T2V; I2V
and TI2V append to it, below).

Wan 2.1 I2V (``image_dim``, e.g. 14B-480P: 36 channels in, 16 out, image_dim 1280): each
sequence also carries its conditioning image's CLIP tokens (``PackedBatch.image_context``,
(S, 257, 1280)), embedded once (``image_in``: LN, Linear, GELU, Linear, LN; diffusers'
``WanImageEmbedding``) and cross-attended by every block beside the text, with the same
queries and their own keys and values (diffusers' ``add_k_proj``, ``add_v_proj``,
``norm_added_k``): attn2 = to_out(attn(q, text) + attn(q, image)). diffusers takes the
image's rows as those before the last 512 of the context, so an I2V config pads text to
512 (``text_pad_to``). The embedded image tokens are per sequence, so they ride in
``condition``'s rows after the modulation: (S, 7·d + 257·d).

Wan 2.2 TI2V-5B (``expand_timesteps``; the T2V blocks at 48 channels): time is per token.
With a conditioning image the first latent frame is the image's clean latent and gets
time 0, the other frames the sequence's t (``WanPipeline``'s ``expand_timesteps``). Each
sequence gives both times (``timesteps``, ``first_frame_timesteps``: t when no image
conditions it), ``condition`` returns both modulations per sequence, (S, 14·d): the t
row's 7·d then the first frame's; the blocks and the head pick per token by its frame
(``pos[:, 0] == 0``), as a row index seq + S·first_frame into the 2S rows.

Balanced: the blocks take a ``knapray.distributed.BagCrossAttention`` (the executor
builds it from the plan and every sequence's text count): Ulysses over the image queries
and the text keys and values of a bag's sequences. Single-process (``forward``), both
attentions run per sequence on this rank. The condition rows reach each rank with the
sequence's chunks (``route_sequence_features``; an empty chunk gets its row too), so a rank
holding chunk p of a sequence holds its whole image context: ``BagCrossAttention.cross_attn``
takes ``image`` ((S_loc·257, H, D) keys and values, every head, computed here per local
row, i.e. per routed chunk) and keeps its block of heads after Ulysses moves the queries,
as it does for the padding key, so image keys never travel; its bag's queries attend to
them (257 per sequence) and the two outputs are summed before ``to_tokens``. TI2V's blocks
pick rows by the routed tokens' ``pos``, its ``head`` by the home tokens' (the executor
gives ``head`` them). Balanced against single-process on 4 gloo ranks
(tests/dist/test_wan_dist.py): I2V worst 3.6e-6 in fp32 but ``attn2.to_k.bias`` (1.1e-5,
a near-cancellation over 512 padding rows), 3.1e-14 in float64; TI2V 1.1e-6 in fp32,
2.0e-15 in float64.

Not yet: Wan 2.1 FLF2V (``pos_embed_seq_len``); per-token times in ``knapray reference``
(it compares a TI2V checkpoint by its call with one time per sequence: ``expand_timesteps``
is the pipeline's flag, not in the transformer's config.json).
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
from knapray.models.config import PIPELINE_EXPAND_TIMESTEPS, DiTConfig
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
IMAGE_TOKENS = 257
"""Wan 2.1 I2V's image context: CLIP ViT-H/14's penultimate tokens of a 224 px image, 16·16
patches and the class token."""
IMAGE_NORM_EPS = 1e-5
"""Epsilon of ``WanImageEmbedding``'s two LayerNorms (``FP32LayerNorm``'s default, not ``eps``)."""


def wan_rope_split(head_dim: int) -> tuple[int, int, int]:
    """(t, h, w) head channels of diffusers' ``WanRotaryPosEmbed``."""
    h = w = 2 * (head_dim // 6)
    return head_dim - h - w, h, w


@dataclasses.dataclass(kw_only=True, slots=True)
class WanConfig(DiTConfig):
    """Wan in knapray's field names (defaults: Wan 2.1 T2V 14B's shape, diffusers' defaults;
    I2V with ``image_dim`` and ``out_channels``, TI2V-5B with ``expand_timesteps``).
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
    out_channels: int = dataclasses.field(default=0, metadata={"ge": 0})
    """Latent channels of the output (diffusers' ``out_channels``); 0: ``in_channels``. Wan 2.1
    I2V: 16 of its 36 input channels (the noisy latent; the other 20 are the image's: a
    4-channel mask of the given frames and their 16-channel latent)."""
    image_dim: int = dataclasses.field(default=0, metadata={"ge": 0})
    """Features of the conditioning image's tokens (diffusers' ``image_dim``; Wan 2.1 I2V:
    1280, CLIP ViT-H/14); 0: no image context (T2V, Wan 2.2)."""
    image_tokens: int = dataclasses.field(default=IMAGE_TOKENS, metadata={"ge": 1})
    """Image-context tokens per sequence (with ``image_dim``): 257 for Wan 2.1 I2V's CLIP."""
    expand_timesteps: bool = False
    """Per-token times as Wan 2.2 TI2V-5B's pipelines give them (its model_index.json's
    ``expand_timesteps``; not in the transformer's config.json): a sequence's first latent
    frame has its own time (``PackedBatch.first_frame_timesteps``: 0 under a conditioning
    image), its other frames the sequence's."""

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
        for name in ("cross_attn_norm", "expand_timesteps"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.out_channels == self.in_channels:
            self.out_channels = 0  # one spelling of "as many as in", as the checkpoint check compares
        if self.image_dim and self.text_pad_to != TEXT_LENGTH:
            raise ValueError(f"family wan: image_dim {self.image_dim} (I2V) needs text_pad_to {TEXT_LENGTH}, got "
                             f"{self.text_pad_to}: diffusers' Wan takes the context rows before the last "
                             f"{TEXT_LENGTH} as the image's, so every caption is padded to exactly {TEXT_LENGTH}")
        if self.expand_timesteps and self.patch_size[0] != 1:
            raise ValueError(f"family wan: expand_timesteps (a time per latent frame) needs a temporal patch of 1, "
                             f"got patch_size {tuple(self.patch_size)}")

    @property
    def output_channels(self) -> int:
        """Latent channels of the output: ``out_channels``, or ``in_channels`` when 0."""
        return self.out_channels or self.in_channels

    @property
    def out_patch_dim(self) -> int:
        """Features per output token: output_channels · pt · ph · pw (Wan 2.1 I2V 14B: 64 of 144)."""
        return self.output_channels * math.prod(self.patch_size)

    @property
    def modulation_dim(self) -> int:
        """``condition``'s modulation columns: 7·d (temb, then the blocks' 6·d), twice with
        ``expand_timesteps`` (the sequence's time, then its first frame's)."""
        return 7 * self.hidden_size * (2 if self.expand_timesteps else 1)

    @property
    def condition_dim(self) -> int:
        """``condition``'s (S, modulation_dim + image_tokens·d): the modulation, then the
        embedded image context when ``image_dim``."""
        return self.modulation_dim + (self.image_tokens * self.hidden_size if self.image_dim else 0)

    def to_diffusers(self) -> dict[str, Any]:
        """The ``config.json`` of the equivalent ``WanTransformer3DModel``."""
        return {
            "_class_name": DIFFUSERS_CLASS, "patch_size": list(self.patch_size),
            "num_attention_heads": self.num_heads, "attention_head_dim": self.head_dim,
            "in_channels": self.in_channels, "out_channels": self.output_channels, "text_dim": self.text_dim,
            "freq_dim": self.freq_dim, "ffn_dim": self.ffn_dim, "num_layers": self.depth_single,
            "cross_attn_norm": self.cross_attn_norm, "qk_norm": "rms_norm_across_heads", "eps": self.eps,
            "image_dim": self.image_dim or None, "added_kv_proj_dim": self.hidden_size if self.image_dim else None,
            "rope_max_seq_len": self.rope_max_seq_len, "pos_embed_seq_len": None,
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
    if values["pos_embed_seq_len"] is not None:
        raise ValueError(f"{where}: pos_embed_seq_len={values['pos_embed_seq_len']!r}: a first-last-frame (FLF2V) "
                         "Wan; knapray reads text-to-video and image-to-video Wan only")
    hidden = values["attention_head_dim"] * values["num_attention_heads"]
    for key in ("image_dim", "added_kv_proj_dim", "out_channels"):
        value = values[key]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{where}: {key}={value!r} is not a valid size")
    if (values["image_dim"] is None) != (values["added_kv_proj_dim"] is None):
        raise ValueError(f"{where}: image_dim={values['image_dim']!r} with added_kv_proj_dim="
                         f"{values['added_kv_proj_dim']!r}: an I2V Wan has both (its image tokens' embedder and "
                         "their keys and values), a T2V Wan neither")
    if values["added_kv_proj_dim"] not in (None, hidden):
        raise ValueError(f"{where}: added_kv_proj_dim={values['added_kv_proj_dim']} differs from the model width "
                         f"{hidden}: diffusers' Wan projects the embedded image tokens (model width) with it")
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
        "out_channels": 0 if values["out_channels"] in (None, values["in_channels"]) else values["out_channels"],
        "image_dim": values["image_dim"] or 0,
        # a pipeline folder's model_index.json says whether its transformer takes a time per
        # token (TI2V-5B); a bare transformer folder does not say, and leaves the config's value
        **({"expand_timesteps": config[PIPELINE_EXPAND_TIMESTEPS]} if PIPELINE_EXPAND_TIMESTEPS in config else {}),
    }


def condition_fields(cfg: WanConfig) -> tuple[str, ...]:
    """The sequence's time; its first frame's (``expand_timesteps``); its image context (``image_dim``)."""
    return (("timesteps",) + (("first_frame_timesteps",) if cfg.expand_timesteps else ())
            + (("image_context",) if cfg.image_dim else ()))


def reference_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """What ``knapray reference`` changes in a checkpoint's model-section ``values``: T2V
    compares the transformer's own call on the text as given (``text_pad_to`` 0); I2V keeps
    the pipeline's 512 rows, without which diffusers' model cannot tell the image context
    from the text (``diffusers_call`` pads the text to them)."""
    return {} if values.get("image_dim") else {"text_pad_to": 0}


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
    """One sequence ``s`` (``latent`` (C, T, H, W), ``text`` (L, text_dim), ``timestep``,
    ``image_context``, ``first_frame_timestep``: ``knapray.testing.reference.Inputs``; Wan has
    no pooled vector or guidance) through diffusers' ``WanTransformer3DModel`` ``ref``:
    timestep t·1000 as the pipeline's scheduler gives it (with ``expand_timesteps`` one per
    token, (1, T·H·W), the first latent frame's the first frame's time, as ``WanPipeline``
    gives it), text padded with zero rows to ``cfg.text_pad_to`` as the pipeline pads it, the
    image context as ``encoder_hidden_states_image`` -> its output patchified as knapray's
    tokens."""
    text, pad_to = s.text, cfg.text_pad_to
    if pad_to > text.shape[0]:
        text = torch.cat([text, text.new_zeros(pad_to - text.shape[0], text.shape[1])])
    if text.shape[0] == 0:
        raise ValueError("a Wan sequence without text tokens needs text_pad_to > 0 (diffusers attends to no keys)")
    timestep = torch.tensor([s.timestep], dtype=torch.float32)
    if cfg.expand_timesteps:
        t, h, w = (n // p for n, p in zip(s.latent.shape[1:], cfg.patch_size))
        timestep = timestep.repeat(t * h * w)
        timestep[: h * w] = s.first_frame_timestep
        timestep = timestep[None]
    image = s.image_context[None] if cfg.image_dim else None
    out = ref(hidden_states=s.latent[None], timestep=timestep * 1000.0, encoder_hidden_states=text[None],
              encoder_hidden_states_image=image, return_dict=False)[0]
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


class ImageEmbed(nn.Module):
    """diffusers' ``WanImageEmbedding``: the image context's tokens (n, image_dim) ->
    LN -> Linear -> GELU (erf) -> Linear -> LN -> (n, d); both LayerNorms affine, eps 1e-5,
    in fp32 (at least) and back to the input's dtype."""

    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.image_dim, eps=IMAGE_NORM_EPS)
        self.fc1 = nn.Linear(cfg.image_dim, cfg.image_dim)
        self.fc2 = nn.Linear(cfg.image_dim, cfg.hidden_size)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=IMAGE_NORM_EPS)

    @staticmethod
    def _norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(_wide(x), norm.normalized_shape, _wide(norm.weight), _wide(norm.bias),
                            norm.eps).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(self.norm2, self.fc2(F.gelu(self.fc1(self._norm(self.norm1, x)))))


class WanAttention(nn.Module):
    """q, k, v and output projections; q and k RMS-normalized over all heads together. With
    ``image`` (I2V's attn2): keys and values of the image context too (``to_k_img``,
    ``to_v_img``; its keys RMS-normalized across heads by ``norm_k_img``)."""

    def __init__(self, cfg: WanConfig, image: bool = False) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads, self.eps = cfg.num_heads, cfg.eps
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d, d) for _ in range(4))
        self.norm_q = nn.Parameter(torch.ones(d))
        self.norm_k = nn.Parameter(torch.ones(d))
        if image:
            self.to_k_img, self.to_v_img = nn.Linear(d, d), nn.Linear(d, d)
            self.norm_k_img = nn.Parameter(torch.ones(d))

    def image_kv(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of the embedded image context ctx (n, d), each (n, H, D)."""
        k = F.rms_norm(self.to_k_img(ctx), (ctx.shape[-1],), self.norm_k_img, self.eps)
        # (n, d) -> (n, H, D)
        return k.unflatten(-1, (self.heads, -1)), self.to_v_img(ctx).unflatten(-1, (self.heads, -1))

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
        self.attn2 = WanAttention(cfg, image=bool(cfg.image_dim))
        self.norm2 = nn.LayerNorm(d, eps=cfg.eps) if cfg.cross_attn_norm else None
        self.ffn = MLP(d, cfg.ffn_dim, d, activation="gelu_tanh")
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, d) / d**0.5)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mod: torch.Tensor, mod_index: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], attn: "WanAttentionOps",
                pad_row: torch.Tensor | None = None, image: torch.Tensor | None = None) -> torch.Tensor:
        """x (Ni, d) visual tokens, ctx (Nt, d) text tokens, mod (R, 6, d) time projections
        (a row per sequence, or per sequence and kind of frame: ``WanTransformer.blocks``),
        mod_index (Ni,) each visual token's row of mod -> x (Ni, d). ``pad_row``: (1, d) the
        embedded zero text row that padding repeats (None: no padding). ``image``: (S·L, d)
        the embedded image context, L rows per local sequence (None: T2V).

        The modulation is added to the table per row and indexed per token where it is
        used, so a block keeps (Ni, d) rows of the four it multiplies by, not (Ni, 6, d)."""
        d = x.shape[-1]
        table = (self.scale_shift_table + _wide(mod)).unbind(1)  # 6 x (R, d), fp32
        shift, scale, gate, c_shift, c_scale, c_gate = (gather_rows(t, mod_index) for t in table)
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
        # I2V: the same queries to the image context's keys too, the two summed before to_out
        out = attn.cross_attn(q, k, v, pad, image=None if image is None else self.attn2.image_kv(image))
        x = x + self.attn2.to_out(out.flatten(1))
        y = (ln(x) * (1 + c_scale) + c_shift).to(x.dtype)
        return (_wide(x) + _wide(self.ffn(y)) * c_gate).to(x.dtype)


class WanHead(nn.Module):
    """LN(h)·(1 + scale) + shift, (shift, scale) = scale_shift_table + temb; then proj_out
    to out_patch_dim."""

    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.eps = cfg.eps
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, d) / d**0.5)
        self.linear = nn.Linear(d, cfg.out_patch_dim)

    def forward(self, x: torch.Tensor, temb_rows: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
        """x (Ni, d), temb_rows (R, d), row_index (Ni,) each token's row -> (Ni, out_patch_dim)."""
        d = x.shape[-1]
        temb = gather_rows(temb_rows, row_index)  # (Ni, d)
        shift, scale = (self.scale_shift_table + temb[:, None, :]).unbind(1)
        y = (F.layer_norm(_wide(x), (d,), eps=self.eps) * (1 + scale) + shift).to(x.dtype)
        return self.linear(y)


class WanAttentionOps(Protocol):
    """The two attentions a Wan block calls: ``_Segments`` (every token of each sequence on
    this rank) or ``knapray.distributed.BagCrossAttention`` (a bag's sequences, Ulysses)."""

    def self_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    longest_text: int
    """The most text tokens of a sequence it serves (for I2V's check against ``text_pad_to``)."""

    def cross_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   pad: tuple[torch.Tensor, torch.Tensor] | None,
                   image: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Image queries to their sequences' text keys (and padding key). I2V's blocks also
        give ``image=(k_img, v_img)``, (S_loc·L, H, D) each, L keys per local sequence row
        (every head), whose attention is added before the output projection."""


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
        self.num_seq = num_seq
        self.img_counts = torch.bincount(seq_img, minlength=num_seq).tolist()
        self.txt_counts = torch.bincount(seq_txt, minlength=num_seq).tolist()
        self.pad_counts = [max(pad_to - c, 0) for c in self.txt_counts] if pad_to else None
        self.cu = torch.zeros(num_seq + 1, dtype=torch.int32, device=seq_img.device)
        self.cu[1:] = torch.cumsum(torch.bincount(seq_img, minlength=num_seq), 0)
        self.max_len = max(self.img_counts, default=0)
        self.longest_text = max(self.txt_counts, default=0)

    def _sort(self, x: torch.Tensor) -> torch.Tensor:
        return permute_rows(x, self.img_order, self.img_unorder)

    def _unsort(self, out_sorted: torch.Tensor) -> torch.Tensor:
        return permute_rows(out_sorted, self.img_unorder, self.img_order)

    def self_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (self._sort(t) for t in (q, k, v))
        return self._unsort(varlen_attention(q, k, v, self.cu, self.max_len, seq_lens=self.img_counts))

    def cross_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   pad: tuple[torch.Tensor, torch.Tensor] | None = None,
                   image: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q (Ni, H, D) visual, k, v (Nt, H, D) text, pad: the padding key and value (H, D)
        -> (Ni, H, D); a sequence with no key gets zeros (diffusers' call is undefined there).
        ``image``: (k, v) of the image context, (S·L, H, D) each in sequence order: each
        sequence's queries also attend to its L image keys, the two outputs summed."""
        q = self._sort(q)
        k, v = (permute_rows(t, self.txt_order, self.txt_unorder) for t in (k, v))
        pad = pad if self.pad_counts is not None else None
        out = cross_attention(q, k, v, self.img_counts, self.txt_counts, pad, self.pad_counts)
        if image is not None:
            k_img, v_img = image
            per_seq = k_img.shape[0] // max(self.num_seq, 1)
            out = out + cross_attention(q, k_img, v_img, self.img_counts, [per_seq] * self.num_seq)
        return self._unsort(out)


class WanTransformer(nn.Module):
    """Wan 2.1 T2V and I2V, Wan 2.2 TI2V-5B over packed token batches. Submodules
    ``img_in``, ``txt_in``, ``time_in``, ``image_in`` (I2V's image-context embedder, None
    otherwise), ``single_blocks`` (Wan's blocks), ``final``: the units of ``fsdp_units``."""

    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        if not isinstance(cfg, WanConfig):
            raise TypeError(f"WanTransformer takes a WanConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        d = cfg.hidden_size
        self.img_in = PatchEmbed(cfg)
        self.txt_in = MLP(cfg.text_dim, d, d, activation="gelu_tanh")
        self.time_in = TimeEmbed(cfg)
        self.image_in = ImageEmbed(cfg) if cfg.image_dim else None
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
        return [self.time_in] + ([self.image_in] if self.image_in is not None else [])

    def fsdp_units(self) -> FsdpUnits:
        """The time embedding (and I2V's image-context embedder), then the visual and text
        embedders; the blocks; the head."""
        return FsdpUnits(embedders=(*self.conditioning_mlps(), self.img_in, self.txt_in),
                         blocks=tuple(self.single_blocks), final=self.final)

    @property
    def param_dtype(self) -> torch.dtype:
        return self.img_in.weight.dtype

    def positions(self, pos: torch.Tensor, seq_index: torch.Tensor, is_text: torch.Tensor) -> torch.Tensor:
        """Wan's RoPE ids are the packed (frame, row, column) ids as they are."""
        return pos

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flux_rope(pos, self.cfg.rope_axes_dim, THETA)

    def condition(self, timesteps: torch.Tensor, first_frame_timesteps: torch.Tensor | None = None,
                  image_context: torch.Tensor | None = None) -> torch.Tensor:
        """timesteps (S,) in [0, 1] (diffusers' model takes t·1000) -> (S, cfg.condition_dim),
        fp32 (at least) whatever the compute dtype, as diffusers keeps Wan's modulation: every
        block reads it, so its gradient sums over all of them in fp32.

        With ``expand_timesteps``, first_frame_timesteps (S,): the first latent frame's time
        (0 under a conditioning image, else the sequence's), its 7·d after the sequence's.
        With ``image_dim``, image_context (S, image_tokens, image_dim): embedded and
        appended, (S, image_tokens·d), computed in the model's dtype (widening is exact)."""
        cfg = self.cfg
        if timesteps.dim() != 1:
            raise ValueError(f"expected timesteps (S,), got {tuple(timesteps.shape)}")
        for name, value, flag in (("first_frame_timesteps", first_frame_timesteps, "expand_timesteps"),
                                  ("image_context", image_context, "image_dim")):
            if (value is not None) != bool(getattr(cfg, flag)):
                raise ValueError(f"Wan {'takes no' if value is not None else 'needs'} {name} with model.{flag} "
                                 f"{getattr(cfg, flag)!r}")
        s = timesteps.shape[0]
        if first_frame_timesteps is None:
            rows = _wide(self.time_in(timesteps))  # (S, 7·d)
        else:
            if first_frame_timesteps.shape != (s,):
                raise ValueError(f"expected first_frame_timesteps ({s},), got {tuple(first_frame_timesteps.shape)}")
            both = _wide(self.time_in(torch.cat((timesteps, first_frame_timesteps.to(timesteps.dtype)))))
            rows = torch.cat((both[:s], both[s:]), dim=1)  # (2S, 7·d) -> (S, 14·d)
        if image_context is None:
            return rows
        want = (s, cfg.image_tokens, cfg.image_dim)
        if tuple(image_context.shape) != want:
            raise ValueError(f"expected image_context {want}, got {tuple(image_context.shape)}")
        ctx = self.image_in(image_context.to(self.param_dtype))  # (S, L, d)
        return torch.cat((rows, _wide(ctx).flatten(1)), dim=1)

    def _modulation_rows(self, vec_seq: torch.Tensor, seq_img: torch.Tensor,
                         pos_img: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (R, 7·d): temb then the blocks' 6·d, row (Ni,) of each visual token) from
        ``condition``'s (S, condition_dim). R = S, or 2S with ``expand_timesteps``: the
        sequences' times, then their first frames', a token of frame 0 taking the latter."""
        d = self.cfg.hidden_size
        if not self.cfg.expand_timesteps:
            return vec_seq[:, :7 * d], seq_img
        if pos_img is None:
            raise ValueError("Wan with expand_timesteps picks each token's time by its frame: give the tokens' pos")
        rows = torch.cat((vec_seq[:, :7 * d], vec_seq[:, 7 * d:14 * d]))  # (2S, 7·d)
        return rows, seq_img + vec_seq.shape[0] * (pos_img[:, 0] == 0).to(seq_img.dtype)

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
        cfg = self.cfg
        if vec_seq.dim() != 2 or vec_seq.shape[1] != cfg.condition_dim:
            raise ValueError(f"vec_seq must be (S_loc, {cfg.condition_dim}) (Wan's condition), got "
                             f"{tuple(vec_seq.shape)}")
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
        image = None
        if cfg.image_dim:
            if attn.longest_text > cfg.text_pad_to:
                raise ValueError(f"Wan I2V: a sequence has {attn.longest_text} text tokens, more than "
                                 f"{cfg.text_pad_to}: diffusers would take its last rows for the image's")
            # (S, L·d) -> (S·L, d), L rows per local sequence, in the blocks' dtype
            image = vec_seq[:, cfg.modulation_dim:].unflatten(1, (cfg.image_tokens, d)).flatten(0, 1).to(x.dtype)
        pos_img = pos.index_select(0, streams.img_idx)
        rope = self.rope(pos_img)
        rows, row_index = self._modulation_rows(vec_seq, seq_img, pos_img)
        mod = rows[:, d:].unflatten(1, (6, d))  # (R, 6, d): per row, indexed per token in the blocks
        x_in = x
        for i, block in enumerate(self.single_blocks):
            x = block(x, ctx, mod, row_index, rope, attn, pad_row, image)
            if i == 0 and cache is not None:  # a sampling step's first-block cache (models/step_cache)
                x_0 = x
                if cache.reuse(x_in, x_0):
                    return streams.merge(ctx, cache.apply(x_0))
        if cache is not None:
            cache.store(x_0, x)
        return streams.merge(ctx, x)

    def head(self, h: torch.Tensor, vec_seq: torch.Tensor, seq_index: torch.Tensor, is_text: torch.Tensor, *,
             streams: TokenStreams | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
        """The visual tokens of h (N, d) -> (Ni, out_patch_dim). ``pos`` (N, 3): the tokens'
        positions, needed with ``expand_timesteps`` (a first-frame token takes that frame's time)."""
        streams = streams if streams is not None else TokenStreams.from_mask(is_text)
        pos_img = None if pos is None else pos.index_select(0, streams.img_idx)
        rows, row_index = self._modulation_rows(vec_seq, seq_index.index_select(0, streams.img_idx), pos_img)
        return self.final(h.index_select(0, streams.img_idx), rows[:, :self.cfg.hidden_size], row_index)

    def forward(self, batch: PackedBatch, attn: AttentionFn | None = None) -> torch.Tensor:
        """Single-process composition -> (Ni, out_patch_dim)."""
        vec = self.condition(**{name: getattr(batch, name) for name in condition_fields(self.cfg)})
        h = self.embed(batch.x_txt, batch.x_img, batch.is_text)
        h = self.blocks(h, vec, batch.seq_index, batch.pos, batch.is_text, attn)
        return self.head(h, vec, batch.seq_index, batch.is_text, pos=batch.pos)
