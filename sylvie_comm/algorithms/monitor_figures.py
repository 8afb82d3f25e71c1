"""One tensor's figures for the monitor: the per-step lag and error summed on its device, the exact check's last
comparison, its counters of checks over and under the bound, and how they are checkpointed.

Every figure stays a device scalar until a check stacks them (:func:`stack`) for the one all-reduce that averages
them across the ranks; the host reads them once per check (:meth:`TensorFigures.read`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sylvie_comm.algorithms.base import Algorithm, Member

FIGURES = ("lag", "error", "exact_error", "exact_cos")  # a tensor's figures of a check, as the report names them


@dataclass
class TensorFigures:
    """One tensor's figures since the last check (device sums) and its history (host)."""

    name: str
    shape: tuple[int, ...]
    base: dict[str, Any]  # the options it started with (the policy's)
    lag_sum: torch.Tensor | None = None
    err_sum: torch.Tensor | None = None
    count: torch.Tensor | None = None  # steps whose figures were finite
    exact: tuple[torch.Tensor, torch.Tensor] | None = None  # (relative error, cosine) of the last exact check
    over: int = 0  # checks in a row over the bound
    under: int = 0  # checks in a row well under it
    warned: bool = False  # its trouble was named in a warning, and nothing has happened to it since
    variant: str = ""  # what averaged it (auto's candidate), see Delegating.variant
    feedback: bool = False  # a residual was seen: judged by its lag, not by the exact check
    failed: set[str] = field(default_factory=set)  # settings that were over the bound: never taken again
    last: dict[str, float | None] = field(default_factory=dict)

    def restart(self, variant: str) -> None:
        """Another candidate averages it now: its figures and counters start afresh."""
        self.variant, self.lag_sum, self.err_sum, self.count, self.over, self.under = variant, None, None, None, 0, 0
        self.exact, self.feedback, self.warned = None, False, False

    def accumulate(self, alg: Algorithm, g2: torch.Tensor, given2: torch.Tensor, lock: threading.Lock) -> None:
        """One step's lag and error (the residual now, against the norms :func:`norms_before` took before the
        step), added once the step settles, unless it was skipped (its state put back: it did not happen)."""
        inner = alg.residual_inner(self.name, None)
        if inner is None:
            return
        self.feedback = True
        r = inner[0].clamp_min(0).sqrt()
        lag, err = r / g2.sqrt(), r / given2.clamp_min(0).sqrt()
        ok = torch.isfinite(lag) & torch.isfinite(err)

        def add(bad: torch.Tensor | None) -> None:
            taken = ok if bad is None else ok & ~bad
            one, lag_, err_ = taken.float(), torch.where(taken, lag, 0.0), torch.where(taken, err, 0.0)
            with lock:
                self.lag_sum = lag_ if self.lag_sum is None else self.lag_sum + lag_
                self.err_sum = err_ if self.err_sum is None else self.err_sum + err_
                self.count = one if self.count is None else self.count + one

        alg.guard.on_settle(add)

    def read(self, row: Sequence[float]) -> dict[str, float | None]:
        """A check's figures from ``row`` (its averaged column of :func:`stack`); the report keeps a figure not
        measured since the last check (a tensor not sampled this time)."""
        lag, err, count, ex_rel, ex_cos, has = row
        fresh = {
            "lag": lag / count if count > 0 else None,
            "error": err / count if count > 0 else None,
            "exact_error": ex_rel if has > 0 else None,
            "exact_cos": ex_cos if has > 0 else None,
        }
        self.last = {k: v if v is not None else self.last.get(k) for k, v in fresh.items()}
        return fresh

    def state(self) -> dict[str, Any]:
        """Its checkpoint: sums read on the host, counters, decisions' history, the figures the report shows."""
        return {
            "lag_sum": _host(self.lag_sum), "err_sum": _host(self.err_sum), "count": _host(self.count),
            "exact": None if self.exact is None else [_host(self.exact[0]), _host(self.exact[1])],
            "over": self.over, "under": self.under, "warned": self.warned, "failed": sorted(self.failed),
            "variant": self.variant, "feedback": self.feedback, "shape": list(self.shape), "base": dict(self.base),
            "last": dict(self.last),  # the figures the report shows (a tensor not measured since keeps them)
        }  # fmt: skip

    def restore(self, s: Mapping[str, Any], device: torch.device | None) -> None:
        """Take :meth:`state`'s fields (checked by the monitor's ``check_state``), the sums placed on ``device``."""

        def dev(x: float) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.float32, device=device)

        if s["count"]:
            self.lag_sum, self.err_sum, self.count = dev(s["lag_sum"]), dev(s["err_sum"]), dev(s["count"])
        if s["exact"] is not None:
            self.exact = (dev(s["exact"][0]), dev(s["exact"][1]))
        self.over, self.under, self.warned, self.failed = s["over"], s["under"], s["warned"], set(s["failed"])
        self.variant, self.feedback = s["variant"], bool(s.get("feedback", False))
        self.last = dict(s.get("last", {}))


def norms_before(alg: Algorithm, members: Sequence[Member]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per member, ``(||g||^2, ||g + r||^2)`` before the step runs (``r``: its residual; none yet: 0): what
    :meth:`TensorFigures.accumulate` divides the residual after the step by. Two passes over the gradient and one
    over the residual, on the gradient's device."""
    out = {}
    for m in members:
        g = m.tensor.detach().reshape(-1).float()
        inner = alg.residual_inner(m.name, g)
        g2 = torch.dot(g, g)
        out[m.name] = (g2, g2 if inner is None else g2 + 2 * inner[1] + inner[0])
    return out


def stack(ts: Sequence[TensorFigures], device: torch.device) -> torch.Tensor:
    """The figures of ``ts`` since the last check as one ``[len(ts), 6]`` fp32 tensor on ``device`` (a column
    per figure, a stack each: a few ops per check, not per tensor): lag, error and count sums, the exact check's
    error and cosine, and whether it was taken (a skipped step: not). The sums start afresh."""
    zero = torch.zeros((), device=device)
    exact = [zero if t.exact is None else t.exact[0].to(device) for t in ts]
    cos = [zero if t.exact is None else t.exact[1].to(device) for t in ts]
    taken = torch.tensor([t.exact is not None for t in ts], device=device)
    columns = [
        torch.stack([zero if t.lag_sum is None else t.lag_sum.to(device) for t in ts]),
        torch.stack([zero if t.err_sum is None else t.err_sum.to(device) for t in ts]),
        torch.stack([zero if t.count is None else t.count.to(device) for t in ts]),
        torch.stack(exact).nan_to_num(nan=0.0),
        torch.stack(cos).nan_to_num(nan=0.0),
        (torch.stack(exact).isfinite() & taken).float(),
    ]
    for t in ts:
        t.lag_sum = t.err_sum = t.count = None
        t.exact = None
    return torch.stack(columns, dim=1).float()


def compare(out: torch.Tensor, exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative error and cosine of ``out`` against ``exact`` (flat fp32), device scalars."""
    n = exact.norm()
    return (out - exact).norm() / n, (out @ exact) / (out.norm() * n)


def _host(t: torch.Tensor | None) -> float:
    """A figure read on the host for a checkpoint (0 for none, and on the ``meta`` device, which holds no values)."""
    return 0.0 if t is None or t.device.type == "meta" else float(t)


__all__ = ["FIGURES", "TensorFigures", "compare", "norms_before", "stack"]
