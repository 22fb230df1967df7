"""Jobs resolved for the ranks that run them: each ``Job``'s caption encoded (or a corpus
sample's text borrowed), its latent shape, noise, timesteps and guidance fixed on one
process, as ``knapray sample`` resolves its requests, so that every rank plans the same
batch and every job's result is the single-process sampler's."""

from __future__ import annotations

from typing import Any

import numpy as np

from knapray.inference.jobs import Job
from knapray.models.sampling import DenoiseJob, denoise_job, job_noise


def default_guidance(model_cfg) -> float:
    """``--guidance``'s default: FLUX.1-dev's embedded 3.5, else 1 (off)."""
    return 3.5 if getattr(model_cfg, "guidance_embeds", False) else 1.0


def latent_shape(model_cfg, down: int, job: Job) -> tuple[int, int, int]:
    """(T, H, W) latent of a job: ``frames`` latent frames times the temporal patch."""
    return job.frames * int(model_cfg.patch_size[0]), job.height // down, job.width // down


def denoise_jobs(cfg: Any, jobs: list[Job], text_encoder: Any, unconditional: tuple[np.ndarray, np.ndarray], *,
                 down: int, shared_seed: int | None = None, max_text_tokens: int = 256) -> list[DenoiseJob]:
    """``cfg``: the run's TrainConfig. ``shared_seed``: draw every job's noise in order from
    one generator (``knapray sample``'s batch); None: each from its own ``seed``."""
    from knapray.inference.conditioning import corpus_text

    m = cfg.model
    conds = []
    for job in jobs:
        if job.like is not None:
            conds.append(corpus_text(cfg.data.corpus, job.like, m.text_dim, m.pooled_dim))
        elif job.caption is not None:
            conds.append(text_encoder.encode(job.caption, max_text_tokens))
        else:
            conds.append(unconditional)
    shapes = [latent_shape(m, down, job) for job in jobs]
    noise = job_noise(m, shapes, shared_seed if shared_seed is not None else [job.seed for job in jobs])
    return [denoise_job(m, z, cond, steps=job.steps, shift=job.shift, unconditional=unconditional,
                        guidance=job.guidance if job.guidance is not None else default_guidance(m))
            for job, z, cond in zip(jobs, noise, conds)]
