"""What an algorithm that averages through others offers the session and the monitor (``auto``).

An algorithm of its own (a codec, a low-rank method) averages every group the same way for the whole run. One that
*delegates* averages each group through one of the other registered algorithms, chosen while it runs, and so has
hooks the session, the policy and the monitor need to reach: which candidate averages a tensor now, how long its
choice takes to settle, how to move a group to a safer candidate. They are this protocol, not methods of every
algorithm: a caller asks :func:`delegating` once and calls them only where it answers.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Delegating(Protocol):
    """An algorithm that averages each group through one of its candidates, registered algorithms of their own."""

    @classmethod
    def candidates_take_rank(cls) -> bool:
        """Whether a default candidate is low-rank, so that a ``rank`` option reaches what it sends."""
        ...

    def variant(self, name: str) -> str:
        """The candidate that averages ``name`` now (``""`` before the first choice); the monitor starts a
        tensor's figures afresh when it changes."""
        ...

    def unmonitored(self) -> None:
        """No compression monitor watches this run: leave out the candidates that need one."""
        ...

    def judge_with(self, max_lag: float, steps: int, window: int) -> None:
        """The monitor watches this run: judge a candidate that needs it on ``steps`` steps (its lag on the last
        ``window``, against ``max_lag``) before it averages the model's gradients."""
        ...

    def settles_after(self) -> int:
        """Compressed steps before what it sends is its choice for the run; the monitor's checks count from there."""
        ...

    def patience(self, key: int, default: int) -> int:
        """Checks in a row over the bound before the monitor acts on group ``key`` (``default``: the monitor's)."""
        ...

    def demote(self, key: int) -> tuple[str, str] | None:
        """Move group ``key`` to its next safer candidate: ``(from, to)``, or None where there is none left (the
        monitor then adapts tensor by tensor)."""
        ...


def delegating(algorithm: Any) -> Delegating | None:
    """``algorithm`` as a :class:`Delegating`, or None for an algorithm of its own."""
    return algorithm if isinstance(algorithm, Delegating) else None


def takes_rank(cls: type[Any]) -> bool:
    """Whether a ``rank`` option sets what algorithm class ``cls`` sends: its own low-rank factors' (``low_rank``),
    or those of the candidates it averages through."""
    if issubclass(cls, Delegating):
        return bool(cls.candidates_take_rank())
    return bool(cls.record.low_rank)


__all__ = ["Delegating", "delegating", "takes_rank"]
