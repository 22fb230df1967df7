"""Run the model on a BalancePlan: embed at home, route, compute in bags, route home.

Per step and rank:

1. ``condition`` and ``embed`` at home (per sequence / per token, no communication);
2. one all-to-all routes hidden states with their positions and modality flags to the
   ranks the plan chose, and per-sequence conditioning vectors follow their chunks;
3. the transformer blocks run on the routed chunks; attention inside a bag is Ulysses;
4. one all-to-all brings the hidden states home, where ``head`` and the loss run.

So the loss, and everything after the model, sees exactly the batch it would have seen
without balancing; balanced and unbalanced runs compute the same function.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from knapray.distributed import UlyssesAttention, reverse_route, route, route_plan, route_sequence_features
from knapray.models import PackedBatch
from knapray.models.families import condition_inputs
from knapray.planning import BalancePlan


def check_batch_matches_plan(batch: PackedBatch, plan: BalancePlan, rank: int) -> None:
    lo, hi = int(plan.seq_offsets[rank]), int(plan.seq_offsets[rank + 1])
    planned = plan.seq_lens[lo:hi].tolist()
    actual = batch.seq_lens.tolist()
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
) -> torch.Tensor:
    """Model output for this rank's image tokens, (Ni_home, patch_dim), in home order.

    ``model``: any family's model (knapray/models/families): its four stages are called.

    ``bag_group``: the process group of this rank's bag (None for a bag of one);
    ``route_group``: the balance group (None: the world). Collective: every rank of the
    balance group calls it for the same plan, also ranks with no sequences.
    """
    check_batch_matches_plan(batch, plan, rank)
    vec = model.condition(**condition_inputs(model, batch))  # (S_home, d)
    h = model.embed(batch.x_txt, batch.x_img, batch.is_text)  # (N_home, d)
    routed = route(plan, rank, {"h": h, "pos": batch.pos, "is_text": batch.is_text}, route_group)
    vec_loc = route_sequence_features(plan, rank, vec, route_group)  # (S_loc, d)
    seq_local = route_plan(plan, rank, route_group, h.device).token_seq_local
    attn = UlyssesAttention(plan, rank, bag_group, backend=backend, device=h.device)
    h_loc = model.blocks(routed["h"], vec_loc, seq_local, routed["pos"], routed["is_text"], attn)
    h_home = reverse_route(plan, rank, h_loc, route_group)  # (N_home, d)
    return model.head(h_home, vec, batch.seq_index, batch.is_text)
