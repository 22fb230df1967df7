"""FLUX.2 ([dev], and the [klein] sizes) over packed token batches: the math of diffusers'
``Flux2Transformer2DModel`` (0.42; text-to-image, no reference images) and of BFL's
reference model, behind knapray's stage interface (condition / embed / blocks / head,
attention injected).

Its blocks are knapray's double- and single-stream blocks (LayerNorm eps 1e-6 without
affine, fused q/k/v, RMSNorm eps 1e-6 on q and k per head, joint attention over [text,
image]; the single block's one input projection to q, k, v and the MLP, one output
projection over their concatenation) with what FLUX.2 does differently:

- **no biases** anywhere (embedders, blocks, modulation, final layer);
- **SwiGLU** MLPs of 3·d (``GatedMLP``: the gate half first; in a single block the MLP's
  2·3·d columns of ``linear1``);
- **shared modulation**: one modulation per kind of block for the whole model (the image
  stream's, the text stream's, the single blocks'), computed once per sequence in
  ``condition`` and gathered per token once per step; ``condition`` returns the timestep
  (+ guidance) embedding and the three side by side, (S, 16·d);
- the timestep (and FLUX.2 [dev]'s guidance) through 256 cos/sin features of t·1000 and a
  SiLU MLP each (as Flux.1's), no pooled text vector;
- **4-axis RoPE** (t, h, w, l), theta 2000, angles in float64 as diffusers: an image token
  at (0, row, column, 0), the k-th text token at (0, 0, 0, k) (the pipeline's ``img_ids``
  and ``txt_ids``); ``positions`` derives them at home from the packed (frame, row, column)
  ids.

Parameter layouts differ from diffusers' by names, the fusing of q/k/v, and the final
layer's modulation order (diffusers' ``norm_out``: scale, shift; knapray and BFL: shift,
scale): ``flux2_keys`` maps them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
import torch.nn as nn

from knapray.attention import AttentionFn, LocalAttention
from knapray.models.blocks import DoubleStreamBlock, FinalLayer, SingleStreamBlock, StreamWeights, _qk_norm
from knapray.models.config import DiTConfig
from knapray.models.families.flux import flux_rope
from knapray.models.layers import MLP, TIME_EMBED_DIM, GatedMLP, LayerNorm, Modulation, per_token, swiglu, timestep_embedding
from knapray.models.mmdit import MMDiT
from knapray.models.packing import PackedBatch
from knapray.planning.inference.sampling_memory import ArchSpec

DIFFUSERS_CLASS = "Flux2Transformer2DModel"
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")
"""``Flux2Pipeline``'s system message: the chat turn before the caption, for Mistral Small 3.1."""
TEXT_LAYERS = (10, 20, 30)
"""The Mistral hidden states the pipeline stacks per token (3 x 5,120 = 15,360 wide)."""
VAE = ArchSpec.of("AutoencoderKLFlux2", {
    "in_channels": 3, "out_channels": 3, "latent_channels": 32, "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2, "use_quant_conv": True, "use_post_quant_conv": True}, dtype="bf16")
"""FLUX.2's VAE (its pipeline folder's vae/), in bf16 as its pipeline decodes."""
TEXT_MODEL = ArchSpec.of("Mistral3ForConditionalGeneration", {
    "text_config.vocab_size": 131072, "text_config.hidden_size": 5120, "text_config.intermediate_size": 32768,
    "text_config.num_hidden_layers": 40, "text_config.num_attention_heads": 32, "text_config.num_key_value_heads": 8,
    "text_config.head_dim": 128, "vision_config.num_hidden_layers": 24, "vision_config.hidden_size": 1024,
    "vision_config.intermediate_size": 4096, "vision_config.patch_size": 14, "spatial_merge_size": 2,
    "multimodal_projector_bias": False, "layers_out": 3, "tie_word_embeddings": False}, tokens=512)
"""FLUX.2's text encoder (its pipeline folder's text_encoder/: Mistral Small 3.1, 24B), in bf16,
at its 512 padded tokens, three layers' hidden states per token: what sampling holds on rank 0."""
TEXT_TOKENS = 512
"""``max_sequence_length``: every caption padded to it, and the transformer attends to all of them."""
PATCH = (1, 2, 2)
"""FLUX.2 packs 2x2 latent patches into one token (``Flux2Pipeline._patchify_latents``)."""
THETA = 2000.0
"""``Flux2Transformer2DModel(rope_theta=2000)``."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Flux2Config(DiTConfig):
    """FLUX.2's architecture in knapray's field names (defaults: FLUX.2 [dev]'s 32B shape, as
    diffusers' defaults). ``in_channels`` counts latent channels (32 for its VAE);
    diffusers' ``in_channels`` counts packed features (128 = 32·2·2)."""

    rope_axes: ClassVar[int] = 4
    gated_mlp: ClassVar[bool] = True
    linear_bias: ClassVar[bool] = False
    shared_modulation: ClassVar[bool] = True

    in_channels: int = dataclasses.field(default=32, metadata={"ge": 1})
    hidden_size: int = dataclasses.field(default=6144, metadata={"ge": 1})
    num_heads: int = dataclasses.field(default=48, metadata={"ge": 1})
    depth_double: int = dataclasses.field(default=8, metadata={"ge": 0})
    depth_single: int = dataclasses.field(default=48, metadata={"ge": 0})
    mlp_ratio: float = dataclasses.field(default=3.0, metadata={"gt": 0, "le": 64})
    text_dim: int = dataclasses.field(default=15360, metadata={"ge": 1})
    pooled_dim: int = dataclasses.field(default=0, metadata={"ge": 0})
    rope_axes_dim: tuple[int, ...] = dataclasses.field(default=(32, 32, 32, 32), metadata={"ge": 0})
    rope_theta: float = dataclasses.field(default=THETA, metadata={"gt": 0})
    family: str = "flux2"
    guidance_embeds: bool = True
    """Embed a guidance strength per sequence (FLUX.2 [dev]: true; the [klein] models: false)."""

    def __post_init__(self) -> None:
        DiTConfig.__post_init__(self)
        fixed = {"patch_size": PATCH, "qk_norm": True, "pooled_dim": 0}
        for name, value in fixed.items():
            if getattr(self, name) != value:
                raise ValueError(f"family flux2: {name} must be {value!r} (fixed in FLUX.2), got {getattr(self, name)!r}")
        if self.text_dim < 1:
            raise ValueError(f"family flux2: text_dim must be >= 1 (FLUX.2 always takes text tokens), got "
                             f"{self.text_dim!r}")
        if int(self.hidden_size * self.mlp_ratio) != self.hidden_size * self.mlp_ratio:
            raise ValueError(f"family flux2: hidden_size x mlp_ratio must be a whole number, got "
                             f"{self.hidden_size} x {self.mlp_ratio:g}")
        if not isinstance(self.guidance_embeds, bool):
            raise ValueError(f"guidance_embeds must be true or false, got {self.guidance_embeds!r}")

    @property
    def condition_dim(self) -> int:
        """``condition``'s (S, 16·d): the embedding, then the image stream's, the text
        stream's (6·d each) and the single blocks' (3·d) modulation."""
        return 16 * self.hidden_size

    # ---- diffusers' config.json ---------------------------------------------------------

    def to_diffusers(self) -> dict[str, Any]:
        """The ``config.json`` of the equivalent ``Flux2Transformer2DModel``."""
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
            "timestep_guidance_channels": TIME_EMBED_DIM,
            "mlp_ratio": self.mlp_ratio,
            "axes_dims_rope": list(self.rope_axes_dim),
            "rope_theta": int(self.rope_theta) if float(self.rope_theta).is_integer() else self.rope_theta,
            "eps": 1e-6,
            "guidance_embeds": self.guidance_embeds,
        }


DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "patch_size": 1, "in_channels": 128, "out_channels": None, "num_layers": 8, "num_single_layers": 48,
    "attention_head_dim": 128, "num_attention_heads": 48, "joint_attention_dim": 15360,
    "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000,
    "eps": 1e-6, "guidance_embeds": True,
}
"""``Flux2Transformer2DModel.__init__``'s defaults: what diffusers uses for a key config.json
leaves out."""


def section_from_diffusers(config: dict[str, Any], where: str) -> dict[str, Any]:
    """Model-section values (knapray's names) of a diffusers ``Flux2Transformer2DModel``
    config.json; ValueError naming ``where`` and the key for what knapray's FLUX.2 cannot be."""
    values = {**DIFFUSERS_DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}
    unknown = sorted(set(values) - set(DIFFUSERS_DEFAULTS))
    if unknown:
        raise ValueError(f"{where}: keys {unknown} are not Flux2Transformer2DModel's; valid: "
                         f"{sorted(DIFFUSERS_DEFAULTS)}")
    for key in ("patch_size", "in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim"):
        if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < 1:
            raise ValueError(f"{where}: {key}={values[key]!r} is not a valid size")
    for key in ("num_layers", "num_single_layers"):
        if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < 0:
            raise ValueError(f"{where}: {key}={values[key]!r} is not a valid number of blocks")
    if values["patch_size"] != 1:
        raise ValueError(f"{where}: patch_size={values['patch_size']}; FLUX.2 packs 2x2 latent patches into "
                         "in_channels with patch_size 1, and knapray supports only that")
    if values["in_channels"] % 4:
        raise ValueError(f"{where}: in_channels={values['in_channels']} is not latent channels x 2 x 2")
    if values["out_channels"] not in (None, values["in_channels"]):
        raise ValueError(f"{where}: out_channels={values['out_channels']} differs from in_channels="
                         f"{values['in_channels']}; knapray trains text-to-image FLUX.2")
    if values["timestep_guidance_channels"] != TIME_EMBED_DIM:
        raise ValueError(f"{where}: timestep_guidance_channels={values['timestep_guidance_channels']!r}; knapray's "
                         f"timestep features are {TIME_EMBED_DIM} wide, as every FLUX.2 checkpoint's")
    if values["eps"] != 1e-6:
        raise ValueError(f"{where}: eps={values['eps']!r}; knapray's FLUX.2 norms use 1e-6, as its checkpoints")
    axes = values["axes_dims_rope"]
    if not isinstance(axes, (list, tuple)) or len(axes) != 4:
        raise ValueError(f"{where}: axes_dims_rope={axes!r} must be 4 ints (t, h, w, l)")
    if not isinstance(values["guidance_embeds"], bool):
        raise ValueError(f"{where}: guidance_embeds={values['guidance_embeds']!r} must be true or false")
    return {
        "in_channels": values["in_channels"] // 4,
        "patch_size": PATCH,
        "hidden_size": values["attention_head_dim"] * values["num_attention_heads"],
        "num_heads": values["num_attention_heads"],
        "depth_double": values["num_layers"],
        "depth_single": values["num_single_layers"],
        "mlp_ratio": float(values["mlp_ratio"]),
        "text_dim": values["joint_attention_dim"],
        "pooled_dim": 0,
        "rope_axes_dim": tuple(axes),
        "rope_theta": float(values["rope_theta"]),
        "guidance_embeds": values["guidance_embeds"],
    }


def sample_shift_of(image_tokens: int, steps: int) -> float:
    """The shift ``Flux2Pipeline`` samples with: e^mu of its ``compute_empirical_mu``, a fit of
    mu to the image tokens n and the step count s (BFL's): over 4,300 tokens the line
    mu = a2·n + b2; else mu interpolated in s, linearly, between its fits at 10 and 200 steps
    (a1·n + b1 and a2·n + b2)."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    at_200 = a2 * image_tokens + b2
    if image_tokens > 4300:
        return math.exp(at_200)
    at_10 = a1 * image_tokens + b1
    slope = (at_200 - at_10) / 190.0
    return math.exp(slope * steps + at_200 - 200.0 * slope)


def condition_fields(cfg: Flux2Config) -> tuple[str, ...]:
    """The ``PackedBatch`` fields ``Flux2Transformer.condition`` takes: the guidance too for [dev]."""
    return ("timesteps", "guidance") if cfg.guidance_embeds else ("timesteps",)


def _axes(head_dim: int) -> tuple[int, int, int, int]:
    """A head's RoPE channels split over (t, h, w, l) as FLUX.2's (a quarter each, even)."""
    quarter = head_dim // 4 // 2 * 2
    return (head_dim - 3 * quarter, quarter, quarter, quarter)


def small_config(width: int) -> Flux2Config:
    """FLUX.2's blocks at ``width`` (heads of 32 channels): one double- and one single-stream
    block, guidance embedded ([dev])."""
    return Flux2Config(hidden_size=width, num_heads=width // 32, depth_double=1, depth_single=1, in_channels=4,
                       text_dim=32, rope_axes_dim=(8, 8, 8, 8))


def sized_config(hidden: int, heads: int, depth_double: int, depth_single: int) -> Flux2Config:
    """FLUX.2 of a size (what calibration times)."""
    return Flux2Config(hidden_size=hidden, num_heads=heads, depth_double=depth_double, depth_single=depth_single,
                       in_channels=4, text_dim=16, rope_axes_dim=_axes(hidden // heads))


def diffusers_call(ref: nn.Module, cfg: Flux2Config, s: Any) -> torch.Tensor:
    """One sequence ``s`` (``latent`` (C, 1, H, W), ``text`` (L, text_dim), ``timestep``,
    ``guidance``: ``knapray.testing.reference.Inputs``) through diffusers'
    ``Flux2Transformer2DModel`` ``ref`` as ``Flux2Pipeline`` packs it -> (H/2 · W/2, 4·C)."""
    c, _, h, w = s.latent.shape
    # (C, 1, H, W) -> (1, H/2 · W/2, 4C), channels outermost: Flux2Pipeline._patchify_latents, then _pack_latents
    x = s.latent[:, 0].reshape(1, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, (h // 2) * (w // 2), 4 * c)
    img_ids = torch.zeros(h // 2, w // 2, 4)  # Flux2Pipeline._prepare_latent_ids: (0, row, column, 0)
    img_ids[..., 1] = torch.arange(h // 2)[:, None]
    img_ids[..., 2] = torch.arange(w // 2)[None, :]
    txt_ids = torch.zeros(s.text.shape[0], 4)  # Flux2Pipeline._prepare_text_ids: (0, 0, 0, k)
    txt_ids[:, 3] = torch.arange(s.text.shape[0])
    kwargs = {"guidance": torch.tensor([s.guidance])} if s.guidance is not None else {}
    out = ref(hidden_states=x, encoder_hidden_states=s.text[None], timestep=torch.tensor([s.timestep]),
              img_ids=img_ids.reshape(1, -1, 4), txt_ids=txt_ids[None], return_dict=False, **kwargs)[0]
    return out[0]


# ---- the model ------------------------------------------------------------------------------


def flux2_positions(pos: torch.Tensor, seq_index: torch.Tensor, is_text: torch.Tensor) -> torch.Tensor:
    """FLUX.2's RoPE ids (N, 4) of whole packed sequences (text first in each): an image token
    at (frame, row, column, 0), the k-th text token of its sequence at (0, 0, 0, k). Device ops
    only (no host read): every rank derives them at home."""
    n = pos.shape[0]
    ones = is_text.to(pos.dtype)
    before = torch.cumsum(ones, 0) - ones  # text tokens before this token in the batch
    first = torch.zeros(n, dtype=pos.dtype, device=pos.device).scatter_reduce(0, seq_index, before, "amin",
                                                                              include_self=False)
    k = torch.where(is_text, before - first[seq_index], 0)
    return torch.cat((torch.where(is_text[:, None], 0, pos), k[:, None]), dim=1)


class Flux2Stream(StreamWeights):
    """One modality's weights in a FLUX.2 double-stream block: no modulation of its own (the
    model's is shared), no biases, a SwiGLU MLP."""

    def __init__(self, cfg: Flux2Config) -> None:
        nn.Module.__init__(self)
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.norm1 = LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.q_norm, self.k_norm = _qk_norm(cfg), _qk_norm(cfg)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = LayerNorm(d)
        self.mlp = GatedMLP(d, cfg.mlp_hidden)


class Flux2DoubleBlock(DoubleStreamBlock):
    """FLUX.2's double-stream block: given each stream's modulation (the model's, shared)."""

    def __init__(self, cfg: Flux2Config) -> None:
        nn.Module.__init__(self)
        self.txt = Flux2Stream(cfg)
        self.img = Flux2Stream(cfg)

    def forward(self, h_txt: torch.Tensor, h_img: torch.Tensor, mods_txt: tuple[torch.Tensor, ...],
                mods_img: tuple[torch.Tensor, ...], streams, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionFn) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.joint_qkv(h_txt, h_img, mods_txt, mods_img, streams, rope)
        out = attn(q, k, v)  # in forward itself: compiled blocks break their graph here, and resume in this frame
        return self.joint_out(h_txt, h_img, out, mods_txt, mods_img, streams)


class Flux2SingleBlock(SingleStreamBlock):
    """FLUX.2's single-stream block: no biases, the MLP's half of ``linear1`` 2·3·d wide
    (SwiGLU), given its modulation (the model's, shared)."""

    def __init__(self, cfg: Flux2Config) -> None:
        nn.Module.__init__(self)
        d, m = cfg.hidden_size, cfg.mlp_hidden
        self.num_heads, self.head_dim, self.mlp_hidden = cfg.num_heads, cfg.head_dim, m
        self.norm = LayerNorm(d)
        self.linear1 = nn.Linear(d, 3 * d + 2 * m, bias=False)
        self.q_norm, self.k_norm = _qk_norm(cfg), _qk_norm(cfg)
        self.linear2 = nn.Linear(d + m, d, bias=False)

    def forward(self, h: torch.Tensor, mods: tuple[torch.Tensor, ...], rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionFn) -> torch.Tensor:
        q, k, v, mlp_in, gate = self.attn_inputs(h, mods, rope)
        out = attn(q, k, v)  # in forward itself: compiled blocks break their graph here, and resume in this frame
        return self.attn_out(h, out, mlp_in, gate)

    def activate(self, mlp_in: torch.Tensor) -> torch.Tensor:
        return swiglu(mlp_in)


class Flux2Final(FinalLayer):
    """adaLN LayerNorm + linear to patch features, no biases, its modulation from the
    embedding (the first d columns of ``condition``'s vector)."""

    def __init__(self, cfg: Flux2Config) -> None:
        nn.Module.__init__(self)
        self.width = cfg.hidden_size
        self.mod = Modulation(cfg.hidden_size, 2, bias=False)
        self.norm = LayerNorm(cfg.hidden_size)
        self.linear = nn.Linear(cfg.hidden_size, cfg.out_patch_dim, bias=False)

    def forward(self, h_img: torch.Tensor, vec_seq: torch.Tensor, seq_img: torch.Tensor) -> torch.Tensor:
        return FinalLayer.forward(self, h_img, vec_seq[:, :self.width], seq_img)


class SharedModulation(nn.Module):
    """FLUX.2's modulation, one per kind of block for the whole model: the image stream's
    (``img``) and the text stream's (``txt``) 6·d, the single blocks' (``single``) 3·d."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.img = Modulation(d, 6, bias=False)
        self.txt = Modulation(d, 6, bias=False)
        self.single = Modulation(d, 3, bias=False)

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        """emb (S, d) -> (S, 15·d): the image stream's, the text stream's, the single blocks'."""
        return torch.cat([m.per_sequence(emb) for m in (self.img, self.txt, self.single)], dim=1)


class Flux2Transformer(MMDiT):
    """FLUX.2 over packed token batches; attention is injected per call.

    The MMDiT's stages and submodule names (``img_in``, ``txt_in``, ``time_in``,
    ``double_blocks``, ``single_blocks``, ``final``; no ``vector_in``), with
    ``guidance_in`` ([dev]) and the shared ``modulation`` (module doc)."""

    def __init__(self, cfg: Flux2Config) -> None:
        nn.Module.__init__(self)
        if not isinstance(cfg, Flux2Config):
            raise TypeError(f"Flux2Transformer takes a Flux2Config, got {type(cfg).__name__}")
        self.cfg = cfg
        d = cfg.hidden_size
        self.img_in = nn.Linear(cfg.patch_dim, d, bias=False)
        self.txt_in = nn.Linear(cfg.text_dim, d, bias=False)
        self.time_in = MLP(TIME_EMBED_DIM, d, d, activation="silu", bias=False)
        self.guidance_in = MLP(TIME_EMBED_DIM, d, d, activation="silu", bias=False) if cfg.guidance_embeds else None
        self.vector_in = None
        self.modulation = SharedModulation(d)
        self.double_blocks = nn.ModuleList(Flux2DoubleBlock(cfg) for _ in range(cfg.depth_double))
        self.single_blocks = nn.ModuleList(Flux2SingleBlock(cfg) for _ in range(cfg.depth_single))
        self.final = Flux2Final(cfg)
        self.init_weights()

    def conditioning_mlps(self) -> list[nn.Module]:
        return [m for m in (self.time_in, self.guidance_in) if m is not None]

    def fsdp_units(self):
        """The MMDiT's, with the shared modulation a unit after the conditioning MLPs."""
        units = MMDiT.fsdp_units(self)
        return dataclasses.replace(units, embedders=(*self.conditioning_mlps(), self.modulation, self.img_in,
                                                     self.txt_in))

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flux_rope(pos, self.cfg.rope_axes_dim, self.cfg.rope_theta)

    def positions(self, pos: torch.Tensor, seq_index: torch.Tensor, is_text: torch.Tensor) -> torch.Tensor:
        """The RoPE ids (t, h, w, l) of whole sequences at home (``flux2_positions``)."""
        return flux2_positions(pos, seq_index, is_text)

    def condition(self, timesteps: torch.Tensor, guidance: torch.Tensor | None = None) -> torch.Tensor:
        """timesteps (S,) in [0, 1], guidance (S,) for [dev] -> (S, 16·d) fp32: the embedding
        (t·1000 and guidance·1000 through 256 cos/sin features and an MLP each, summed), then
        the image stream's, text stream's and single blocks' modulation of it."""
        s = timesteps.shape[0]
        if timesteps.dim() != 1:
            raise ValueError(f"expected timesteps (S,), got {tuple(timesteps.shape)}")
        dtype = self.param_dtype
        emb = self.time_in(timestep_embedding(timesteps).to(dtype))
        if self.guidance_in is not None:
            if guidance is None or guidance.shape != (s,):
                raise ValueError(
                    "this FLUX.2 model embeds guidance (guidance_embeds: FLUX.2 [dev]): condition needs one guidance "
                    f"value per sequence, shape ({s},), got {None if guidance is None else tuple(guidance.shape)}")
            emb = emb + self.guidance_in(timestep_embedding(guidance).to(dtype))
        return torch.cat((emb, self.modulation(emb)), dim=1).float()

    def double_inputs(self, vec_seq: torch.Tensor, seq_txt: torch.Tensor, seq_img: torch.Tensor,
                      dtype: torch.dtype) -> tuple:
        """Each stream's 6 modulation tensors per token in the residual stream's ``dtype``,
        gathered once for every block."""
        d = self.cfg.hidden_size
        return (per_token(vec_seq[:, 7 * d:13 * d].to(dtype), seq_txt, 6),
                per_token(vec_seq[:, d:7 * d].to(dtype), seq_img, 6))

    def single_inputs(self, vec_seq: torch.Tensor, seq_index: torch.Tensor, dtype: torch.dtype) -> tuple:
        """The single blocks' shift, scale and gate per token, gathered once for every block."""
        d = self.cfg.hidden_size
        return (per_token(vec_seq[:, 13 * d:].to(dtype), seq_index, 3),)

    def forward(self, batch: PackedBatch, attn: AttentionFn | None = None) -> torch.Tensor:
        """Single-process composition; ``attn`` defaults to varlen attention over the batch."""
        if attn is None:
            attn = LocalAttention(batch.cu_seqlens, batch.max_seqlen)
        vec = self.condition(**{name: getattr(batch, name) for name in condition_fields(self.cfg)})
        h = self.embed(batch.x_txt, batch.x_img, batch.is_text)
        pos = self.positions(batch.pos, batch.seq_index, batch.is_text)
        h = self.blocks(h, vec, batch.seq_index, pos, batch.is_text, attn)
        return self.head(h, vec, batch.seq_index, batch.is_text)
