"""Pure planning logic (numpy only): workload and cost models, topologies, the balance
solver, automatic topology."""

from .search.autotopo import TopologyChoice, choose_topology, search_topology
from .costs.cost import CostModel, StepTimes
from .shapes.mix import PAPER_MIXES, DataCode, parse_mix, sample_step
from .balance.plan import BalancePlan
from .balance.solver import SOLVERS, identity_plan, plan_balance
from .shapes.topology import Topology
from .costs.workload import WorkloadModel

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
