"""The algorithms by name (their part of the one namespace, :mod:`sylvie_comm.registry`).

:data:`ALGORITHMS` is the one list of them; what an algorithm can do is declared in its class's record
(:class:`~sylvie_comm.algorithms.record.Record`: ``shards``, ``payload_per_element``, ``averages_momentum``,
``low_rank``, ...), and every list of algorithms elsewhere is read from the two. The base class sees the list
as :attr:`Algorithm.registered <sylvie_comm.algorithms.base.Algorithm>`, set here: the modules this one imports
read it without importing it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from sylvie_comm.algorithms.acpsgd import ACPSGDAlgorithm
from sylvie_comm.algorithms.auto import AutoAlgorithm
from sylvie_comm.algorithms.base import Algorithm
from sylvie_comm.algorithms.cast import Bf16Algorithm, Fp16Algorithm
from sylvie_comm.algorithms.none import NoneAlgorithm
from sylvie_comm.algorithms.onebit import OneBitAlgorithm
from sylvie_comm.algorithms.powersgd import PowerSGDAlgorithm
from sylvie_comm.algorithms.qsgd import QSGDAlgorithm
from sylvie_comm.algorithms.sign import SignAlgorithm
from sylvie_comm.algorithms.sparseloco import SparseLoCoAlgorithm
from sylvie_comm.algorithms.topk import TopKAlgorithm
from sylvie_comm.registry import unknown

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (
        NoneAlgorithm,
        Fp16Algorithm,
        Bf16Algorithm,
        SignAlgorithm,
        TopKAlgorithm,
        OneBitAlgorithm,
        ACPSGDAlgorithm,
        PowerSGDAlgorithm,
        QSGDAlgorithm,
        SparseLoCoAlgorithm,
        AutoAlgorithm,
    )
}
Algorithm.registered = MappingProxyType(ALGORITHMS)


def algorithm_class(name: str, what: str = "algorithm") -> type[Algorithm]:
    """The class registered under ``name``; ValueError listing the valid names otherwise.

    ``what`` is how the caller calls it in the message (an integration says "hook").
    """
    cls = ALGORITHMS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise unknown(name, "algorithm", what)
    return cls


def make_algorithm(name: str, transport: Any, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> Algorithm:
    """Build the algorithm registered under ``name`` on ``transport``."""
    return algorithm_class(name)(transport, options, seed=seed)
