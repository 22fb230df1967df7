"""How a checkpoint's tensors map onto a knapray model's parameters, row range by row range.

A ``Layout`` is a list of ``Piece``s: rows [src, src + rows) of checkpoint tensor ``key``
are rows [dst, dst + rows) of knapray parameter ``param``; the trailing dimensions are the
same. That covers every difference between the layouts knapray reads and writes: renames,
tensors fused in one and split in the other (q, k, v), and halves in another order (a
final modulation's shift and scale). Loading and exporting use the same pieces in the two
directions, and the checkpoint's tensor shapes follow from the parameters' shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    key: str
    """The checkpoint tensor's name."""
    param: str
    """The knapray parameter's name (``named_parameters`` of the unwrapped model)."""
    src: int
    """First row of the piece in the checkpoint tensor."""
    dst: int
    """First row of the piece in the parameter."""
    rows: int
    """Rows in the piece (dim 0; the whole of a 1-D tensor's length)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """A checkpoint layout for one model config: pieces, and the checkpoint's shapes."""

    name: str
    """``diffusers`` or ``bfl`` (what the pieces' keys follow)."""
    pieces: tuple[Piece, ...]
    shapes: Mapping[str, tuple[int, ...]]
    """Checkpoint key -> the tensor's shape."""

    @property
    def keys(self) -> list[str]:
        """Checkpoint keys in the order of the pieces (the model's parameter order)."""
        return list(dict.fromkeys(p.key for p in self.pieces))

    def pieces_of(self, key: str) -> list[Piece]:
        return [p for p in self.pieces if p.key == key]

    def gather(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The checkpoint's tensors from a model's parameters (``named_parameters``, plain
        tensors), each made where and in the dtype of the parameter it starts from."""
        out: dict[str, Any] = {}
        for p in self.pieces:
            src = params[p.param]
            if p.key not in out:
                out[p.key] = src.new_empty(self.shapes[p.key])
            out[p.key][p.src: p.src + p.rows].copy_(src[p.dst: p.dst + p.rows])
        return out

    def first_mismatch(self, found: Mapping[str, Sequence[int]]) -> str | None:
        """The first problem of a checkpoint holding ``found`` (key -> shape), in one phrase
        naming the key (missing keys first, in model order; then extra keys; then shapes);
        None if every key is there with its shape and nothing else."""
        for key in self.keys:
            if key not in found:
                return f"tensor {key!r} is missing"
        extra = [k for k in found if k not in self.shapes]
        if extra:
            return f"tensor {sorted(extra)[0]!r} is not part of this model" + (
                f" ({len(extra) - 1} more such)" if len(extra) > 1 else "")
        for key in self.keys:
            if tuple(found[key]) != tuple(self.shapes[key]):
                return f"tensor {key!r} has shape {list(found[key])}, the model's config needs {list(self.shapes[key])}"
        return None


def build_layout(name: str, rules: Iterable[tuple[str, str, int, int, int]],
                 param_shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    """A layout from (key, param, src, dst, rows) rules; ``rows`` -1 means the parameter's
    whole dim 0. Every parameter must be covered exactly once, row by row."""
    pieces = []
    for key, param, src, dst, rows in rules:
        if param not in param_shapes:
            raise KeyError(f"layout {name}: rule for {key!r} names no parameter {param!r}")
        pieces.append(Piece(key, param, src, dst, param_shapes[param][0] if rows < 0 else rows))
    covered: dict[str, list[tuple[int, int]]] = {}
    sources: dict[str, list[tuple[int, int]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for p in pieces:
        covered.setdefault(p.param, []).append((p.dst, p.dst + p.rows))
        sources.setdefault(p.key, []).append((p.src, p.src + p.rows))
        trailing = tuple(param_shapes[p.param][1:])
        rows = max(shapes.get(p.key, (0,))[0], p.src + p.rows)
        if p.key in shapes and shapes[p.key][1:] != trailing:
            raise ValueError(f"layout {name}: {p.key!r} pieces disagree on trailing dims")
        shapes[p.key] = (rows, *trailing)
    for what, spans_of, sizes in (("parameter", covered, {k: v[0] for k, v in param_shapes.items()}),
                                  ("tensor", sources, {k: v[0] for k, v in shapes.items()})):
        for name_, size in sizes.items():
            spans = sorted(spans_of.get(name_, []))
            ends = [0] + [b for _, b in spans]
            if not spans or [a for a, _ in spans] != ends[:-1] or ends[-1] != size:
                raise ValueError(f"layout {name}: {what} {name_!r} ({size} rows) is covered by rows {spans}")
    return Layout(name, tuple(pieces), shapes)
