"""A :class:`~sylvie_comm.gnn.train.Trainer`'s checkpoint, checked field by field before any of it loads.

:func:`check_checkpoint` takes what ``Trainer.state_dict()`` wrote and the trainer it is to load into (its
settings, whether it has a halo pipeline and a gradient average's state, its optimizer) and raises ValueError
naming the first field that does not fit; the trainer runs it inside its agreement across the ranks, so a
refusal on one rank is one on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sylvie_comm.gnn.halo_checks import check_settings, check_state

# What Trainer.state_dict() holds.
KEYS = frozenset({"settings", "epoch", "model", "optimizer", "rng", "cuda_rng", "halo", "grad_hook"})


def check_checkpoint(
    what: str,
    state: Any,
    settings: Mapping[str, Any],
    *,
    halo: bool,
    grad_hook: bool,
    optimizer: torch.optim.Optimizer,
) -> Mapping[str, Any]:
    """``state`` (a trainer's :meth:`state_dict`) as a dict, once it fits a trainer of these ``settings``, with a
    halo pipeline or not (``halo``), a gradient average's state or not (``grad_hook``) and this ``optimizer``."""
    st = check_state(what, state, set(KEYS))
    check_settings(what, settings, st["settings"])
    epoch = st["epoch"]
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < -1:
        raise ValueError(f"{what}: 'epoch' must be an integer >= -1, got {epoch!r}")
    for field, mine in (("halo", halo), ("grad_hook", grad_hook)):
        if (st[field] is None) == mine:
            holds = f"no '{field}' state" if st[field] is None else f"'{field}' state"
            raise ValueError(f"{what}: the checkpoint holds {holds} but this trainer has {'one' if mine else 'none'}")
    if not _generator_state(st["rng"]):
        raise ValueError(f"{what}: 'rng' must be a 1-D uint8 tensor (torch.get_rng_state())")
    if st["cuda_rng"] is not None and not _generator_state(st["cuda_rng"]):
        raise ValueError(f"{what}: 'cuda_rng' must be None or a 1-D uint8 tensor (torch.cuda.get_rng_state())")
    if halo:
        halo_epoch = st["halo"].get("epoch") if isinstance(st["halo"], Mapping) else None
        if halo_epoch != epoch:
            raise ValueError(f"{what}: the checkpoint is at epoch {epoch} but its halo state at epoch "
                             f"{halo_epoch!r}; it was not written by Trainer.state_dict()")  # fmt: skip
    check_optimizer_kind(what, optimizer, st["optimizer"])
    return st


def _generator_state(value: Any) -> bool:
    """Whether ``value`` is a random generator's state: a 1-D uint8 tensor."""
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


def check_optimizer_kind(what: str, optimizer: torch.optim.Optimizer, state: Any) -> None:
    """ValueError where ``state`` (an optimizer's ``state_dict()``) was written by another kind of optimizer than
    ``optimizer``: torch loads another optimizer's state without a word (Adam's into SGD, say).

    Two kinds differ in settings each has and the other lacks (Adam's ``betas``, SGD's ``momentum``); a release
    of torch that adds a setting to one optimizer leaves one side's names a subset of the other's, which loads.
    A state of another shape is left to the optimizer's own ``load_state_dict`` to refuse.
    """
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    mine = optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(mine):
        return
    for i, (theirs, ours) in enumerate(zip(groups, mine, strict=True)):
        if isinstance(theirs, Mapping) and set(theirs) - set(ours) and set(ours) - set(theirs):
            raise ValueError(f"{what}: the checkpoint's optimizer group {i} has the settings {sorted(theirs)}, this "
                             f"trainer's optimizer ({type(optimizer).__name__}) {sorted(ours)}; expected a "
                             "checkpoint written with the same optimizer")  # fmt: skip


__all__ = ["KEYS", "check_checkpoint", "check_optimizer_kind"]
