"""Pure planning logic (numpy only): workload model, topologies, the balance solver."""

from .mix import PAPER_MIXES, DataCode, parse_mix, sample_step
from .plan import BalancePlan
from .solver import SOLVERS, identity_plan, plan_balance
from .topology import Topology
from .workload import WorkloadModel

__all__ = [
    "BalancePlan",
    "DataCode",
    "PAPER_MIXES",
    "SOLVERS",
    "Topology",
    "WorkloadModel",
    "identity_plan",
    "parse_mix",
    "plan_balance",
    "sample_step",
]
