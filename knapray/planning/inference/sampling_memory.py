"""Per-GPU memory of a sampling gang, by phase and category, and what fits a GPU (pure:
stdlib and numpy only, no torch). ``knapray dryrun --sample`` measures it on fake tensors.

The placement policy it counts (what knapray's sampling engine holds where):

- **The transformer** as ``worker.denoise.prepare_model`` holds it: its weights in bf16,
  cast once (no fp32 copy), its final layer in fp32; the residual stream in fp32 around and
  between the blocks, whose matrix products run in bf16 under autocast. ``replicated``
  (``--shard off``, and ``auto`` where the weights fit; what ``knapray dryrun --sample``
  measures): every rank of the gang holds the whole model. ``bag-sharded`` (``--shard
  bags``; modelled, not measured): FSDP2 over a bag's ``g`` ranks, a ``g``-th of the weights
  per rank plus the largest unit gathered (a block, or the embedders and final layer). A run
  of two experts (``flow.expert_boundary``, Wan 2.2 A14B) holds both transformers, each as
  one model is held: a trajectory switches between them at the boundary, one forward at a
  time (the working memory is one model's).
- **The text encoders** (Flux: T5-XXL and CLIP-L; Wan: umT5-XXL) live on rank 0 only, in
  bf16, and encode the batch's captions together. Policy ``encoders``: ``keep`` (resident
  beside the transformer: serving), ``offload`` (on the host between batches, on the device
  only while a batch is encoded), ``free`` (one batch, ``knapray sample``: encode first,
  free the encoders, then the transformer's weights arrive).
- **The VAE** is resident on every bag lead (a bag's first rank), in the family's VAE dtype
  (bf16 ``AutoencoderKL`` for Flux, fp32 ``AutoencoderKLWan`` for Wan, as WanPipeline runs
  it), and decodes the bag's jobs after its denoising loop, one job at a time.
- **Denoising** is a forward under ``torch.no_grad()``: one step of the bag's batch. The
  lead holds the bag's jobs' latents in fp32 (image tokens x patch features) and the step's
  packed batch (the passes' latents, fp32 text rows, positions and indices, and the step's
  layout); the bag's ranks run ``balanced_forward`` on the bag's ``bag_plan`` (a guided job
  has a conditional and an unconditional pass; FLUX.1-dev embeds its guidance: one pass).

A rank's peak is the largest of its phases, each what is resident then plus that phase's
working memory:

=========  ===========================================  ================================
phase      resident                                     working
=========  ===========================================  ================================
encode     rank 0: encoders, VAE (a lead), transformer  the encoders' forward over the
           (not under ``free``)                         batch's captions
denoise    transformer, encoders (``keep``), VAE, the   the forward at the rank's routed
           step's inputs (``latents``)                  tokens (and, a lead, its home ones)
decode     a lead: transformer, encoders (``keep``),    one job's VAE decode (the latents
           VAE                                          went to the host; one comes back)
=========  ===========================================  ================================

Working memory, counted from what torch's tracker saw alive at each peak on fake tensors
(``knapray dryrun --sample``; ``b`` the compute dtype's bytes (bf16: 2), ``f`` the stream's
(fp32: 4), ``d`` the width, ``m`` the MLP width, ``D`` the head width; "per token" of the
rank's routed tokens unless "home"):

- *T5 / umT5*, B captions of L tokens: the relative position bias (L, L, heads), its masked
  copy and that copy's clone (B, heads, L, L), q, k, v, the input embeddings, the residual
  and the normed stream (B, L, d each), the ids and mask (int64); plus what earlier
  encoders returned. *CLIP*: at its MLP, fc1's output, the quick-GELU's two (B, L, ffn) and
  four (B, L, d). Attention itself keeps no scores (SDPA's fused kernels).
- *Joint blocks* (Flux), the largest of a double block at its image MLP: per image token
  ``(12d + 2m) b + 3 d f`` (in ``b`` the modulation 6d, q/k/v 3d, normed q and k, the
  attention's split output, fc1 and GELU; in ``f`` the stream, its residual and the MLP's
  input), per text token ``12 d b + 2 d f``, per token ``4 d b`` (merged q, k, v, attention
  output) and RoPE's fp32 cos/sin (``4 D``); and of a single block at its concatenation:
  per token ``(10d + 3m) b + 2 d f`` (the block's input and the double blocks' last
  streams; ``1 d f`` without double blocks) + RoPE.
- *Wan blocks*, at the self-attention's modulation: per image token thirteen fp32 rows of d
  (six modulation rows gathered, the stream, its norm and products, q and k normed) and
  five in ``b`` (q, k, v, RoPE'd q and k) + RoPE; per text token the context and its
  padded copy, in ``f``.
- Around the blocks: the home embedding (``d f`` per home token, a lead's), the routing
  buffer (``d f`` + 24 B per routed token, in a bag of more than one rank); at the end the
  head over the home image tokens in fp32 (Flux: ``24 d``: modulation 2d, the split stream,
  the norm and its two products; Wan: ``24 d + d f``), the blocks' output home again and
  the routed one. Wan's text MLP output (home text rows + its padding row, in ``b``) stays
  all step.
- *AutoencoderKL* decoding frames at P pixels: the last up block's first ResNet input, its
  GroupNorm and SiLU, ``3 C P b`` (C its input channels). *AutoencoderKLWan* (Wan 2.1's,
  causal, one latent frame a chunk after the first): two frames of every causal
  convolution's input cached, and at the last up block's second ResNet the chunk's four
  frames three times (the block's input, the ResNet's input, the SiLU), its new cache, the
  cache-and-chunk concatenation and its spatially padded copy; plus the frames decoded so
  far (fp32 RGB). A one-frame latent has one-frame caches and no concatenation.

What is left out: per-sequence conditioning rows, the Euler update after the forward
(below the forward's peak), the CUDA context, cuBLAS/NCCL workspaces and the caching
allocator's fragmentation (the training model's reserve and fragmentation: ``usable_bytes``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..costs.memory import FRAGMENTATION, FP32, GIB, INDEX, RESERVE_BYTES, ModelShape
from .sampling import COND, SINGLE, UNCOND, bag_plan, cfg_parallel_bag, plan_jobs
from ..shapes.topology import Topology

PLACEMENTS = ("replicated", "bag-sharded")
ENCODER_POLICIES = ("keep", "offload", "free")
PHASES = ("encode", "denoise", "decode")
CATEGORIES = ("transformer", "encoders", "vae", "latents", "working")
"""Bytes of a phase: the weights (three), the lead's latents and batch, the phase's working memory."""

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": FP32}
COMPUTE_BYTES = 2
"""The transformer's and the text encoders' dtype on a GPU: bf16."""
STREAM_BYTES = FP32
"""The transformer's residual stream: fp32 between and around the blocks, whose matrix
products run in bf16 under autocast (``worker.denoise.prepare_model``); its final layer too."""
ROUTE_POS = 3 * INDEX
"""Per routed token, the (t, h, w) positions sent beside the hidden state."""


@dataclass(frozen=True)
class ArchSpec:
    """A pretrained model as its library builds it: the class (``T5EncoderModel``,
    ``AutoencoderKL``, ...) and the config values that size it, as its ``config.json`` names
    them. What a family declares (``knapray.corpus.stages.FamilyEncoding``)."""

    cls: str
    config: tuple[tuple[str, Any], ...]
    dtype: str = "bf16"
    """What the engine holds it in."""
    tokens: int = 0
    """A text encoder: the tokens a caption is encoded at (its pipeline's length)."""

    @classmethod
    def of(cls, name: str, config: Mapping[str, Any], *, dtype: str = "bf16", tokens: int = 0) -> ArchSpec:
        return cls(name, tuple(sorted((k, _frozen(v)) for k, v in config.items())), dtype, tokens)

    @property
    def values(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.config}

    def nested(self) -> dict[str, Any]:
        """The config as its library's config class takes it: ``text_config.*`` and
        ``vision_config.*`` values in their sub-configs (the head's tying in both), knapray's
        own keys (``layers_out``) left out."""
        out: dict[str, Any] = {}
        for key, value in self.values.items():
            if key == "layers_out":
                continue
            head, _, tail = key.partition(".")
            if tail:
                out.setdefault(head, {})[tail] = value
            else:
                out[key] = value
        if "tie_word_embeddings" in out and "text_config" in out:
            out["text_config"]["tie_word_embeddings"] = out["tie_word_embeddings"]
        return out

    def get(self, key: str) -> Any:
        for k, v in self.config:
            if k == key:
                return v
        raise ValueError(f"{self.cls}: its config has no {key!r} (knapray's memory model reads it)")


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


# ---- text encoders ---------------------------------------------------------------------------

T5_CLASSES = ("T5EncoderModel", "UMT5EncoderModel")
CLIP_CLASSES = ("CLIPTextModel",)
LM_CLASSES = ("Qwen2_5_VLForConditionalGeneration", "Mistral3ForConditionalGeneration")
"""Vision-language models whose decoder's hidden states are a pipeline's text (Qwen-Image's
Qwen2.5-VL, FLUX.2's Mistral Small 3.1): their config's ``text_config.*`` and
``vision_config.*`` values, the vision tower counted with the rest (the pipelines load it)."""


def _vision_params(spec: ArchSpec, text_width: int) -> int:
    """The vision tower and its projection into the decoder, as transformers builds them."""
    get = spec.get
    d, f, layers, patch = (get(f"vision_config.{k}") for k in ("hidden_size", "intermediate_size", "depth" if
                           spec.cls.startswith("Qwen") else "num_hidden_layers", "patch_size"))
    if spec.cls.startswith("Qwen"):  # Qwen2.5-VL's ViT: biased q/k/v, proj and SwiGLU; a 2x2 patch merger
        merged = d * get("vision_config.spatial_merge_size") ** 2
        per_layer = (d * 3 * d + 3 * d) + (d * d + d) + 2 * (d * f + f) + (f * d + d) + 2 * d
        embed = 3 * get("vision_config.temporal_patch_size") * patch * patch * d
        merger = d + (merged * merged + merged) + (merged * get("vision_config.out_hidden_size")
                                                  + get("vision_config.out_hidden_size"))
        return embed + layers * per_layer + merger
    # Pixtral: no biases; Mistral3's projector (a norm, the patch merger, two linears)
    per_layer = 4 * d * d + 3 * d * f + 2 * d
    bias = bool(get("multimodal_projector_bias"))
    projector = d + d * get("spatial_merge_size") ** 2 * d + (d * text_width + (text_width if bias else 0)) + (
        text_width * text_width + (text_width if bias else 0))
    return 3 * patch * patch * d + d + layers * per_layer + projector


@dataclass(frozen=True, kw_only=True)
class TextEncoderShape:
    """What the memory model needs of a text encoder (a T5 / umT5 encoder, a CLIP text model,
    or a vision-language model's decoder: ``LM_CLASSES``)."""

    cls: str
    vocab: int
    width: int
    ffn: int
    layers: int
    heads: int
    head_dim: int
    tokens: int
    """Tokens a caption is encoded at."""
    gated: bool = False
    buckets: int = 0
    """T5: relative-attention buckets (layer 0's table; umT5: every layer's)."""
    positions: int = 0
    """CLIP: learned positions."""
    kv_heads: int = 0
    """A language model's key/value heads (grouped-query attention)."""
    qkv_bias: bool = False
    """Qwen2's biased q, k and v projections."""
    layers_out: int = 1
    """Hidden states its pipeline takes side by side per token (FLUX.2's 3)."""
    extra_params: int = 0
    """A vision-language model's vision tower and projection (``_vision_params``)."""
    tied: bool = False
    """A language model's output head is its embedding (``tie_word_embeddings``)."""
    dtype: str = "bf16"

    @classmethod
    def of(cls, spec: ArchSpec) -> TextEncoderShape:
        get = spec.get
        if spec.cls in T5_CLASSES:
            return cls(cls=spec.cls, vocab=get("vocab_size"), width=get("d_model"), ffn=get("d_ff"),
                       layers=get("num_layers"), heads=get("num_heads"), head_dim=get("d_kv"), tokens=spec.tokens,
                       gated=str(get("feed_forward_proj")).startswith("gated"),
                       buckets=get("relative_attention_num_buckets"), dtype=spec.dtype)
        if spec.cls in CLIP_CLASSES:
            d = get("hidden_size")
            return cls(cls=spec.cls, vocab=get("vocab_size"), width=d, ffn=get("intermediate_size"),
                       layers=get("num_hidden_layers"), heads=get("num_attention_heads"),
                       head_dim=d // get("num_attention_heads"), tokens=spec.tokens,
                       positions=get("max_position_embeddings"), dtype=spec.dtype)
        if spec.cls in LM_CLASSES:
            d, heads = get("text_config.hidden_size"), get("text_config.num_attention_heads")
            head_dim = dict(spec.config).get("text_config.head_dim") or d // heads
            return cls(cls=spec.cls, vocab=get("text_config.vocab_size"), width=d,
                       ffn=get("text_config.intermediate_size"), layers=get("text_config.num_hidden_layers"),
                       heads=heads, head_dim=head_dim, tokens=spec.tokens, gated=True,
                       kv_heads=get("text_config.num_key_value_heads"), qkv_bias=spec.cls.startswith("Qwen"),
                       layers_out=int(dict(spec.config).get("layers_out", 1)), tied=bool(get("tie_word_embeddings")),
                       extra_params=_vision_params(spec, d), dtype=spec.dtype)
        raise ValueError(f"text encoder {spec.cls}: not modelled; knapray's memory model knows "
                         f"{', '.join(T5_CLASSES + CLIP_CLASSES + LM_CLASSES)}")

    @property
    def t5(self) -> bool:
        return self.cls in T5_CLASSES

    @property
    def lm(self) -> bool:
        return self.cls in LM_CLASSES

    @property
    def num_params(self) -> int:
        d, f, inner = self.width, self.ffn, self.heads * self.head_dim
        if self.lm:  # embedding and an untied head; q, k, v (biased: Qwen2), o; SwiGLU; two RMS norms a layer
            kv = self.kv_heads * self.head_dim
            attn = d * inner + 2 * d * kv + inner * d + ((inner + 2 * kv) if self.qkv_bias else 0)
            tables = (1 if self.tied else 2) * self.vocab * d
            return tables + self.layers * (attn + 3 * d * f + 2 * d) + d + self.extra_params
        if self.t5:  # no biases; one shared embedding; RMS norms of d
            ffn = (3 if self.gated else 2) * d * f
            tables = (self.layers if self.cls == "UMT5EncoderModel" else 1) * self.buckets * self.heads
            return self.vocab * d + self.layers * (4 * d * inner + ffn + 2 * d) + tables + d
        per_layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d
        return (self.vocab + self.positions) * d + self.layers * per_layer + 2 * d

    @property
    def weight_bytes(self) -> int:
        """Its parameters in its dtype, and CLIP's position ids (an int64 buffer)."""
        return self.num_params * DTYPE_BYTES[self.dtype] + self.positions * INDEX

    def output_bytes(self, captions: int) -> int:
        """What it returns for ``captions``: the token embeddings (and CLIP's pooled vector)."""
        b = DTYPE_BYTES[self.dtype]
        if self.lm:
            return captions * self.tokens * self.width * self.layers_out * b
        return captions * self.tokens * self.width * b + (0 if self.t5 else captions * self.width * b)

    def encode_bytes(self, captions: int) -> int:
        """Working memory of one forward over ``captions`` captions at ``tokens`` tokens."""
        bsz, n, d, b = captions, self.tokens, self.width, DTYPE_BYTES[self.dtype]
        if not bsz:
            return 0
        ids = 2 * INDEX * bsz * n  # input ids and attention mask
        if self.t5:
            bias = self.heads * n * n * b + 2 * bsz * self.heads * n * n * b + bsz * n * n  # + the bool mask
            return ids + bias + bsz * n * (3 * self.heads * self.head_dim + 3 * d) * b
        if self.lm:  # every layer's hidden states kept (output_hidden_states), and one layer's MLP at a time
            return ids + bsz * n * ((self.layers + 1) * d + 3 * self.ffn + 4 * d) * b
        return ids + bsz * n * (3 * self.ffn + 4 * d) * b


# ---- VAEs -------------------------------------------------------------------------------------

VAE_CLASSES = ("AutoencoderKL", "AutoencoderKLFlux2", "AutoencoderKLWan", "AutoencoderKLQwenImage")
WAN_VAES = ("AutoencoderKLWan", "AutoencoderKLQwenImage")
"""Wan 2.1's causal video VAE, and Qwen-Image's, the same network under its own name."""
CACHE_FRAMES = 2
"""Frames a causal convolution of Wan's VAE keeps of its input (diffusers' ``CACHE_T``)."""


@dataclass(frozen=True, kw_only=True)
class VAEShape:
    """What the memory model needs of a VAE: ``AutoencoderKL`` (images, frame by frame) or
    ``AutoencoderKLWan`` (Wan 2.1's causal video VAE)."""

    cls: str
    latent_channels: int
    channels: tuple[int, ...]
    """AutoencoderKL: ``block_out_channels``; Wan: ``base_dim`` x ``dim_mult``."""
    layers_per_block: int
    in_channels: int = 3
    out_channels: int = 3
    temporal_down: tuple[bool, ...] = ()
    """Wan: ``temperal_downsample`` per down block."""
    quant_conv: bool = True
    post_quant_conv: bool = True
    dtype: str = "bf16"

    @classmethod
    def of(cls, spec: ArchSpec) -> VAEShape:
        get = spec.get
        if spec.cls in ("AutoencoderKL", "AutoencoderKLFlux2"):  # FLUX.2's: an AutoencoderKL and its patch statistics
            return cls(cls=spec.cls, latent_channels=get("latent_channels"),
                       channels=tuple(get("block_out_channels")), layers_per_block=get("layers_per_block"),
                       in_channels=get("in_channels"), out_channels=get("out_channels"),
                       quant_conv=bool(get("use_quant_conv")), post_quant_conv=bool(get("use_post_quant_conv")),
                       dtype=spec.dtype)
        if spec.cls in WAN_VAES:
            qwen = spec.cls == "AutoencoderKLQwenImage"  # no residual or patch keys; its channels one key
            if get("attn_scales") or (not qwen and (get("is_residual") or get("patch_size") is not None)):
                raise ValueError(f"{spec.cls}: only Wan 2.1's VAE (not residual, no attention scales, no "
                                 "patches) is modelled")
            base = get("base_dim")
            return cls(cls=spec.cls, latent_channels=get("z_dim"), channels=tuple(base * u for u in get("dim_mult")),
                       layers_per_block=get("num_res_blocks"),
                       in_channels=get("input_channels") if qwen else get("in_channels"),
                       out_channels=get("input_channels") if qwen else get("out_channels"),
                       temporal_down=tuple(get("temperal_downsample")), dtype=spec.dtype)
        raise ValueError(f"VAE {spec.cls}: not modelled; knapray's memory model knows {', '.join(VAE_CLASSES)}")

    @property
    def video(self) -> bool:
        return self.cls in WAN_VAES

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.channels) - 1)

    @property
    def temporal_downsample(self) -> int:
        return 2 ** sum(self.temporal_down)

    def frames(self, latent_frames: int) -> int:
        """Frames it decodes from ``latent_frames``."""
        return 1 + (latent_frames - 1) * self.temporal_downsample if self.video else latent_frames

    @property
    def num_params(self) -> int:
        return self._wan_params() if self.video else self._kl_params()

    @property
    def weight_bytes(self) -> int:
        """Its parameters in its dtype, and FLUX.2's batch statistics (running mean and variance
        per patchified channel, in its dtype, and the batch counter, an int64)."""
        stats = 2 * 4 * self.latent_channels * DTYPE_BYTES[self.dtype] + INDEX if self.cls == "AutoencoderKLFlux2" else 0
        return self.num_params * DTYPE_BYTES[self.dtype] + stats

    def _kl_params(self) -> int:
        def conv(i: int, o: int, k: int = 3) -> int:
            return i * o * k * k + o

        def resnet(i: int, o: int) -> int:
            return 2 * i + conv(i, o) + 2 * o + conv(o, o) + (conv(i, o, 1) if i != o else 0)

        def mid(c: int) -> int:
            return 2 * resnet(c, c) + 2 * c + 4 * (c * c + c)  # two ResNets, GroupNorm + q, k, v, out

        ch, n, lat = self.channels, self.layers_per_block, self.latent_channels
        enc = conv(self.in_channels, ch[0])
        prev = ch[0]
        for i, c in enumerate(ch):
            enc += resnet(prev, c) + (n - 1) * resnet(c, c) + (conv(c, c) if i < len(ch) - 1 else 0)
            prev = c
        enc += mid(ch[-1]) + 2 * ch[-1] + conv(ch[-1], 2 * lat)
        dec = conv(lat, ch[-1]) + mid(ch[-1])
        up = ch[::-1]
        prev = up[0]
        for i, c in enumerate(up):
            dec += resnet(prev, c) + n * resnet(c, c) + (conv(c, c) if i < len(up) - 1 else 0)
            prev = c
        dec += 2 * up[-1] + conv(up[-1], self.out_channels)
        quant = (conv(2 * lat, 2 * lat, 1) if self.quant_conv else 0) + (conv(lat, lat, 1) if self.post_quant_conv else 0)
        return enc + dec + quant

    def _wan_params(self) -> int:
        def conv3(i: int, o: int) -> int:  # causal 3x3x3
            return 27 * i * o + o

        def resnet(i: int, o: int) -> int:  # RMS norms (gamma only), two convs, a 1x1x1 shortcut
            return i + conv3(i, o) + o + conv3(o, o) + (i * o + o if i != o else 0)

        def mid(c: int) -> int:  # two ResNets and a single-head attention (norm, qkv, proj)
            return 2 * resnet(c, c) + c + (3 * c * c + 3 * c) + (c * c + c)

        ch, n, z = self.channels, self.layers_per_block, self.latent_channels
        enc_dims = [ch[0], *ch]
        enc = conv3(self.in_channels, enc_dims[0])
        for i, (a, o) in enumerate(zip(enc_dims[:-1], enc_dims[1:])):
            enc += resnet(a, o) + (n - 1) * resnet(o, o)
            if i < len(ch) - 1:
                enc += 9 * o * o + o + (3 * o * o + o if self.temporal_down[i] else 0)  # 2D conv (+ time conv)
        enc += mid(ch[-1]) + ch[-1] + conv3(ch[-1], 2 * z)
        dims = [ch[-1], *ch[::-1]]
        up_temporal = self.temporal_down[::-1]
        dec = conv3(z, dims[0]) + mid(dims[0])
        for i, (a, o) in enumerate(zip(dims[:-1], dims[1:])):
            a = a // 2 if i > 0 else a  # Wan 2.1: each upsampler halves the channels
            dec += resnet(a, o) + n * resnet(o, o)
            if i < len(ch) - 1:
                dec += 9 * o * (o // 2) + o // 2 + (3 * o * 2 * o + 2 * o if up_temporal[i] else 0)
        dec += dims[-1] + conv3(dims[-1], self.out_channels)
        return enc + dec + (4 * z * z + 2 * z) + (z * z + z)

    def decode_bytes(self, latent_frames: int, height: int, width: int) -> int:
        """Working memory of decoding one job's latent of ``latent_frames`` x ``height`` x
        ``width`` latent pixels: the latent un-normalized in fp32, its copy in the VAE's dtype
        (none in fp32), and the decoder's peak (module docstring)."""
        b = DTYPE_BYTES[self.dtype]
        latent = self.latent_channels * latent_frames * height * width
        inputs = latent * FP32 + (latent * b if b != FP32 else 0)
        post_quant = latent * b if self.post_quant_conv or self.video else 0
        pixels = height * width * self.downsample ** 2
        if not self.video:  # every frame a batch row; the last up block's first ResNet at full size
            return inputs + post_quant + latent_frames * 3 * self.channels[1] * pixels * b
        return inputs + post_quant + self._wan_decode(latent_frames, height, width) * b

    def _wan_caches(self, latent_pixels: int, frames: int = 2) -> int:
        """Values the causal convolutions keep of their inputs between chunks: the last
        ``frames`` frames of every 3x3x3 convolution's input, and from the second chunk on
        (``frames`` 2) the temporal upsamplers' too."""
        ch, n, z = self.channels, self.layers_per_block, self.latent_channels
        dims = [ch[-1], *ch[::-1]]
        up_temporal = self.temporal_down[::-1]
        px = latent_pixels
        per_frame = z * px + 4 * dims[0] * px  # conv_in; the middle block's two ResNets
        for i, (a, o) in enumerate(zip(dims[:-1], dims[1:])):
            a = a // 2 if i > 0 else a
            per_frame += (a + o + 2 * n * o) * px  # each ResNet: its two convolutions' inputs
            if i < len(ch) - 1:
                if up_temporal[i] and frames == CACHE_FRAMES:
                    per_frame += o * px
                px *= 4
        per_frame += dims[-1] * px  # conv_out
        return frames * per_frame

    def _wan_decode(self, latent_frames: int, height: int, width: int) -> int:
        """Values alive at the decoder's peak beyond its input (module docstring)."""
        pixels = height * width * self.downsample ** 2
        pad = (height * self.downsample + 2) * (width * self.downsample + 2)  # a 3x3 convolution's padded input
        c = self.channels[0]  # the last up block's width
        if latent_frames == 1:  # a first chunk: one frame cached, the convolution pads two zero frames
            return self._wan_caches(height * width, 1) + 3 * c * pixels + 3 * c * pad
        chunk = self.temporal_downsample
        # the up block's input, the ResNet's input, its SiLU; the new cache; cache ++ chunk, padded
        live = 3 * chunk * c * pixels + CACHE_FRAMES * c * pixels + (CACHE_FRAMES + chunk) * c * (pixels + pad)
        done = self.out_channels * (self.frames(latent_frames) - chunk) * pixels
        return self._wan_caches(height * width) + live + done


# ---- a rank's part of a batch -----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SampleJob:
    """One request as the memory model sees it."""

    latent: tuple[int, int, int]
    """(frames, height, width) of its latent, in latent pixels."""
    image_tokens: int
    text_tokens: int
    """Of each pass (the unconditional pass counted at the same length: a negative prompt may be as long)."""
    passes: int = 1
    """2 with classifier-free guidance."""

    def __post_init__(self) -> None:
        if self.passes not in (1, 2):
            raise ValueError(f"passes must be 1 or 2, got {self.passes!r}")
        if self.image_tokens < 1 or self.text_tokens < 0 or min(self.latent) < 1:
            raise ValueError(f"a job needs image tokens and a latent, got {self}")

    @property
    def tokens(self) -> int:
        return self.image_tokens + self.text_tokens


@dataclass(frozen=True)
class BagStep:
    """One denoising step of a bag: its passes as the lead packs them and the plan the bag runs."""

    bag: int
    jobs: tuple[int, ...]
    pass_jobs: tuple[int, ...]
    """The job of every pass."""
    kinds: tuple[int, ...]
    """COND / UNCOND / SINGLE per pass (``planning.inference.sampling``)."""
    lens: tuple[int, ...]
    text: tuple[int, ...]
    """Text tokens of every pass."""
    halves: bool
    """CFG parallel: conditional passes on one half of the bag, unconditional on the other."""
    plan: Any
    """The step's ``BalancePlan`` (``bag_plan``)."""


def bag_steps(topology: Topology, jobs: list[SampleJob], cfg_parallel: bool = True) -> list[BagStep]:
    """Every bag's first step: the batch's jobs planned over the bags (``plan_jobs``), then each
    bag's passes (conditional ones first) as one ``bag_plan``. Bags without jobs are left out."""
    assign = plan_jobs([j.tokens for j in jobs], [1] * len(jobs), [j.passes for j in jobs], topology)
    out = []
    for bag in range(topology.num_bags):
        mine = [int(k) for k in assign.jobs_of(bag)]
        if not mine:
            continue
        passes = [(k, COND if jobs[k].passes == 2 else SINGLE) for k in mine]
        passes += [(k, UNCOND) for k in mine if jobs[k].passes == 2]
        g = int(topology.bag_sizes[bag])
        halves = cfg_parallel_bag(g, any(jobs[k].passes == 2 for k in mine), cfg_parallel)
        lens = tuple(jobs[k].tokens for k, _ in passes)
        kinds = tuple(kind for _, kind in passes)
        out.append(BagStep(bag, tuple(mine), tuple(k for k, _ in passes), kinds, lens,
                           tuple(jobs[k].text_tokens for k, _ in passes), halves,
                           bag_plan(topology, bag, lens, kinds, halves)))
    return out


@dataclass(frozen=True, kw_only=True)
class RankRole:
    """What one rank of a sampling gang does in a batch (``rank_role``)."""

    rank: int
    encodes: bool
    """Rank 0: the text encoders encode the batch's captions here."""
    captions: int = 0
    lead: bool = False
    """The first rank of a bag with jobs: latents, the packed batch, the VAE."""
    bag_size: int = 1
    attention_ranks: int = 1
    """Ranks of its attention group (a CFG-parallel half, or the bag)."""
    home_image: int = 0
    home_text: int = 0
    home_sequences: int = 0
    routed_image: int = 0
    routed_text: int = 0
    latents: tuple[tuple[int, int, int], ...] = ()
    """A lead: its bag's jobs' latents (frames, height, width)."""
    image_tokens: tuple[int, ...] = ()
    """A lead: its bag's jobs' image tokens."""
    guided_image: int = 0
    """A lead: the image tokens of its bag's guided jobs (their latents feed two passes)."""

    @property
    def routed(self) -> int:
        return self.routed_image + self.routed_text

    @property
    def home(self) -> int:
        return self.home_image + self.home_text


def rank_role(topology: Topology, rank: int, jobs: list[SampleJob], cfg_parallel: bool = True,
              steps: list[BagStep] | None = None) -> RankRole:
    """``rank``'s role in sampling ``jobs`` on ``topology`` (its bag's first step: every job
    active, the step of most tokens)."""
    if not 0 <= rank < topology.world_size:
        raise ValueError(f"rank {rank} is not in a world of {topology.world_size}")
    steps = bag_steps(topology, jobs, cfg_parallel) if steps is None else steps
    bag = int(topology.bag_of_rank[rank])
    base = RankRole(rank=rank, encodes=rank == 0, captions=len(jobs) if rank == 0 else 0,
                    bag_size=int(topology.bag_sizes[bag]))
    step = next((s for s in steps if s.bag == bag), None)
    if step is None:
        return base
    plan = step.plan
    recv = plan.recv_chunks(rank)
    text = np.asarray(step.text, dtype=np.int64)[plan.chunk_seq[recv]]
    routed_text = int(np.clip(text - plan.chunk_start[recv], 0, plan.chunk_len[recv]).sum())
    routed = int(plan.chunk_len[recv].sum())
    lead = rank == int(topology.bag_starts[bag])
    fields_ = dict(rank=rank, encodes=base.encodes, captions=base.captions, bag_size=base.bag_size,
                   attention_ranks=base.bag_size // 2 if step.halves else base.bag_size,
                   routed_image=routed - routed_text, routed_text=routed_text)
    if lead:
        fields_.update(lead=True, home_text=sum(step.text), home_image=sum(step.lens) - sum(step.text),
                       home_sequences=len(step.lens), latents=tuple(jobs[k].latent for k in step.jobs),
                       image_tokens=tuple(jobs[k].image_tokens for k in step.jobs),
                       guided_image=sum(jobs[k].image_tokens for k in step.pass_jobs[len(step.jobs):]))
    return RankRole(**fields_)


# ---- the model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseBytes:
    """One phase's bytes by category (``CATEGORIES``)."""

    phase: str
    transformer: int = 0
    encoders: int = 0
    vae: int = 0
    latents: int = 0
    working: int = 0

    @property
    def weights(self) -> int:
        return self.transformer + self.encoders + self.vae

    @property
    def total(self) -> int:
        return self.weights + self.latents + self.working

    def to_gib(self) -> dict[str, float]:
        out = {c: getattr(self, c) / GIB for c in CATEGORIES}
        out["total"] = self.total / GIB
        return out


@dataclass(frozen=True)
class SamplingBreakdown:
    """A rank's bytes in each phase it runs; ``total`` is the largest."""

    phases: tuple[PhaseBytes, ...]

    def phase(self, name: str) -> PhaseBytes | None:
        return next((p for p in self.phases if p.phase == name), None)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: p.total).phase

    @property
    def total(self) -> int:
        return max(p.total for p in self.phases)


@dataclass(frozen=True, kw_only=True)
class SamplingMemoryModel:
    """Per-GPU memory of a sampling gang: the transformer's shape, the family's encoders and
    VAE, the placement and the encoders' policy (the module docstring says what is counted)."""

    shape: ModelShape
    text_encoders: tuple[TextEncoderShape, ...] = ()
    vae: VAEShape | None = None
    text_dim: int = 0
    pooled_dim: int = 0
    placement: str = "replicated"
    encoders: str = "keep"
    adapter_params: int = 0
    """A LoRA run's adapters, held in the compute dtype beside the base."""
    experts: int = 1
    """Transformers held: 2 for a run of two experts (both resident, each with its adapters)."""
    reserve_bytes: int = RESERVE_BYTES
    fragmentation: float = FRAGMENTATION

    def __post_init__(self) -> None:
        if not isinstance(self.shape, ModelShape):
            object.__setattr__(self, "shape", ModelShape.of(self.shape))
        for name, valid in (("placement", PLACEMENTS), ("encoders", ENCODER_POLICIES)):
            if getattr(self, name) not in valid:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; valid: {', '.join(valid)}")
        if not 0 <= self.fragmentation < 1 or self.reserve_bytes < 0:
            raise ValueError("need 0 <= fragmentation < 1 and reserve_bytes >= 0")
        if self.experts not in (1, 2):
            raise ValueError(f"experts: 1 (one model) or 2 (two experts), got {self.experts!r}")

    @classmethod
    def of(cls, model_cfg: Any, text_models: tuple[ArchSpec, ...] = (), vae: ArchSpec | None = None,
           **kwargs: Any) -> SamplingMemoryModel:
        """From a model config (``ModelShape.of``) and the specs its family declares."""
        return cls(shape=ModelShape.of(model_cfg), text_encoders=tuple(TextEncoderShape.of(s) for s in text_models),
                   vae=VAEShape.of(vae) if vae is not None else None, text_dim=int(getattr(model_cfg, "text_dim", 0)),
                   pooled_dim=int(getattr(model_cfg, "pooled_dim", 0)), **kwargs)

    # ---- weights ----------------------------------------------------------------------------

    @property
    def final_params(self) -> int:
        """The final layer's parameters (fp32 on a GPU): its modulation and output projection
        (Flux), or its shift/scale table and output projection (Wan)."""
        s = self.shape
        bias = 1 if s.biases else 0
        out = s.hidden_size * s.head_width + bias * s.head_width
        return out + (2 * s.hidden_size if s.cross_attention else 2 * s.hidden_size * (s.hidden_size + bias))

    def transformer_bytes(self, bag_size: int = 1) -> int:
        """The transformers' weights on a rank (``experts`` of them), bf16 and each final layer
        fp32: whole (replicated), or a ``bag_size``-th of them plus the largest unit gathered
        (bag-sharded: one unit of one model at a time)."""
        s = self.shape
        one = (s.num_params + self.adapter_params) * COMPUTE_BYTES + self.final_params * (STREAM_BYTES - COMPUTE_BYTES)
        total = self.experts * one
        if self.placement == "replicated" or bag_size == 1:
            return total
        largest = max(sum(s.double_block[:2]) if s.depth_double else 0,
                      sum(s.single_block[:2]) if s.depth_single else 0, sum(s.root[:2]))
        return -(-total // bag_size) + largest * COMPUTE_BYTES

    @property
    def encoder_bytes(self) -> int:
        return sum(e.weight_bytes for e in self.text_encoders)

    @property
    def vae_bytes(self) -> int:
        return self.vae.weight_bytes if self.vae is not None else 0

    # ---- working memory ---------------------------------------------------------------------

    def encode_bytes(self, captions: int) -> int:
        """Rank 0 encoding ``captions``: each encoder in turn, beside what the earlier returned."""
        out, kept = 0, 0
        for enc in self.text_encoders:
            out = max(out, kept + enc.encode_bytes(captions))
            kept += enc.output_bytes(captions)
        return max(out, kept)

    def latents_bytes(self, role: RankRole) -> int:
        """The step's inputs on a rank: a lead's jobs' latents (fp32), the segment's packed
        batch (fp32 latents and text rows, positions, indices, per-sequence values) and, with
        guided jobs, the passes' latents (their rows repeated) and the guided rows' indices and
        scales; every rank's step layout (int64 index maps of its home and routed tokens and
        of its attention group's sequences)."""
        s = self.shape
        per_seq = FP32 + FP32 * self.pooled_dim + INDEX + FP32 + FP32  # timestep, pooled, length, cu_seqlens, guidance
        out = (FP32 * s.patch_dim * (sum(role.image_tokens) + role.home_image) + FP32 * self.text_dim * role.home_text
               + role.home * (1 + ROUTE_POS + INDEX) + role.home_sequences * per_seq)
        if role.guided_image:
            out += FP32 * s.patch_dim * role.home_image + role.guided_image * (INDEX + FP32)
        group = role.routed * role.attention_ranks
        return out + INDEX * (4 * role.home + 5 * role.routed + 2 * group) + role.routed

    def denoise_bytes(self, role: RankRole) -> int:
        """The forward's peak beyond weights and batch: the largest of the blocks and the head."""
        s, b, f = self.shape, COMPUTE_BYTES, STREAM_BYTES
        d, m, hd = s.hidden_size, s.mlp_hidden, s.head_dim
        ni, nt, n = role.routed_image, role.routed_text, role.routed
        if not n and not role.home:
            return 0
        home_h = role.home * d * f  # the embedding, widened to the stream's dtype
        route = n * (d * f + ROUTE_POS) if role.bag_size > 1 else 0
        rope = 4 * hd  # fp32 cos and sin of D/2 frequencies
        if s.cross_attention:
            text_rows = (role.home_text + 1) * d * b  # the text MLP's output and its padding row
            block = ni * (13 * FP32 * d + 5 * b * d + rope) + (2 * nt + 1) * d * f
            blocks = home_h + text_rows + route + block
            head = role.home_image * (6 * FP32 * d + d * f) + text_rows
        else:
            double = ni * ((12 * d + 2 * m) * b + 3 * d * f) + nt * (12 * d * b + 2 * d * f) + n * (4 * d * b + rope) \
                if s.depth_double else 0
            single = n * ((10 * d + 3 * m) * b + (2 if s.depth_double else 1) * d * f + rope) if s.depth_single else 0
            blocks = home_h + route + max(double, single)
            head = role.home_image * 6 * d * FP32  # the final layer in fp32
        # the head at home: the embedding, the blocks' output home again (and the routed one, and
        # the routing buffer, in a bag of more ranks)
        head += 2 * home_h + (n * d * f + route if role.bag_size > 1 else 0)
        return max(blocks, head if role.lead else 0)

    def decode_bytes(self, role: RankRole) -> int:
        if self.vae is None or not role.latents:
            return 0
        return max(self.vae.decode_bytes(*latent) for latent in role.latents)

    # ---- phases -----------------------------------------------------------------------------

    def breakdown(self, role: RankRole) -> SamplingBreakdown:
        """``role``'s bytes in each phase it runs (module docstring)."""
        t = self.transformer_bytes(role.bag_size)
        vae = self.vae_bytes if role.lead else 0
        keep = self.encoder_bytes if role.encodes and self.encoders == "keep" else 0
        phases = []
        if role.encodes and self.text_encoders:
            phases.append(PhaseBytes("encode", transformer=0 if self.encoders == "free" else t,
                                     encoders=self.encoder_bytes, vae=vae, working=self.encode_bytes(role.captions)))
        phases.append(PhaseBytes("denoise", transformer=t, encoders=keep, vae=vae,
                                 latents=self.latents_bytes(role) if role.routed or role.lead else 0,
                                 working=self.denoise_bytes(role)))
        if role.lead and self.vae is not None:
            # the engine hands the latents to the host before decoding (one job's comes back)
            phases.append(PhaseBytes("decode", transformer=t, encoders=keep, vae=vae, working=self.decode_bytes(role)))
        return SamplingBreakdown(tuple(phases))

    def usable_bytes(self, gpu_bytes: int) -> int:
        """What sampling may use of a GPU: the training model's reserve and fragmentation."""
        return max(0, int((gpu_bytes - self.reserve_bytes) * (1 - self.fragmentation)))

    def fits(self, role: RankRole, gpu_bytes: int) -> bool:
        return self.breakdown(role).total <= self.usable_bytes(gpu_bytes)

    def gpu_gib_needed(self, role: RankRole) -> float:
        """The smallest GPU (GiB, to a tenth) whose usable bytes hold ``role``'s peak."""
        need = self.breakdown(role).total / (1 - self.fragmentation) + self.reserve_bytes
        return math.ceil(need / GIB * 10) / 10


@dataclass(frozen=True)
class Alternative:
    """A placement and encoders' policy that fits, and the largest rank's peak under it."""

    placement: str
    encoders: str
    peak: int
    rank: int


def alternatives(model: SamplingMemoryModel, roles: list[RankRole], gpu_bytes: int) -> list[Alternative]:
    """Every (placement, encoders) whose every rank fits ``gpu_bytes``, least sharding and
    most encoders resident first (the ones that cost the least speed)."""
    out = []
    for placement in PLACEMENTS:
        for policy in ENCODER_POLICIES:
            m = replace(model, placement=placement, encoders=policy)
            peaks = [(m.breakdown(r).total, r.rank) for r in roles]
            peak, rank = max(peaks)
            if peak <= m.usable_bytes(gpu_bytes):
                out.append(Alternative(placement, policy, peak, rank))
    return out
