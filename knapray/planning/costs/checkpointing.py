"""Which transformer blocks activation checkpointing recomputes: the one rule (pure).

Blocks are numbered in execution order, double-stream blocks first, then single-stream
ones. ``every_k`` checkpoints blocks ``k-1, 2k-1, 3k-1, ...`` (torchtitan's ``ac_freq``: it
counts a block, then checkpoints it when the count is a multiple of k), so a model of
fewer than k blocks has none checkpointed. ``full`` is every block (``every_k`` with k=1);
``none`` is none. ``selective`` checkpoints every block like ``full`` but keeps what
attention returns (its output and log-sum-exp: ``SELECTIVE_KEEPS``), so backward
recomputes the matrix products and elementwise work and never the attention kernel.

Everything that applies or models checkpointing asks this function: the trainer's
``parallelize`` (``knapray.worker.parallelize``), the memory model
(``knapray.planning.costs.memory``), its measurement (``knapray.testing.memory_check``) and
calibration (through ``parallelize``), so all four agree on what is recomputed.
"""

from __future__ import annotations

AC_MODES = ("none", "full", "every_k", "selective")
"""The one list of checkpointing modes: the run config, the flags, ``parallelize`` and the
memory model take theirs from here."""

SELECTIVE_KEEPS = frozenset({
    "torch_attn::_varlen_attn",  # torch.nn.attention.varlen (torch_varlen, FA3 / FA4 through it)
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "flash_attn::_flash_attn_varlen_forward",  # flash-attn 2.6+ registers its kernels as ops
    "flash_attn::_flash_attn_forward",
})
"""The attention kernels (operator names) whose outputs ``selective`` keeps through backward.
An attention that reaches none of them (the reference's composite SDPA) is recomputed, as
under ``full``. Ulysses' all-to-alls are recomputed too: they write into buffers in place,
and torch's selective checkpointing caches only the outputs of functional ops."""


def checkpointed_blocks(mode: str, every: int, num_blocks: int) -> tuple[bool, ...]:
    """Per block in execution order: is it checkpointed under ``mode`` (``none``, ``full``,
    ``selective``, ``every_k`` with k = ``every``)? Raises ValueError naming a bad value."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing must be one of {list(AC_MODES)}, got {mode!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"ac_every must be an int >= 1, got {every!r}")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
    if mode == "none":
        return (False,) * num_blocks
    k = every if mode == "every_k" else 1
    return tuple((i + 1) % k == 0 for i in range(num_blocks))
