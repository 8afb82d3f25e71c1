"""A model's gradients averaged after backward, over any transport: what DDP and its hook do, without DDP.

For a training loop on a :class:`~sylvie_comm.collectives.Transport` that is not a process group DDP could
wrap (Horovod's, the in-process one of the tests), and the GNN trainer's gradients there::

    avg = GradientAverage(model, transport, "qsgd")
    loss.backward(); avg.average(); opt.step()

One group of every parameter that has a gradient goes through the algorithm's
:class:`~sylvie_comm.algorithms.Policy`, with the statistics, per-name state and checkpoint format of every
integration (a :class:`~sylvie_comm.algorithms.session.Session`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sylvie_comm.algorithms import Group, Member
from sylvie_comm.algorithms.session import Session, SessionHolder, merge_config
from sylvie_comm.collectives import Transport
from sylvie_comm.config import Config


class GradientAverage(SessionHolder):
    """A model's gradients averaged across a transport's ranks by a named algorithm, after backward.

    Building one is a collective call: every rank must build it, and ranks with another configuration fail
    on every rank naming the field. ``options`` as for the DDP hooks (the algorithm's, ``warmup_steps``, ...).
    """

    what = "sylvie_comm gradient average"

    def __init__(self, model: torch.nn.Module, transport: Transport, codec: str = "none", **options: Any) -> None:
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.session = Session.agreed(
            self.what, transport, lambda: merge_config(self.what, codec, None, options, default="none"),
            prepare=lambda session: session.policy.check_parameters(self.params, self.what),
        )  # fmt: skip
        # Whether each parameter compresses, and with which options: fixed by its name and shape.
        self.plan = [self.policy.member_options(n, p.shape) for n, p in self.params]

    @property
    def step(self) -> int:
        """Averages done (the policy's step)."""
        return self.session.step

    def average(self) -> None:
        """Replace every gradient by its mean over the ranks (a collective: every rank calls it each step)."""
        members = []
        for (name, p), (compress, options) in zip(self.params, self.plan, strict=True):
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every rank sends every parameter, in the same order
            members.append(Member(name, p.grad, compress, options))
        self.session.run(Group(0, members)).wait()
        self.session.advance()

    def state_dict(self) -> dict[str, Any]:
        """This rank's state in every integration's checkpoint format."""
        return self.session.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], *, agreed: bool = True) -> None:
        """Resume from this rank's :meth:`state_dict`, every field checked first (a collective unless
        ``agreed=False``: then the caller agrees across ranks, as the GNN trainer does for its checkpoint)."""
        if isinstance(state, Mapping) and "codec" in state and not {"config", "world_size", "rank"} & set(state):
            # Written by an older release, whose average had the codec's default configuration only.
            state = {**state, "config": _default_config(state["codec"]), "world_size": self.world_size,
                     "rank": self.session.rank}  # fmt: skip
        self.session.load_state_dict(state, ((n, p.shape) for n, p in self.params), agreed=agreed)


def _default_config(codec: Any) -> dict[str, Any]:
    """The configuration an older release's average ran with: ``codec``'s defaults."""
    try:
        return Config(codec=codec).to_dict()
    except (TypeError, ValueError):
        return {"codec": codec}  # not a codec: the checkpoint check names it


__all__ = ["GradientAverage"]
