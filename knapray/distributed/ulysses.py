"""DeepSpeed-Ulysses attention inside a bag of ``g`` ranks.

Each rank of a bag holds, after routing, chunk ``p`` (its place in the bag) of every
sequence the bag runs, in the bag's agreed order (global sequence order). Attention needs
whole sequences, so one all-to-all trades tokens for heads:

    (N_p tokens, H heads)  ->  (all T tokens of the bag, H/g heads)

varlen attention runs over the bag's whole sequences, and a second all-to-all trades back.
The token permutation between "grouped by source rank" (what the all-to-all delivers) and
"grouped by sequence" (what attention needs) comes from the plan, so nothing but q, k, v
and the output travel. q, k and v move in one exchange.

A plan with overlapping groups (``knapray.planning.search.overlap``) may also give a rank whole
sequences of its own beside its share of the bag's (its *solo* bag): the layout then
lists which of the rank's rows are the bag's and which its own, the bag's rows take the
exchange above, and the rank's own sequences run as a bag of one, with no exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from knapray.indexing import permute_rows
from knapray.planning import BalancePlan
from knapray.transfer import host_to_device

from .comms import all_to_all_varsize
from .router import concat_ranges


@dataclass(frozen=True, eq=False)
class UlyssesLayout:
    """One rank's view of its bag for one plan (pure; built by ``UlyssesLayout.build``)."""

    bag: int
    bag_size: int
    rank_in_bag: int
    local_tokens: int
    """N_p: tokens this rank holds (its routed tokens)."""
    recv_splits: tuple[int, ...]
    """Tokens each bag rank holds (= tokens received from it in the first exchange)."""
    seq_order: torch.Tensor
    """(T,) int64: rows of the received buffer (grouped by source rank) in whole-sequence
    order."""
    rank_order: torch.Tensor
    """(T,) int64: inverse of ``seq_order``."""
    cu_seqlens: torch.Tensor
    """(S_bag + 1,) int32: boundaries of the bag's whole sequences."""
    max_seqlen: int
    seq_lens: tuple[int, ...] = ()
    """(S_bag,) tokens of each of the bag's sequences (host ints)."""
    solo: "UlyssesLayout | None" = None
    """The rank's own whole sequences beside the bag's (a bag of one), if the plan gives it any."""
    rows: torch.Tensor | None = None
    """With ``solo``: (N,) int64, the rank's rows of the bag's sequences, then those of its
    own, as rows of what it holds (chunk order)."""
    rows_inverse: torch.Tensor | None = None
    """The inverse permutation of ``rows``."""

    @property
    def all_tokens(self) -> int:
        """Rows this rank holds: the bag's sequences' and its own (``solo``)."""
        return self.local_tokens + (self.solo.local_tokens if self.solo is not None else 0)

    @classmethod
    def build(cls, plan: BalancePlan, rank: int, device: torch.device | str | None = None,
              chunk_len: np.ndarray | None = None) -> "UlyssesLayout":
        """``chunk_len``: (C,) tokens of each of the plan's chunks that take part, a prefix
        or suffix of every chunk kept in order (default: all, ``plan.chunk_len``); e.g.
        only the image tokens of every chunk, for attention over a sequence's image
        tokens alone (``knapray.distributed.cross``)."""
        chunk_len = plan.chunk_len if chunk_len is None else np.asarray(chunk_len, dtype=np.int64)
        lay = cls._build_bag(plan, rank, int(plan.topology.bag_of_rank[rank]), chunk_len, device)
        if not plan.overlapping:
            return lay
        solo_bag = plan.topology.solo_bag(rank)
        recv = plan.recv_chunks(rank)
        lens = chunk_len[recv]
        mine = plan.bag[plan.chunk_seq[recv]] == solo_bag
        if not mine.any():
            return lay
        starts = np.cumsum(lens) - lens
        rows = np.concatenate([concat_ranges(starts[~mine], lens[~mine]), concat_ranges(starts[mine], lens[mine])])
        return replace(lay, solo=cls._build_bag(plan, rank, solo_bag, chunk_len, device),
                       rows=host_to_device(rows, device, torch.int64),
                       rows_inverse=host_to_device(np.argsort(rows, kind="stable"), device, torch.int64))

    @classmethod
    def _build_bag(cls, plan: BalancePlan, rank: int, bag: int, chunk_len: np.ndarray,
                   device: torch.device | str | None) -> "UlyssesLayout":
        """The layout of one bag of ``rank`` (its bag of the topology, or its solo bag)."""
        topo = plan.topology
        g = int(topo.all_bag_sizes[bag])
        seqs = plan.bag_sequences(bag)
        # Chunks are sorted by (sequence, chunk) and a sequence on this bag has g of them.
        seq_first = np.cumsum(plan.bag_size_of_seq) - plan.bag_size_of_seq
        chunk_ids = seq_first[seqs][:, None] + np.arange(g)  # (S_bag, g)
        lens = chunk_len[chunk_ids]  # (S_bag, g): tokens of sequence s on bag rank c
        per_rank = lens.sum(axis=0)  # (g,)
        # Received row of (s, c, t): rank c's block offset + rows of c before s + t.
        block_start = np.cumsum(per_rank) - per_rank  # (g,)
        before = np.cumsum(lens, axis=0) - lens  # (S_bag, g)
        starts = block_start[None, :] + before  # (S_bag, g)
        # Row-major ravel walks sequence by sequence, chunk by chunk: whole-sequence order.
        seq_order = concat_ranges(starts.ravel(), lens.ravel())
        seq_lens = lens.sum(axis=1)  # (S_bag,)
        cu = np.concatenate([[0], np.cumsum(seq_lens)])

        def t(a: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return host_to_device(a, device, dtype)  # pinned, non-blocking on a GPU

        p = rank - int(topo.all_bag_starts[bag])
        return cls(
            bag=bag,
            bag_size=g,
            rank_in_bag=p,
            local_tokens=int(per_rank[p]),
            recv_splits=tuple(int(n) for n in per_rank),
            seq_order=t(seq_order),
            rank_order=t(np.argsort(seq_order, kind="stable")),
            cu_seqlens=t(cu, torch.int32),
            max_seqlen=int(seq_lens.max()) if seq_lens.size else 0,
            seq_lens=tuple(int(n) for n in seq_lens),
        )


class UlyssesAttention:
    """``attn(q, k, v)``: (N_p, H, D) each -> (N_p, H, D), attention over the bag's whole
    sequences. A bag of one rank runs plain local varlen attention.

    Collective within the bag: every rank of the bag must call it the same number of times
    (once per attention layer), also when it holds no tokens (N_p == 0), and must run the
    backward through every call. H must be divisible by the bag size.
    """

    def __init__(
        self,
        plan: BalancePlan,
        rank: int,
        group: dist.ProcessGroup | None,
        *,
        backend: str = "auto",
        scale: float | None = None,
        device: torch.device | str | None = None,
        layout: UlyssesLayout | None = None,
    ) -> None:
        """``layout``: a layout of ``plan`` built already (default: every token of the plan)."""
        self.layout = layout if layout is not None else UlyssesLayout.build(plan, rank, device)
        g = self.layout.bag_size
        if g > 1 and group is None:
            raise ValueError(
                f"rank {rank} is in a bag of {g} ranks: pass the bag's process group "
                "(BagGroups.bag_group)"
            )
        if g > 1 and dist.is_initialized() and dist.get_world_size(group) != g:
            raise ValueError(
                f"rank {rank}'s bag has {g} ranks but the group given has "
                f"{dist.get_world_size(group)}; pass BagGroups.bag_group of the same topology"
            )
        self.group = group
        self.backend = backend
        self.scale = scale
        self.choice = None
        """The ``AttentionChoice`` of the first call (``backend="auto"``: chosen for this
        step from the bag's lengths, ``knapray.attention.choose_backend``)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from knapray.attention import AttentionChoice, check_qkv, choose_backend, varlen_attention

        self.layout = lay = on_device(self.layout, q.device)
        # Before the exchange: stacking would silently promote mixed dtypes.
        check_qkv(q, k, v)
        check_local(lay, q, "q")
        if self.choice is None:
            lens = lay.seq_lens + (lay.solo.seq_lens if lay.solo is not None else ())
            self.choice = choose_backend(lens, q.device, q.dtype, q.shape[1] // lay.bag_size, q.shape[2]) \
                if self.backend == "auto" else AttentionChoice(self.backend, "set by the caller")
        backend = self.choice.backend

        def attend(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, bag: UlyssesLayout = lay) -> torch.Tensor:
            return varlen_attention(
                qs, ks, vs, bag.cu_seqlens, bag.max_seqlen, backend=backend, scale=self.scale,
                seq_lens=bag.seq_lens or None,
            )

        def in_bag(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
            if lay.bag_size == 1:
                return attend(qs, ks, vs)
            qkv = to_bag(torch.stack((qs, ks, vs), dim=1), lay, self.group)  # (T, 3, H/g, D), whole sequences
            return to_tokens(attend(*qkv.unbind(1)), lay, self.group)

        if lay.solo is None:
            return in_bag(q, k, v)
        # The bag's rows first, then the rank's own sequences (a bag of one), and back.
        qkv = permute_rows(torch.stack((q, k, v), dim=1), lay.rows, lay.rows_inverse)
        n = lay.local_tokens
        bag_out = in_bag(*qkv[:n].unbind(1))
        own_out = attend(*qkv[n:].unbind(1), bag=lay.solo)
        return permute_rows(torch.cat((bag_out, own_out)), lay.rows_inverse, lay.rows)


def on_device(lay: UlyssesLayout, device: torch.device) -> UlyssesLayout:
    """``lay`` with its index tensors on ``device`` (moved once, on first use)."""
    if lay.seq_order.device == device:
        return lay
    moved = replace(lay, seq_order=lay.seq_order.to(device), rank_order=lay.rank_order.to(device),
                    cu_seqlens=lay.cu_seqlens.to(device))
    if lay.solo is None:
        return moved
    return replace(moved, solo=on_device(lay.solo, device), rows=lay.rows.to(device),
                   rows_inverse=lay.rows_inverse.to(device))


def check_local(lay: UlyssesLayout, x: torch.Tensor, name: str) -> None:
    """``x`` (N_p, H, ...) holds this rank's tokens of ``lay`` and heads that split over its bag."""
    n, h = x.shape[:2]
    if n != lay.all_tokens:
        raise ValueError(f"this rank holds {lay.all_tokens} routed tokens under the plan, got {name} with {n} rows")
    if h % lay.bag_size:
        raise ValueError(
            f"{h} heads cannot be split over a bag of {lay.bag_size} ranks; the bag size must divide "
            f"the head count (see knapray.distributed.check_heads)"
        )


def to_bag(x: torch.Tensor, lay: UlyssesLayout, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Tokens for heads: x (N_p, c, H, D), this rank's tokens of ``lay`` with every head
    (c tensors stacked) -> (T, c, H/g, D), every token of the bag's sequences with this
    rank's block of heads (bag rank p: heads p·H/g to (p+1)·H/g - 1), in whole-sequence order."""
    n, c, h, d = x.shape
    g = lay.bag_size
    hg = h // g
    # (N, c, H, D) -> (N, c, g, H/g, D) -> (g, N, c, H/g, D) -> (g*N, c, H/g, D):
    # block j holds every local token with bag rank j's heads
    x = x.reshape(n, c, g, hg, d).permute(2, 0, 1, 3, 4).reshape(g * n, c, hg, d)
    x = all_to_all_varsize(x, [n] * g, lay.recv_splits, group)  # (T, c, H/g, D), grouped by source rank
    return permute_rows(x, lay.seq_order, lay.rank_order)  # grouped by source rank -> whole sequences


def to_tokens(out: torch.Tensor, lay: UlyssesLayout, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Heads for tokens, ``to_bag``'s inverse: (T, H/g, D) in whole-sequence order -> (N_p, H, D)."""
    n, g = lay.local_tokens, lay.bag_size
    hg, d = out.shape[1:]
    out = permute_rows(out, lay.rank_order, lay.seq_order)  # whole sequences -> grouped by source rank
    # (T, H/g, D) -> (g*N, H/g, D): block j is this rank's tokens with bag rank j's heads
    out = all_to_all_varsize(out, lay.recv_splits, [n] * g, group)
    # (g*N, H/g, D) -> (g, N, H/g, D) -> (N, g, H/g, D) -> (N, H, D)
    return out.reshape(g, n, hg, d).permute(1, 0, 2, 3).reshape(n, g * hg, d)
