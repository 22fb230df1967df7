"""Sampling requests: a caption (or a corpus sample's text) at a size, the sizes read and
checked against what the model takes, and captions paired with sizes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Request:
    caption: str | None
    height: int
    """Pixels (latent height times the corpus's VAE downsample)."""
    width: int
    frames: int = 1
    like: int | None = None
    """A corpus sample id whose text embeddings to use instead of a caption."""
    image: str | None = None
    """The conditioning image's path (``--image``): its latent is the first latent frame."""


def parse_size(text: str) -> tuple[int, int]:
    """``"768x384"`` -> (width 768, height 384), in pixels, each side at most ``MAX_IMAGE_SIDE``.
    One spelling: ``512X512``, ``512 x 512`` or ``+512x512`` is refused, naming the form."""
    import unicodedata

    from knapray.limits import MAX_IMAGE_SIDE, SIZE_FORM

    match = re.fullmatch(SIZE_FORM, text) if len(text) <= 40 else None
    if match is None:
        meant = re.sub(r"[\s+]", "", unicodedata.normalize("NFKC", text)).lower() if len(text) <= 40 else ""
        raise ValueError(f"--size {text[:40]!r}: expected WIDTHxHEIGHT in pixels, ASCII digits and a lowercase x: "
                         + (meant if re.fullmatch(SIZE_FORM, meant) else "e.g. 768x512"))
    w, h = int(match[1]), int(match[2])
    if w < 1 or h < 1:
        raise ValueError(f"--size {text!r}: width and height must be positive")
    if max(w, h) > MAX_IMAGE_SIDE:
        raise ValueError(f"--size {text}: at most {MAX_IMAGE_SIDE} pixels a side")
    return w, h


def check_sizes(sizes: list[tuple[int, int]], frames: int, down: int, patch: tuple[int, int]) -> None:
    """Every (width, height) a multiple of what the model takes (VAE factor ``down`` times the
    patch (height, width)), never rounded: the error names the nearest valid sizes; and the
    image tokens of a request and of all of them bounded (one packed batch per step)."""
    from knapray.limits import MAX_IMAGE_TOKENS, MAX_SAMPLE_BATCH_TOKENS

    mh, mw = down * patch[0], down * patch[1]
    total = 0
    for w, h in sizes:
        if h % mh or w % mw:
            def near(v: int, m: int) -> tuple[int, int]:
                return max(m, v // m * m), max(m, -(-v // m) * m)

            (w0, w1), (h0, h1) = near(w, mw), near(h, mh)
            nearest = " or ".join(dict.fromkeys(f"{a}x{b}" for a, b in ((w0, h0), (w1, h1))))
            both = f"of {mw}" if mw == mh else f"of {mw} (width) and {mh} (height)"
            raise ValueError(f"--size {w}x{h}: with a VAE downsample of {down} and patches of {patch[1]}x{patch[0]} "
                             f"the width and height must be multiples {both} pixels; nearest valid: {nearest}")
        tokens = frames * (h // mh) * (w // mw)
        if tokens > MAX_IMAGE_TOKENS:
            raise ValueError(f"--size {w}x{h}" + (f" --frames {frames}" if frames > 1 else "") + f": {tokens} image "
                             f"tokens; at most {MAX_IMAGE_TOKENS} a request (e.g. {256 * mw}x{256 * mh})")
        total += tokens
    if total > MAX_SAMPLE_BATCH_TOKENS:
        raise ValueError(f"{len(sizes)} requests of {total} image tokens together (one batch every step); at most "
                         f"{MAX_SAMPLE_BATCH_TOKENS}: sample them in several runs")


def pair_requests(prompts: list, sizes: list[tuple[int, int]]) -> list[tuple[Any, tuple[int, int]]]:
    """(prompt, size) per request: one size for every prompt, one size per prompt, or one
    prompt at every size; anything else, or more than ``MAX_SAMPLE_REQUESTS`` requests, is a
    ValueError naming the counts."""
    from knapray.limits import MAX_SAMPLE_REQUESTS

    requests = max(len(prompts), len(sizes))
    if requests > MAX_SAMPLE_REQUESTS:
        raise ValueError(f"{requests} requests (--caption / --like / --size); at most {MAX_SAMPLE_REQUESTS} a call "
                         "(each is a tile of one PNG grid): sample them in several calls")
    if len(sizes) == 1:
        return [(p, sizes[0]) for p in prompts]
    if len(prompts) == 1:
        return [(prompts[0], size) for size in sizes]
    if len(sizes) == len(prompts):
        return list(zip(prompts, sizes))
    raise ValueError(f"{len(prompts)} requests (--caption / --like) and {len(sizes)} --size values: give one "
                     "--size for all, one per request, or one caption with several sizes")
