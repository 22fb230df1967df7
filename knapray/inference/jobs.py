"""One sampling job (a request with its own steps, guidance and seed) and the rules a run
sets for them, read without loading weights: what ``knapray sample --world-size N`` plans
together and what ``knapray serve`` receives over HTTP.

A job's result is the single-process ``knapray sample`` output of that one request with
the same ``seed`` (its noise is drawn alone from ``seed``), whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from knapray.limits import MAX_IMAGE_SIDE, MAX_SEED, MAX_STEPS, MAX_TEXT_LENGTH

MAX_GUIDANCE = 100.0
"""Largest guidance scale (classifier-free, or FLUX.1-dev's input) and timestep shift a job may ask for."""


@dataclass(frozen=True)
class Job:
    caption: str | None
    """None: the unconditional caption, or ``like``'s text."""
    width: int
    """Pixels."""
    height: int
    frames: int = 1
    """Latent frames (videos); 1 for an image."""
    steps: int = 28
    guidance: float | None = None
    """None: the family's default (1, off; FLUX.1-dev: 3.5, its embedded input)."""
    shift: float | None = None
    """None: the family's (``models.sampling.request_shifts``)."""
    seed: int = 0
    like: int | None = None
    """A corpus sample id whose text embeddings replace the caption."""
    adapter: str | None = None
    """A served LoRA adapter by name (``knapray serve --lora NAME=RUN``); None: the run's own."""
    image: bytes | None = field(default=None, repr=False)
    """A conditioning image, a PNG or JPEG file's bytes: its latent is the first latent frame,
    kept clean at time 0 (a model with a time per token, Wan 2.2 TI2V), or its conditioning
    channels and image tokens (Wan 2.1 I2V, which needs one); None: from text alone."""


@dataclass(frozen=True)
class RunRules:
    """What a run's jobs must satisfy, from its config and corpus record (no weights)."""

    down: int
    """The corpus's VAE downsample."""
    patch: tuple[int, int]
    """The model's patch (height, width)."""
    text_encoder: bool
    """Whether captions can be encoded (the corpus records a text encoder)."""
    first_frame: bool = False
    """Whether the model takes a conditioning image as its first latent frame (``model.expand_timesteps``)."""
    image_encoder: bool = False
    """Whether the corpus records the latent encoder (its VAE) that encodes such an image."""
    condition: bool = False
    """Whether the model takes a conditioning image's channels and tokens (``model.image_dim``:
    Wan 2.1 I2V): every job needs an image."""
    vision_encoder: bool = False
    """Whether the image encoder of those tokens is known (the corpus's record, or ``--image-encoder``)."""

    @property
    def takes_image(self) -> bool:
        """Whether a job may send a conditioning image (Wan 2.2 TI2V, Wan 2.1 I2V)."""
        return self.first_frame or self.condition

    @property
    def multiple(self) -> tuple[int, int]:
        """(width, height) every size must be a multiple of, in pixels."""
        return self.down * self.patch[1], self.down * self.patch[0]

    def check(self, job: Job) -> None:
        """ValueError naming the first bad field and its valid range (the bounds
        ``knapray sample`` applies to its flags)."""
        from knapray.inference.requests import check_sizes

        if job.caption is not None and not self.text_encoder:
            raise ValueError("caption: this run's corpus records no text encoder; send 'like' (a corpus sample id)")
        if job.caption is not None and len(job.caption) > MAX_TEXT_LENGTH:
            raise ValueError(f"caption: {len(job.caption)} characters; at most {MAX_TEXT_LENGTH}")
        for name, value, lo, hi in (("width", job.width, 1, MAX_IMAGE_SIDE), ("height", job.height, 1, MAX_IMAGE_SIDE),
                                    ("frames", job.frames, 1, 1 << 16), ("steps", job.steps, 1, MAX_STEPS),
                                    ("seed", job.seed, 0, MAX_SEED)):
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name}: {value!r}; an integer in [{lo}, {hi}]")
        if job.like is not None and (isinstance(job.like, bool) or not isinstance(job.like, int) or job.like < 0):
            raise ValueError(f"like: {job.like!r}; a corpus sample id, an integer >= 0")
        for name, value, lo in (("guidance", job.guidance, 0.0), ("shift", job.shift, None)):
            if value is None:
                continue
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
            ok = ok and (value > 0 if lo is None else lo <= value) and value <= MAX_GUIDANCE
            if not ok:
                what = f"in (0, {MAX_GUIDANCE:g}]" if lo is None else f"in [{lo:g}, {MAX_GUIDANCE:g}]"
                raise ValueError(f"{name}: {value!r}; a number {what}")
        try:
            check_sizes([(job.width, job.height)], job.frames, self.down, self.patch)
        except ValueError as e:  # the sample command's words, with the field names of a job
            raise ValueError(str(e).replace("--size ", "width x height ").replace("--frames", "frames")) from None
        if job.image is None and self.condition:
            raise ValueError("image: this run's model (Wan 2.1 I2V, model.image_dim) samples from a conditioning "
                             "image; send image (a PNG or JPEG file, base64)")
        if job.image is not None:
            self.check_image(job.frames, "image")
            if not isinstance(job.image, bytes):
                raise ValueError(f"image: a {type(job.image).__name__}; the bytes of a PNG or JPEG file")
            from knapray.inference.first_frames import open_image

            open_image(job.image, "image")

    def check_image(self, frames: int, name: str) -> None:
        """ValueError naming ``name`` (``--image``, a request's ``image``) where a conditioning
        image cannot be taken: a model that takes none (neither a time per token nor image
        tokens), a corpus without its VAE, a Wan 2.1 I2V run whose image encoder is unknown, or,
        with a time per token, a single latent frame (the image would be the whole sample)."""
        if not self.takes_image:
            raise ValueError(f"{name}: this run's model takes no conditioning image (model.expand_timesteps is "
                             "false and model.image_dim 0; only Wan 2.2 TI2V, a time per token, and Wan 2.1 I2V, "
                             "image tokens, sample from an image)")
        if not self.image_encoder:
            raise ValueError(f"{name}: this run's corpus records no latent encoder (VAE) to encode the image with")
        if self.condition and not self.vision_encoder:
            raise ValueError(f"{name}: this run's corpus records no image encoder (schema.json encoders.image: an "
                             "ingest without --image-encoder); give --image-encoder DIR (a CLIPVisionModel)")
        if self.first_frame and frames < 2:
            raise ValueError(f"{name}: the image is the first latent frame; give frames 2 or more (got {frames})")


def run_rules(cfg, vision_encoder: bool = False) -> RunRules:
    """The ``RunRules`` of a run's config (its corpus's schema.json read, nothing else);
    ``vision_encoder``: an image encoder given beside the corpus's record (``--image-encoder``)."""
    from knapray.corpus import read_schema_json
    from knapray.inference.conditioning import TEXT_ENCODERS, corpus_records

    text_rec, latent_rec, dims = corpus_records(cfg.data.corpus)
    image_rec = (read_schema_json(cfg.data.corpus).get("encoders") or {}).get("image") or {}
    _, ph, pw = cfg.model.patch_size
    return RunRules(down=int(dims.get("vae_downsample", 8)), patch=(int(ph), int(pw)),
                    text_encoder=text_rec.get("class") in TEXT_ENCODERS,
                    first_frame=bool(getattr(cfg.model, "expand_timesteps", False)),
                    image_encoder=encodes_images(latent_rec),
                    condition=bool(getattr(cfg.model, "image_dim", 0)),
                    vision_encoder=vision_encoder or "path" in image_rec)


def encodes_images(latent_rec: dict) -> bool:
    """Whether a corpus's latent encoder record is one ``inference.conditioning.corpus_decoder``
    rebuilds (a diffusers VAE, or the stand-in pixel encoder): it encodes a conditioning image."""
    return "path" in latent_rec or latent_rec.get("class") == "PixelPatchEncoder"
