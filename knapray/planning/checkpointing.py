"""Which transformer blocks activation checkpointing recomputes: the one rule (pure).

Blocks are numbered in execution order, double-stream blocks first, then single-stream
ones. ``every_k`` checkpoints blocks ``k-1, 2k-1, 3k-1, ...`` (torchtitan's ``ac_freq``: it
counts a block, then checkpoints it when the count is a multiple of k), so a model of
fewer than k blocks has none checkpointed. ``full`` is every block (``every_k`` with k=1);
``none`` is none.

Everything that applies or models checkpointing asks this function: the trainer's
``parallelize`` (``knapray.train.parallelize``), the memory model
(``knapray.planning.memory``), its measurement (``knapray.testing.memory_check``) and
calibration (through ``parallelize``), so all four agree on what is recomputed.
"""

from __future__ import annotations

AC_MODES = ("none", "full", "every_k")


def checkpointed_blocks(mode: str, every: int, num_blocks: int) -> tuple[bool, ...]:
    """Per block in execution order: is it checkpointed under ``mode`` (``none``, ``full``,
    ``every_k`` with k = ``every``)? Raises ValueError naming a bad value."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing must be one of {list(AC_MODES)}, got {mode!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"ac_every must be an int >= 1, got {every!r}")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
    if mode == "none":
        return (False,) * num_blocks
    k = 1 if mode == "full" else every
    return tuple((i + 1) % k == 0 for i in range(num_blocks))
