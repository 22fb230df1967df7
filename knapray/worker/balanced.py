"""Run the model on a BalancePlan: embed at home, route, compute in bags, route home.

Per step and rank:

1. ``condition`` and ``embed`` at home (per sequence / per token, no communication);
2. one all-to-all routes hidden states with their positions and modality flags to the
   ranks the plan chose, and per-sequence conditioning vectors follow their chunks;
3. the transformer blocks run on the routed chunks; attention inside a bag is Ulysses
   (joint attention over text and image tokens; for a family that cross-attends to its
   text, Wan, self-attention over the image tokens and cross-attention of image queries to
   text keys: ``knapray.distributed.cross``);
4. one all-to-all brings the hidden states home, where ``head`` (given the home tokens'
   positions) and the loss run.

So the loss, and everything after the model, sees exactly the batch it would have seen
without balancing; balanced and unbalanced runs compute the same function.

Nothing in a step needs to wait for the device when the host prepares its ``StepLayout``
first (``prepare_step``, before the timed region): the routing and Ulysses index tensors
and the text/image index maps of the home and the routed tokens, all derived on the host
from the plan and every sequence's text-token count, and copied to the device without
blocking. Without one, ``balanced_forward`` derives them itself (``nonzero`` on the device:
the host waits for it; fine on CPU and in tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from knapray.distributed import (
    BagCrossAttention,
    UlyssesAttention,
    reverse_route,
    route,
    route_plan,
    route_sequence_features,
)
from knapray.distributed.router import RoutePlan, concat_ranges
from knapray.models import PackedBatch
from knapray.models.blocks import TokenStreams
from knapray.models.families import condition_inputs, cross_text_pad
from knapray.models.step_cache import StepCache
from knapray.planning import BalancePlan
from knapray.transfer import host_to_device


@dataclass(frozen=True, eq=False)
class StepLayout:
    """What one rank's balanced step needs besides the batch, prepared on the host."""

    route: RoutePlan
    attention: UlyssesAttention | BagCrossAttention
    """What the blocks call: joint attention, or the bag's self- and cross-attention."""
    home: TokenStreams
    """Text/image index maps of the home tokens (embed, head)."""
    routed: TokenStreams
    """Text/image index maps of the routed tokens (the blocks)."""
    routed_is_text: torch.Tensor
    """(N_loc,) bool on the device, the routed tokens' modality (no exchange needed)."""


def routed_text_mask(plan: BalancePlan, rank: int, text_tokens: np.ndarray) -> np.ndarray:
    """(N_loc,) bool: which of ``rank``'s routed tokens are text. ``text_tokens``: (S,) text
    tokens of every sequence of the plan, in the plan's order (text comes first in a
    sequence, so a chunk's token is text iff its offset is below its sequence's count)."""
    text_tokens = np.asarray(text_tokens, dtype=np.int64)
    if text_tokens.shape != plan.seq_lens.shape or np.any(text_tokens < 0) or np.any(text_tokens > plan.seq_lens):
        raise ValueError(f"text_tokens must give 0..length text tokens for each of the plan's "
                         f"{plan.num_sequences} sequences, got shape {text_tokens.shape}")
    recv = plan.recv_chunks(rank)
    lens = plan.chunk_len[recv]
    offset = concat_ranges(plan.chunk_start[recv], lens)  # (N_loc,) position in its sequence
    return offset < np.repeat(text_tokens[plan.chunk_seq[recv]], lens)


def prepare_step(
    batch: PackedBatch,
    plan: BalancePlan,
    rank: int,
    text_tokens: np.ndarray,
    device: torch.device | str,
    *,
    bag_group: dist.ProcessGroup | None,
    route_group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    cross_pad: int | None = None,
) -> StepLayout:
    """The ``StepLayout`` of ``rank`` for ``plan``, from the HOST batch (before ``.to(device)``)
    and ``text_tokens``, every sequence's text-token count in the plan's order (the trainer
    learns the other ranks' with the step's first all-reduce). Checks the batch against the
    plan. ``cross_pad``: the model's ``cross_text_pad`` (None: joint attention). Collective
    only where ``route_plan`` is (never: it reads group membership)."""
    check_batch_matches_plan(batch, plan, rank)
    device = torch.device(device)
    routed = routed_text_mask(plan, rank, text_tokens)
    attention = UlyssesAttention(plan, rank, bag_group, backend=backend, device=device) if cross_pad is None else \
        BagCrossAttention(plan, rank, bag_group, text_tokens, cross_pad, backend=backend, device=device)
    return StepLayout(
        route=route_plan(plan, rank, route_group, device),
        attention=attention,
        home=TokenStreams.from_host_mask(batch.is_text, device),
        routed=TokenStreams.from_host_mask(routed, device),
        routed_is_text=host_to_device(routed, device),
    )


def check_batch_matches_plan(batch: PackedBatch, plan: BalancePlan, rank: int) -> None:
    lo, hi = int(plan.seq_offsets[rank]), int(plan.seq_offsets[rank + 1])
    planned = plan.seq_lens[lo:hi].tolist()
    lens = batch.seq_lens
    actual = (lens.numpy() if lens.device.type == "cpu" else lens).tolist()  # a host batch: no op dispatched
    if planned != actual:
        raise ValueError(
            f"rank {rank}: the batch's sequence lengths {actual[:8]}{'...' if len(actual) > 8 else ''} "
            f"differ from the plan's {planned[:8]}{'...' if len(planned) > 8 else ''}; plan from the "
            "lengths of the batch that is being trained"
        )


def balanced_forward(
    model: torch.nn.Module,
    batch: PackedBatch,
    plan: BalancePlan,
    rank: int,
    *,
    bag_group: dist.ProcessGroup | None,
    route_group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    layout: StepLayout | None = None,
    cache: StepCache | None = None,
) -> torch.Tensor:
    """Model output for this rank's image tokens, (Ni_home, patch_dim), in home order.

    ``model``: any family's model (knapray/models/families): its four stages are called.

    ``bag_group``: the process group of this rank's bag (None for a bag of one);
    ``route_group``: the balance group (None: the world). Collective: every rank of the
    balance group calls it for the same plan, also ranks with no sequences. ``layout``:
    from ``prepare_step`` (then nothing here waits for the device), else derived here.
    ``cache``: a sampling step's first-block cache (``knapray.models.step_cache``), decided
    the same on every rank of the bag.
    """
    if layout is None and cross_text_pad(model.cfg) is not None:
        # The bag's attentions need every sequence's text count: the ranks tell each other.
        text_tokens = _gather_text_tokens(batch, route_group)
        layout = prepare_step(batch, plan, rank, text_tokens, batch.x_img.device, bag_group=bag_group,
                              route_group=route_group, backend=backend, cross_pad=cross_text_pad(model.cfg))
    if layout is None:
        check_batch_matches_plan(batch, plan, rank)
        return _forward(model, batch, plan, rank, route_plan(plan, rank, route_group, batch.x_img.device),
                        UlyssesAttention(plan, rank, bag_group, backend=backend, device=batch.x_img.device),
                        route_group, None, None, None, cache)
    return _forward(model, batch, plan, rank, layout.route, layout.attention, route_group, layout.home,
                    layout.routed, layout.routed_is_text, cache)


def _gather_text_tokens(batch: PackedBatch, group: dist.ProcessGroup | None) -> np.ndarray:
    """(S,) text tokens of every sequence of the balance group, in plan order (rank by rank)."""
    mine = np.bincount(batch.seq_index[batch.is_text].cpu().numpy(), minlength=batch.num_sequences).astype(np.int64)
    if not dist.is_initialized():
        return mine
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return np.concatenate(every)


def _forward(model: nn.Module, batch: PackedBatch, plan: BalancePlan, rank: int, rp: RoutePlan, attn: UlyssesAttention,
             route_group: dist.ProcessGroup | None, home: TokenStreams | None, routed_streams: TokenStreams | None,
             routed_is_text: torch.Tensor | None, cache: StepCache | None = None) -> torch.Tensor:
    vec = model.condition(**condition_inputs(model, batch))  # (S_home, d)
    h = model.embed(batch.x_txt, batch.x_img, batch.is_text, streams=home)  # (N_home, d)
    pos = model.positions(batch.pos, batch.seq_index, batch.is_text)  # of whole sequences: at home
    if routed_is_text is None:  # the modality travels with the tokens
        routed = route(rp, rank, {"h": h, "pos": pos, "is_text": batch.is_text}, route_group)
        routed_is_text = routed["is_text"]
    else:  # known on the host from the plan: h and pos travel
        routed = route(rp, rank, {"h": h, "pos": pos}, route_group)
    vec_loc = route_sequence_features(rp, rank, vec, route_group)  # (S_loc, d)
    h_loc = model.blocks(routed["h"], vec_loc, rp.token_seq_local, routed["pos"], routed_is_text, attn,
                         streams=routed_streams, **({} if cache is None else {"cache": cache}))
    h_home = reverse_route(rp, rank, h_loc, route_group)  # (N_home, d)
    # The home tokens' positions: a family with per-token times picks them by frame (Wan 2.2 TI2V).
    return model.head(h_home, vec, batch.seq_index, batch.is_text, streams=home, pos=batch.pos)
