"""The two stages of ingestion, shared by the in-process path and the Ray Data path.

``decode_batch`` (a plain function: Ray Data runs it as CPU tasks) reads and fits a
batch of files; ``EncodeStage`` (a callable class: Ray Data runs it in an actor pool,
one model copy per actor, on a GPU where there is one) turns the decoded frames and
captions into corpus rows. Both take and return pyarrow tables, so one batch looks the
same in a Ray block and in a Python loop. ``EncoderSpec`` says how to build the encoders
and is what travels to the actors: the models are loaded there, never pickled.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from knapray.corpus import hf
from knapray.corpus.encoders import (
    HashTextEncoder,
    LatentEncoder,
    PixelPatchEncoder,
    TextEncoder,
    encode_captions,
    encode_latents,
    encoder_record,
)
from knapray.corpus.media import (
    MediaItem,
    fit_frames,
    is_video_file,
    read_image,
    read_video,
    sample_id_for,
)
from knapray.corpus.schema import CORPUS_SCHEMA, visual_token_count
from knapray.corpus.writer import build_table
from knapray.planning.inference.sampling_memory import ArchSpec

ITEM_SCHEMA = pa.schema([("path", pa.string()), ("source", pa.string()), ("caption", pa.string())])
DECODED_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("caption", pa.string()),
        ("skip", pa.string()),  # "" when decoded, else the reason
        ("kind", pa.string()),
        ("f", pa.int32()),
        ("h", pa.int32()),
        ("w", pa.int32()),
        # (f, h, w, 3) uint8 in C order. large_binary: a batch of clips can pass 2 GiB.
        ("pixels", pa.large_binary()),
    ]
)
ROWS_SCHEMA = CORPUS_SCHEMA.append(pa.field("skip", pa.string(), nullable=False))
"""EncodeStage's output: corpus rows (with the conditioning columns when it has an image
encoder) plus ``skip``; skipped files are rows with zero lengths and empty payloads that the
writer drops after counting them."""


def load_factory(spec: str) -> Callable[[], Any]:
    """``package.module:name`` -> the callable it names (a class or factory)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"bad factory {spec!r}: expected 'package.module:name'")
    obj = getattr(importlib.import_module(module), name, None)
    if not callable(obj):
        raise ValueError(f"{spec!r}: {module} has no callable {name!r}")
    return obj


@dataclass(frozen=True, kw_only=True, slots=True)
class FamilyEncoding:
    """What a corpus made for a model family holds: how the family's pipeline encodes a
    caption. Each family declares its own (``knapray.models.families.Family.encoders``); the
    caller that knows the families hands it to ``EncoderSpec`` (the corpus knows none)."""

    family: str
    """The family's name (schema.json ``family``: pre-flight refuses a model of another)."""
    model: str
    """Its model, as errors name it (``Wan's text length``)."""
    pooled: bool = True
    """A pooled text vector per sample (CLIP's) besides the token embeddings; False: none
    (pooled_dim 0, each row's ``pooled`` empty)."""
    text_length: int = 0
    """The pipeline's text length: it truncates a prompt's tokens there and pads their
    embeddings with zero rows to it (the corpus keeps the tokens; schema.json
    ``text_pad_to`` says the length); 0: none fixed."""
    pipeline: str = ""
    """The diffusers pipeline whose text handling the corpus reproduces (named in errors)."""
    clean_prompts: bool = False
    """Captions cleaned as the pipeline cleans prompts (:func:`knapray.corpus.hf.wan_prompt_clean`)."""
    text_models: tuple[ArchSpec, ...] = ()
    """The pipeline's pretrained text encoders (public architectures, in the order a caption goes
    through them): what sampling holds on rank 0 (``knapray.planning.inference.sampling_memory``)."""
    vae: ArchSpec | None = None
    """The pipeline's pretrained VAE, in the dtype the pipeline decodes with."""
    prompt: hf.PromptFormat | None = None
    """The pipeline's template around a caption for its language-model text encoder, and the
    template tokens dropped from the front (Qwen-Image's); None: captions as they are."""
    image_pipeline: str = ""
    """The diffusers image-to-video pipeline whose conditioning an ingest with an image encoder
    writes per clip (:class:`knapray.corpus.hf.WanI2VConditioning`: Wan 2.1 I2V's); "": the
    family takes none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EncoderSpec:
    """How to build the latent and text encoders. Small and picklable: each Ray actor
    builds its own models from it. Without ``vae``/``text_encoder`` (or a factory) the
    weightless stand-ins are used."""

    vae: str | None = None
    """diffusers VAE directory (AutoencoderKL, AutoencoderKLWan, AutoencoderKLHunyuanVideo)."""
    text_encoder: str | None = None
    """T5 or CLIP text model directory: its token embeddings are ``text``."""
    text_tokenizer: str | None = None
    """Tokenizer directory for ``text_encoder`` when it is not in the model's directory."""
    pooled_encoder: str | None = None
    """CLIP text model directory: its pooled output is ``pooled``."""
    pooled_tokenizer: str | None = None
    """Tokenizer directory for ``pooled_encoder`` when it is not in the model's directory."""
    image_encoder: str | None = None
    """CLIPVisionModel directory: with it each row holds its image-to-video conditioning
    (``condition`` and ``image_context``, the family's ``image_pipeline``'s), from ``vae``."""
    image_processor: str | None = None
    """CLIPImageProcessor directory for ``image_encoder`` when it is not in the model's directory."""
    device: str = "auto"
    """auto | cpu | cuda; auto is cuda where torch sees a GPU."""
    dtype: str = "auto"
    """auto | fp32 | bf16 | fp16 for the models; auto is bf16 on cuda, fp32 on cpu. Rows
    are float32 whatever it is."""
    vae_batch: int = 8
    """Frames per VAE call."""
    text_batch: int = 32
    """Captions per text-model call."""
    encoder_factory: str | None = None
    """'module:factory' returning a LatentEncoder, instead of ``vae``."""
    text_encoder_factory: str | None = None
    """'module:factory' returning a TextEncoder, instead of ``text_encoder``."""
    channels: int = 4
    """Stand-in PixelPatchEncoder: latent channels."""
    downsample: int = 8
    """Stand-in PixelPatchEncoder: spatial downsample."""
    seed: int = 0
    """Stand-in PixelPatchEncoder: seed of its RGB -> C matrix."""
    text_dim: int = 64
    """Stand-in HashTextEncoder: token width."""
    pooled_dim: int = 32
    """Stand-in HashTextEncoder: pooled width."""
    family: FamilyEncoding | None = None
    """The model family the corpus is made for (its name recorded in schema.json), or None
    (any): how its pipeline encodes captions (wan: no pooled vector, pooled_dim 0, captions
    cleaned as WanPipeline cleans prompts)."""

    def __post_init__(self) -> None:
        pairs = (("vae", "encoder_factory"), ("text_encoder", "text_encoder_factory"))
        for a, b in pairs:
            if getattr(self, a) and getattr(self, b):
                raise ValueError(f"give {a} or {b}, not both")
        for needs, name in (("text_encoder", "pooled_encoder"), ("text_encoder", "text_tokenizer"),
                            ("pooled_encoder", "pooled_tokenizer"), ("image_encoder", "image_processor")):
            if getattr(self, name) and not getattr(self, needs):
                raise ValueError(f"{name} is given without {needs}")
        if self.device not in hf.DEVICES:
            raise ValueError(f"device {self.device!r} is not one of {hf.DEVICES}")
        if self.dtype not in hf.DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {hf.DTYPES}")
        for name in ("vae_batch", "text_batch", "channels", "downsample", "text_dim", "pooled_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pooled_encoder and not self.pooled_vector:
            raise ValueError(f"pooled_encoder is given for family {self.family.family}, which has no pooled vector")
        if self.image_encoder and not (self.family is not None and self.family.image_pipeline):
            takers = "a family whose pipeline takes an image (--family wan)"
            raise ValueError(f"--image-encoder {self.image_encoder}: given for "
                             f"{'family ' + self.family.family if self.family else 'no --family'}; it is for {takers}")
        if self.image_encoder and not self.vae:
            raise ValueError(f"--image-encoder {self.image_encoder}: needs --vae (the conditioning latent is the "
                             "corpus VAE's)")

    @property
    def pooled_vector(self) -> bool:
        """Whether the corpus has a pooled vector (every family's but Wan's)."""
        return self.family is None or self.family.pooled

    @property
    def clean_prompts(self) -> bool:
        """Whether captions are cleaned as the family's pipeline cleans prompts (Wan's)."""
        return self.family is not None and self.family.clean_prompts

    def _standin_text(self) -> HashTextEncoder:
        return HashTextEncoder(dim=self.text_dim, pooled_dim=self.pooled_dim if self.pooled_vector else 0)

    @property
    def uses_models(self) -> bool:
        """Whether a VAE or text model is loaded (and so a device matters)."""
        return bool(self.vae or self.text_encoder)

    def conditioning(self, encoder: LatentEncoder) -> hf.WanI2VConditioning:
        """The image-to-video conditioning encoder over ``encoder`` (the :meth:`build` VAE) and
        ``image_encoder``, on the encoder's device and dtype."""
        assert isinstance(encoder, hf.DiffusersVAE) and self.image_encoder
        return hf.WanI2VConditioning(encoder, self.image_encoder, self.image_processor, encoder.device,
                                     encoder.dtype)

    def resolved(self, device: str) -> EncoderSpec:
        """This spec with ``device`` ('cpu' or 'cuda') and the dtype that goes with it."""
        return replace(self, device=device, dtype=hf.resolve_dtype(self.dtype, device))

    def check(self) -> None:
        """Read the model configs and tokenizer folders (not the weights) and import the
        libraries, so a bad path or a missing extra fails before any work starts."""
        if self.vae:
            vae = hf.vae_info(self.vae)
            hf._import("diffusers")
            if self.image_encoder and vae.temporal_downsample == 1:
                raise ValueError(f"--image-encoder {self.image_encoder}: the conditioning latent needs a video VAE "
                                 f"(AutoencoderKLWan); --vae {self.vae} is {vae.cls}")
        if self.image_encoder:
            hf.image_encoder_info(self.image_encoder, self.image_processor)
            hf._import("transformers")
        if self.text_encoder:
            hf.text_encoder_infos(self.text_encoder, self.text_tokenizer, self.pooled_encoder,
                                  self.pooled_tokenizer)
            hf._import("transformers")

    def build(self) -> tuple[LatentEncoder, TextEncoder]:
        """Load the encoders (on ``device``; resolve 'auto' first with :meth:`resolved`)."""
        device = hf.resolve_device(self.device) if self.uses_models else "cpu"
        dtype = hf.resolve_dtype(self.dtype, device)
        if self.vae:
            encoder: Any = hf.DiffusersVAE(self.vae, device=device, dtype=dtype, batch_frames=self.vae_batch)
        elif self.encoder_factory:
            encoder = load_factory(self.encoder_factory)()
        else:
            encoder = PixelPatchEncoder(channels=self.channels, downsample=self.downsample, seed=self.seed)
        if self.text_encoder:
            text: Any = hf.HFTextEncoder(
                self.text_encoder, text_tokenizer=self.text_tokenizer, pooled=self.pooled_encoder,
                pooled_tokenizer=self.pooled_tokenizer, device=device, dtype=dtype,
                batch_size=self.text_batch, pooled_vector=self.pooled_vector, wan_prompts=self.clean_prompts,
                prompt=self.family.prompt if self.family is not None else None,
            )
        elif self.text_encoder_factory:
            text = load_factory(self.text_encoder_factory)()
        else:
            text = self._standin_text()
        return encoder, text

    def describe(self) -> EncoderInfo:
        """Dims and schema.json records of what :meth:`build` makes, read from the model
        configs without loading weights (factory encoders are built: they are the user's
        objects and may hold anything)."""
        if self.vae:
            vae = hf.vae_info(self.vae)
            channels, downsample = vae.channels, vae.downsample
            latent_record = {**vae.record(), "dtype": self.dtype}
        else:
            built = (load_factory(self.encoder_factory)() if self.encoder_factory else
                     PixelPatchEncoder(channels=self.channels, downsample=self.downsample, seed=self.seed))
            channels, downsample, latent_record = built.channels, built.downsample, encoder_record(built)
        if self.text_encoder:
            t, p = hf.text_encoder_infos(self.text_encoder, self.text_tokenizer, self.pooled_encoder,
                                         self.pooled_tokenizer)
            text_record = hf.text_encoder_record(t, p, self.dtype, pooled_vector=self.pooled_vector,
                                                 wan_prompts=self.clean_prompts,
                                                 prompt=self.family.prompt if self.family is not None else None)
            dim, pooled_dim = text_record["dim"], text_record["pooled_dim"]
        else:
            made = (load_factory(self.text_encoder_factory)() if self.text_encoder_factory else
                    self._standin_text())
            dim, pooled_dim, text_record = made.dim, made.pooled_dim, encoder_record(made)
        image = None
        if self.image_encoder:
            vae = hf.vae_info(self.vae)  # type: ignore[arg-type]
            image = hf.condition_record(hf.image_encoder_info(self.image_encoder, self.image_processor),
                                        vae.temporal_downsample, vae.channels, self.dtype)
        return EncoderInfo(channels, downsample, dim, pooled_dim, latent_record, text_record, image)


@dataclass(frozen=True, slots=True)
class EncoderInfo:
    """What the driver needs about the encoders: dims for decoding and schema.json."""

    channels: int
    downsample: int
    text_dim: int
    pooled_dim: int
    latent_record: dict[str, Any]
    text_record: dict[str, Any]
    image_record: dict[str, Any] | None = None
    """The image encoder and how each row's conditioning was made (``hf.condition_record``);
    None: the rows hold none."""

    @staticmethod
    def of(encoder: LatentEncoder, text: TextEncoder, conditioning: hf.WanI2VConditioning | None = None
           ) -> EncoderInfo:
        return EncoderInfo(encoder.channels, encoder.downsample, text.dim, text.pooled_dim,
                           encoder_record(encoder), encoder_record(text),
                           conditioning.describe() if conditioning is not None else None)

    def dims(self) -> dict[str, int]:
        """schema.json's ``dims`` of these encoders' corpus (with the conditioning's widths)."""
        dims = {"channels": self.channels, "text_dim": self.text_dim, "pooled_dim": self.pooled_dim,
                "vae_downsample": self.downsample}
        if self.image_record is not None:
            dims.update(condition_channels=int(self.image_record["condition_channels"]),
                        image_dim=int(self.image_record["dim"]), image_tokens=int(self.image_record["tokens"]))
        return dims


def items_table(items: list[MediaItem]) -> pa.Table:
    return pa.table(
        [[str(i.path) for i in items], [i.source for i in items], [i.caption for i in items]],
        schema=ITEM_SCHEMA,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeOptions:
    max_side: int
    max_frames: int
    frame_stride: int
    multiple: int
    """Frame sides are cropped to multiples of this (VAE downsample x patch)."""
    video_decoder: str | None
    """First importable video decoder on the driver (None: video files are skipped)."""


def decode_batch(items: pa.Table, opts: DecodeOptions) -> pa.Table:
    """ITEM_SCHEMA rows -> DECODED_SCHEMA rows: frames read, shrunk and cropped, or the
    reason the file is skipped (video_no_decoder, unreadable, too_small)."""
    cols: dict[str, list[Any]] = {name: [] for name in DECODED_SCHEMA.names}
    for path_s, source, caption in zip(*(items.column(c).to_pylist() for c in ITEM_SCHEMA.names)):
        path = Path(path_s)
        video = is_video_file(path)
        skip, frames, n_raw = "", None, 0
        if video and opts.video_decoder is None:
            skip = "video_no_decoder"
        else:
            try:
                if video:
                    raw = read_video(path, opts.video_decoder, opts.max_frames, opts.frame_stride)  # type: ignore[arg-type]
                else:
                    raw = read_image(path, opts.max_frames, opts.frame_stride)
                n_raw = len(raw)
                frames = fit_frames(raw, opts.multiple, opts.max_side) if raw else None
                if raw and frames is None:
                    skip = "too_small"
                elif not raw:
                    skip = "unreadable"
            except Exception:  # noqa: BLE001 - any decoder failure (or frames of mixed sizes) means an unreadable file
                skip, frames = "unreadable", None
        f, h, w = frames.shape[:3] if frames is not None else (0, 0, 0)
        for name, value in zip(
            DECODED_SCHEMA.names,
            (source, caption, skip, "video" if video or n_raw > 1 else "image", f, h, w,
             frames.tobytes() if frames is not None else b""),
        ):
            cols[name].append(value)
    return pa.table(cols, schema=DECODED_SCHEMA)


def _check_latent(latent: np.ndarray, encoder: LatentEncoder, frames: np.ndarray) -> None:
    _, h, w, _ = frames.shape
    d = encoder.downsample
    ok = (
        isinstance(latent, np.ndarray)
        and latent.ndim == 4
        and latent.shape[0] == encoder.channels
        and latent.shape[2:] == (h // d, w // d)
    )
    if not ok:
        raise ValueError(
            f"{type(encoder).__name__}.encode returned shape {getattr(latent, 'shape', None)} for "
            f"frames {frames.shape}; expected ({encoder.channels}, T, {h // d}, {w // d})"
        )


def _check_text(text: np.ndarray, pooled: np.ndarray, encoder: TextEncoder) -> None:
    if text.ndim != 2 or text.shape[1] != encoder.dim or pooled.shape != (encoder.pooled_dim,):
        raise ValueError(
            f"{type(encoder).__name__}.encode returned text {text.shape} and pooled "
            f"{pooled.shape}; expected (L, {encoder.dim}) and ({encoder.pooled_dim},)"
        )


def _pair(encoder: LatentEncoder, text: TextEncoder) -> tuple[LatentEncoder, TextEncoder]:
    return encoder, text


def prebuilt(encoder: LatentEncoder, text: TextEncoder) -> Callable[[], tuple[LatentEncoder, TextEncoder]]:
    """A build function handing out already made encoders (pickled into actors as they are)."""
    return functools.partial(_pair, encoder, text)


class EncodeStage:
    """DECODED_SCHEMA rows -> ROWS_SCHEMA rows. Ray Data builds one per actor (so the
    models load once per actor); the in-process path builds one."""

    def __init__(self, build: Callable[[], tuple[LatentEncoder, TextEncoder]], max_text_tokens: int,
                 conditioning: Callable[[LatentEncoder], hf.WanI2VConditioning] | None = None) -> None:
        self.encoder, self.text_encoder = build()
        for obj, proto in ((self.encoder, LatentEncoder), (self.text_encoder, TextEncoder)):
            if not isinstance(obj, proto):
                raise TypeError(f"{type(obj).__name__} does not implement {proto.__name__}")
        self.max_text_tokens = max_text_tokens
        self.conditioning = conditioning(self.encoder) if conditioning is not None else None

    def __call__(self, batch: pa.Table) -> pa.Table:
        d = batch.to_pydict()
        keep = [i for i, s in enumerate(d["skip"]) if not s]
        frames = [
            np.frombuffer(d["pixels"][i], np.uint8).reshape(d["f"][i], d["h"][i], d["w"][i], 3) for i in keep
        ]
        latents = encode_latents(self.encoder, frames)
        for latent, px in zip(latents, frames):
            _check_latent(latent, self.encoder, px)
        texts = encode_captions(self.text_encoder, [d["caption"][i] for i in keep], self.max_text_tokens)
        for text, pooled in texts:
            _check_text(text, pooled, self.text_encoder)
        conds = self.conditioning.encode_many(frames) if self.conditioning is not None else []
        n = len(d["skip"])
        empty = np.zeros(0, np.float32)
        lat: list[np.ndarray] = [empty] * n
        txt: list[np.ndarray] = [empty] * n
        pool: list[np.ndarray] = [empty] * n
        cols: dict[str, list[Any]] = {
            "sample_id": [sample_id_for(s) for s in d["source"]], "kind": d["kind"], "source": d["source"],
            **{c: [0] * n for c in ("frames", "height", "width", "channels", "visual_tokens",
                                    "text_tokens", "seq_len")},
        }
        cond: list[np.ndarray] = [empty] * n
        image: list[np.ndarray] = [empty] * n
        for k, (i, latent, (text, pooled)) in enumerate(zip(keep, latents, texts)):
            if conds:
                cond[i], image[i] = conds[k]
            c, t, h, w = latent.shape
            visual = visual_token_count(t, h, w)
            for name, value in zip(
                ("frames", "height", "width", "channels", "visual_tokens", "text_tokens", "seq_len"),
                (t, h, w, c, visual, text.shape[0], visual + text.shape[0]),
            ):
                cols[name][i] = value
            lat[i], txt[i], pool[i] = latent, text, pooled
        with_conds = self.conditioning is not None
        table = build_table(cols, lat, txt, pool, conditions=cond if with_conds else None,
                            image_contexts=image if with_conds else None)
        return table.append_column(ROWS_SCHEMA.field("skip"), pa.array(d["skip"], pa.string()))
