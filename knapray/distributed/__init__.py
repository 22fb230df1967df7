"""The only place that calls torch.distributed: process groups, autograd all-to-all,
token routing per a BalancePlan, and Ulysses attention within a bag.

Process groups are always passed in explicitly; nothing here reads a global group.
"""

from .comms import AllToAllPacked, AllToAllVarsize, all_to_all_packed, all_to_all_varsize
from .cross import BagCrossAttention, split_chunks
from .groups import BagGroups, RankLayout, TopologyDims, check_heads, valid_bag_sizes
from .router import RoutePlan, reverse_route, route, route_plan, route_sequence_features
from .ulysses import UlyssesAttention, UlyssesLayout

__all__ = [
    "AllToAllPacked",
    "AllToAllVarsize",
    "BagCrossAttention",
    "BagGroups",
    "TopologyDims",
    "RankLayout",
    "RoutePlan",
    "UlyssesAttention",
    "UlyssesLayout",
    "all_to_all_packed",
    "all_to_all_varsize",
    "check_heads",
    "reverse_route",
    "route",
    "route_plan",
    "route_sequence_features",
    "split_chunks",
    "valid_bag_sizes",
]
