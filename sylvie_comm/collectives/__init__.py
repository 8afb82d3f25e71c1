"""Collectives: the transport protocol and its implementations, fused buffers, byte accounting."""

from sylvie_comm.collectives import fusion
from sylvie_comm.collectives.accounting import Meter, Stats, StepStats, wire_bytes
from sylvie_comm.collectives.transport import (
    DEFAULT_TIMEOUT_S,
    CollectiveError,
    ProcessGroupTransport,
    SerialExecutor,
    Transport,
    agree,
    wait,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CollectiveError",
    "Meter",
    "ProcessGroupTransport",
    "SerialExecutor",
    "Stats",
    "StepStats",
    "Transport",
    "agree",
    "fusion",
    "wait",
    "wire_bytes",
]
