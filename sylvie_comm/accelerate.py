"""``sylvie_comm.accelerate``: a sylvie_comm hook on the model ``accelerator.prepare`` returns, every rank's state
in ``accelerator.save_state`` (its own file, read back with ``weights_only=True``; see
:mod:`sylvie_comm.integrations.accelerate`)."""

from sylvie_comm.integrations.accelerate import (
    STATE_FILE,
    PerRankState,
    check_accelerator,
    checkpoint_with,
    diloco,
    log,
    read_state_file,
    register,
    state_file,
)

__all__ = [
    "STATE_FILE",
    "PerRankState",
    "check_accelerator",
    "checkpoint_with",
    "diloco",
    "log",
    "read_state_file",
    "register",
    "state_file",
]
