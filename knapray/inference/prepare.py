"""Jobs resolved for the ranks that run them: each ``Job``'s caption encoded (or a corpus
sample's text borrowed), its latent shape, noise, timesteps and guidance fixed on one
process, as ``knapray sample`` resolves its requests, so that every rank plans the same
batch and every job's result is the single-process sampler's."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from knapray.inference.jobs import Job
from knapray.models.sampling import DenoiseJob, check_first_frame, denoise_job, job_noise


def default_guidance(model_cfg) -> float:
    """``--guidance``'s default: a model's embedded guidance input as its pipeline's (FLUX.1-dev
    3.5, FLUX.2 [dev] 4.0), else the family's classifier-free scale (``Family.cfg_default``:
    Qwen-Image's pipeline 4.0; 1: off)."""
    from knapray.models.families import get_family

    fam = get_family(model_cfg.family)
    return fam.guidance_input_default if getattr(model_cfg, "guidance_embeds", False) else fam.cfg_default


def latent_shape(model_cfg, down: int, job: Job) -> tuple[int, int, int]:
    """(T, H, W) latent of a job: ``frames`` latent frames times the temporal patch."""
    return job.frames * int(model_cfg.patch_size[0]), job.height // down, job.width // down


def denoise_jobs(cfg: Any, jobs: list[Job], text_encoder: Any, unconditional: tuple[np.ndarray, np.ndarray], *,
                 down: int, shared_seed: int | None = None, max_text_tokens: int = 256,
                 image_encoder: Any = None) -> list[DenoiseJob]:
    """``cfg``: the run's TrainConfig. ``shared_seed``: draw every job's noise in order from
    one generator (``knapray sample``'s batch); None: each from its own ``seed``. The first
    job that cannot be resolved is a ValueError."""
    out = resolve_jobs(cfg, jobs, text_encoder, unconditional, down=down, shared_seed=shared_seed,
                       max_text_tokens=max_text_tokens, image_encoder=image_encoder)
    for got in out:
        if isinstance(got, str):
            raise ValueError(got)
    return out


def resolve_jobs(cfg: Any, jobs: list[Job], text_encoder: Any, unconditional: tuple[np.ndarray, np.ndarray], *,
                 down: int, shared_seed: int | None = None, max_text_tokens: int = 256,
                 image_encoder: Any = None) -> list[DenoiseJob | str]:
    """Each job's ``DenoiseJob``, or the error (one line) that rules it out alone. Every
    caption of the batch is encoded in one call (``encode_captions``: batched on the
    encoder's device), ``like`` ids read from the corpus, a conditioning ``image`` encoded
    by ``image_encoder`` at the job's size: into its clean first latent frame by the corpus's
    VAE (a time per token: ``first_frames.first_frame``), or into its conditioning channels and
    image tokens by a ``corpus.hf.WanI2VConditioning`` (Wan 2.1 I2V, ``model.image_dim``:
    ``first_frames.image_condition``; every job needs an image)."""
    from knapray.corpus.encoders import encode_captions
    from knapray.inference.conditioning import corpus_text
    from knapray.inference.first_frames import first_frame, image_condition

    m = cfg.model
    conds: list[Any] = []
    for job in jobs:
        if job.like is not None:
            try:
                conds.append(corpus_text(cfg.data.corpus, job.like, m.text_dim, m.pooled_dim))
            except ValueError as e:
                conds.append(str(e))
        else:
            conds.append(unconditional if job.caption is None else None)
    captioned = [i for i, job in enumerate(jobs) if job.caption is not None]
    if captioned:
        encoded = encode_captions(text_encoder, [jobs[i].caption for i in captioned], max_text_tokens)
        for i, cond in zip(captioned, encoded):
            conds[i] = cond
    firsts: dict[int, np.ndarray] = {}
    conditions: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    takes_tokens = bool(getattr(m, "image_dim", 0))
    for i, job in enumerate(jobs):
        if isinstance(conds[i], str):
            continue
        if job.image is None:
            if takes_tokens:
                conds[i] = "image: this run's model (Wan 2.1 I2V, model.image_dim) samples from a conditioning image"
            continue
        if image_encoder is None:
            conds[i] = ("image: this run's corpus records no image encoder to encode it with" if takes_tokens else
                        "image: this run's corpus records no latent encoder (VAE) to encode it with")
            continue
        shape = latent_shape(m, down, job)
        try:
            if takes_tokens:
                conditions[i] = image_condition(image_encoder, job.image, "image", job.width, job.height, shape[0])
            else:
                firsts[i] = first_frame(image_encoder, job.image, "image", job.width, job.height)
                check_first_frame(m, (m.in_channels, *shape), firsts[i])
        except ValueError as e:
            conds[i] = str(e) if str(e).startswith("image: ") else f"image: {e}"
    ok = [i for i, c in enumerate(conds) if not isinstance(c, str)]
    shapes = [latent_shape(m, down, jobs[i]) for i in ok]
    noise = job_noise(m, shapes, shared_seed if shared_seed is not None else [jobs[i].seed for i in ok])
    out: list[DenoiseJob | str] = list(conds)
    for i, z in zip(ok, noise):
        job = jobs[i]
        condition, image_context = conditions.get(i, (None, None))
        out[i] = dataclasses.replace(
            denoise_job(m, z, conds[i], steps=job.steps, shift=job.shift, unconditional=unconditional,
                        guidance=job.guidance if job.guidance is not None else default_guidance(m),
                        first_frame=firsts.get(i), condition=condition, image_context=image_context),
            adapter=job.adapter)
    return out
