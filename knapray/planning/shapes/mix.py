"""Data mixes in the KnapFormer paper's notation.

A mix is a comma-separated list of data codes ``gGbBiRfFsS``: ``G`` ranks each draw
``B`` samples of resolution ``R`` with ``F`` frames; ``S=1`` means the frames are
temporally compressed by 3.4 (a video VAE), ``S=0`` means they are not, ``S=2`` means
Wan's causal video VAE (4x temporal, the first frame alone: ``1 + (F-1)//4`` latent
frames). Visual tokens per sample are ``floor(R/16)**2 * latent frames`` (8x VAE
downsampling times a 2x2 patch), and every sample carries 0..392 text tokens in its
sequence (joint attention; ``sample_step(max_text_tokens=0)`` for a cross-attention model,
whose text is not part of the sequence).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from knapray.limits import (MAX_FRAMES, MAX_PLANNED_SEQUENCES, MAX_RANK_TOKENS, MAX_RESOLUTION, MAX_SAMPLES_PER_RANK,
                            MAX_SEQUENCE_TOKENS, MAX_STEP_SEQUENCES, MAX_WORLD_SIZE)

TEMPORAL_COMPRESSION = 3.4
MAX_TEXT_TOKENS = 392
SPATIAL_TOKEN_STRIDE = 16  # VAE downsample (8) x patch (2)

WAN_TEMPORAL_COMPRESSION = 4
_CODE = re.compile(r"^g(\d+)b(\d+)i(\d+)f(\d+)s([012])$")


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
    causal_vae: bool = False
    """``S=2``: Wan's causal VAE, ``1 + (F-1)//4`` latent frames (``compressed`` is True too)."""

    @property
    def latent_frames(self) -> int:
        if self.causal_vae:
            return 1 + (self.frames - 1) // WAN_TEMPORAL_COMPRESSION
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
        s = 2 if self.causal_vae else int(self.compressed)
        return f"g{self.ranks}b{self.batch}i{self.resolution}f{self.frames}s{s}"


_FIELDS = (  # letter, meaning, upper bound
    ("g", "ranks", MAX_WORLD_SIZE), ("b", "samples per rank", MAX_SAMPLES_PER_RANK),
    ("i", "resolution", MAX_RESOLUTION), ("f", "frames", MAX_FRAMES),
)


def parse_code(code: str) -> DataCode:
    """One data code, every field and the tokens it makes bounded (``knapray.limits``)."""
    m = _CODE.match(code.strip())
    shown = _short(code.strip())
    if not m:
        raise ValueError(
            f"bad data code {shown!r}: expected gGbBiRfFsS, e.g. 'g8b4i256f1s0' "
            "(G ranks, B samples each, resolution R, F frames, S in {0,1,2})"
        )
    code = shown
    for (letter, what, high), text in zip(_FIELDS, m.groups()):
        if len(text) > 12 or int(text) > high:  # the length first: int() of 5000 digits is refused
            raise ValueError(f"bad data code {code!r}: {letter}{_short(text, 20)} ({what}) must be at most {high}")
    g, b, r, f, s = (int(x) for x in m.groups())
    if g < 1 or b < 1 or f < 1:
        raise ValueError(f"bad data code {code!r}: G, B and F must be >= 1")
    if r < SPATIAL_TOKEN_STRIDE:
        raise ValueError(
            f"bad data code {code!r}: resolution {r} gives no visual token "
            f"(must be >= {SPATIAL_TOKEN_STRIDE})"
        )
    c = DataCode(g, b, r, f, bool(s), causal_vae=s == 2)
    if c.visual_tokens > MAX_SEQUENCE_TOKENS:
        raise ValueError(f"bad data code {code!r}: a sample of {c.visual_tokens} visual tokens; at most "
                         f"{MAX_SEQUENCE_TOKENS} per sample")
    if c.batch * (c.visual_tokens + MAX_TEXT_TOKENS) > MAX_RANK_TOKENS:
        raise ValueError(f"bad data code {code!r}: {c.batch} samples of up to {c.visual_tokens + MAX_TEXT_TOKENS} "
                         f"tokens on a rank; at most {MAX_RANK_TOKENS} tokens per rank per step")
    return c


def parse_mix(mix: str) -> list[DataCode]:
    """Parse ``"g16b4i256f1s0,g4b5i512f1s0"`` (or a paper mix name: ``low-res``,
    ``mixed-res``, ``image+video``, ``wan``) into data codes; the mix's ranks and the sequences of
    one of its steps are bounded too."""
    mix = MIXES.get(mix.strip(), mix)
    parts = [p for p in mix.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"empty mix {mix!r}: give at least one data code like 'g8b4i256f1s0'")
    codes = [parse_code(p) for p in parts]
    check_step_size(codes)
    return codes


def check_step_size(codes: list[DataCode], world_size: int | None = None) -> None:
    """A ValueError naming the mix unless its ranks (``world_size``, default the mix's) and
    the sequences of one step over them are within ``knapray.limits``: checked before any
    per-rank or per-sequence list is built."""
    world = world_size or mix_world_size(codes)
    sequences = step_sequences(codes, world)
    mix = ",".join(c.code for c in codes)
    if world > MAX_WORLD_SIZE:
        raise ValueError(f"mix {_short(mix)!r} on {world} ranks: at most {MAX_WORLD_SIZE} ranks")
    if sequences > MAX_STEP_SEQUENCES:
        raise ValueError(f"mix {_short(mix)!r} on {world} ranks: {sequences} sequences per step; at most "
                         f"{MAX_STEP_SEQUENCES}")


def check_planned(codes: list[DataCode], steps: int, world_size: int | None = None) -> None:
    """A ValueError unless ``steps`` steps of the mix on ``world_size`` ranks hold at most
    ``MAX_PLANNED_SEQUENCES`` sequences: what ``knapray plan``/``simulate`` keep in memory."""
    check_step_size(codes, world_size)
    per_step = step_sequences(codes, world_size)
    if steps * per_step > MAX_PLANNED_SEQUENCES:
        raise ValueError(f"--steps {steps} of mix {_short(','.join(c.code for c in codes))!r}: {per_step} sequences "
                         f"per step, {steps * per_step} in all; at most {MAX_PLANNED_SEQUENCES} (--steps <= "
                         f"{max(1, MAX_PLANNED_SEQUENCES // per_step)} here)")


def step_sequences(codes: list[DataCode], world_size: int | None = None) -> int:
    """Sequences of one step of the mix replicated to ``world_size`` ranks (default the mix's)."""
    ranks = mix_world_size(codes)
    return sum(c.ranks * c.batch for c in codes) * max(1, (world_size or ranks) // ranks)


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def mix_world_size(codes: list[DataCode]) -> int:
    return sum(c.ranks for c in codes)


def rank_codes(codes: list[DataCode], world_size: int | None = None) -> list[DataCode]:
    """The data code of every rank; a world that is a multiple of the mix's ranks
    replicates the mix (as KnapFormer's balance groups do)."""
    ranks = mix_world_size(codes)
    if world_size is not None and world_size % ranks:
        raise ValueError(f"world size {world_size} is not a multiple of the mix's {ranks} ranks")
    check_step_size(codes, world_size)  # before the lists are built
    base = [c for c in codes for _ in range(c.ranks)]
    return base if world_size is None else base * (world_size // ranks)


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

WAN_MIXES = {
    "wan": (
        "g8b8i512f1s0,g4b4i1024f1s0,g8b2i512f17s2,g4b1i512f49s2,g4b1i512f81s2,g4b1i768f81s2"
    ),
}
"""A Wan 2.1 fine-tuning mix (32 ranks): 512² and 1024² images (1024 and 4096 tokens), and
clips through Wan's causal VAE: 17 frames at 512² (5 latent frames, 5120 tokens), 49 at
512² (13, 13312), 81 at 512² (21, 21504) and 81 at 768² (21, 48384, about a 720p clip's
75600 at 1280x720 scaled down). Lengths are visual tokens: plan it with a cross-attention
model (``knapray simulate --model wan14b``)."""

HELD_OUT_MIXES = {
    "long-video": "g16b4i256f1s0,g8b1i512f85s1,g8b1i1024f33s1",
}
"""A mix no planner was tuned on (32 ranks): 256² images beside long clips, 85 frames at
512² (25 latent frames, 25,600 tokens) and 33 at 1024² (10, 40,960)."""

MIXES = {**PAPER_MIXES, **WAN_MIXES, **HELD_OUT_MIXES}
"""Every named mix ``parse_mix`` accepts."""
