"""``sylvie_comm.ddp``: DistributedDataParallel hooks (see :mod:`sylvie_comm.integrations.ddp`)."""

from sylvie_comm.integrations.ddp import HOOKS, HookState, hook, make_hook, make_state, register
from sylvie_comm.integrations.optim import ddp_compressed_adamw as compressed_adamw
from sylvie_comm.integrations.optim import ddp_compressed_sgd as compressed_sgd

__all__ = ["HOOKS", "HookState", "hook", "make_hook", "make_state", "register"]
__all__ += ["compressed_adamw", "compressed_sgd"]
