"""The monitor's judgement of a check: per tensor, over its bound or well under it, and the warning per group.

A tensor is **over the bound** where its mean ``lag`` exceeds ``max_lag`` (algorithms with error feedback) or,
without error feedback, its exact relative error exceeds ``max_error``; over it at ``patience`` checks in a row, it
is to be adapted; well under it (a quarter of it) as long, it may be made lighter.

A check's tensors over the bound are said in **one warning per group** (a DDP bucket, an FSDP unit): how many,
the worst few with their figure, the others by name, the bound and what is done about them. A tensor named in a
warning is not named again while nothing happens to it: it is named again once it moves a level, is moved to
another candidate (``auto``), or recovers (a check under the bound) and goes over again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sylvie_comm.algorithms.monitor_figures import TensorFigures

LOG = logging.getLogger("sylvie_comm")
RELAX = 0.25  # a tensor this far under its bound gives back what adaptation added
WORST = 3  # a warning gives the figures of this many of its tensors, the worst first; the others by name


@dataclass(frozen=True)
class Bounds:
    """The bounds a check judges on: ``max_lag`` (what it divides by: ``averages``) and ``max_error``."""

    max_lag: float
    max_error: float
    averages: str

    def of(self, t: TensorFigures, fresh: Mapping[str, float | None]) -> tuple[float, float, str] | None:
        """``(figure, bound, what it is)`` a check judges ``t`` on: its lag where measured, else its exact relative
        error where it has no residual; None where the check measured neither."""
        lag, exact = fresh["lag"], fresh["exact_error"]
        if lag is not None:
            return lag, self.max_lag, f"lag (residual / {self.averages})"
        if exact is not None and not t.feedback:
            return exact, self.max_error, "exact relative error"
        return None


@dataclass(frozen=True)
class Over:
    """A tensor over its bound at ``checks`` checks in a row; ``new``: not named in a warning since what
    happened to it last."""

    name: str
    figure: float
    bound: float
    what: str
    checks: int
    new: bool


def judge(t: TensorFigures, judged: tuple[float, float, str] | None, patience: int,
          relax_after: int | None) -> Over | str | None:  # fmt: skip
    """Count a check for or against ``t`` on its ``judged`` figure (:meth:`Bounds.of`): an :class:`Over` where it
    is over its bound at ``patience`` checks in a row (marked warned), ``"down"`` where it has been well under it
    for ``relax_after`` checks (None: it may not be made lighter), else None. A check under the bound ends the
    trouble a warning named."""
    if judged is None:
        return None
    figure, bound, what = judged
    if figure > bound:
        t.over, t.under = t.over + 1, 0
    elif figure < RELAX * bound:
        t.over, t.under, t.warned = 0, t.under + 1, False
    else:
        t.over, t.under, t.warned = 0, 0, False
    if t.over >= patience:
        new, t.warned = not t.warned, True
        return Over(t.name, figure, bound, what, t.over, new)
    if relax_after is not None and t.under >= relax_after:
        return "down"
    return None


def warning(algorithm: str, where: str, over: Sequence[Over], action: str) -> str | None:
    """The one warning of a group's check: its tensors newly over their bound, every one named (the worst
    :data:`WORST` with their figures, the others in name order), per figure and bound; those named before that are
    still over, counted; and ``action``. None where no tensor is newly over."""
    new = [o for o in over if o.new]
    if not new:
        return None
    parts = []
    for what, bound in sorted({(o.what, o.bound) for o in new}):
        these = sorted((o for o in new if (o.what, o.bound) == (what, bound)), key=lambda o: (-o.figure, o.name))
        checks = sorted({o.checks for o in these})
        row = f"{checks[0]}" if len(checks) == 1 else f"{checks[0]}-{checks[-1]}"
        worst = ", ".join(f"'{o.name}' {o.figure:.3g}" for o in these[:WORST])
        rest = sorted(these[WORST:], key=lambda o: o.name)
        more = f" and {len(rest)} more ({', '.join(repr(o.name) for o in rest)})" if rest else ""
        count = f"{len(these)} tensor{'s' if len(these) > 1 else ''}"
        parts.append(f"{count} over the bound {bound:.3g} of {what} at {row} check(s) in a row: {worst}{more}")
    before = len(over) - len(new)
    still = f"; {before} named before still over" if before else ""
    return f"sylvie_comm {algorithm}: {where}: {'; '.join(parts)}{still}; {action}"


def warn(algorithm: str, where: str, over: Sequence[Over], action: str) -> None:
    """Log :func:`warning` on the ``sylvie_comm`` logger, where there is one."""
    text = warning(algorithm, where, over, action)
    if text is not None:
        LOG.warning("%s", text)


__all__ = ["LOG", "RELAX", "Bounds", "Over", "judge", "warn", "warning"]
