"""``NodeRelay``: one small actor per node that batches its ranks' submissions into one
coordinator call per step.

The ranks of a node submit a step at about the same time (the step's collectives keep
them in step). Each rank's ``exchange`` goes to its node's relay, on the same node; the
relay forwards one ``exchange`` with the node's submissions (and timing reports) once it
holds all ``node_ranks`` of them, or ``LINGER_S`` after the first if some rank is late (the
late one goes in a batch of its own: never a wait for a rank that may not come). The
coordinator's answer, a reference to the plan in the object store, goes back to every
rank of the batch. So the coordinator sees one call per node and step instead of one per
rank, and no collective is added: ranks only wait for the plan, as before.

Errors keep their meaning: a rejection (``StepFailed``) reaches every rank of the batch
(the coordinator fails the step for every rank anyway), and a coordinator that cannot be
reached is ``CoordinatorUnavailable`` to each, which the trainer answers with its local
fallback. A relay that dies (its creator, one of the node's ranks, died) is the same to
its ranks: the next submission creates it again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

LINGER_S = 0.05
"""How long a batch waits for the rest of its node after its first submission."""


@dataclass
class _Batch:
    subs: dict[int, tuple] = field(default_factory=dict)
    timings: list[tuple] = field(default_factory=list)
    answer: asyncio.Future | None = None
    full: asyncio.Event = field(default_factory=asyncio.Event)


class NodeRelay:
    """Async actor: batches a node's ``exchange`` calls (see the module docstring)."""

    def __init__(self, coordinator: str, namespace: str | None) -> None:
        self._name, self._namespace = coordinator, namespace
        self._coordinator = None
        self._open: dict[tuple[int, int | None], _Batch] = {}
        """(step, epoch) -> the batch still taking submissions."""

    def _actor(self):
        if self._coordinator is None:
            import ray

            self._coordinator = ray.get_actor(self._name, namespace=self._namespace)
        return self._coordinator

    async def exchange(self, step: int, epoch: int | None, submission: tuple, timings: list, timeout_s: float,
                       node_ranks: int) -> tuple[Any, bool]:
        """One rank's ``(rank, seq_lens, sample_ids, exhausted)`` for ``step``; answers as
        the coordinator's ``exchange`` does, for the batch it went out in."""
        key = (int(step), epoch)
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch()
            batch.answer = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._forward(key, batch, timeout_s))
        batch.subs[int(submission[0])] = submission
        batch.timings.extend(timings)
        if len(batch.subs) >= node_ranks:
            batch.full.set()
        return await asyncio.shield(batch.answer)

    async def _forward(self, key: tuple[int, int | None], batch: _Batch, timeout_s: float) -> None:
        from ray.exceptions import RayActorError, RayTaskError

        from .errors import CoordinatorUnavailable
        from .steps import PlanTimeout

        try:
            await asyncio.wait_for(batch.full.wait(), LINGER_S)
        except asyncio.TimeoutError:
            pass
        if self._open.get(key) is batch:
            del self._open[key]  # later submissions of this step start a batch of their own
        subs = [batch.subs[r] for r in sorted(batch.subs)]
        try:
            result = await self._actor().exchange.remote(key[0], key[1], subs, batch.timings, timeout_s)
            batch.answer.set_result(result)
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, Exception) else e
            if isinstance(cause, PlanTimeout):
                cause = CoordinatorUnavailable(str(cause))
            batch.answer.set_exception(cause)
        except (RayActorError, ValueError) as e:  # ValueError: no actor by that name
            self._coordinator = None
            batch.answer.set_exception(CoordinatorUnavailable(f"coordinator unreachable from the node's relay: {e}"))
        except Exception as e:  # noqa: BLE001 - every rank of the batch must hear of it, whatever it is
            log.exception("node relay: step %s failed to forward", key[0])
            batch.answer.set_exception(CoordinatorUnavailable(f"the node's relay could not forward step {key[0]}: {e}"))
