"""Move tokens from their home rank to the ranks a BalancePlan computes them on, and back.

Layouts (``S_home``/``N_home``: this rank's own sequences/tokens; ``S_loc``/``N_loc``: the
chunks it computes):

- home: the rank's sequences packed back to back in local order, ``(N_home, *T)``.
- routed: the rank's chunks back to back in ``plan.recv_chunks(rank)`` order (global
  sequence order, the order its bag agrees on for Ulysses), ``(N_loc, *T)``. A rank holds
  at most one chunk of a sequence, so chunk ``i`` is "local sequence" ``i``.

Per step the forward route costs one gather and one all-to-all; the reverse route one
all-to-all and one gather (by the inverse permutation). ``RoutePlan`` precomputes the
indices and split sizes; every rank derives it from the same plan, so nothing but the
payload is exchanged. Which sequence each routed token belongs to, and where in it, is
known from the plan too (``RoutePlan.token_seq_local`` etc.) and never travels.

Several per-token tensors (float activations, int64 positions, bool flags, ids) travel
together in ONE exchange when passed as a mapping: they are bit-cast to bytes and
concatenated per row (``comms.AllToAllPacked``), so integers arrive bit-exact whatever
the float dtype, and only floating-point tensors carry gradients back.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from knapray.indexing import gather_rows, permute_rows
from knapray.planning import BalancePlan
from knapray.transfer import host_to_device

from .comms import all_to_all_packed, all_to_all_varsize

Payload = TypeVar("Payload", torch.Tensor, Mapping[str, torch.Tensor])


def concat_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + l)`` for each (s, l)."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.cumsum(lens) - lens  # position of each range's first element
    return (np.repeat(starts - first, lens) + np.arange(total)).astype(np.int64)


def group_peers(group: dist.ProcessGroup | None, world_size: int) -> tuple[int, ...]:
    """Global ranks of ``group`` in group-rank order; ``None`` is the whole world."""
    if group is None:
        return tuple(range(world_size))
    return tuple(dist.get_process_group_ranks(group))


def _counts(keys: np.ndarray, weights: np.ndarray, peers: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(weights[keys == p].sum()) for p in peers)


@dataclass(frozen=True, eq=False)
class RoutePlan:
    """Everything one rank needs to route one step's plan (built by ``RoutePlan.build``)."""

    rank: int
    peers: tuple[int, ...]
    """Global ranks of the routing group, ascending (group rank ``j`` is ``peers[j]``)."""
    num_home_sequences: int
    num_home_tokens: int
    send_index: torch.Tensor
    """(N_home,) int64: home rows in send order (by destination, then local index)."""
    home_index: torch.Tensor
    """(N_home,) int64: inverse of ``send_index`` (send order -> home layout)."""
    send_is_identity: bool
    """True if ``send_index`` is ``arange`` (nothing to gather)."""
    local_only: bool
    """True if no rank of the group sends anything to another rank under this plan (every
    rank derives the same answer, so all of them skip the collective together)."""
    send_splits: tuple[int, ...]
    """Tokens sent to each peer."""
    recv_splits: tuple[int, ...]
    """Tokens received from each peer."""
    seq_send_index: torch.Tensor
    """(C_send,) int64: local sequence of each chunk this rank sends, in send order."""
    seq_send_splits: tuple[int, ...]
    """Chunks (one feature row each) sent to each peer."""
    seq_recv_splits: tuple[int, ...]
    """Chunks received from each peer."""
    recv_seq_ids: torch.Tensor
    """(S_loc,) int64: global sequence id of each routed chunk / local sequence."""
    recv_chunk_starts: torch.Tensor
    """(S_loc,) int64: offset of each routed chunk in its sequence."""
    recv_chunk_lens: torch.Tensor
    """(S_loc,) int64: tokens of each routed chunk."""
    token_seq_local: torch.Tensor
    """(N_loc,) int64: local sequence of each routed token, in [0, S_loc)."""
    token_seq_global: torch.Tensor
    """(N_loc,) int64: global sequence id of each routed token."""
    token_offset: torch.Tensor
    """(N_loc,) int64: position of each routed token in its sequence."""

    @property
    def num_routed_tokens(self) -> int:
        return int(self.token_seq_local.shape[0])

    @classmethod
    def build(
        cls,
        plan: BalancePlan,
        rank: int,
        peers: tuple[int, ...] | None = None,
        device: torch.device | str | None = None,
    ) -> "RoutePlan":
        """Pure: no process group. ``peers``: global ranks of the routing group (default:
        the whole world); the plan must route this rank's tokens only among them."""
        w = plan.world_size
        if not 0 <= rank < w:
            raise ValueError(f"rank must be in [0, {w}) for this plan, got {rank}")
        peers = tuple(range(w)) if peers is None else tuple(int(p) for p in peers)
        if list(peers) != sorted(set(peers)) or rank not in peers:
            raise ValueError(f"peers must be ascending distinct ranks including rank {rank}, got {peers}")

        lo, hi = int(plan.seq_offsets[rank]), int(plan.seq_offsets[rank + 1])
        home_lens = plan.seq_lens[lo:hi]
        home_start = np.cumsum(home_lens) - home_lens  # (S_home,) first row of each sequence

        send = plan.send_chunks(rank)
        dest = plan.chunk_rank[send]
        outside = np.setdiff1d(dest, peers)
        if outside.size:
            raise ValueError(
                f"the plan sends tokens of rank {rank} to rank(s) {outside.tolist()}, outside the "
                f"routing group {list(peers)}; route on the balance group that contains both"
            )
        send_local = plan.local_index[plan.chunk_seq[send]]
        send_lens = plan.chunk_len[send]
        send_idx = concat_ranges(home_start[send_local] + plan.chunk_start[send], send_lens)

        recv = plan.recv_chunks(rank)
        src = plan.chunk_src[recv]
        outside = np.setdiff1d(src, peers)
        if outside.size:
            raise ValueError(
                f"the plan sends tokens from rank(s) {outside.tolist()} to rank {rank}, outside the "
                f"routing group {list(peers)}"
            )
        recv_lens = plan.chunk_len[recv]
        recv_seq = plan.chunk_seq[recv]
        ones_send, ones_recv = np.ones_like(send), np.ones_like(recv)
        in_group = np.isin(plan.chunk_src, peers)
        local_only = not np.any(in_group & (plan.chunk_src != plan.chunk_rank))

        def t(a: np.ndarray) -> torch.Tensor:
            return host_to_device(a, device, torch.int64)  # pinned, non-blocking on a GPU

        return cls(
            rank=rank,
            peers=peers,
            num_home_sequences=hi - lo,
            num_home_tokens=int(home_lens.sum()),
            send_index=t(send_idx),
            home_index=t(np.argsort(send_idx, kind="stable")),
            send_is_identity=bool(np.array_equal(send_idx, np.arange(send_idx.size))),
            local_only=local_only,
            send_splits=_counts(dest, send_lens, peers),
            recv_splits=_counts(src, recv_lens, peers),
            seq_send_index=t(send_local),
            seq_send_splits=_counts(dest, ones_send, peers),
            seq_recv_splits=_counts(src, ones_recv, peers),
            recv_seq_ids=t(recv_seq),
            recv_chunk_starts=t(plan.chunk_start[recv]),
            recv_chunk_lens=t(recv_lens),
            token_seq_local=t(np.repeat(np.arange(recv.size), recv_lens)),
            token_seq_global=t(np.repeat(recv_seq, recv_lens)),
            token_offset=t(concat_ranges(plan.chunk_start[recv], recv_lens)),
        )


_CACHE: "weakref.WeakKeyDictionary[BalancePlan, dict]" = weakref.WeakKeyDictionary()


def route_plan(
    plan: BalancePlan | RoutePlan,
    rank: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> RoutePlan:
    """The RoutePlan of ``rank`` for ``plan`` on ``group`` (built once per plan and kept
    while the plan lives). A RoutePlan is checked against ``rank`` and ``group``."""
    if isinstance(plan, RoutePlan):
        if plan.rank != rank:
            raise ValueError(f"RoutePlan was built for rank {plan.rank}, used on rank {rank}")
        if group is not None and group_peers(group, 0) != plan.peers:
            raise ValueError(
                f"RoutePlan was built for peers {list(plan.peers)}, but the group has "
                f"{list(group_peers(group, 0))}"
            )
        return plan
    peers = group_peers(group, plan.world_size)
    key = (rank, peers, str(torch.device(device or "cpu")))
    per_plan = _CACHE.setdefault(plan, {})
    if key not in per_plan:
        per_plan[key] = RoutePlan.build(plan, rank, peers, device)
    return per_plan[key]


def _exchange(
    rp: RoutePlan,
    payload: Payload,
    send: tuple[int, ...],
    recv: tuple[int, ...],
    group: dist.ProcessGroup | None,
) -> Payload:
    """One collective for a tensor or a mapping of tensors (rows already in send order)."""
    if rp.local_only:
        return payload if isinstance(payload, torch.Tensor) else dict(payload)
    if isinstance(payload, torch.Tensor):
        return all_to_all_varsize(payload, send, recv, group)
    keys = sorted(payload)  # every rank packs the same keys in the same order
    outs = all_to_all_packed([payload[k] for k in keys], send, recv, group)
    return {k: outs[keys.index(k)] for k in payload}


def _rows(payload: Payload, what: str, expected: int) -> None:
    items = [("", payload)] if isinstance(payload, torch.Tensor) else list(payload.items())
    if not items:
        raise ValueError(f"{what}: empty mapping, nothing to route")
    for name, x in items:
        if x.dim() == 0 or x.shape[0] != expected:
            label = f" {name!r}" if name else ""
            raise ValueError(
                f"{what}{label}: expected {expected} rows for this rank under the plan, "
                f"got shape {tuple(x.shape)}"
            )


def _permute(payload: Payload, order: torch.Tensor, inverse: torch.Tensor) -> Payload:
    """payload's rows by the permutation ``order`` (backward: a gather by ``inverse``)."""
    if isinstance(payload, torch.Tensor):
        return permute_rows(payload, order, inverse)
    return {k: permute_rows(v, order, inverse) for k, v in payload.items()}


def route(
    plan: BalancePlan | RoutePlan,
    rank: int,
    x_local: Payload,
    group: dist.ProcessGroup | None = None,
) -> Payload:
    """Home layout (N_home, *T) -> routed layout (N_loc, *T); a tensor or a mapping of
    tensors (all with N_home rows, moved in one exchange, dtypes kept bit-exact).

    Backward: the gradient goes home by the reverse exchange. ``group``: the routing group
    (the balance group; None = the world). Every rank of the group must call it, in the
    same order as the others, also with no tokens; every rank of a mapping call must pass
    the same keys, dtypes and trailing shapes. When the plan moves nothing between ranks
    (e.g. ``identity_plan``) no collective runs, and the input itself may come back.
    """
    rp = route_plan(plan, rank, group, _device(x_local))
    _rows(x_local, "route: x_local", rp.num_home_tokens)
    send = x_local if rp.send_is_identity else _permute(x_local, rp.send_index, rp.home_index)
    return _exchange(rp, send, rp.send_splits, rp.recv_splits, group)


def reverse_route(
    plan: BalancePlan | RoutePlan,
    rank: int,
    y_routed: Payload,
    group: dist.ProcessGroup | None = None,
) -> Payload:
    """Routed layout (N_loc, *T) -> home layout (N_home, *T): the inverse of ``route``.

    Backward: the gradient is routed forward again. Same calling rules as ``route``."""
    rp = route_plan(plan, rank, group, _device(y_routed))
    _rows(y_routed, "reverse_route: y_routed", rp.num_routed_tokens)
    back = _exchange(rp, y_routed, rp.recv_splits, rp.send_splits, group)
    return back if rp.send_is_identity else _permute(back, rp.home_index, rp.send_index)


def route_sequence_features(
    plan: BalancePlan | RoutePlan,
    rank: int,
    feats: Payload,
    group: dist.ProcessGroup | None = None,
) -> Payload:
    """Per-sequence rows (S_home, *F) at home -> (S_loc, *F), row ``i`` for the sequence of
    routed chunk ``i`` (``RoutePlan.recv_seq_ids[i]``), so ``out[token_seq_local]`` gives
    every routed token its sequence's row.

    A sequence split over several ranks sends its row to each of them; in backward their
    gradients come home and are summed, in fp32 (``knapray.indexing.gather_rows``)."""
    rp = route_plan(plan, rank, group, _device(feats))
    _rows(feats, "route_sequence_features: feats", rp.num_home_sequences)
    if isinstance(feats, torch.Tensor):
        send = gather_rows(feats, rp.seq_send_index)
    else:
        send = {k: gather_rows(v, rp.seq_send_index) for k, v in feats.items()}
    return _exchange(rp, send, rp.seq_send_splits, rp.seq_recv_splits, group)


def _device(payload: Payload) -> torch.device:
    if isinstance(payload, torch.Tensor):
        return payload.device
    first = next(iter(payload.values()), None)
    return first.device if first is not None else torch.device("cpu")
