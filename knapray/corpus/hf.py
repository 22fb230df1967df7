"""Encoders people use, from local directories: diffusers VAEs, transformers T5 and CLIP.

Everything loads with ``local_files_only=True``: nothing is downloaded at run time, and a
missing directory is a one-line error naming it. diffusers and transformers are an
optional extra (``pip install 'knapray[encoders]'``), imported only when an adapter is
built. The ``*_info`` functions read ``config.json`` alone (no weights, no extra
packages), so a driver learns dims and records without loading a model.

Latent normalization, the one each model's diffusers pipeline applies before the DiT:
``latent = (z - shift) / std * scaling_factor`` with ``z`` the posterior **mean**, and
- ``shift``/``std`` the per-channel ``latents_mean``/``latents_std`` when the config has
  both (Wan, some AutoencoderKL), else ``shift = shift_factor`` (Flux, SD3; 0 when absent)
  and ``std = 1``;
- ``scaling_factor`` from the config, 1 when absent (Wan).
The mean, not a sample, so a corpus is reproducible byte for byte; a trainer that wants
posterior noise would need the log-variance too, and for the VAEs above the posterior
standard deviation is small next to the spread of the means.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import importlib
import json
import re
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from knapray.quiet_imports import load_torchao_quietly

IMAGE_VAES = ("AutoencoderKL", "AutoencoderKLFlux2")
VIDEO_VAES = ("AutoencoderKLWan", "AutoencoderKLHunyuanVideo", "AutoencoderKLQwenImage")
T5_TYPES = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel"}
CLIP_TYPE = "clip_text_model"
LM_TYPES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "mistral3": "Mistral3ForConditionalGeneration"}
"""Causal language models whose hidden states are a pipeline's text (Qwen-Image's
Qwen2.5-VL, FLUX.2's Mistral Small 3.1), read through the family's ``PromptFormat``."""
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16", "fp16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.json")
_VERSION_KEYS = ("_diffusers_version", "transformers_version", "_name_or_path", "_commit_hash", "dtype",
                 "torch_dtype")


def _import(name: str) -> Any:
    load_torchao_quietly()  # transformers' and diffusers' quantizers import it where installed
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            f"the VAE/T5/CLIP adapters need {name}, which is not importable here: "
            "pip install 'knapray[encoders]'"
        ) from e


def model_dir(path: str | Path, flag: str) -> Path:
    """``path`` as a directory holding a config.json; one-line errors naming ``flag``."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{flag} {path}: no such directory")
    if not (p / "config.json").is_file() and (p / "model_index.json").is_file():
        raise FileNotFoundError(
            f"{flag} {path}: a pipeline directory (model_index.json); pass the model's sub folder "
            "(vae/, text_encoder/, text_encoder_2/, ...)"
        )
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{flag} {path}: no config.json (expected a model directory written by save_pretrained)"
        )
    return p.resolve()


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def config_sha256(cfg: dict[str, Any]) -> str:
    """Hash of the model's config without library versions and dtype, so the same
    architecture and factors give the same hash whichever version saved it."""
    kept = {k: v for k, v in cfg.items() if k not in _VERSION_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {DEVICES}")
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device here")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """'auto' -> bf16 on a GPU, fp32 on the CPU (bf16 matmuls are slow there)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    if dtype == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return dtype


def torch_dtype(dtype: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


# --- VAEs -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VAEInfo:
    path: str
    cls: str
    """diffusers class named by the config's ``_class_name``."""
    channels: int
    downsample: int
    """Spatial factor: pixels per latent cell along H and W."""
    temporal_downsample: int
    """Frames per latent frame after the first; 1 for an image VAE (frames encoded one
    by one)."""
    scaling_factor: float
    shift: tuple[float, ...]
    """Subtracted before scaling: one value for all channels, or one per channel."""
    std: tuple[float, ...]
    """Divided by before scaling: one value, or one per channel."""
    config_sha256: str
    patch_norm: bool = False
    """Normalized as FLUX.2's pipeline normalizes: each channel of each position in a 2x2
    patch by the VAE's batch statistics (its weights' ``bn.running_mean``/``running_var``,
    ``batch_norm_eps``), not by ``shift``/``std``."""

    def record(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "class": self.cls,
            "config_sha256": self.config_sha256,
            "channels": self.channels,
            "downsample": self.downsample,
            "temporal_downsample": self.temporal_downsample,
            "latent": "posterior mean",
            "normalization": ("(z - bn.running_mean) / sqrt(bn.running_var + eps) per channel of each 2x2 patch "
                              "position" if self.patch_norm else "(z - shift) / std * scaling_factor"),
            "scaling_factor": self.scaling_factor,
            "shift": list(self.shift),
            "std": list(self.std),
        }


def vae_info(path: str | Path, flag: str = "--vae") -> VAEInfo:
    """Channels, compression and normalization of a diffusers VAE, from its config."""
    d = model_dir(path, flag)
    cfg = read_config(d)
    cls = cfg.get("_class_name")
    try:
        if cls in IMAGE_VAES:  # FLUX.2's normalizes by its batch statistics (``patch_norm``)
            channels = cfg["latent_channels"]
            downsample = 2 ** (len(cfg["block_out_channels"]) - 1)
            temporal = 1
        elif cls in ("AutoencoderKLWan", "AutoencoderKLQwenImage"):  # Qwen-Image's is Wan 2.1's, an image a 1-frame clip
            channels = cfg["z_dim"]
            downsample = 2 ** (len(cfg["dim_mult"]) - 1) * (cfg.get("patch_size") or 1)
            temporal = 2 ** sum(bool(t) for t in cfg["temperal_downsample"])
        elif cls == "AutoencoderKLHunyuanVideo":
            channels = cfg["latent_channels"]
            downsample = cfg["spatial_compression_ratio"]
            temporal = cfg["temporal_compression_ratio"]
        else:
            raise ValueError(
                f"{flag} {path}: _class_name {cls!r} is not a supported VAE; "
                f"supported: {IMAGE_VAES + VIDEO_VAES}"
            )
    except KeyError as e:
        raise ValueError(f"{flag} {path}: {cls} config lacks {e.args[0]!r}") from None
    mean, std = cfg.get("latents_mean"), cfg.get("latents_std")
    if cls == "AutoencoderKLFlux2":
        if tuple(cfg.get("patch_size") or (2, 2)) != (2, 2):
            raise ValueError(f"{flag} {path}: patch_size {cfg.get('patch_size')!r}; FLUX.2's VAE normalizes 2x2 patches")
        shift, scale = (0.0,), (1.0,)  # its normalization is patch_norm's, from the weights
    elif mean and std:
        if len(mean) != channels or len(std) != channels:
            raise ValueError(
                f"{flag} {path}: latents_mean/latents_std have {len(mean)}/{len(std)} values "
                f"for {channels} channels"
            )
        shift, scale = tuple(float(v) for v in mean), tuple(float(v) for v in std)
    else:
        shift, scale = (float(cfg.get("shift_factor") or 0.0),), (1.0,)
    return VAEInfo(
        path=str(d), cls=cls, channels=int(channels), downsample=int(downsample),
        temporal_downsample=int(temporal),
        scaling_factor=1.0 if cls == "AutoencoderKLFlux2" else float(cfg.get("scaling_factor") or 1.0),
        shift=shift, std=scale, config_sha256=config_sha256(cfg), patch_norm=cls == "AutoencoderKLFlux2",
    )


def kept_frames(frames: int, temporal: int) -> int:
    """Frames a causal video VAE encodes whole: the first, then groups of ``temporal``."""
    return 1 + (frames - 1) // temporal * temporal


_MODEL_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def model_lock(model: Any) -> threading.Lock:
    """One lock per VAE model: a video VAE is not reentrant. diffusers' ``AutoencoderKLWan``
    keeps its causal convolutions' caches on the module (``clear_cache`` at the start of every
    encode and decode, then one latent frame at a time through them), so an encode that starts
    while a decode runs empties the decode's caches: its next latent frame decodes as a first
    frame (1 frame, not 4), and a 9-frame clip came back with 6. A serving rank does both at
    once (a request's conditioning image encoded while another's latent decodes)."""
    with _LOCKS_LOCK:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.Lock()
        return lock


@dataclass(slots=True)
class DiffusersVAE:
    """A :class:`~knapray.corpus.encoders.LatentEncoder` over a diffusers VAE directory.

    An image VAE (AutoencoderKL: Flux, SD3, SDXL) encodes every frame alone, so a video
    keeps all its frames (T = F). A video VAE (AutoencoderKLWan, AutoencoderKLHunyuanVideo)
    compresses time: a clip is cut to ``1 + k * temporal_downsample`` frames (the rest of
    the clip is dropped) and gives ``1 + k`` latent frames; an image is a 1-frame clip.
    """

    path: str
    device: str = "cpu"
    dtype: str = "fp32"
    batch_frames: int = 8
    """Frames per VAE call (for a video VAE: whole clips while they fit)."""
    info: VAEInfo = field(init=False)
    channels: int = field(init=False)
    downsample: int = field(init=False)
    temporal_downsample: int = field(init=False)
    _model: Any = field(init=False, repr=False)
    _shift: Any = field(init=False, repr=False)
    _std: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.batch_frames < 1:
            raise ValueError(f"batch_frames must be >= 1, got {self.batch_frames}")
        self.info = vae_info(self.path)
        self.channels, self.downsample = self.info.channels, self.info.downsample
        self.temporal_downsample = self.info.temporal_downsample
        torch = _import("torch")
        cls = getattr(_import("diffusers"), self.info.cls)
        model = cls.from_pretrained(self.info.path, local_files_only=True, torch_dtype=torch_dtype(self.dtype))
        self._model = model.to(self.device).eval()
        shape = (1, -1, 1, 1) if self.temporal_downsample == 1 else (1, -1, 1, 1, 1)
        self._shift = torch.tensor(self.info.shift, dtype=torch.float32, device=self.device).reshape(shape)
        self._std = torch.tensor(self.info.std, dtype=torch.float32, device=self.device).reshape(shape)
        if self.info.patch_norm:  # (C·2·2,) statistics of the patchified latent -> (1, C, 1, 2, 1, 2)
            bn = model.bn
            tile = (1, self.channels, 1, 2, 1, 2)
            self._shift = bn.running_mean.float().reshape(tile).to(self.device)
            self._std = (bn.running_var.float() + float(bn.eps)).sqrt().reshape(tile).to(self.device)

    def describe(self) -> dict[str, Any]:
        return {**self.info.record(), "dtype": self.dtype}

    def _latent(self, x: Any) -> Any:
        """(B, 3, [F,] H, W) pixels in [-1, 1] -> normalized float32 posterior mean."""
        torch = _import("torch")
        with torch.inference_mode():
            x = x.to(self.device, torch_dtype(self.dtype))
            with model_lock(self._model):
                z = self._model.encode(x).latent_dist.mean.float()
            return self._normalized(z).cpu().numpy()

    def _normalized(self, z: Any) -> Any:
        if not self.info.patch_norm:
            return (z - self._shift) / self._std * self.info.scaling_factor
        b, c, h, w = z.shape  # each 2x2 patch position's own statistics: (B, C, h/2, 2, w/2, 2)
        return ((z.reshape(b, c, h // 2, 2, w // 2, 2) - self._shift) / self._std).reshape(b, c, h, w)

    def _denormalized(self, z: Any) -> Any:
        if not self.info.patch_norm:
            return z / self.info.scaling_factor * self._std + self._shift
        b, c, h, w = z.shape
        return (z.reshape(b, c, h // 2, 2, w // 2, 2) * self._std + self._shift).reshape(b, c, h, w)

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """(F, H, W, 3) uint8 -> (C, T, H/downsample, W/downsample) float32."""
        return self.encode_many([pixels])[0]

    def decode(self, latent: np.ndarray) -> np.ndarray:
        """(C, T, h, w) normalized latent -> (F, h*downsample, w*downsample, 3) uint8: the
        inverse normalization, then the VAE's decoder (an image VAE frame by frame)."""
        torch = _import("torch")
        z = torch.from_numpy(np.ascontiguousarray(latent, dtype=np.float32)).to(self.device)
        with torch.inference_mode(), model_lock(self._model):
            if self.temporal_downsample == 1:
                z = self._denormalized(z.permute(1, 0, 2, 3))  # (C, T, h, w) -> (T, C, h, w): frames as a batch
                x = self._model.decode(z.to(torch_dtype(self.dtype))).sample.float()  # (T, 3, H, W)
                x = x.permute(0, 2, 3, 1)
            else:
                z = self._denormalized(z[None])  # (1, C, T, h, w)
                x = self._model.decode(z.to(torch_dtype(self.dtype))).sample.float()[0]  # (3, F, H, W)
                x = x.permute(1, 2, 3, 0)
        return ((x.clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8).cpu().numpy()

    def encode_many(self, items: list[np.ndarray]) -> list[np.ndarray]:
        """Encode several files' frames, batching frames (or clips) of one size together."""
        torch = _import("torch")
        self._check_frames(items)
        if self.temporal_downsample > 1:
            return self._clip_latents(items, first_frame_only=False)
        out: list[np.ndarray | None] = [None] * len(items)
        # Every frame of every item, grouped by size: (item, frame) per slot.
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i, px in enumerate(items):
            f, h, w, _ = px.shape
            out[i] = np.empty((self.channels, f, h // self.downsample, w // self.downsample), np.float32)
            groups.setdefault((h, w), []).extend((i, t) for t in range(f))
        for slots in groups.values():
            for start in range(0, len(slots), self.batch_frames):
                chunk = slots[start : start + self.batch_frames]
                px = np.stack([items[i][t] for i, t in chunk])  # (B, H, W, 3)
                x = torch.from_numpy(px).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # (B, 3, H, W)
                z = self._latent(x)  # (B, C, H/d, W/d)
                for (i, t), zi in zip(chunk, z):
                    out[i][:, t] = zi  # type: ignore[index]
        return out  # type: ignore[return-value]

    def encode_first_frames(self, items: list[np.ndarray]) -> list[np.ndarray]:
        """Per clip ((F, H, W, 3) uint8), the normalized latent of its first frame followed
        by zero frames (pixel value 0 in [-1, 1]) up to the frames ``encode_many`` keeps:
        the video ``WanImageToVideoPipeline.prepare_latents`` encodes as its condition
        (posterior mean, its ``sample_mode="argmax"``). A video VAE only."""
        if self.temporal_downsample == 1:
            raise ValueError(f"{self.info.cls} at {self.path} compresses no time: a first-frame condition "
                             "needs a video VAE (AutoencoderKLWan)")
        self._check_frames(items)
        return self._clip_latents(items, first_frame_only=True)

    def _check_frames(self, items: list[np.ndarray]) -> None:
        for px in items:
            if px.ndim != 4 or px.shape[-1] != 3 or px.shape[1] % self.downsample or px.shape[2] % self.downsample:
                raise ValueError(
                    f"expected (F, H, W, 3) frames with H, W multiples of {self.downsample}, got {px.shape}"
                )

    def _clip_latents(self, items: list[np.ndarray], *, first_frame_only: bool) -> list[np.ndarray]:
        """A video VAE's latents of whole clips (cut to ``kept_frames``), clips of one shape
        batched together; ``first_frame_only``: each clip's first frame, then zeros."""
        torch = _import("torch")
        out: list[np.ndarray | None] = [None] * len(items)
        clips: dict[tuple[int, ...], list[int]] = {}
        for i, px in enumerate(items):
            f = kept_frames(px.shape[0], self.temporal_downsample)
            clips.setdefault((f, *px.shape[1:3]), []).append(i)
        for (f, h, w), members in clips.items():
            per_call = max(1, self.batch_frames // f)
            for start in range(0, len(members), per_call):
                chunk = members[start : start + per_call]
                px = np.stack([items[i][: 1 if first_frame_only else f] for i in chunk])  # (B, F or 1, H, W, 3)
                x = torch.from_numpy(px).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0  # (B, 3, F or 1, H, W)
                if first_frame_only:  # the zero frames as floats: 0 is no uint8 pixel value
                    x = torch.cat([x, x.new_zeros(len(chunk), 3, f - 1, h, w)], dim=2)  # (B, 3, F, H, W)
                z = self._latent(x)  # (B, C, T, H/d, W/d)
                want = 1 + (f - 1) // self.temporal_downsample
                if z.shape[2] != want:
                    raise ValueError(
                        f"{self.info.cls} at {self.path} turned {f} frames into {z.shape[2]} latent "
                        f"frames; its config implies {want} (temporal_downsample "
                        f"{self.temporal_downsample})"
                    )
                for i, zi in zip(chunk, z):
                    out[i] = np.ascontiguousarray(zi)
        return out  # type: ignore[return-value]


# --- image encoder: image-to-video conditioning ----------------------------------------

CLIP_VISION_TYPE = "clip_vision_model"
PROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True, slots=True)
class ImageEncoderInfo:
    path: str
    processor: str
    """Directory of its CLIPImageProcessor."""
    dim: int
    """Token width (the vision model's hidden_size)."""
    tokens: int
    """Tokens per image: (image_size / patch_size)^2 patches and the class token."""
    image_size: int
    config_sha256: str

    def record(self) -> dict[str, Any]:
        return {
            "path": self.path, "processor": self.processor, "class": "CLIPVisionModel",
            "config_sha256": self.config_sha256, "dim": self.dim, "tokens": self.tokens,
            "image_size": self.image_size, "output": "hidden_states[-2] of the first frame",
        }


def _crop_sides(crop: Any) -> tuple[int, int] | None:
    """A preprocessor_config.json's crop_size ({"height", "width"}, or one int) as (h, w)."""
    if isinstance(crop, dict) and "height" in crop and "width" in crop:
        return int(crop["height"]), int(crop["width"])
    if type(crop) is int:
        return crop, crop
    return None


def image_encoder_info(path: str | Path, processor: str | Path | None = None,
                       flag: str = "--image-encoder") -> ImageEncoderInfo:
    """What a CLIP vision model directory holds (Wan 2.1 I2V's image_encoder/), from its config
    and its processor's (``processor``, or the model's own directory when None)."""
    d = model_dir(path, flag)
    cfg = read_config(d)
    if cfg.get("model_type") != CLIP_VISION_TYPE:
        raise ValueError(f"{flag} {path}: model_type {cfg.get('model_type')!r} is not a CLIP vision model "
                         f"({CLIP_VISION_TYPE!r}: CLIPVisionModel, Wan 2.1 I2V's image_encoder/)")
    try:
        dim, size, patch = int(cfg["hidden_size"]), int(cfg["image_size"]), int(cfg["patch_size"])
    except KeyError as e:
        raise ValueError(f"{flag} {path}: CLIPVisionModel config lacks {e.args[0]!r}") from None
    proc_flag = flag.replace("encoder", "processor")
    proc = Path(processor).expanduser() if processor is not None else d
    named = f"{proc_flag} {processor}" if processor is not None else f"{flag} {path}"
    if not proc.is_dir():
        raise FileNotFoundError(f"{proc_flag} {processor}: no such directory")
    if not (proc / PROCESSOR_FILE).is_file():
        raise FileNotFoundError(f"{named}: no {PROCESSOR_FILE}; pass the image processor's directory with "
                                f"{proc_flag} (Wan 2.1 I2V keeps it in image_processor/)")
    crop = _crop_sides(json.loads((proc / PROCESSOR_FILE).read_text()).get("crop_size"))
    if crop is not None and crop != (size, size):
        raise ValueError(f"{named}: the processor crops {crop[0]}x{crop[1]}, the model takes {size}x{size} images")
    return ImageEncoderInfo(path=str(d), processor=str(proc.resolve()), dim=dim, tokens=(size // patch) ** 2 + 1,
                            image_size=size, config_sha256=config_sha256(cfg))


class HFImageEncoder:
    """A loaded CLIPVisionModel with its CLIPImageProcessor: ``WanImageToVideoPipeline.encode_image``."""

    def __init__(self, info: ImageEncoderInfo, device: str, dtype: str) -> None:
        transformers = _import("transformers")
        self.info, self.device = info, device
        self.processor = transformers.CLIPImageProcessor.from_pretrained(info.processor, local_files_only=True)
        with _no_loading_bar(transformers):
            model = transformers.CLIPVisionModel.from_pretrained(info.path, local_files_only=True,
                                                                 dtype=torch_dtype(dtype))
        self.model = model.to(device).eval()

    def run(self, images: list[np.ndarray]) -> np.ndarray:
        """(H, W, 3) uint8 images -> (B, tokens, dim) float32: the penultimate hidden states."""
        torch = _import("torch")
        if not images:
            return np.zeros((0, self.info.tokens, self.info.dim), np.float32)
        pixels = self.processor(images=list(images), return_tensors="pt")["pixel_values"]  # (B, 3, S, S)
        with torch.inference_mode():
            out = self.model(pixel_values=pixels.to(self.device, self.model.dtype), output_hidden_states=True)
        return out.hidden_states[-2].float().cpu().numpy()


class WanI2VConditioning:
    """Each clip's image-to-video conditioning as ``WanImageToVideoPipeline`` computes it for
    the clip's first frame (Wan 2.1 I2V: no ``expand_timesteps``), the clip's length its
    ``num_frames``:

    - ``condition`` (temporal_downsample + C, T, h, w): a mask of ``temporal_downsample``
      channels (the first pixel frame repeated over the first latent frame's slots: 1 on latent
      frame 0, 0 after), then the corpus VAE's normalized latent of the first frame followed by
      zero frames (``DiffusersVAE.encode_first_frames``);
    - ``image_context`` (tokens, dim): the image encoder's penultimate hidden states of the
      first frame.

    The VAE is the corpus's own (the latents' encoder), not a second copy."""

    def __init__(self, vae: DiffusersVAE, image: str, processor: str | None, device: str, dtype: str) -> None:
        if vae.temporal_downsample == 1:
            raise ValueError(f"--image-encoder: the conditioning latent needs a video VAE (AutoencoderKLWan); "
                             f"--vae {vae.path} is {vae.info.cls}")
        self.vae, self.dtype = vae, dtype
        self.info = image_encoder_info(image, processor)
        self.image = HFImageEncoder(self.info, device, dtype)
        self.mask_channels = vae.temporal_downsample
        self.channels = self.mask_channels + vae.channels
        self.dim, self.tokens = self.info.dim, self.info.tokens

    def describe(self) -> dict[str, Any]:
        return condition_record(self.info, self.mask_channels, self.vae.channels, self.dtype)

    def encode_many(self, items: list[np.ndarray], images: list[np.ndarray] | None = None
                    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """(F, H, W, 3) uint8 clips -> per clip (condition, image_context). ``images``: per clip,
        the (h, w, 3) uint8 image the image encoder reads instead of the clip's first frame
        (sampling: the conditioning image as given, the clip's first frame its resize, as
        ``WanImageToVideoPipeline`` reads them)."""
        latents = self.vae.encode_first_frames(items)
        tokens = self.image.run([px[0] for px in items] if images is None else images)
        out = []
        for z, t in zip(latents, tokens):
            mask = np.zeros((self.mask_channels, *z.shape[1:]), np.float32)  # (4, T, h, w)
            mask[:, 0] = 1.0
            out.append((np.concatenate([mask, z]), np.ascontiguousarray(t)))
        return out


def condition_record(image: ImageEncoderInfo, mask_channels: int, latent_channels: int, dtype: str) -> dict[str, Any]:
    """schema.json's ``encoders.image``: the image encoder, and how ``condition`` was made."""
    return {
        **image.record(), "dtype": dtype, "pipeline": "WanImageToVideoPipeline",
        "condition_channels": mask_channels + latent_channels,
        "condition": f"{mask_channels} mask channels (1 on the first latent frame, 0 after), then the latent "
                     "encoder's normalized posterior mean of the first frame followed by zero frames (pixel 0)",
    }


# --- text encoders --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TextModelInfo:
    path: str
    tokenizer: str
    cls: str
    """transformers class that loads it (T5EncoderModel, CLIPTextModel, ...)."""
    kind: str
    """'t5', 'clip' or 'lm' (a causal language model: ``LM_TYPES``)."""
    dim: int
    """Token embedding width."""
    pooled_dim: int
    """Pooled width: CLIP's pooled output (its projection when it has one); for T5, d_model
    (the mean of its token embeddings stands in)."""
    max_positions: int | None
    """Longest token sequence the model takes (CLIP: 77); None for T5 (relative positions)."""
    config_sha256: str

    def record(self) -> dict[str, Any]:
        pooled = {
            "t5": "mean of the kept token embeddings",
            "clip": "text_embeds (projection)" if self.cls == "CLIPTextModelWithProjection" else "pooler_output",
            "lm": "none",
        }[self.kind]
        return {
            "path": self.path, "tokenizer": self.tokenizer, "class": self.cls,
            "config_sha256": self.config_sha256, "dim": self.dim, "pooled_dim": self.pooled_dim,
            "pooled": pooled,
        }


def text_model_info(path: str | Path, tokenizer: str | Path | None = None, flag: str = "--text-encoder") -> TextModelInfo:
    """What a T5 or CLIP text model directory holds, from its config; the tokenizer comes
    from ``tokenizer`` or, when None, the model's own directory."""
    d = model_dir(path, flag)
    cfg = read_config(d)
    model_type = cfg.get("model_type")
    try:
        if model_type in T5_TYPES:
            cls, kind = T5_TYPES[model_type], "t5"
            dim = pooled = cfg["d_model"]
            max_positions = None
        elif model_type in LM_TYPES:
            cls, kind = LM_TYPES[model_type], "lm"
            dim = pooled = (cfg.get("text_config") or cfg)["hidden_size"]
            max_positions = None
        elif model_type == CLIP_TYPE:
            projected = "CLIPTextModelWithProjection" in (cfg.get("architectures") or [])
            cls = "CLIPTextModelWithProjection" if projected else "CLIPTextModel"
            kind, dim = "clip", cfg["hidden_size"]
            pooled = cfg["projection_dim"] if projected else dim
            max_positions = cfg["max_position_embeddings"]
        else:
            raise ValueError(
                f"{flag} {path}: model_type {model_type!r} is not a supported text encoder; supported: "
                f"{sorted(T5_TYPES)} (T5EncoderModel), {CLIP_TYPE!r} (CLIPTextModel[WithProjection]) and "
                f"{sorted(LM_TYPES)} (Qwen-Image's and FLUX.2's text encoders)"
            )
    except KeyError as e:
        raise ValueError(f"{flag} {path}: {model_type} config lacks {e.args[0]!r}") from None
    tok_flag = flag.replace("encoder", "tokenizer")
    tok = Path(tokenizer).expanduser() if tokenizer is not None else d
    if not tok.is_dir():
        raise FileNotFoundError(f"{tok_flag} {tokenizer}: no such directory")
    if not any((tok / name).is_file() for name in TOKENIZER_FILES):
        named = f"{tok_flag} {tokenizer}" if tokenizer is not None else f"{flag} {path}"
        raise FileNotFoundError(
            f"{named}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass the tokenizer's "
            f"directory with {tok_flag} (a Flux checkpoint keeps them in tokenizer/ and tokenizer_2/)"
        )
    return TextModelInfo(
        path=str(d), tokenizer=str(tok.resolve()), cls=cls, kind=kind, dim=int(dim),
        pooled_dim=int(pooled), max_positions=max_positions, config_sha256=config_sha256(cfg),
    )


@contextlib.contextmanager
def _no_loading_bar(transformers: Any) -> Iterator[None]:
    """transformers 5 draws a "Loading weights" bar for every model it loads (two for T5 +
    CLIP, in every command that loads them, under knapray's own bars); its switch is global,
    so it is put back as it was."""
    hf_logging = transformers.utils.logging
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


class HFTextModel:
    """A loaded T5 or CLIP text model with its tokenizer."""

    def __init__(self, info: TextModelInfo, device: str, dtype: str) -> None:
        transformers = _import("transformers")
        self.info, self.device = info, device
        if (Path(info.tokenizer) / "processor_config.json").is_file():  # FLUX.2's: Mistral's chat template lives there
            self.tokenizer = transformers.AutoProcessor.from_pretrained(info.tokenizer, local_files_only=True)
        else:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(info.tokenizer, local_files_only=True)
        self.tokenizer.padding_side = "right"  # real tokens first: row i keeps hidden[i, :n_i]
        with _no_loading_bar(transformers):
            model = getattr(transformers, info.cls).from_pretrained(
                info.path, local_files_only=True, dtype=torch_dtype(dtype)
            )
        self.model = model.to(device).eval()

    def limit(self, max_tokens: int | None) -> int:
        """Tokens kept per caption: ``max_tokens`` capped by what the model and tokenizer take."""
        tokenizer = getattr(self.tokenizer, "tokenizer", self.tokenizer)  # a processor's own tokenizer
        caps = [self.info.max_positions, getattr(tokenizer, "model_max_length", None), max_tokens]
        return int(min((c for c in caps if c is not None and c < 1_000_000), default=1_000_000))

    def run(self, captions: list[str], max_tokens: int | None, prompt: PromptFormat | None = None
            ) -> tuple[list[np.ndarray], np.ndarray | None]:
        """Per caption: its real tokens' embeddings (n_i, dim) (padding dropped; special
        tokens such as T5's </s> and CLIP's start/end kept), and for CLIP the pooled vectors
        (B, pooled_dim). A language model's through its pipeline's ``prompt`` format: the
        template's first tokens left out (``max_tokens`` counts the rest), or a chat padded to
        ``pad_to`` tokens all kept; its hidden states of ``prompt.layers`` side by side."""
        torch = _import("torch")
        drop = prompt.drop if prompt else 0
        if prompt is not None and prompt.system is not None:
            chats = [[{"role": "system", "content": [{"type": "text", "text": prompt.system}]},
                      {"role": "user", "content": [{"type": "text", "text": c.replace("[IMG]", "")}]}]
                     for c in captions]
            length = min(self.limit(max_tokens), prompt.pad_to) if prompt.pad_to else self.limit(max_tokens)
            batch = self.tokenizer.apply_chat_template(
                chats, add_generation_prompt=False, tokenize=True, return_dict=True, return_tensors="pt",
                padding="max_length" if prompt.pad_to else True, truncation=True, max_length=length).to(self.device)
        else:
            batch = self.tokenizer(
                [prompt.template.format(c) for c in captions] if prompt else captions, padding=True,
                truncation=True, max_length=self.limit(max_tokens) + drop, return_tensors="pt").to(self.device)
        with torch.inference_mode():
            if self.info.kind == "lm":
                out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 output_hidden_states=True, use_cache=False)
                last = torch.cat([out.hidden_states[k] for k in prompt.layers], dim=-1)
            else:
                out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                last = out.last_hidden_state
        hidden = last.float().cpu().numpy()  # (B, L, dim)
        counts = ([hidden.shape[1]] * len(captions) if prompt is not None and prompt.pad_to
                  else batch["attention_mask"].sum(dim=1).tolist())
        tokens = [np.ascontiguousarray(h[drop:max(n, drop)]) for h, n in zip(hidden, counts)]
        if self.info.kind != "clip":
            return tokens, None
        pooled = out.text_embeds if self.info.cls == "CLIPTextModelWithProjection" else out.pooler_output
        return tokens, pooled.float().cpu().numpy()


class HFTextEncoder:
    """A :class:`~knapray.corpus.encoders.TextEncoder` as Flux conditions: the text model's
    token embeddings (T5, or CLIP) as ``text``, and a CLIP model's pooled vector as
    ``pooled`` (the text model's own when it is CLIP and no ``pooled`` model is given;
    for T5 alone, the mean of the kept token embeddings).

    Tokens are the caption's real ones, capped at ``max_tokens`` (and at 77 for CLIP);
    an empty caption has no tokens, but still gets CLIP's pooled vector of "".

    ``pooled_vector=False`` (Wan: umT5 alone): no pooled vector, ``pooled_dim`` 0, each
    caption's ``pooled`` an empty array. ``wan_prompts``: captions cleaned as
    ``WanPipeline`` cleans prompts (:func:`wan_prompt_clean`) before tokenizing.
    ``prompt``: the pipeline's template around every caption and the tokens of it dropped
    from the front (Qwen-Image's): every caption, the empty one too, goes through the model.
    """

    def __init__(
        self,
        text: str,
        *,
        text_tokenizer: str | None = None,
        pooled: str | None = None,
        pooled_tokenizer: str | None = None,
        device: str = "cpu",
        dtype: str = "fp32",
        batch_size: int = 32,
        pooled_vector: bool = True,
        wan_prompts: bool = False,
        prompt: PromptFormat | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if pooled and not pooled_vector:
            raise ValueError(f"--pooled-encoder {pooled}: given for a corpus without a pooled vector (Wan)")
        self.text_info, self.pooled_info = text_encoder_infos(text, text_tokenizer, pooled, pooled_tokenizer)
        self.dtype, self.batch_size = dtype, batch_size
        self.pooled_vector, self.wan_prompts, self.prompt = pooled_vector, wan_prompts, prompt
        if (self.text_info.kind == "lm") != (prompt is not None):
            raise ValueError(f"--text-encoder {text}: {self.text_info.cls} " + (
                "is read through its pipeline's prompt format: give the family it is for (--family qwen_image or "
                "flux2)"
                if prompt is None else "takes no prompt template (a language model's pipeline has one)"))
        self.text = HFTextModel(self.text_info, device, dtype)
        self.pooled_model = HFTextModel(self.pooled_info, device, dtype) if self.pooled_info else None
        self.dim = self.text_info.dim * (len(prompt.layers) if prompt else 1)
        self.pooled_dim = (self.pooled_info or self.text_info).pooled_dim if pooled_vector else 0

    def describe(self) -> dict[str, Any]:
        return text_encoder_record(self.text_info, self.pooled_info, self.dtype, pooled_vector=self.pooled_vector,
                                   wan_prompts=self.wan_prompts, prompt=self.prompt)

    def encode(self, caption: str, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        return self.encode_many([caption], max_tokens)[0]

    def encode_many(self, captions: list[str], max_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
        out: list[tuple[np.ndarray, np.ndarray]] = []
        for start in range(0, len(captions), self.batch_size):
            out.extend(self._encode_chunk(captions[start : start + self.batch_size], max_tokens))
        return out

    def _encode_chunk(self, captions: list[str], max_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
        if self.wan_prompts:
            captions = [wan_prompt_clean(c) for c in captions]
        texts = [np.zeros((0, self.dim), np.float32) for _ in captions]
        real = [i for i, c in enumerate(captions) if c.strip() or self.prompt] if max_tokens > 0 else []
        if real:
            tokens, _ = self.text.run([captions[i] for i in real], max_tokens, self.prompt)
            for i, t in zip(real, tokens):
                texts[i] = t
        if not self.pooled_vector:
            return [(t, np.zeros(0, np.float32)) for t in texts]
        if self.pooled_model is not None:
            pooled = self.pooled_model.run(captions, None)[1]
        elif self.text_info.kind == "clip":
            pooled = self.text.run(captions, None)[1]
        else:
            pooled = np.stack([t.mean(axis=0) if len(t) else np.zeros(self.dim, np.float32) for t in texts])
        assert pooled is not None
        return [(t, np.ascontiguousarray(p, dtype=np.float32)) for t, p in zip(texts, pooled)]


def text_encoder_infos(
    text: str, text_tokenizer: str | None, pooled: str | None, pooled_tokenizer: str | None
) -> tuple[TextModelInfo, TextModelInfo | None]:
    text_info = text_model_info(text, text_tokenizer, "--text-encoder")
    pooled_info = text_model_info(pooled, pooled_tokenizer, "--pooled-encoder") if pooled else None
    if pooled_info is not None and pooled_info.kind != "clip":
        raise ValueError(f"--pooled-encoder {pooled}: is {pooled_info.cls}; the pooled vector comes from CLIP")
    return text_info, pooled_info


def text_encoder_record(text: TextModelInfo, pooled: TextModelInfo | None, dtype: str, *,
                        pooled_vector: bool = True, wan_prompts: bool = False,
                        prompt: PromptFormat | None = None) -> dict[str, Any]:
    return {
        "class": "HFTextEncoder",
        "dtype": dtype,
        "text": text.record(),
        "pooled": (pooled or text).record() if pooled_vector else None,
        "dim": text.dim * (len(prompt.layers) if prompt else 1),
        "pooled_dim": (pooled or text).pooled_dim if pooled_vector else 0,
        **({"prompt_clean": "WanPipeline's prompt_clean"} if wan_prompts else {}),
        **(prompt.record() if prompt else {}),
    }


@dataclass(frozen=True, slots=True)
class PromptFormat:
    """How a pipeline feeds a caption to its language-model text encoder, and which of its
    hidden states are the text: Qwen-Image's ``template`` around the caption with the
    template's first ``drop`` tokens left out of the last hidden states; FLUX.2's chat (the
    tokenizer's chat template over a ``system`` message and the caption as the user's turn),
    every caption padded to ``pad_to`` tokens that are all kept, and the hidden states of
    ``layers`` side by side."""

    template: str = "{}"
    drop: int = 0
    system: str | None = None
    """The chat's system message: the caption goes through the tokenizer's chat template."""
    layers: tuple[int, ...] = (-1,)
    """Hidden states (indices into the model's ``hidden_states``) concatenated per token."""
    pad_to: int = 0
    """Every caption padded (or cut) to this many tokens, the padding's states kept: what a
    pipeline that attends to its padding hands the transformer (0: the real tokens only)."""

    def __post_init__(self) -> None:
        if self.template.count("{}") != 1 or self.drop < 0 or self.pad_to < 0 or not self.layers:
            raise ValueError(f"a prompt format has one '{{}}' in its template, drop and pad_to >= 0 and a layer, got "
                             f"{self.template!r}, {self.drop}, {self.pad_to}, {self.layers!r}")
        if self.system is not None and (self.template != "{}" or self.drop):
            raise ValueError("a chat prompt format (system) takes no template of its own")

    def record(self) -> dict[str, Any]:
        return {"prompt_template": self.template, "prompt_drop": self.drop, "prompt_system": self.system,
                "prompt_layers": list(self.layers), "prompt_pad_to": self.pad_to}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> PromptFormat | None:
        """The format a corpus's text record holds (``record``), or None."""
        if "prompt_template" not in rec:
            return None
        return cls(str(rec["prompt_template"]), int(rec["prompt_drop"]), rec.get("prompt_system"),
                   tuple(int(k) for k in rec.get("prompt_layers", (-1,))), int(rec.get("prompt_pad_to", 0)))


def wan_prompt_clean(text: str) -> str:
    """``WanPipeline``'s ``prompt_clean``: ftfy's fix_text where ftfy is installed, HTML
    entities unescaped twice, whitespace runs collapsed to one space, ends stripped."""
    try:
        import ftfy
    except ImportError:
        ftfy = None
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()
