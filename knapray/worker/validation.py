"""``metrics.validation``: samples drawn while training.

Every ``every`` steps (at an optimizer-step boundary) and after the last step, every rank
runs the same Euler sampler (``knapray.models.sampling.sample_latents``, as ``knapray
sample`` does) over the same requests with the run's current weights, the EMA's swapped in
when the run keeps one: a sharded model's forward is collective, so every rank takes part;
the requests are few. The prompts' embeddings are made once, by rank 0 (corpus sample ids
read from the corpus, captions by the corpus's text encoder) and broadcast. Rank 0 then
decodes the latents (the corpus's VAE, or a latent preview) and writes
``validation/step-<N>.png`` and TensorBoard images in a thread of its own, so no rank waits
for more than the sampling; the sampling's seconds are logged (``validation/seconds``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

VALIDATION_DIR = "validation"


class Validator:
    """Draws the run's validation samples (``due`` / ``run``); ``close`` waits for the last write."""

    def __init__(self, cfg: Any, *, rank: int, group: Any = None) -> None:
        self.cfg, self.rank, self.group = cfg, rank, group
        self.v = cfg.metrics.validation
        self.enabled = self.v.every > 0
        self.last_step: int | None = None
        self._writer: threading.Thread | None = None
        self._decoder = None
        if not self.enabled:
            return
        from knapray.inference.conditioning import corpus_records
        from knapray.inference.requests import pair_requests, parse_size

        _, _, dims = corpus_records(cfg.data.corpus)
        self.down = int(dims.get("vae_downsample", 8))
        prompts = [(c, None) for c in self.v.captions] + [(None, int(i)) for i in self.v.like]
        self.pairs = pair_requests(prompts, [parse_size(s) for s in self.v.sizes])
        pt = cfg.model.patch_size[0]
        self.shapes = [(self.v.frames * pt, h // self.down, w // self.down) for _, (w, h) in self.pairs]
        self.titles = [(c or f"like sample {i}") + f"\n{w}x{h}" for (c, i), (w, h) in self.pairs]
        self.conds, self.unconditional = self._prompts()

    def _prompts(self) -> tuple[list, Any]:
        """Rank 0 embeds the prompts (and the empty caption) once; every rank gets them."""
        payload = None
        if self.rank == 0:
            from knapray.inference.conditioning import corpus_codecs, corpus_text
            from knapray.corpus.unconditional import unconditional_embeddings

            m = self.cfg.model
            encoder = None
            conds = []
            for (caption, like), _ in self.pairs:
                if like is not None:
                    conds.append(corpus_text(self.cfg.data.corpus, like, m.text_dim, m.pooled_dim))
                    continue
                if encoder is None:
                    encoder, self._decoder, _ = corpus_codecs(self.cfg.data.corpus, "cpu")
                    if encoder is None:
                        raise ValueError(f"metrics.validation.captions: the corpus {self.cfg.data.corpus} records no "
                                         "text encoder knapray can rebuild; use metrics.validation.like")
                conds.append(encoder.encode(caption, 512))
            payload = (conds, unconditional_embeddings(self.cfg.data.corpus, m.text_dim, m.pooled_dim))
        if self.group is not None:
            import torch.distributed as dist

            box = [payload]
            dist.broadcast_object_list(box, src=0, group=self.group)
            payload = box[0]
        return payload

    def due(self, step: int) -> bool:
        """Does completed step ``step`` end with a validation?"""
        return self.enabled and (step + 1) % self.v.every == 0 and self.last_step != step

    def run(self, step: int, model: Any, ema: Any = None, sinks: Any = None) -> float:
        """Sample at completed step ``step`` (every rank); returns the sampling's seconds."""
        from knapray.models.sampling import embeds_guidance, sample_latents

        t0 = time.perf_counter()
        swap = ema.swap_into(model) if ema is not None else contextlib.nullcontext(model)
        was_training = model.training
        model.eval()
        try:
            with swap:
                guidance = self.v.guidance or (3.5 if embeds_guidance(model) else 1.0)
                latents = sample_latents(model, [tuple(c) for c in self.conds], self.shapes, steps=self.v.steps,
                                         seed=self.v.seed, guidance=guidance, shift=None,
                                         unconditional=self.unconditional)
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - t0
        self.last_step = step
        if self.rank == 0:
            self.close()  # the previous validation's files first
            self._writer = threading.Thread(target=self._write, args=(step, latents, sinks, seconds),
                                            name="knapray-validation", daemon=True)
            self._writer.start()
            logger.info("validation at step %d: %d sample(s) in %.1f s (every rank sampled; files written "
                        "in the background)", step, len(latents), seconds)
        return seconds

    def _write(self, step: int, latents: list[np.ndarray], sinks: Any, seconds: float) -> None:
        from knapray.inference.conditioning import corpus_codecs
        from knapray.inference.images import preview, save_grid

        try:
            if self._decoder is None:
                _, self._decoder, _ = corpus_codecs(self.cfg.data.corpus, "cpu")
            images = [self._decoder.decode(z) if self._decoder is not None else preview(z) for z in latents]
            folder = os.path.join(self.cfg.run_dir, VALIDATION_DIR)
            os.makedirs(folder, exist_ok=True)
            save_grid(os.path.join(folder, f"step-{step:06d}.png"), images, self.titles)
            if sinks is not None:
                sinks.images(step, {f"validation/{i}": _strip(im) for i, im in enumerate(images)})
                sinks.log(step, {"validation/seconds": seconds})
        except Exception:  # noqa: BLE001 - a failed picture never stops the training
            logger.exception("validation at step %d: the samples could not be written", step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None


def _strip(image: np.ndarray) -> np.ndarray:
    """(H, W, 3) as it is, or a clip (T, H, W, 3) as its frames side by side, in [0, 1]."""
    raw = np.asarray(image)
    image = raw.astype(np.float32) / (255.0 if raw.dtype == np.uint8 else 1.0)
    if image.ndim == 4:
        image = np.concatenate(list(image), axis=1)
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=2)
    return np.clip(image, 0.0, 1.0)
