"""``sylvie_comm.ddp``: DistributedDataParallel hooks (see :mod:`sylvie_comm.integrations.ddp`)."""

from sylvie_comm.integrations.ddp import HOOKS, HookState, hook, make_hook, make_state, register

__all__ = ["HOOKS", "HookState", "hook", "make_hook", "make_state", "register"]
