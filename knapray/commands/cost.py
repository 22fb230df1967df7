"""The cost-model flags of ``knapray plan`` and ``knapray simulate``: ``--profile FILE``
(a ``knapray calibrate`` profile) and ``--cost FIELD=VALUE`` (a ``CostModel`` field).
``--set`` is a run-config override in every subcommand, so a cost-model field written
with it is refused with one line naming ``--cost``."""

from __future__ import annotations

import argparse
import json

from .flags import add_removed


def add_cost_model(p: argparse.ArgumentParser, what: str = "") -> None:
    p.add_argument("--profile", metavar="FILE", help=f"{what}cost model profile JSON (knapray calibrate)")
    p.add_argument("--cost", action="append", default=[], metavar="FIELD=VALUE",
                   help=f"{what}override a CostModel field, e.g. --cost inter_node_bw=25e9 (repeatable)")
    add_removed(p, "--set", "a CostModel field is --cost FIELD=VALUE now (--set overrides run-config keys, "
                "in the subcommands that take --config)")


def cost_model(args: argparse.Namespace):
    """CostModel from ``--profile`` and ``--cost`` overrides (defaults: 8xH100, Flux)."""
    from knapray.planning.costs.cost import CostModel

    overrides = {}
    for item in args.cost:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--cost expects FIELD=VALUE, got {item!r}")
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value
    if getattr(args, "gpus_per_node", None):
        overrides.setdefault("gpus_per_node", args.gpus_per_node)
    if args.profile:
        return CostModel.from_profile(args.profile, **overrides)
    return CostModel.from_dict(overrides)
