"""The serving policy: which waiting requests start now, on which ranks (pure: numpy).
``knapray serve``'s gang runs it (``driver.gang``), and the serving simulator predicts it
(``planning.inference.serving``): the same decisions, from real completions in one and from the
predicted ones in the other.

Requests run on *blocks*: ranks that form a bag for a whole denoising loop, on their own (a
block that finishes takes the next requests at once; no block waits for another, as every
bag of a batch-by-batch gang waited for the batch's slowest). The blocks a gang can form
are fixed when it starts (every rank makes each block's process group once): the aligned
power-of-two blocks of every node whose size the model's heads divide, and of whole nodes
(``planning.shapes.blocks.blocks_of``), or one fixed partition (static USP: one block of all; data parallel:
blocks of one).

At every arrival and every completion, while a rank is free and requests wait, ``decide``:

- ``balanced`` (knapray): the oldest ``window`` waiting requests are planned over every
  partition of the ranks into the scheduler's blocks (``partitions``): each request,
  largest first, to the block of the partition where it would finish earliest (a block
  starts when its last rank frees: busy ranks at their predicted end); the partition of
  the smallest makespan wins (then the smallest sum of completions). Every block of it that
  is free now starts all the requests it was given, packed in one loop (a request leaves
  the loop after its own steps); the requests of blocks that are not free wait for the
  next decision, where they are planned again. So a lightly loaded gang runs a request
  over many ranks (low latency), and a loaded one packs requests onto single ranks (no
  communication, the per-step overhead shared).
- ``fifo`` (the baselines): every free block (lowest first) takes the oldest waiting request.

Seconds are per request alone on each block (measured, or the cost model's); a packed
loop's steps each cost the sum of its running requests' (``packed_finish``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

ORDERS = ("balanced", "fifo")
MAX_PARTITIONS = 4096
"""Partitions ``balanced`` plans over, at most (the most regular ones first)."""


def partitions(blocks: tuple[tuple[int, int], ...], ranks: int, limit: int = MAX_PARTITIONS) -> list[tuple[int, ...]]:
    """Every way (at most ``limit``) to cover ranks ``0..ranks-1`` exactly with ``blocks``, as
    block indices; where there are more, those of at most two block sizes (one size in a
    prefix of the ranks, another in the rest) first."""
    at: dict[int, list[int]] = {}
    for i, (first, _) in enumerate(blocks):
        at.setdefault(first, []).append(i)
    out: list[tuple[int, ...]] = []

    def walk(rank: int, chosen: list[int]) -> None:
        if len(out) >= limit:
            return
        if rank == ranks:
            out.append(tuple(chosen))
            return
        for i in sorted(at.get(rank, []), key=lambda i: -blocks[i][1]):
            walk(rank + blocks[i][1], chosen + [i])

    sizes = sorted({g for _, g in blocks}, reverse=True)
    # the regular ones first: k blocks of one size, then the rest of another
    for big in sizes:
        for small in sizes:
            if small > big:
                continue
            for k in range(ranks // big + 1):
                tiling, rank, ok = [], 0, True
                for size in [big] * k + [small] * ((ranks - k * big) // small if small else 0):
                    i = next((j for j in at.get(rank, []) if blocks[j][1] == size), None)
                    if i is None:
                        ok = False
                        break
                    tiling.append(i)
                    rank += size
                if ok and rank == ranks and tuple(tiling) not in out:
                    out.append(tuple(tiling))
    if ranks <= 8:  # every irregular tiling too, where they are few
        walk(0, [])
    return list(dict.fromkeys(out))[:limit]


def packed_finish(seconds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Seconds after a packed loop starts at which each of its requests is done: request k
    alone takes ``seconds[k]`` over ``steps[k]`` steps; each step of the loop costs the sum
    of the per-step costs of the requests still running."""
    seconds, steps = np.asarray(seconds, np.float64), np.asarray(steps, np.int64)
    per_step = seconds / steps
    out = np.empty(len(seconds))
    for k in range(len(seconds)):
        out[k] = float((per_step * np.minimum(steps, steps[k])).sum())
    return out


@dataclass(frozen=True)
class Waiting:
    """A request waiting for ranks."""

    key: Hashable
    arrival: float
    seconds: np.ndarray
    """(blocks,) predicted seconds of the request alone on every block of the scheduler."""
    steps: int = 1


class BagScheduler:
    """Ranks, the blocks they form, the waiting requests, and ``decide`` (see the module docstring)."""

    def __init__(self, blocks: tuple[tuple[int, int], ...], order: str = "balanced", window: int | None = None) -> None:
        if order not in ORDERS:
            raise ValueError(f"order must be one of {list(ORDERS)}, got {order!r}")
        if not blocks or min(g for _, g in blocks) < 1:
            raise ValueError(f"blocks must be (first rank, size >= 1), got {list(blocks)[:4]}")
        self.blocks = tuple((int(a), int(g)) for a, g in blocks)
        self.ranks = max(a + g for a, g in self.blocks)
        self.members = [np.arange(a, a + g) for a, g in self.blocks]
        self.order = order
        self.window = window or 4 * self.ranks
        self.partitions = partitions(self.blocks, self.ranks) if order == "balanced" else []
        if order == "balanced" and not self.partitions:
            raise ValueError(f"the blocks {list(self.blocks)[:8]} do not cover ranks 0..{self.ranks - 1}")
        self.busy = np.zeros(self.ranks, dtype=bool)
        self.ready = np.zeros(self.ranks)
        """When every rank is predicted to free (a free rank: when it freed)."""
        self.running: dict[int, list[Hashable]] = {}
        """Block -> the requests it runs."""
        self.waiting: list[Waiting] = []
        self.decisions = 0

    def add(self, key: Hashable, arrival: float, seconds, steps: int = 1) -> None:
        seconds = np.asarray(seconds, dtype=np.float64).reshape(-1)
        if seconds.shape != (len(self.blocks),) or not np.all(seconds > 0):
            raise ValueError(f"a request's seconds: one positive number per block ({len(self.blocks)}), "
                             f"got {seconds.tolist()[:8]}")
        self.waiting.append(Waiting(key, float(arrival), seconds, max(1, int(steps))))

    def cancel(self, key: Hashable) -> bool:
        """Drop a waiting request; False if it is not waiting (running, done or unknown)."""
        kept = [w for w in self.waiting if w.key != key]
        dropped = len(kept) != len(self.waiting)
        self.waiting = kept
        return dropped

    def finished(self, block: int, now: float) -> list[Hashable]:
        """Block ``block``'s loop ended (done, failed or stopped) at ``now``; returns its requests."""
        ranks = self.members[block]
        self.busy[ranks] = False
        self.ready[ranks] = now
        return self.running.pop(block, [])

    def decide(self, now: float) -> list[tuple[int, list[Hashable]]]:
        """(block, its requests) of every loop that starts now; the requests leave the
        waiting list and the blocks' ranks are busy until ``finished``."""
        if not self.waiting or self.busy.all():
            return []
        self.decisions += 1
        starts = self._fifo() if self.order == "fifo" else self._balanced(now)
        started = {id(w) for _, ws in starts for w in ws}
        self.waiting = [w for w in self.waiting if id(w) not in started]
        for block, ws in starts:
            ranks = self.members[block]
            secs = np.array([w.seconds[block] for w in ws])
            self.busy[ranks] = True
            self.ready[ranks] = now + float(packed_finish(secs, np.array([w.steps for w in ws])).max())
            self.running[block] = [w.key for w in ws]
        return [(block, [w.key for w in ws]) for block, ws in starts]

    def _fifo(self) -> list[tuple[int, list[Waiting]]]:
        starts, taken = [], np.zeros(self.ranks, dtype=bool)
        queue = iter(self.waiting)
        for b in range(len(self.blocks)):
            ranks = self.members[b]
            if self.busy[ranks].any() or taken[ranks].any():
                continue
            w = next(queue, None)
            if w is None:
                break
            taken[ranks] = True
            starts.append((b, [w]))
        return starts

    def _balanced(self, now: float) -> list[tuple[int, list[Waiting]]]:
        batch = self.waiting[: self.window]
        cost = np.stack([w.seconds for w in batch])  # (q, blocks)
        ready = np.where(self.busy, np.maximum(self.ready, now), now)
        order = np.argsort(-cost.min(axis=1), kind="stable")  # largest first
        best = None
        for part in self.partitions:
            start = np.array([ready[self.members[b]].max() for b in part])
            load = start.copy()
            given: list[list[int]] = [[] for _ in part]
            for r in order:
                end = load + cost[r, list(part)]
                j = int(np.argmin(end))
                load[j] = end[j]
                given[j].append(int(r))
            key = (float(load.max()), float(sum(load[j] for j in range(len(part)) if given[j])))
            if best is None or key < best[0]:
                best = (key, part, start, given)
        _, part, start, given = best
        starts = []
        for j, b in enumerate(part):
            if given[j] and start[j] <= now + 1e-12 and not self.busy[self.members[b]].any():
                starts.append((b, [batch[r] for r in sorted(given[j])]))
        return starts
