"""Gradient algorithms, each written once: named tensors of a group + a transport -> a future.

See :mod:`sylvie_comm.algorithms.base` for the contract and
:mod:`sylvie_comm.algorithms.registry` for the names.
"""

from sylvie_comm.algorithms.base import Algorithm, Group, Member, then
from sylvie_comm.algorithms.policy import Policy
from sylvie_comm.algorithms.registry import ALGORITHMS, algorithm_class, make_algorithm

__all__ = ["ALGORITHMS", "Algorithm", "Group", "Member", "Policy", "algorithm_class", "make_algorithm", "then"]
