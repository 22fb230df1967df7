"""Data mixes in the KnapFormer paper's notation.

A mix is a comma-separated list of data codes ``gGbBiRfFsS``: ``G`` ranks each draw
``B`` samples of resolution ``R`` with ``F`` frames; ``S=1`` means the frames are
temporally compressed by 3.4 (a video VAE), ``S=0`` means they are not. Visual tokens
per sample are ``floor(R/16)**2 * frames`` (8x VAE downsampling times a 2x2 patch), and
every sample carries 0..392 text tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

TEMPORAL_COMPRESSION = 3.4
MAX_TEXT_TOKENS = 392
SPATIAL_TOKEN_STRIDE = 16  # VAE downsample (8) x patch (2)

_CODE = re.compile(r"^g(\d+)b(\d+)i(\d+)f(\d+)s([01])$")


@dataclass(frozen=True, slots=True)
class DataCode:
    """One entry of a mix: ``ranks`` ranks each holding ``batch`` samples of one kind."""

    ranks: int
    """How many ranks of the balance group draw this kind of sample."""
    batch: int
    """Samples per rank per step."""
    resolution: int
    """Square side in pixels."""
    frames: int
    """Frames in pixel space (1 for an image)."""
    compressed: bool
    """True if frames are temporally compressed by 3.4 (video latents)."""

    @property
    def latent_frames(self) -> int:
        if not self.compressed:
            return self.frames
        # The epsilon keeps 85/3.4 == 25 despite binary rounding.
        return max(1, int(self.frames / TEMPORAL_COMPRESSION + 1e-9))

    @property
    def visual_tokens(self) -> int:
        side = self.resolution // SPATIAL_TOKEN_STRIDE
        return side * side * self.latent_frames

    @property
    def code(self) -> str:
        return f"g{self.ranks}b{self.batch}i{self.resolution}f{self.frames}s{int(self.compressed)}"


def parse_code(code: str) -> DataCode:
    m = _CODE.match(code.strip())
    if not m:
        raise ValueError(
            f"bad data code {code!r}: expected gGbBiRfFsS, e.g. 'g8b4i256f1s0' "
            "(G ranks, B samples each, resolution R, F frames, S in {0,1})"
        )
    g, b, r, f, s = (int(x) for x in m.groups())
    if g < 1 or b < 1 or f < 1:
        raise ValueError(f"bad data code {code!r}: G, B and F must be >= 1")
    if r < SPATIAL_TOKEN_STRIDE:
        raise ValueError(
            f"bad data code {code!r}: resolution {r} gives no visual token "
            f"(must be >= {SPATIAL_TOKEN_STRIDE})"
        )
    return DataCode(g, b, r, f, bool(s))


def parse_mix(mix: str) -> list[DataCode]:
    """Parse ``"g16b4i256f1s0,g4b5i512f1s0"`` (or a paper mix name: ``low-res``,
    ``mixed-res``, ``image+video``) into data codes."""
    mix = PAPER_MIXES.get(mix.strip(), mix)
    parts = [p for p in mix.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"empty mix {mix!r}: give at least one data code like 'g8b4i256f1s0'")
    return [parse_code(p) for p in parts]


def mix_world_size(codes: list[DataCode]) -> int:
    return sum(c.ranks for c in codes)


def rank_codes(codes: list[DataCode], world_size: int | None = None) -> list[DataCode]:
    """The data code of every rank; a world that is a multiple of the mix's ranks
    replicates the mix (as KnapFormer's balance groups do)."""
    base = [c for c in codes for _ in range(c.ranks)]
    if world_size is None:
        return base
    if world_size % len(base):
        raise ValueError(
            f"world size {world_size} is not a multiple of the mix's {len(base)} ranks"
        )
    return base * (world_size // len(base))


def sample_step(
    codes: list[DataCode],
    rng: np.random.Generator,
    world_size: int | None = None,
    max_text_tokens: int = MAX_TEXT_TOKENS,
) -> list[list[int]]:
    """Sequence lengths (text + visual tokens) of one step, one list per rank."""
    per_rank = rank_codes(codes, world_size)
    batches = np.array([c.batch for c in per_rank])
    visual = np.repeat([c.visual_tokens for c in per_rank], batches)
    text = rng.integers(0, max_text_tokens + 1, size=visual.size)
    lens = (visual + text).tolist()
    bounds = np.concatenate([[0], np.cumsum(batches)]).tolist()
    return [lens[bounds[i] : bounds[i + 1]] for i in range(len(per_rank))]


PAPER_MIXES = {
    "low-res": "g32b32i256f1s0",
    "mixed-res": "g16b4i256f1s0,g4b5i512f1s0,g4b5i1024f1s0,g8b1i2048f1s0",
    "image+video": (
        "g8b4i256f1s0,g2b5i512f1s0,g2b5i1024f1s0,g4b1i2048f1s0,"
        "g1b10i256f4s0,g3b1i512f4s0,g8b2i256f85s1,g4b1i512f85s1"
    ),
}
