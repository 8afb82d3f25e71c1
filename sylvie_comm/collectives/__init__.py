"""Collectives over a transport: wire accounting and a deterministic launch order."""

from sylvie_comm.collectives.transport import (
    DEFAULT_TIMEOUT_S,
    CollectiveError,
    ProcessGroupTransport,
    SerialExecutor,
    agree,
    wire_bytes,
)

__all__ = ["DEFAULT_TIMEOUT_S", "CollectiveError", "ProcessGroupTransport", "SerialExecutor", "agree", "wire_bytes"]
