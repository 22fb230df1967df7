"""Flux.1 (dev and schnell) over packed token batches: the math of diffusers'
``FluxTransformer2DModel`` (0.42) and of BFL's reference model, behind knapray's stage
interface (condition / embed / blocks / head, attention injected).

Where the math is knapray's MMDiT's, the layers are knapray's: the double-stream block
(adaLN-Zero modulation shift, scale, gate, shift, scale, gate; LayerNorm eps 1e-6 without
affine; fused q/k/v per stream; RMSNorm eps 1e-6 on q and k per head; GELU-tanh MLP of
4·d), the single-stream block (one fused input projection to q, k, v and the MLP, one
output projection over their concatenation), the final adaLN LayerNorm + linear, and
the SiLU MLP embedders. What Flux adds or does differently lives here:

- the guidance embedder (FLUX.1-dev, ``guidance_embeds``): guidance·1000 through the same
  sinusoidal features as the timestep and its own MLP, added to the timestep embedding;
  FLUX.1-schnell has none;
- RoPE angles computed in float64 (as diffusers' ``FluxPosEmbed`` does on CUDA and CPU),
  theta 10000, axes ``axes_dims_rope`` over the ids (t, h, w): image token (i, j) of a
  frame at (0, i, j), text tokens at (0, 0, 0), as the pipelines' ``img_ids``/``txt_ids``.

Parameter layouts differ from diffusers' only by names, the fusing of q/k/v (and of the
single block's MLP input into ``linear1``), and the final layer's modulation order
(knapray/BFL: shift, scale; diffusers' ``norm_out``: scale, shift): the key layouts in
``flux_keys`` map them row range by row range.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from knapray.attention import AttentionFn, LocalAttention
from knapray.models.blocks import DoubleStreamBlock, FinalLayer, SingleStreamBlock
from knapray.models.config import MMDiTConfig
from knapray.models.layers import MLP, TIME_EMBED_DIM, timestep_embedding
from knapray.models.mmdit import MMDiT
from knapray.models.packing import PackedBatch
from knapray.planning.inference.sampling_memory import ArchSpec

DIFFUSERS_CLASS = "FluxTransformer2DModel"
PATCH = (1, 2, 2)
"""Flux packs 2x2 latent patches into one token (the pipelines' ``_pack_latents``)."""
THETA = 10000.0
"""``FluxPosEmbed(theta=10000)``: fixed in diffusers, not a config value."""

# FLUX.1-dev's other models (its pipeline folder's text_encoder_2/, text_encoder/ and vae/
# config.json): google/t5-v1_1-xxl at FluxPipeline's 512 tokens, openai/clip-vit-large-patch14
# at its 77, the 16-channel AutoencoderKL in bf16. What sampling holds besides the transformer.
TEXT_MODELS = (
    ArchSpec.of("T5EncoderModel", {"vocab_size": 32128, "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64,
                                   "num_layers": 24, "feed_forward_proj": "gated-gelu",
                                   "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128},
                tokens=512),
    ArchSpec.of("CLIPTextModel", {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072,
                                  "num_hidden_layers": 12, "num_attention_heads": 12, "max_position_embeddings": 77,
                                  "hidden_act": "quick_gelu", "projection_dim": 768}, tokens=77),
)
VAE = ArchSpec.of("AutoencoderKL", {
    "in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2, "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "norm_num_groups": 32, "act_fn": "silu", "use_quant_conv": False, "use_post_quant_conv": False,
    "scaling_factor": 0.3611, "shift_factor": 0.1159, "sample_size": 1024}, dtype="bf16")


@dataclasses.dataclass(kw_only=True, slots=True)
class FluxConfig(MMDiTConfig):
    """Flux.1's architecture in knapray's field names (defaults: FLUX.1's 12B shape, as
    diffusers' defaults, without guidance). ``in_channels`` counts latent channels (16 for
    the Flux VAE); diffusers' ``in_channels`` counts packed features (64 = 16·2·2)."""

    in_channels: int = dataclasses.field(default=16, metadata={"ge": 1})
    hidden_size: int = dataclasses.field(default=3072, metadata={"ge": 1})
    num_heads: int = dataclasses.field(default=24, metadata={"ge": 1})
    depth_double: int = dataclasses.field(default=19, metadata={"ge": 0})
    depth_single: int = dataclasses.field(default=38, metadata={"ge": 0})
    text_dim: int = dataclasses.field(default=4096, metadata={"ge": 1})
    pooled_dim: int = dataclasses.field(default=768, metadata={"ge": 1})
    rope_axes_dim: tuple[int, int, int] = dataclasses.field(default=(16, 56, 56), metadata={"ge": 0})
    family: str = "flux"
    guidance_embeds: bool = False
    """Embed a guidance strength per sequence (FLUX.1-dev: true; schnell: false)."""

    def __post_init__(self) -> None:
        MMDiTConfig.__post_init__(self)
        fixed = {"patch_size": PATCH, "mlp_ratio": 4.0, "qk_norm": True, "rope_theta": THETA}
        for name, value in fixed.items():
            if getattr(self, name) != value:
                raise ValueError(f"family flux: {name} must be {value!r} (fixed in Flux.1), got {getattr(self, name)!r}")
        for name in ("text_dim", "pooled_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"family flux: {name} must be >= 1 (Flux always takes T5 tokens and a CLIP "
                                 f"pooled vector), got {getattr(self, name)!r}")
        if not isinstance(self.guidance_embeds, bool):
            raise ValueError(f"guidance_embeds must be true or false, got {self.guidance_embeds!r}")

    # ---- diffusers' config.json ---------------------------------------------------------

    def to_diffusers(self) -> dict[str, Any]:
        """The ``config.json`` of the equivalent ``FluxTransformer2DModel``."""
        return {
            "_class_name": DIFFUSERS_CLASS,
            "patch_size": 1,
            "in_channels": self.patch_dim,
            "out_channels": None,
            "num_layers": self.depth_double,
            "num_single_layers": self.depth_single,
            "attention_head_dim": self.head_dim,
            "num_attention_heads": self.num_heads,
            "joint_attention_dim": self.text_dim,
            "pooled_projection_dim": self.pooled_dim,
            "guidance_embeds": self.guidance_embeds,
            "axes_dims_rope": list(self.rope_axes_dim),
        }


DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19, "num_single_layers": 38,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "pooled_projection_dim": 768, "guidance_embeds": False, "axes_dims_rope": [16, 56, 56],
}
"""``FluxTransformer2DModel.__init__``'s defaults: what diffusers uses for a key config.json
leaves out."""


def section_from_diffusers(config: dict[str, Any], where: str) -> dict[str, Any]:
    """Model-section values (knapray's names) of a diffusers ``FluxTransformer2DModel``
    config.json; ValueError naming ``where`` and the key for what Flux.1 cannot be."""
    values = {**DIFFUSERS_DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}
    unknown = sorted(set(values) - set(DIFFUSERS_DEFAULTS))
    if unknown:
        raise ValueError(f"{where}: keys {unknown} are not FluxTransformer2DModel's; valid: {sorted(DIFFUSERS_DEFAULTS)}")
    ints = ("patch_size", "in_channels", "num_layers", "num_single_layers", "attention_head_dim",
            "num_attention_heads", "joint_attention_dim", "pooled_projection_dim")
    for key in ints:
        if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < (0 if "layers" in key else 1):
            raise ValueError(f"{where}: {key}={values[key]!r} is not a valid size")
    if values["patch_size"] != 1:
        raise ValueError(f"{where}: patch_size={values['patch_size']}; Flux.1 packs 2x2 latent patches into "
                         "in_channels with patch_size 1, and knapray supports only that")
    if values["in_channels"] % 4:
        raise ValueError(f"{where}: in_channels={values['in_channels']} is not latent channels x 2 x 2")
    if values["out_channels"] not in (None, values["in_channels"]):
        raise ValueError(f"{where}: out_channels={values['out_channels']} differs from in_channels="
                         f"{values['in_channels']} (a Fill/Kontext variant); knapray trains text-to-image Flux.1")
    axes = values["axes_dims_rope"]
    if not isinstance(axes, (list, tuple)) or len(axes) != 3:
        raise ValueError(f"{where}: axes_dims_rope={axes!r} must be 3 ints (t, h, w)")
    if not isinstance(values["guidance_embeds"], bool):
        raise ValueError(f"{where}: guidance_embeds={values['guidance_embeds']!r} must be true or false")
    return {
        "in_channels": values["in_channels"] // 4,
        "patch_size": PATCH,
        "hidden_size": values["attention_head_dim"] * values["num_attention_heads"],
        "num_heads": values["num_attention_heads"],
        "depth_double": values["num_layers"],
        "depth_single": values["num_single_layers"],
        "text_dim": values["joint_attention_dim"],
        "pooled_dim": values["pooled_projection_dim"],
        "rope_axes_dim": tuple(axes),
        "guidance_embeds": values["guidance_embeds"],
    }


def condition_fields(cfg: FluxConfig) -> tuple[str, ...]:
    """The ``PackedBatch`` fields ``FluxTransformer.condition`` takes: the guidance too for dev."""
    return ("timesteps", "pooled", "guidance") if cfg.guidance_embeds else ("timesteps", "pooled")


def sample_shift(cfg: FluxConfig) -> float | None:
    """FLUX.1-dev (guidance embedded): None, each request's own shift from its image tokens,
    as BFL's and diffusers' dev pipelines; schnell samples unshifted, as BFL's
    ``get_schedule(..., shift=not is_schnell)``."""
    return None if cfg.guidance_embeds else 1.0


def small_config(width: int) -> FluxConfig:
    """Flux.1's blocks at ``width`` (heads of 32 channels): one double- and one single-stream
    block, guidance embedded (FLUX.1-dev)."""
    return FluxConfig(hidden_size=width, num_heads=width // 32, depth_double=1, depth_single=1, in_channels=4,
                      text_dim=32, pooled_dim=32, rope_axes_dim=(8, 12, 12), guidance_embeds=True)


def diffusers_call(ref: nn.Module, cfg: FluxConfig, s: Any) -> torch.Tensor:
    """One sequence ``s`` (``latent`` (C, 1, H, W), ``text`` (L, text_dim), ``pooled``,
    ``timestep``, ``guidance``: ``knapray.testing.reference.Inputs``) through diffusers'
    ``FluxTransformer2DModel`` ``ref`` as ``FluxPipeline`` packs it -> (H/2 · W/2, 4·C)."""
    c, _, h, w = s.latent.shape
    # (C, 1, H, W) -> (1, C, H/2, 2, W/2, 2) -> (1, H/2, W/2, C, 2, 2) -> (1, H/2 · W/2, 4C): FluxPipeline._pack_latents
    x = s.latent[:, 0].reshape(1, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, (h // 2) * (w // 2), 4 * c)
    ids = torch.zeros(h // 2, w // 2, 3)  # FluxPipeline._prepare_latent_image_ids: (0, row, column)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    kwargs = {"guidance": torch.tensor([s.guidance])} if s.guidance is not None else {}
    out = ref(hidden_states=x, encoder_hidden_states=s.text[None], pooled_projections=s.pooled[None],
              timestep=torch.tensor([s.timestep]), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(s.text.shape[0], 3),
              return_dict=False, **kwargs)[0]
    return out[0]


# ---- the model ------------------------------------------------------------------------------


def flux_rope(pos: torch.Tensor, axes_dim: tuple[int, ...], theta: float = THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (N, sum(axes_dim)/2) fp32 of integer ids pos (N, A), angles in float64.

    Channel pair i of axis a turns by pos[:, a] / theta**(2i/axes_dim[a]); the pairs are
    consecutive channels (2i, 2i+1), as knapray's ``apply_rope`` rotates them."""
    if pos.dim() != 2 or pos.shape[1] != len(axes_dim) or pos.dtype.is_floating_point:
        raise ValueError(f"pos must be (N, {len(axes_dim)}) integer ids, got {tuple(pos.shape)} {pos.dtype}")
    angles = []
    for axis, dim in enumerate(axes_dim):
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim))  # (dim/2,)
        angles.append(pos[:, axis].to(torch.float64)[:, None] * inv_freq[None, :])  # (N, dim/2)
    angle = torch.cat(angles, dim=-1)  # (N, D/2)
    return angle.cos().float(), angle.sin().float()


class FluxTransformer(MMDiT):
    """Flux.1 over packed token batches; attention is injected per call.

    The MMDiT's stages (``embed``, ``blocks``, ``head``: the same blocks and submodule names
    ``img_in``, ``txt_in``, ``time_in``, ``vector_in``, ``double_blocks``, ``single_blocks``,
    ``final``, so parallelization applies unchanged) with Flux.1's own conditioning (the
    guidance MLP ``guidance_in`` of FLUX.1-dev) and RoPE (angles in float64, as diffusers)."""

    def __init__(self, cfg: FluxConfig) -> None:
        nn.Module.__init__(self)  # the same modules as the MMDiT, with guidance_in after time_in
        if not isinstance(cfg, FluxConfig):
            raise TypeError(f"FluxTransformer takes a FluxConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        d = cfg.hidden_size
        self.img_in = nn.Linear(cfg.patch_dim, d)
        self.txt_in = nn.Linear(cfg.text_dim, d)
        self.time_in = MLP(TIME_EMBED_DIM, d, d, activation="silu")
        self.guidance_in = MLP(TIME_EMBED_DIM, d, d, activation="silu") if cfg.guidance_embeds else None
        self.vector_in = MLP(cfg.pooled_dim, d, d, activation="silu")
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.depth_double))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(cfg) for _ in range(cfg.depth_single))
        self.final = FinalLayer(cfg)
        self.init_weights()

    def conditioning_mlps(self) -> list[nn.Module]:
        """The timestep, guidance (dev) and pooled-text MLPs: a random init (training from
        scratch, tests; a fine-tune loads weights) draws them as the MMDiT's."""
        return [m for m in (self.time_in, self.guidance_in, self.vector_in) if m is not None]

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flux_rope(pos, self.cfg.rope_axes_dim)

    def condition(
        self, timesteps: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor | None = None
    ) -> torch.Tensor:
        """timesteps (S,) in [0, 1], pooled (S, pooled_dim), guidance (S,) for dev -> vec (S, d).

        As diffusers: t·1000 and guidance·1000 through cos/sin features of 256 channels
        (``timestep_embedding``), each through its MLP; plus the pooled MLP."""
        s = timesteps.shape[0]
        if timesteps.dim() != 1 or pooled.shape != (s, self.cfg.pooled_dim):
            raise ValueError(
                f"expected timesteps (S,) and pooled (S, {self.cfg.pooled_dim}), "
                f"got {tuple(timesteps.shape)} and {tuple(pooled.shape)}"
            )
        dtype = self.param_dtype
        vec = self.time_in(timestep_embedding(timesteps).to(dtype))
        if self.guidance_in is not None:
            if guidance is None or guidance.shape != (s,):
                raise ValueError(
                    "this Flux model embeds guidance (guidance_embeds: FLUX.1-dev): condition needs one guidance "
                    f"value per sequence, shape ({s},), got {None if guidance is None else tuple(guidance.shape)}"
                )
            vec = vec + self.guidance_in(timestep_embedding(guidance).to(dtype))
        return (vec + self.vector_in(pooled.to(dtype))).float()  # fp32: as the MMDiT's condition

    def forward(self, batch: PackedBatch, attn: AttentionFn | None = None) -> torch.Tensor:
        """Single-process composition; ``attn`` defaults to varlen attention over the batch."""
        if attn is None:
            attn = LocalAttention(batch.cu_seqlens, batch.max_seqlen)
        vec = self.condition(**{name: getattr(batch, name) for name in condition_fields(self.cfg)})
        h = self.embed(batch.x_txt, batch.x_img, batch.is_text)
        h = self.blocks(h, vec, batch.seq_index, batch.pos, batch.is_text, attn)
        return self.head(h, vec, batch.seq_index, batch.is_text)
