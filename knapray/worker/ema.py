"""An exponential moving average of a model's weights, for sampling.

The shadow of each parameter is ``p.detach().clone()`` in fp32: a plain tensor for a
plain parameter, a DTensor with the same mesh and placements for an FSDP2 shard, so each
rank averages only the shard it owns and the EMA costs no communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule

from knapray.config.run import OptimSection

NUM_UPDATES = "num_updates"
"""The state-dict key of the update count; every other key is a parameter's name."""


class EMA:
    """shadow <- d·shadow + (1-d)·weights after each optimizer step, with d = ``decay``, or
    with ``warmup`` d = min(decay, (1+n)/(10+n)) at update n (from 0): 0.1 at the first
    update, 0.5 at the 9th, reaching 0.9999 after about 90k updates."""

    def __init__(self, model: torch.nn.Module, decay: float, *, warmup: bool = True) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay!r} (0 means no EMA: build none)")
        self.decay, self.warmup = decay, warmup
        self.num_updates = 0
        _reshard(model)  # shadow the shards even if a forward without backward left them gathered
        with torch.no_grad():
            self.shadow: dict[str, torch.Tensor] = {
                name: p.detach().clone().float() for name, p in model.named_parameters() if p.requires_grad
            }  # trained parameters only: a LoRA run's frozen base has no average to keep

    def current_decay(self) -> float:
        """The decay the next ``update`` uses."""
        n = self.num_updates
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    def _params(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The model's parameters in the shadow's order (FSDP2: its sharded ones); raises if
        the names differ."""
        _reshard(model)
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if params.keys() != self.shadow.keys():
            missing, extra = sorted(self.shadow.keys() - params.keys()), sorted(params.keys() - self.shadow.keys())
            raise ValueError(f"EMA: the model's parameters differ from the EMA's: missing {missing}, unexpected {extra}")
        return [params[name] for name in self.shadow]

    @torch.no_grad()
    def update(self, model: torch.nn.Module, skipped: torch.Tensor | None = None) -> None:
        """Move the shadow toward the model's current weights (after the optimizer step).
        ``skipped``: a 0-d device float, 1 where that optimizer step was not applied (its
        gradients not finite): the shadow is then left as it was, decided on the device
        (the count is taken back with ``uncount`` once the host reads the flag)."""
        weights = [p.detach().float() for p in self._params(model)]  # fp32 params: no copy
        shadow = list(self.shadow.values())
        if skipped is None:
            torch._foreach_lerp_(shadow, weights, 1.0 - self.current_decay())
        else:  # the weight a device tensor, (1-d)·(1-skipped); on the local shards (the same placements)
            local = [_local(t) for t in shadow]
            weight = (1.0 - self.current_decay()) * (1.0 - skipped.to(local[0].device, torch.float32))
            torch._foreach_lerp_(local, [_local(w) for w in weights], [weight] * len(local))
        self.num_updates += 1

    def uncount(self, updates: int) -> None:
        """Take back ``updates`` counted by ``update`` whose step was skipped on the device."""
        self.num_updates -= updates

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter name: fp32 shadow (the live tensor, DTensor under FSDP2), NUM_UPDATES:
        int64 scalar}: what ``torch.distributed.checkpoint`` saves and loads in place. Saved
        under the key ``ema``, the shadow's keys read ``ema.<parameter name>``, which is what
        ``knapray sample`` loads into a model."""
        return {**self.shadow, NUM_UPDATES: torch.tensor(self.num_updates, dtype=torch.int64)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the shadow and the update count (a no-op copy for tensors that
        ``dcp.load`` already filled in place)."""
        expected = {*self.shadow, NUM_UPDATES}
        if state.keys() != expected:
            missing, extra = sorted(expected - state.keys()), sorted(state.keys() - expected)
            raise ValueError(f"EMA state: missing keys {missing}, unexpected keys {extra}")
        for name, shadow in self.shadow.items():
            if state[name] is not shadow:
                shadow.copy_(state[name])
        self.num_updates = int(state[NUM_UPDATES])

    @contextlib.contextmanager
    def swap_into(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """Run ``model`` with the EMA weights inside the block (e.g. to sample); its own
        weights are back on exit, also on an error. Holds one extra copy of the weights.

        Under FSDP2 the weights are written into the shards, and the model is resharded on
        entry and on exit: the root module keeps its all-gathered weights after a forward
        without backward, and the next forward would run on those stale copies."""
        params = self._params(model)
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
            for p, shadow in zip(params, self.shadow.values()):
                p.copy_(shadow)  # DTensor has no foreach copy
        try:
            yield model
        finally:
            _reshard(model)
            with torch.no_grad():
                for p, own in zip(params, saved):
                    p.copy_(own)


def _reshard(model: torch.nn.Module) -> None:
    """Register every FSDP2 module's sharded parameters again (frees all-gathered ones); a
    no-op for a model without FSDP2."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def build_ema(model: torch.nn.Module, cfg: OptimSection) -> EMA | None:
    """The EMA ``cfg`` asks for (``ema_decay``, ``ema_warmup``), None when ema_decay is 0.
    Build it after the model is sharded and before a checkpoint is loaded into it."""
    return EMA(model, cfg.ema_decay, warmup=cfg.ema_warmup) if cfg.ema_decay > 0 else None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
