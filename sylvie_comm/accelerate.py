"""``sylvie_comm.accelerate``: a sylvie_comm hook on the model ``accelerator.prepare`` returns, every rank's state
in ``accelerator.save_state`` (see :mod:`sylvie_comm.integrations.accelerate`)."""

from sylvie_comm.integrations.accelerate import PerRankState, check_accelerator, register

__all__ = ["PerRankState", "check_accelerator", "register"]
