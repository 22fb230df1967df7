"""Qwen-Image over packed token batches: the math of diffusers' ``QwenImageTransformer2DModel``
(0.42; text-to-image, ``zero_cond_t``, ``use_additional_t_cond`` and ``use_layer3d_rope``
off) behind knapray's stage interface (condition / embed / blocks / head, attention injected).

Its blocks are knapray's double-stream blocks (the MMDiT's): per stream a modulation of
shift, scale, gate, shift, scale, gate from the timestep vector, LayerNorm eps 1e-6 without
affine, q/k/v (knapray fuses them) with RMSNorm eps 1e-6 per head on q and k, joint attention
over [text, image], an output projection and a GELU-tanh MLP of 4·d; then the final adaLN
LayerNorm + linear. What Qwen-Image does differently lives here:

- no single-stream blocks, no pooled text vector, no guidance: a sequence is conditioned on
  its timestep alone (256 cos/sin features of t times each frequency, times 1000, in that
  order: ``qwen_timestep_features``; then a SiLU MLP);
- the text features (Qwen2.5-VL's last hidden states, 3584 wide) are RMS-normalized
  (``txt_norm``, with a gain) before ``txt_in``;
- RoPE positions (``QwenEmbedRope`` with ``scale_rope``): an image token of row i and column
  j of an h x w token grid sits at (frame, i - ceil(h/2), j - ceil(w/2)), centred; the k-th
  text token at (m + k) on all three axes, m = max(h // 2, w // 2) (after the image); angles
  in float32 as diffusers computes them, channel pairs (2i, 2i+1) rotated. ``positions``
  derives them at the sequence's home from the packed (frame, row, column) ids, before any
  token leaves it.

Parameter layouts differ from diffusers' by names, the fusing of q/k/v, and the final
layer's modulation order (diffusers' ``norm_out``: scale, shift; knapray: shift, scale):
``qwen_keys`` maps them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
import torch.nn as nn

from knapray.attention import AttentionFn, LocalAttention
from knapray.models.blocks import DoubleStreamBlock, FinalLayer, TokenStreams
from knapray.models.config import MMDiTConfig
from knapray.models.layers import MLP, TIME_EMBED_DIM, RMSNorm
from knapray.models.mmdit import MMDiT
from knapray.models.packing import PackedBatch
from knapray.planning.inference.sampling_memory import ArchSpec

DIFFUSERS_CLASS = "QwenImageTransformer2DModel"
PATCH = (1, 2, 2)
"""Qwen-Image packs 2x2 latent patches into one token (``QwenImagePipeline._pack_latents``)."""
THETA = 10000.0
"""``QwenEmbedRope(theta=10000)``: fixed in diffusers."""
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
"""``QwenImagePipeline.prompt_template_encode``: the chat turn Qwen2.5-VL reads a caption in."""
VAE = ArchSpec.of("AutoencoderKLQwenImage", {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "input_channels": 3}, dtype="bf16")
"""Qwen-Image's VAE (its pipeline folder's vae/, Wan 2.1's network), as its pipeline decodes: bf16."""
TEXT_MODEL = ArchSpec.of("Qwen2_5_VLForConditionalGeneration", {
    "text_config.vocab_size": 152064, "text_config.hidden_size": 3584, "text_config.intermediate_size": 18944,
    "text_config.num_hidden_layers": 28, "text_config.num_attention_heads": 28,
    "text_config.num_key_value_heads": 4, "vision_config.depth": 32, "vision_config.hidden_size": 1280,
    "vision_config.intermediate_size": 3420, "vision_config.patch_size": 14, "vision_config.temporal_patch_size": 2,
    "vision_config.spatial_merge_size": 2, "vision_config.out_hidden_size": 3584, "tie_word_embeddings": False},
    tokens=512 + 34)
"""Qwen-Image's text encoder (its pipeline folder's text_encoder/: Qwen2.5-VL 7B), in bf16, a
caption read at up to 512 tokens after the template's 34: what sampling holds on rank 0."""
PROMPT_DROP = 34
"""``QwenImagePipeline.prompt_template_encode_start_idx``: the template's tokens before the
caption, left out of the text features."""


@dataclasses.dataclass(kw_only=True, slots=True)
class QwenImageConfig(MMDiTConfig):
    """Qwen-Image's architecture in knapray's field names (defaults: Qwen-Image's 20B shape,
    as diffusers' defaults). ``in_channels`` counts latent channels (16 for its VAE);
    diffusers' ``in_channels`` counts packed features (64 = 16·2·2)."""

    in_channels: int = dataclasses.field(default=16, metadata={"ge": 1})
    hidden_size: int = dataclasses.field(default=3072, metadata={"ge": 1})
    num_heads: int = dataclasses.field(default=24, metadata={"ge": 1})
    depth_double: int = dataclasses.field(default=60, metadata={"ge": 1})
    depth_single: int = dataclasses.field(default=0, metadata={"ge": 0})
    text_dim: int = dataclasses.field(default=3584, metadata={"ge": 1})
    pooled_dim: int = dataclasses.field(default=0, metadata={"ge": 0})
    rope_axes_dim: tuple[int, int, int] = dataclasses.field(default=(16, 56, 56), metadata={"ge": 0})
    family: str = "qwen_image"
    text_norm: ClassVar[bool] = True

    def __post_init__(self) -> None:
        MMDiTConfig.__post_init__(self)
        fixed = {"patch_size": PATCH, "mlp_ratio": 4.0, "qk_norm": True, "rope_theta": THETA, "depth_single": 0,
                 "pooled_dim": 0}
        for name, value in fixed.items():
            if getattr(self, name) != value:
                raise ValueError(f"family qwen_image: {name} must be {value!r} (fixed in Qwen-Image), "
                                 f"got {getattr(self, name)!r}")
        if self.text_dim < 1 or self.depth_double < 1:
            raise ValueError(f"family qwen_image: text_dim and depth_double must be >= 1 (Qwen-Image's blocks are "
                             f"all double-stream, over its text tokens), got {self.text_dim}, {self.depth_double}")

    # ---- diffusers' config.json ---------------------------------------------------------

    def to_diffusers(self) -> dict[str, Any]:
        """The ``config.json`` of the equivalent ``QwenImageTransformer2DModel``."""
        return {
            "_class_name": DIFFUSERS_CLASS,
            "patch_size": 2,
            "in_channels": self.patch_dim,
            "out_channels": self.in_channels,
            "num_layers": self.depth_double,
            "attention_head_dim": self.head_dim,
            "num_attention_heads": self.num_heads,
            "joint_attention_dim": self.text_dim,
            "guidance_embeds": False,
            "axes_dims_rope": list(self.rope_axes_dim),
            "zero_cond_t": False,
            "use_additional_t_cond": False,
            "use_layer3d_rope": False,
        }


DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": [16, 56, 56],
    "zero_cond_t": False, "use_additional_t_cond": False, "use_layer3d_rope": False,
}
"""``QwenImageTransformer2DModel.__init__``'s defaults: what diffusers uses for a key config.json
leaves out."""

VARIANTS = {"zero_cond_t": "Qwen-Image-Edit-2511's zero_cond_t", "use_additional_t_cond": "an additional timestep "
            "condition", "use_layer3d_rope": "Qwen-Image-Layered's 3D RoPE", "guidance_embeds": "guidance embeddings"}


def section_from_diffusers(config: dict[str, Any], where: str) -> dict[str, Any]:
    """Model-section values (knapray's names) of a diffusers ``QwenImageTransformer2DModel``
    config.json; ValueError naming ``where`` and the key for what text-to-image Qwen-Image
    cannot be."""
    values = {**DIFFUSERS_DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}
    unknown = sorted(set(values) - set(DIFFUSERS_DEFAULTS))
    if unknown:
        raise ValueError(f"{where}: keys {unknown} are not QwenImageTransformer2DModel's; valid: "
                         f"{sorted(DIFFUSERS_DEFAULTS)}")
    for key in ("patch_size", "in_channels", "num_layers", "attention_head_dim", "num_attention_heads",
                "joint_attention_dim"):
        if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < 1:
            raise ValueError(f"{where}: {key}={values[key]!r} is not a valid size")
    for key, what in VARIANTS.items():
        if values[key] is not False:
            raise ValueError(f"{where}: {key}={values[key]!r} ({what}); knapray trains text-to-image Qwen-Image, "
                             f"where it is false")
    if values["patch_size"] != 2:
        raise ValueError(f"{where}: patch_size={values['patch_size']}; Qwen-Image packs 2x2 latent patches, and "
                         "knapray supports only that")
    out = values["out_channels"] if values["out_channels"] is not None else values["in_channels"] // 4
    if values["in_channels"] != 4 * out:
        raise ValueError(f"{where}: in_channels={values['in_channels']} is not out_channels={out} latent channels "
                         "x 2 x 2 (an edit variant with reference latents?); knapray trains text-to-image Qwen-Image")
    axes = values["axes_dims_rope"]
    if not isinstance(axes, (list, tuple)) or len(axes) != 3:
        raise ValueError(f"{where}: axes_dims_rope={axes!r} must be 3 ints (frame, h, w)")
    return {
        "in_channels": out,
        "patch_size": PATCH,
        "hidden_size": values["attention_head_dim"] * values["num_attention_heads"],
        "num_heads": values["num_attention_heads"],
        "depth_double": values["num_layers"],
        "depth_single": 0,
        "text_dim": values["joint_attention_dim"],
        "pooled_dim": 0,
        "rope_axes_dim": tuple(axes),
    }


def condition_fields(cfg: QwenImageConfig) -> tuple[str, ...]:
    return ("timesteps",)


def small_config(width: int) -> QwenImageConfig:
    """Qwen-Image's blocks at ``width`` (heads of 32 channels): two of them."""
    return QwenImageConfig(hidden_size=width, num_heads=width // 32, depth_double=2, in_channels=4, text_dim=32,
                           rope_axes_dim=(8, 12, 12))


def sized_config(hidden: int, heads: int, depth_double: int, depth_single: int) -> QwenImageConfig:
    """Qwen-Image of a size (its blocks are all double-stream: ``depth_single`` joins them)."""
    head_dim = hidden // heads
    side = (head_dim * 3 // 8) // 2 * 2
    return QwenImageConfig(hidden_size=hidden, num_heads=heads, depth_double=depth_double + depth_single,
                           in_channels=4, text_dim=16, rope_axes_dim=(head_dim - 2 * side, side, side))


def diffusers_call(ref: nn.Module, cfg: QwenImageConfig, s: Any) -> torch.Tensor:
    """One sequence ``s`` (``latent`` (C, 1, H, W), ``text`` (L, text_dim), ``timestep``:
    ``knapray.testing.reference.Inputs``) through diffusers' ``QwenImageTransformer2DModel``
    ``ref`` as ``QwenImagePipeline`` packs it (no text mask: every text token counts)
    -> (H/2 · W/2, 4·C)."""
    c, _, h, w = s.latent.shape
    # (C, 1, H, W) -> (1, H/2 · W/2, 4C), channels outermost: QwenImagePipeline._pack_latents
    x = s.latent[:, 0].reshape(1, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, (h // 2) * (w // 2), 4 * c)
    out = ref(hidden_states=x, encoder_hidden_states=s.text[None], encoder_hidden_states_mask=None,
              timestep=torch.tensor([s.timestep]), img_shapes=[[(1, h // 2, w // 2)]], return_dict=False)[0]
    return out[0]


# ---- the model ------------------------------------------------------------------------------


def qwen_positions(pos: torch.Tensor, seq_index: torch.Tensor, is_text: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's RoPE ids (N, 3) of whole packed sequences (text first in each, image
    tokens at their (frame, row, column)): image tokens centred on their grid, text after it
    (module doc). Device ops only (no host read): every rank derives them at home."""
    n = pos.shape[0]
    if n == 0:
        return pos
    # Every sequence's token grid (rows, columns): the largest image ids + 1, by sequence
    # (a row per token is room enough for every sequence index).
    grid = torch.zeros((n, 2), dtype=pos.dtype, device=pos.device).scatter_reduce(
        0, seq_index[:, None].expand(n, 2), torch.where(is_text[:, None], 0, pos[:, 1:] + 1), "amax", include_self=True)
    h, w = grid[seq_index, 0], grid[seq_index, 1]  # (N,) each token's sequence's
    centred = torch.stack((pos[:, 0], pos[:, 1] - (h - h // 2), pos[:, 2] - (w - w // 2)), dim=1)
    # The k-th text token of a sequence: text tokens lead their sequence, so k counts the
    # sequence's text tokens before it.
    ones = is_text.to(pos.dtype)
    before = torch.cumsum(ones, 0) - ones  # text tokens before this token in the batch
    first = torch.zeros(n, dtype=pos.dtype, device=pos.device).scatter_reduce(0, seq_index, before, "amin",
                                                                              include_self=False)
    k = before - first[seq_index]
    text = (torch.maximum(h // 2, w // 2) + k)[:, None].expand(n, 3)
    return torch.where(is_text[:, None], text, centred)


def qwen_timestep_features(t: torch.Tensor, dim: int = TIME_EMBED_DIM) -> torch.Tensor:
    """cos, sin features (S, dim) fp32 of timesteps t (S,) in [0, 1], as diffusers'
    ``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)``: t times each
    frequency, then times 1000 (Flux scales t first: at 1000 radians the order moves the
    phase by ~1e-4, which the time MLP's gradients show)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = (t.float()[:, None] * freqs[None, :]) * 1000.0
    return torch.cat((args.cos(), args.sin()), dim=-1)


def qwen_rope(pos: torch.Tensor, axes_dim: tuple[int, ...], theta: float = THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (N, sum(axes_dim)/2) fp32 of integer ids pos (N, A) (negative ones too), the
    angles in float32 as diffusers' ``QwenEmbedRope.rope_params`` computes them."""
    if pos.dim() != 2 or pos.shape[1] != len(axes_dim) or pos.dtype.is_floating_point:
        raise ValueError(f"pos must be (N, {len(axes_dim)}) integer ids, got {tuple(pos.shape)} {pos.dtype}")
    angles = []
    for axis, dim in enumerate(axes_dim):
        inv_freq = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, device=pos.device).to(torch.float32).div(dim))
        angles.append(torch.outer(pos[:, axis].to(torch.float32), inv_freq))  # (N, dim/2)
    angle = torch.cat(angles, dim=-1)
    return angle.cos(), angle.sin()


class QwenImageTransformer(MMDiT):
    """Qwen-Image over packed token batches; attention is injected per call.

    The MMDiT's stages and submodule names (``img_in``, ``txt_in``, ``time_in``,
    ``double_blocks``, ``final``; no ``vector_in``, no single blocks), with the text RMSNorm
    ``txt_norm`` before ``txt_in`` and Qwen-Image's RoPE positions (``positions``)."""

    def __init__(self, cfg: QwenImageConfig) -> None:
        nn.Module.__init__(self)
        if not isinstance(cfg, QwenImageConfig):
            raise TypeError(f"QwenImageTransformer takes a QwenImageConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        d = cfg.hidden_size
        self.img_in = nn.Linear(cfg.patch_dim, d)
        self.txt_norm = RMSNorm(cfg.text_dim, eps=1e-6)
        self.txt_in = nn.Linear(cfg.text_dim, d)
        self.time_in = MLP(TIME_EMBED_DIM, d, d, activation="silu")
        self.vector_in = None
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.depth_double))
        self.single_blocks = nn.ModuleList()
        self.final = FinalLayer(cfg)
        self.init_weights()

    def fsdp_units(self):
        """The MMDiT's, with the text RMSNorm a unit of its own before ``txt_in``."""
        units = MMDiT.fsdp_units(self)
        return dataclasses.replace(units, embedders=(*self.conditioning_mlps(), self.img_in, self.txt_norm,
                                                     self.txt_in))

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return qwen_rope(pos, self.cfg.rope_axes_dim)

    def positions(self, pos: torch.Tensor, seq_index: torch.Tensor, is_text: torch.Tensor) -> torch.Tensor:
        """The RoPE ids of whole sequences at home (``qwen_positions``), before routing."""
        return qwen_positions(pos, seq_index, is_text)

    def condition(self, timesteps: torch.Tensor) -> torch.Tensor:
        """timesteps (S,) in [0, 1] -> vec (S, d): t·1000 through 256 cos/sin features and
        ``time_in`` (diffusers' ``QwenTimestepProjEmbeddings``)."""
        if timesteps.dim() != 1:
            raise ValueError(f"expected timesteps (S,), got {tuple(timesteps.shape)}")
        return self.time_in(qwen_timestep_features(timesteps).to(self.param_dtype)).float()

    def embed(self, x_txt: torch.Tensor, x_img: torch.Tensor, is_text: torch.Tensor, *,
              streams: TokenStreams | None = None) -> torch.Tensor:
        """As the MMDiT's, the text features RMS-normalized (``txt_norm``) before ``txt_in``."""
        return MMDiT.embed(self, self.txt_norm(x_txt.to(self.param_dtype)), x_img, is_text, streams=streams)

    def forward(self, batch: PackedBatch, attn: AttentionFn | None = None) -> torch.Tensor:
        """Single-process composition; ``attn`` defaults to varlen attention over the batch."""
        if attn is None:
            attn = LocalAttention(batch.cu_seqlens, batch.max_seqlen)
        vec = self.condition(batch.timesteps)
        h = self.embed(batch.x_txt, batch.x_img, batch.is_text)
        pos = self.positions(batch.pos, batch.seq_index, batch.is_text)
        h = self.blocks(h, vec, batch.seq_index, pos, batch.is_text, attn)
        return self.head(h, vec, batch.seq_index, batch.is_text)
