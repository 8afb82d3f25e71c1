"""Streaming DiLoCo's fragments and their schedule.

The parameters are cut into ``F`` fragments (:func:`split`: in order, about equal in size), each with its global
copy (this rank's part), its pseudo-gradient buffer and the session that averages it (:class:`Fragment`); one
fragment syncs every ``sync_every // F`` inner steps (:func:`check_schedule`), its average started ``delay`` inner
steps before it is applied (:func:`due`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sylvie_comm.algorithms import Group, Member
from sylvie_comm.algorithms.session import Session
from sylvie_comm.optim.momentum import is_integer, is_number

Future = torch.futures.Future
Named = list[tuple[str, nn.Parameter]]


def local_part(p: torch.Tensor) -> torch.Tensor:
    """A parameter's values held by this rank: a DTensor's (FSDP2's) local shard, written in place through it;
    any other tensor itself."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


def as_grad(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` (this rank's part, fp32) as a gradient of ``p``: in its dtype, a DTensor laid out as ``p`` is."""
    values = values.to(p.dtype)
    if callable(getattr(p, "to_local", None)):
        from torch.distributed.tensor import DTensor

        assert isinstance(p, DTensor)
        return DTensor.from_local(values, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())  # fmt: skip
    return values


def check_schedule(what: str, sync_every: Any, fragments: Any, delay: Any, alpha: Any) -> int:
    """The outer steps' schedule checked (a ValueError naming the value); returns the period, the inner steps
    between two outer steps (of successive fragments): ``sync_every // fragments``."""
    if not is_integer(sync_every) or sync_every < 1:
        raise ValueError(f"{what}: sync_every must be an integer >= 1, got {sync_every!r}")
    if not is_integer(fragments) or fragments < 1:
        raise ValueError(f"{what}: fragments must be an integer >= 1, got {fragments!r}")
    if sync_every % fragments:
        raise ValueError(
            f"{what}: sync_every ({sync_every}) must be a multiple of fragments ({fragments}): one fragment "
            "syncs every sync_every // fragments inner steps"
        )
    period: int = sync_every // fragments
    if not is_integer(delay) or not 0 <= delay < period:
        raise ValueError(f"{what}: delay must be an integer in [0, sync_every // fragments = {period}), got {delay!r}")
    if not is_number(alpha) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"{what}: alpha must be a number in [0, 1], got {alpha!r}")
    return period


def due(inner_step: int, period: int, delay: int, fragments: int) -> tuple[int, bool, bool]:
    """At inner step ``inner_step`` (counted from 1): the fragment whose period it is (fragment ``k % F`` syncs in
    period ``k``), whether its average starts now (``delay`` inner steps before the period's end) and whether it
    is applied now (at the period's end)."""
    at = inner_step % period
    k = (inner_step - 1) // period
    return k % fragments, at == (period - delay) % period, at == 0


def split(named: Named, parts: int) -> list[Named]:
    """``named`` in order, cut into ``parts`` non-empty runs of about equal numel (``parts <= len(named)``)."""
    total = sum(p.numel() for _, p in named)
    out: list[Named] = [[]]
    seen = 0
    for i, (name, p) in enumerate(named):
        k, left = len(out) - 1, len(named) - i
        # the next part opens once this one has its share, or when each later part needs one of those left
        if out[k] and k < parts - 1 and (seen >= (k + 1) * total / parts or left <= parts - 1 - k):
            out.append([])
        out[-1].append((name, p))
        seen += p.numel()
    return out


class Fragment:
    """One fragment's parameters, global copy (of this rank's part), pseudo-gradient buffer and session."""

    def __init__(self, index: int, named: Named) -> None:
        self.index = index
        self.named = named
        self.params: list[torch.Tensor] = [p for _, p in named]
        local = self.local()
        self.shapes = [t.shape for t in local]
        self.numel = sum(t.numel() for t in local)
        self.outer = [t.detach().clone() for t in local]
        self.flat = torch.zeros(self.numel, dtype=torch.float32, device=local[0].device)
        self.views: list[torch.Tensor] = []
        at = 0
        for t in local:
            self.views.append(self.flat[at : at + t.numel()].view(t.shape))
            at += t.numel()
        self.session: Session | None = None
        self.group: Group | None = None
        self.pending: Future[Any] | None = None  # the average in flight (started, not applied)

    def local(self) -> list[torch.Tensor]:
        """This rank's part of each parameter (read afresh: FSDP2 may replace a shard's tensor object)."""
        return [local_part(p).detach() for p in self.params]

    def attach(self, session: Session) -> None:
        """Average through ``session``: the pseudo-gradient buffer's views as one group, each by its policy."""
        members = []
        for (name, _), view in zip(self.named, self.views, strict=True):
            compress, opts = session.policy.member_options(name, view.shape)
            members.append(Member(name, view, compress, opts))
        self.group = Group(self.index, members, flat=self.flat)
        self.session = session


__all__ = ["Fragment", "as_grad", "check_schedule", "due", "local_part", "split"]
