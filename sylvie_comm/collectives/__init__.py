"""Collectives over a transport: wire accounting and a deterministic launch order."""

from sylvie_comm.collectives.transport import ProcessGroupTransport, SerialExecutor, agree, wire_bytes

__all__ = ["ProcessGroupTransport", "SerialExecutor", "agree", "wire_bytes"]
