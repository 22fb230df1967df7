"""Pure planning logic (numpy only): workload and cost models, topologies, the balance
solver, automatic topology."""

from .autotopo import TopologyChoice, choose_topology, search_topology
from .cost import CostModel, StepTimes
from .mix import PAPER_MIXES, DataCode, parse_mix, sample_step
from .plan import BalancePlan
from .solver import SOLVERS, identity_plan, plan_balance
from .topology import Topology
from .workload import WorkloadModel

__all__ = [
    "BalancePlan",
    "CostModel",
    "DataCode",
    "PAPER_MIXES",
    "SOLVERS",
    "StepTimes",
    "Topology",
    "TopologyChoice",
    "WorkloadModel",
    "choose_topology",
    "identity_plan",
    "parse_mix",
    "plan_balance",
    "sample_step",
    "search_topology",
]
