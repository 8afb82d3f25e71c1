"""``sylvie_comm.fsdp``: compressed FSDP2 reduce-scatter and HSDP replica all-reduce (see
:mod:`sylvie_comm.integrations.fsdp`)."""

from sylvie_comm.integrations.fsdp import FSDPState, param_groups, register, units_of

__all__ = ["FSDPState", "param_groups", "register", "units_of"]
