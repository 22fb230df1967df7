"""In-memory step batches from a data mix, for parity checks and benchmarks (no corpus)."""

from __future__ import annotations

import torch

from knapray.corpus.synthetic import latent_side
from knapray.data import build_packed_batch
from knapray.models import DiTConfig, PackedBatch
from knapray.planning.shapes.mix import MAX_TEXT_TOKENS, SPATIAL_TOKEN_STRIDE, parse_mix, rank_codes


def mix_batches(
    mix: str,
    cfg: DiTConfig,
    *,
    scale: int,
    seed: int,
    world_size: int | None = None,
    max_text_tokens: int = MAX_TEXT_TOKENS,
) -> list[PackedBatch]:
    """One noised PackedBatch per rank, drawn from ``mix`` at 1/``scale`` resolution.

    Deterministic in ``seed``: every process that calls it gets the same batches, so ranks
    (and a single-process reference) agree without exchanging data.
    """
    codes = rank_codes(parse_mix(mix), world_size)
    small = [c.code for c in codes if c.resolution // (SPATIAL_TOKEN_STRIDE * scale) < 1]
    if small:
        raise ValueError(f"scale {scale} leaves {sorted(set(small))} without a visual token")
    gen = torch.Generator().manual_seed(seed)
    text_limit = max_text_tokens // scale
    batches = []
    sample_id = 0
    for code in codes:
        side = latent_side(code, scale)
        samples = []
        for _ in range(code.batch):
            n_txt = int(torch.randint(0, text_limit + 1, (1,), generator=gen)) if cfg.text_dim else 0
            samples.append(
                {
                    "sample_id": sample_id,
                    "latent": torch.randn(cfg.in_channels, code.latent_frames, side, side, generator=gen).numpy(),
                    "text": torch.randn(n_txt, cfg.text_dim, generator=gen).numpy(),
                    "pooled": torch.randn(cfg.pooled_dim, generator=gen).numpy(),
                }
            )
            sample_id += 1
        # The same per-sample timesteps and noise as training (knapray.data).
        batches.append(build_packed_batch(samples, cfg, seed=seed))
    return batches


def concat_batches(batches: list[PackedBatch]) -> PackedBatch:
    """All ranks' batches as one batch (the single-process reference)."""
    seq_index, total = [], 0
    for b in batches:
        seq_index.append(b.seq_index + total)
        total += b.num_sequences
    seq_lens = torch.cat([b.seq_lens for b in batches])
    cu = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq_lens, 0)
    return PackedBatch(
        x_txt=torch.cat([b.x_txt for b in batches]),
        x_img=torch.cat([b.x_img for b in batches]),
        is_text=torch.cat([b.is_text for b in batches]),
        pos=torch.cat([b.pos for b in batches]),
        seq_index=torch.cat(seq_index),
        cu_seqlens=cu,
        max_seqlen=max((b.max_seqlen for b in batches), default=0),
        timesteps=torch.cat([b.timesteps for b in batches]),
        pooled=torch.cat([b.pooled for b in batches]),
        seq_lens=seq_lens,
        grids=tuple(g for b in batches for g in b.grids),
        targets=torch.cat([b.targets for b in batches]),
        guidance=torch.cat([b.guidance for b in batches]) if batches and batches[0].guidance is not None else None,
    )
