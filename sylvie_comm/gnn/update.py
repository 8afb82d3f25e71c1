"""The weight update a :class:`~sylvie_comm.gnn.train.Trainer` takes from its caller: the average of the weight
gradients over the ranks and the optimizer that steps on it.

- An averager (:class:`GradientAverager`, made by an :data:`AveragerFactory` from the trainer's model and a
  transport of its own): the trainer calls ``average()`` after each backward pass, before the optimizer's step;
  counts its ``stats()["bytes_sent"]`` in each epoch's ``grad_bytes``; checkpoints its ``state_dict()``; closes
  it with the trainer. :class:`~sylvie_comm.integrations.average.GradientAverage` is one
  (``lambda model, transport: GradientAverage(model, transport, "qsgd", bits=4)``).
- An optimizer (:data:`OptimizerFactory`): ``params -> torch.optim.Optimizer``, e.g.
  ``lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)``.

This module names the interfaces only. The defaults (DDP with the configuration's hook on a process group, the
gradient average after backward on another transport, Adam with the configuration's ``lr`` and
``weight_decay``) are built by the trainer's module, above the integrations, so that nothing of the gnn layer
imports an integration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch

from sylvie_comm.collectives import Transport


class AverageState(Protocol):
    """What the trainer keeps of the gradient average between epochs: its bytes, its checkpoint, its end."""

    def stats(self) -> dict[str, Any]:
        """Its statistics; ``"bytes_sent"``: the bytes this rank has sent so far."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (the trainer's checkpoint holds it under ``"grad_hook"``)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any], *, agreed: bool = True) -> None:
        """Resume from :meth:`state_dict`'s output (``agreed=False``: the trainer agrees across the ranks)."""
        ...

    def close(self) -> None:
        """Release what it holds (threads, process groups); called once, by :meth:`Trainer.close`."""
        ...


class GradientAverager(AverageState, Protocol):
    """The weight gradients replaced by their mean over the ranks, after backward."""

    def average(self) -> None:
        """Average every parameter's gradient (a collective: every rank calls it each step)."""
        ...


# (the trainer's model, a transport of the averager's own: a fork of the trainer's) -> its averager
AveragerFactory = Callable[[torch.nn.Module, Transport], GradientAverager]
# the model's parameters -> the optimizer that steps on them
OptimizerFactory = Callable[[Iterator[torch.nn.Parameter]], torch.optim.Optimizer]


def build_optimizer(factory: OptimizerFactory, model: torch.nn.Module) -> torch.optim.Optimizer:
    """``factory(model.parameters())``, checked to be a :class:`torch.optim.Optimizer`."""
    made = factory(model.parameters())
    if not isinstance(made, torch.optim.Optimizer):
        raise TypeError(f"gnn: optimizer must be a factory params -> torch.optim.Optimizer, e.g. lambda params: "
                        f"torch.optim.SGD(params, lr=0.1); it returned a {type(made).__name__}")  # fmt: skip
    return made


__all__ = ["AverageState", "AveragerFactory", "GradientAverager", "OptimizerFactory", "build_optimizer"]
