"""Typed, validated configuration of the packed DiTs: ``DiTConfig``, the fields every
family's model section has, and ``MMDiTConfig``, knapray's own MMDiT (the ``mmdit`` family;
Flux.1's config is one). The other families' configs live with them (knapray/models/families),
which map family names to config classes; this module knows no family but its own."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, ClassVar

from knapray.limits import MAX_MODEL_DEPTH, MAX_MODEL_WIDTH


PIPELINE_EXPAND_TIMESTEPS = "_pipeline_expand_timesteps"
"""The config key under which a pipeline folder's model_index.json ``expand_timesteps`` (Wan
2.2 TI2V-5B: a time per token, a fact of the pipeline, not of the transformer's config.json)
reaches a family's ``section_from_diffusers`` beside config.json's values (a leading ``_``:
never a config.json key; ``knapray.weights.source.open_pretrained`` puts it there)."""


LORA_INITS = ("gaussian", "kaiming")
LORA_BASE_DTYPES = ("compute", "fp8")


@dataclasses.dataclass(kw_only=True, slots=True)
class LoraConfig:
    """``model.lora``: rank 0 (the default) trains every weight; a rank trains adapters only."""

    rank: int = dataclasses.field(default=0, metadata={"ge": 0, "le": 4096})
    """Adapter rank r (0: no adapters, full fine-tuning)."""
    alpha: float = dataclasses.field(default=0.0, metadata={"ge": 0, "le": 1e6})
    """Scale numerator: the adapter adds (alpha / r) B A x; 0 means alpha = r (scale 1)."""
    dropout: float = dataclasses.field(default=0.0, metadata={"ge": 0, "lt": 1})
    """Dropout on the adapter's input (training only)."""
    targets: tuple[str, ...] = ("attention",)
    """Preset names of the family (``attention``: its attention projections, as diffusers'
    LoRA scripts default to; ``all-linear``: every linear layer of the blocks) or regular
    expressions matched in full against module names (``double_blocks\\.\\d+\\.img\\.qkv``)."""
    init: str = dataclasses.field(default="gaussian", metadata={"choices": LORA_INITS})
    """``lora_A``'s initial values: ``gaussian`` N(0, 1/r) (peft's ``gaussian``) or
    ``kaiming`` (uniform, as nn.Linear's weights); ``lora_B`` starts at zero either way."""
    base_dtype: str = dataclasses.field(default="compute", metadata={"choices": LORA_BASE_DTYPES})
    """How the frozen base is held: ``compute`` (its matrices in the run's compute dtype) or
    ``fp8`` (the linear layers of its blocks in float8 e4m3 with a power-of-two scale per
    output channel, turned back into bf16 inside each matrix product: half the base's memory;
    needs ``model.pretrained`` and ``parallel.precision: bf16``; knapray/models/fp8.py)."""

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora.rank must be an int >= 0, got {self.rank!r}")
        if not (0 <= self.alpha and math.isfinite(self.alpha)):
            raise ValueError(f"lora.alpha must be a finite number >= 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if self.base_dtype not in LORA_BASE_DTYPES:
            raise ValueError(f"lora.base_dtype must be one of {list(LORA_BASE_DTYPES)}, got {self.base_dtype!r}")
        if self.init not in LORA_INITS:
            raise ValueError(f"lora.init must be one of {list(LORA_INITS)}, got {self.init!r}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"lora.targets must be preset names or regular expressions, got {self.targets!r}")
        for t in self.targets:
            try:
                re.compile(t)
            except re.error as e:
                raise ValueError(f"lora.targets: {t!r} is not a regular expression ({e})") from None

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank (1 when alpha is 0)."""
        return (self.alpha or self.rank) / self.rank if self.rank else 0.0



@dataclasses.dataclass(kw_only=True, slots=True)
class DiTConfig:
    """Architecture of a packed-sequence DiT: the fields every family's model section has
    (a family's config class adds its own and fixes some of these). Not built itself: each
    family's config class sets ``family`` (``knapray.models.families.config_class``).

    Field ``metadata`` holds the bounds a run config checks at load with the field's dotted
    key (knapray/config/run.py); ``__post_init__`` checks them again, and the rules that
    relate fields, for a config built in code.
    """

    attention_kind: ClassVar[str] = "joint"
    """How the blocks attend to the text: ``joint`` (text and image tokens of a sequence in
    one attention) or ``cross`` (image tokens cross-attend to the text: Wan). What the
    balance planner's cost model and the memory model price."""
    rope_axes: ClassVar[int] = 3
    """Coordinates a token's RoPE id has (``rope_axes_dim``'s length): 3, (t, h, w), or a
    family's own (FLUX.2: 4, (t, h, w, l), its text tokens along l)."""
    gated_mlp: ClassVar[bool] = False
    """The blocks' MLPs are SwiGLU (FLUX.2's: three ``d x mlp_hidden`` matrices, no biases)
    rather than two matrices around a GELU: what model FLOPs and the memory model count."""
    linear_bias: ClassVar[bool] = True
    """Every linear layer has a bias (FLUX.2's have none): what the memory model counts."""
    shared_modulation: ClassVar[bool] = False
    """One modulation per kind of block for the whole model (FLUX.2's: the image stream's and
    the text stream's 6·d, the single blocks' 3·d), gathered per token once per step, rather
    than one in every block: what the memory model counts."""
    text_norm: ClassVar[bool] = False
    """The text features pass an RMSNorm with a gain before ``txt_in`` (Qwen-Image's ``txt_norm``)."""

    in_channels: int = dataclasses.field(default=4, metadata={"ge": 1, "le": MAX_MODEL_WIDTH})
    """Channels of the latent (C in (C, T, H, W))."""
    patch_size: tuple[int, int, int] = dataclasses.field(default=(1, 2, 2), metadata={"ge": 1, "le": 64})
    """Patch extent along (t, h, w); one image token per patch."""
    hidden_size: int = dataclasses.field(default=64, metadata={"ge": 1, "le": MAX_MODEL_WIDTH})
    """Model width d."""
    num_heads: int = dataclasses.field(default=4, metadata={"ge": 1, "le": MAX_MODEL_DEPTH})
    """Attention heads; head_dim = hidden_size / num_heads."""
    depth_double: int = dataclasses.field(default=2, metadata={"ge": 0, "le": MAX_MODEL_DEPTH})
    """Double-stream blocks (separate text / image weights, joint attention); 0 in a family
    without them (Wan)."""
    depth_single: int = dataclasses.field(default=2, metadata={"ge": 0, "le": MAX_MODEL_DEPTH})
    """Single-stream blocks (shared weights over all tokens)."""
    mlp_ratio: float = dataclasses.field(default=4.0, metadata={"gt": 0, "le": 64})
    """MLP hidden width as a multiple of hidden_size."""
    text_dim: int = dataclasses.field(default=32, metadata={"ge": 0, "le": MAX_MODEL_WIDTH})
    """Width of incoming text-encoder token features; 0 means the model takes no text tokens."""
    pooled_dim: int = dataclasses.field(default=32, metadata={"ge": 0, "le": MAX_MODEL_WIDTH})
    """Width of the pooled conditioning vector per sequence; 0 means none (timestep only)."""
    rope_axes_dim: tuple[int, ...] = dataclasses.field(default=(4, 6, 6), metadata={"ge": 0})
    """Head channels rotated by the t, h, w coordinates (``rope_axes`` of them); each even,
    summing to head_dim."""
    rope_theta: float = dataclasses.field(default=10000.0, metadata={"gt": 0})
    """RoPE base period."""
    qk_norm: bool = True
    """RMS-normalize q and k per head before RoPE (stabilizes attention logits)."""
    family: str
    """Model family (knapray/models/families): ``mmdit`` (knapray's own MMDiT), ``flux``
    (Flux.1, exact against diffusers' FluxTransformer2DModel; its config adds
    ``guidance_embeds``) or ``wan`` (Wan 2.1 T2V). Each family's config class has its own as
    the default, and only that one."""
    pretrained: str = ""
    """A checkpoint directory to start from ("": random init): a diffusers-layout
    transformer (config.json + safetensors, sharded or not) or a BFL single file. Its
    config.json sets the architecture fields this section leaves out (knapray/weights)."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """LoRA adapters (``rank`` > 0): the base frozen, only adapters trained (knapray/models/lora.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            self.lora = LoraConfig(**self.lora)
        own = type(self).__dataclass_fields__["family"].default
        if own is dataclasses.MISSING:
            raise TypeError(f"{type(self).__name__} is the base of the families' configs: build a family's with "
                            "knapray.models.families.config_class(family)")
        if own != self.family:
            raise ValueError(f"family {self.family!r} is not {type(self).__name__}'s ({own!r}): build a family's "
                             "config with knapray.models.families.config_class(family)")
        self.patch_size = tuple(self.patch_size)
        self.rope_axes_dim = tuple(self.rope_axes_dim)
        for name in ("in_channels", "hidden_size", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("depth_double", "depth_single", "text_dim", "pooled_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.depth_double + self.depth_single < 1:
            raise ValueError(
                f"need at least one block, got depth_double={self.depth_double}, depth_single={self.depth_single}"
            )
        if len(self.patch_size) != 3 or any(not isinstance(p, int) or p < 1 for p in self.patch_size):
            raise ValueError(f"patch_size must be 3 positive ints (t, h, w), got {self.patch_size!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        if not (self.mlp_ratio > 0 and math.isfinite(self.mlp_ratio)):
            raise ValueError(f"mlp_ratio must be a positive number, got {self.mlp_ratio!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        axes = self.rope_axes_dim
        if len(axes) != self.rope_axes or any(not isinstance(a, int) or a < 0 or a % 2 for a in axes):
            names = "t, h, w" if self.rope_axes == 3 else "t, h, w, l"
            raise ValueError(f"rope_axes_dim must be {self.rope_axes} non-negative even ints ({names}), got {axes!r}")
        if sum(axes) != self.head_dim:
            raise ValueError(
                f"rope_axes_dim {axes!r} sums to {sum(axes)}, must equal head_dim="
                f"hidden_size/num_heads={self.head_dim}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Features per image token: in_channels * pt * ph * pw."""
        pt, ph, pw = self.patch_size
        return self.in_channels * pt * ph * pw

    @property
    def out_patch_dim(self) -> int:
        """Features per image token of the model's output (the head's width): ``patch_dim``,
        unless the family outputs fewer channels than it takes (Wan 2.1 I2V: 16 of 36)."""
        return self.patch_dim

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def condition_dim(self) -> int:
        """Width of the per-sequence vector ``condition`` returns (the blocks' ``vec_seq``)."""
        return self.hidden_size

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DiTConfig:
        """Build from a plain mapping (e.g. YAML); unknown keys raise, naming the valid ones."""
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys {unknown}; valid: {valid}")
        return cls(**values)


@dataclasses.dataclass(kw_only=True, slots=True)
class MMDiTConfig(DiTConfig):
    """Architecture of knapray's Flux-style MMDiT (the ``mmdit`` family): double-stream
    blocks, then single-stream blocks. ``depth_double=0`` gives a plain single-stream DiT."""

    family: str = "mmdit"


def dit_config(**overrides: Any) -> MMDiTConfig:
    """A plain DiT: single-stream blocks only, no text tokens (conditioned on timestep + pooled)."""
    values: dict[str, Any] = {"depth_double": 0, "depth_single": 4, "text_dim": 0}
    values.update(overrides)
    return MMDiTConfig.from_dict(values)
