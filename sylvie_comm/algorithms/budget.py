"""Compression within a byte budget: each tensor's setting chosen from its measured error per byte.

The monitor's adaptation on its own (``adapt``) keeps accuracy mostly by sending the tensors it adapts raw,
which gives back most of what compression saved. Given a target instead (``monitor: {target_ratio: 8}``:
eight times fewer bytes than fp32; or ``target_bytes``: bytes per compressed step), the monitor chooses every
tensor's setting at its checks as L-GreCo does (Markov et al., "L-GreCo: Layerwise-Adaptive Gradient Compression
for Efficient and Accurate Deep Learning", MLSys 2024):

* **measured**: at each check, each rank encodes and decodes its error-compensated gradient ``g + r`` of every
  tensor at every level of the algorithm's ladder (:meth:`Algorithm.adapt` walked down and up from the tensor's
  starting setting; a low-rank matrix's ranks from one set of singular values, which give the best rank-``k``
  error of every ``k`` at once; qsgd's bits, top-k's ratios through their codecs) and takes the squared error
  of each. Check steps only, so the cost is bounded by ``period``. Sending it raw is the last level (no error,
  4 bytes an element).
* **agreed**: the figures are averaged across the ranks with one all-reduce (on the algorithm's transport, in
  its order) and read at the next step, then smoothed across checks (:data:`SMOOTH`), so every rank holds the
  same numbers.
* **solved**: a dynamic program over the tensors (a knapsack with a choice per tensor, :func:`solve`) minimises
  the summed squared error subject to the bytes per step the budget leaves (the tensors the policy sends raw
  are counted first). Bytes are counted in units of a :data:`RESOLUTION`-th of the budget, each level's rounded
  up, so the budget is never exceeded; ties go to the cheaper level of the earlier tensor, so the ranks decide
  the same.
* **over the run**: the budget per step is what brings the bytes since the first step (the monitor's own and,
  under ``target_ratio``, the warm-up's fp32 steps included) back to the target over the next
  :data:`REPAY_CHECKS` periods: steps sent above it (the warm-up, the steps before the first check at the
  starting settings) are paid back, and steps below it leave room.

A tensor goes raw only where the budget allows it. The figures, the curve the DP chose from (the least error
at each byte count) and the choice are in ``stats()["monitor"]["budget"]``; they and the bytes counted so far
are in the monitor's checkpoint, so a resumed run decides as the straight run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from sylvie_comm.algorithms.base import Algorithm, Future, Member
from sylvie_comm.algorithms.feedback import FeedbackAlgorithm
from sylvie_comm.algorithms.lowrank import LowRankAlgorithm
from sylvie_comm.algorithms.qsgd import QSGDAlgorithm, merged_rows
from sylvie_comm.codecs import CODECS, codec_options
from sylvie_comm.codecs import lowrank as lr

REPAY_CHECKS = 4  # bytes over or under the target are evened out over this many periods (or to the next check)
RESOLUTION = 2048  # the DP's byte units per step: a 2048th of the budget (each level's bytes rounded up)
SMOOTH = 0.5  # the weight of the new check's figures against those before (an exponential average)
DOWN_LEVELS = 6  # levels below the starting setting at most (a ratio halves without end)
MAX_LEVELS = 16  # levels of one tensor at most, raw included
CURVE_POINTS = 24  # points of the error-against-bytes curve in the report
RAW = "raw"


def solve(costs: Sequence[Sequence[int]], errors: Sequence[Sequence[float]],
          capacity: int) -> tuple[list[int], list[float]]:  # fmt: skip
    """The choice per item (an index into its ``costs``/``errors``) that minimises the summed error with the
    summed cost at most ``capacity``, and the curve: the least summed error at each total cost ``0..capacity``
    (``inf`` where none fits).

    A knapsack with one choice per item, solved exactly over integer costs: ``best[b]`` is the least error of
    the items so far at a total of exactly ``b``. Ties are broken by a fixed order, so the same input gives the
    same choice on every rank: an item's earlier choice (the ladder's cheaper level) wins over a later one of the
    same error at the same total, and the smallest total reaching the least error is taken.

    Raises:
        ValueError: the lengths differ, a cost is negative, or no choice fits ``capacity``.
    """
    if len(costs) != len(errors) or any(len(c) != len(e) or not c for c, e in zip(costs, errors, strict=False)):
        raise ValueError("budget: every item needs one error per cost, and at least one choice")
    if capacity < 0 or any(c < 0 for row in costs for c in row):
        raise ValueError(f"budget: costs and capacity must be >= 0, got capacity {capacity}")
    inf = math.inf
    best = torch.full((capacity + 1,), inf, dtype=torch.float64)
    best[0] = 0.0
    picks = []  # per item, the choice that reached each total
    for cost, err in zip(costs, errors, strict=True):
        new = torch.full_like(best, inf)
        pick = torch.full((capacity + 1,), -1, dtype=torch.int64)
        for j, (c, e) in enumerate(zip(cost, err, strict=True)):
            if c > capacity:
                continue
            cand = best[: capacity + 1 - c] + float(e)
            better = cand < new[c:]  # strictly: the earlier choice keeps a tie
            new[c:] = torch.where(better, cand, new[c:])
            pick[c:] = torch.where(better, j, pick[c:])
        best = new
        picks.append(pick)
    if not math.isfinite(float(best.min())):
        raise ValueError(f"budget: no choice of the {len(costs)} items fits a capacity of {capacity}")
    at = int(torch.argmin(best))  # the first (smallest) total of the least error
    choice = [0] * len(costs)
    for i in range(len(costs) - 1, -1, -1):
        j = int(picks[i][at])
        choice[i] = j
        at -= costs[i][j]
    return choice, torch.cummin(best, 0).values.tolist()


def ladder(alg: Algorithm, shape: tuple[int, ...], base: Mapping[str, Any], min_rate: float) -> list[dict[str, Any]]:
    """The settings a tensor of ``shape`` starting at ``base`` may take, cheapest first (its per-name options;
    raw not included): :meth:`Algorithm.adapt` walked down from ``base`` (at most :data:`DOWN_LEVELS` levels) and
    up while it compresses at least ``min_rate`` times."""
    merged = {**alg.options, **base}
    start = {k: merged[k] for k in sorted(alg.record.per_name_options) if k in merged}
    down: list[dict[str, Any]] = []
    cur = start
    while len(down) < DOWN_LEVELS:
        step = alg.adapt(shape, {**base, **cur}, up=False, floor={**base, **cur})
        if step is None:
            break
        cur = {**cur, **step}
        down.append(cur)
    up: list[dict[str, Any]] = []
    cur = start
    while len(down) + len(up) + 2 < MAX_LEVELS:
        step = alg.adapt(shape, {**base, **cur}, up=True)
        if step is None or alg.compression_rate(shape, {**base, **cur, **step}) < min_rate:
            break
        cur = {**cur, **step}
        up.append(cur)
    out, seen = [], set()
    for opts in [*reversed(down), start, *up]:
        size = level_bytes(alg, shape, {**base, **opts})
        if size < 4.0 * math.prod(shape) and size not in seen:  # one setting per size ("auto" and its integer)
            seen.add(size)
            out.append(opts)
    return sorted(out, key=lambda o: level_bytes(alg, shape, {**base, **o}))


def level_bytes(alg: Algorithm, shape: tuple[int, ...], options: Mapping[str, Any] | None) -> float:
    """Bytes per step a tensor of ``shape`` sends at ``options`` (None: raw, fp32): a low-rank algorithm's from
    its compression rate, uncapped (``bytes_per_element`` caps it at 32x, which would make every rank below
    it cost the same), qsgd's with its rows' scales and minimums, the others' from ``bytes_per_element``."""
    numel = math.prod(shape)
    if options is None:
        return 4.0 * numel
    if isinstance(alg, LowRankAlgorithm):
        return 4.0 * numel / alg.compression_rate(shape, options)
    if isinstance(alg, QSGDAlgorithm):  # the rows' fp32 scale and minimum too (1/8 of a 4-bit row of 128)
        rows, cols = (shape[0], numel // shape[0]) if len(shape) >= 2 else (1, numel)
        rows, cols = merged_rows(rows, cols, int({**alg.options, **options}["block"]))
        return rows * (math.ceil(cols * int({**alg.options, **options}["bits"]) / 8) + 8.0)
    return numel * alg.bytes_per_element(shape, options)


def _residual(alg: Algorithm, name: str) -> torch.Tensor | None:
    """This rank's error-feedback residual of ``name`` as it stands (any owed update applied), never changed."""
    if isinstance(alg, LowRankAlgorithm):
        if name in alg._residuals:
            return alg._residual(name)
        return alg._loaded_residual(name)
    if isinstance(alg, FeedbackAlgorithm) and alg.error_feedback:
        return alg.feedback.residual(name)
    return None


def level_errors(alg: Algorithm, m: Member, base: Mapping[str, Any], levels: Sequence[Mapping[str, Any]],
                 seed: int) -> torch.Tensor:  # fmt: skip
    """``[||c||^2, ||c - C_1(c)||^2, ...]`` on the tensor's device, for ``c`` this rank's error-compensated
    gradient of ``m`` and ``C_i`` the algorithm at ``levels[i]`` (a low-rank one's best rank-``k``
    approximation; the others' codec, its noise seeded by ``seed``)."""
    c = m.tensor.detach().reshape(-1).float()
    res = _residual(alg, m.name)
    if res is not None and res.numel() == c.numel():
        c = c + res.reshape(-1).to(c.device, torch.float32)
    out = [torch.dot(c, c)]
    if isinstance(alg, LowRankAlgorithm):
        s2 = torch.linalg.svdvals(c.view(lr.matrix_shape(m.tensor.shape))).square()
        kept = torch.cumsum(s2, 0)
        for opts in levels:
            r = lr.effective_rank(m.tensor.shape, {**base, **opts}.get("rank", alg.options["rank"]), alg.alternate)
            out.append((out[0] - kept[r - 1]).clamp_min(0))
    else:
        cls = CODECS[str(alg.record.codec_name)]
        names = set(codec_options(cls))
        for i, opts in enumerate(levels):
            kw = {k: v for k, v in {**alg.options, **base, **opts}.items() if k in names}
            if "seed" in names:
                kw["seed"] = (seed * 1_000_003 + i) % 2**31
            codec = cls(**kw)
            d = codec.decode(codec.encode(c.view(m.tensor.shape))).reshape(-1).float() - c
            out.append(torch.dot(d, d))
    return torch.stack(out)


def measurable(alg: Algorithm) -> str | None:
    """Why the budget cannot measure ``alg``'s levels (None where it can)."""
    if isinstance(alg, LowRankAlgorithm) or (alg.record.codec_name is not None and alg.record.codec_name in CODECS):
        return None
    return (f"monitor target_ratio/target_bytes: '{alg.name}' has no codec whose levels the budget can measure "
            "(it needs a low-rank algorithm or one with a registered codec)")  # fmt: skip


class Budget:
    """The byte budget's state: per tensor its ladder and smoothed errors, the bytes counted so far, the last
    allocation (module docstring). Driven by the :class:`~sylvie_comm.algorithms.monitor.Monitor`.

    Args:
        algorithm: the algorithm the monitor watches (:func:`measurable`).
        target_ratio: bytes this many times fewer than fp32's over the run (None: ``target_bytes``).
        target_bytes: bytes per compressed step (None: ``target_ratio``).
        min_rate: a level compressing less than this is not offered (raw is).
    """

    def __init__(self, algorithm: Algorithm, target_ratio: float | None, target_bytes: float | None,
                 min_rate: float) -> None:  # fmt: skip
        why = measurable(algorithm)
        if why is not None:
            raise ValueError(why)
        self.algorithm = algorithm
        self.target_ratio, self.target_bytes = target_ratio, target_bytes
        self.min_rate = min_rate
        self._ladders: dict[str, list[dict[str, Any]]] = {}
        self.errors: dict[str, list[float]] = {}  # name -> [||c||^2, error at each level of its ladder], smoothed
        self.fixed: dict[str, int] = {}  # names the policy sends raw -> their fp32 bytes per step
        self.sent = 0.0  # bytes counted since the first compressed step, at the settings of each step (payload)
        self.plain = 0.0  # what fp32 would have sent over those steps
        self.at = 0  # the compressed step counted up to
        self.due = False  # figures folded since the last allocation
        self.last: dict[str, Any] = {}  # the last allocation, for the report
        self._pending: list[tuple[int, list[str], torch.Tensor, Future[Any]]] = []

    def levels(self, name: str, shape: tuple[int, ...], base: Mapping[str, Any]) -> list[dict[str, Any]]:
        got = self._ladders.get(name)
        if got is None:
            got = self._ladders[name] = ladder(self.algorithm, shape, base, self.min_rate)
        return got

    def measure(self, members: Sequence[Member], bases: Mapping[str, Mapping[str, Any]], step: int) -> torch.Tensor:
        """Every member's :func:`level_errors`, one flat device vector (to be all-reduced)."""
        parts = []
        for i, m in enumerate(members):
            shape = tuple(m.tensor.shape)
            levels = self.levels(m.name, shape, bases[m.name])
            parts.append(level_errors(self.algorithm, m, bases[m.name], levels, step * 4099 + i))
        return torch.cat(parts)

    def launched(self, step: int, names: list[str], summed: torch.Tensor, done: Future[Any]) -> None:
        self._pending.append((step, names, summed, done))

    def fold(self, step: int | None, world: int) -> None:
        """Read the figures of the checks before ``step`` (every one where None), averaged across the ranks, into
        the smoothed errors."""
        ready = [p for p in self._pending if p[0] != step]
        self._pending = [p for p in self._pending if p[0] == step]
        for _, names, summed, done in ready:
            done.wait()
            flat = (summed.double() / world).tolist()
            pos = 0
            for n in names:
                size = len(self._ladders[n]) + 1
                fresh, pos = flat[pos : pos + size], pos + size
                old = self.errors.get(n)
                self.errors[n] = fresh if old is None else [SMOOTH * f + (1 - SMOOTH) * o
                                                            for f, o in zip(fresh, old, strict=True)]  # fmt: skip
            self.due = True

    def allowance(self, step: int, horizon: int, now: float, plain: float, fixed: float, overhead: float,
                  warm: int = 0) -> float:  # fmt: skip
        """Bytes per step the compressible tensors may send over the next ``horizon`` steps: what keeps the run at
        the target, counting the steps to ``step`` at ``now`` bytes per step (fp32: ``plain``), less the raw
        tensors' ``fixed`` bytes, ``overhead`` (the monitor's own bytes so far) counted as sent. Under
        ``target_ratio``, the ``warm`` steps of the warm-up before the first compressed step count as fp32 sent."""
        self.sent += (step - self.at) * now
        self.plain += (step - self.at) * plain
        self.at = step
        if self.target_ratio is not None:
            allowed = (self.plain + (warm + horizon) * plain) / self.target_ratio - warm * plain
        else:
            allowed = (step + horizon) * float(self.target_bytes or 0.0)
        return (allowed - self.sent - overhead) / horizon - fixed

    def allocate(self, options: Mapping[str, tuple[tuple[int, ...], Mapping[str, Any]]],
                 budget: float) -> dict[str, dict[str, Any] | str]:  # fmt: skip
        """Each measured tensor's setting (its per-name options, or :data:`RAW`) within ``budget`` bytes per step:
        :func:`solve` over the tensors in name order. ``options``: name -> (shape, base options)."""
        alg = self.algorithm
        names = sorted(n for n in self.errors if n in options)
        sizes, errs = [], []
        for n in names:
            shape, base = options[n]
            numel = math.prod(shape)
            levels = self.levels(n, shape, base)  # (a resumed run builds it again: a function of shape and base)
            sizes.append([level_bytes(alg, shape, {**base, **o}) for o in levels] + [4.0 * numel])
            errs.append([*self.errors[n][1:], 0.0])
        least = sum(s[0] for s in sizes)
        cap_bytes = max(budget, least)  # below the cheapest levels: the cheapest levels
        unit = max(cap_bytes / RESOLUTION, 1.0)
        costs = [[math.ceil(b / unit - 1e-9) for b in row] for row in sizes]
        capacity = max(int(cap_bytes // unit), sum(c[0] for c in costs))
        choice, curve = solve(costs, errs, capacity)
        out: dict[str, dict[str, Any] | str] = {}
        for n, j in zip(names, choice, strict=True):
            out[n] = RAW if j == len(self._ladders[n]) else dict(self._ladders[n][j])
        total = sum(self.errors[n][0] for n in names) or 1.0
        self.last = {
            "budget_bytes": budget, "chosen_bytes": sum(s[j] for s, j in zip(sizes, choice, strict=True)),
            "chosen_error": sum(e[j] for e, j in zip(errs, choice, strict=True)) / total,
            "curve": _curve(curve, unit, total),
            "levels": {n: [[_label(o), s, e / total] for o, s, e in zip([*self._ladders[n], None], sz, er, strict=True)]
                       for n, sz, er in zip(names, sizes, errs, strict=True)},
        }  # fmt: skip
        self.due = False
        return out

    def report(self) -> dict[str, Any]:
        ratio = self.plain / self.sent if self.sent else None
        return {"target_ratio": self.target_ratio, "target_bytes": self.target_bytes, "counted_ratio": ratio,
                **self.last}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"errors": {n: list(e) for n, e in self.errors.items()}, "fixed": dict(self.fixed),
                "sent": self.sent, "plain": self.plain, "at": self.at, "due": self.due,
                "last": json.loads(json.dumps(self.last))}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ok = isinstance(state, Mapping) and set(state) == {"errors", "fixed", "sent", "plain", "at", "due", "last"}
        if not ok or not all(isinstance(e, list) and all(isinstance(x, float) and math.isfinite(x) for x in e)
                             for e in dict(state["errors"]).values()):  # fmt: skip
            raise ValueError(
                "monitor state: 'budget' must hold errors (lists of finite floats), fixed, sent, plain, "
                f"at, due and last, got {sorted(state) if isinstance(state, Mapping) else state!r}"
            )
        self.errors = {str(n): list(e) for n, e in state["errors"].items()}
        self.fixed = {str(n): int(b) for n, b in state["fixed"].items()}
        self.sent, self.plain, self.at = float(state["sent"]), float(state["plain"]), int(state["at"])
        self.due, self.last = bool(state["due"]), dict(state["last"])
        self._pending = []


def _label(options: Mapping[str, Any] | None) -> str:
    if options is None:
        return RAW
    return ",".join(f"{k}={v}" for k, v in sorted(options.items())) or "start"


def _curve(least: list[float], unit: float, total: float) -> list[list[float]]:
    """The DP's least error at each byte count, as ``[bytes per step, relative squared error]`` points where it
    drops (at most :data:`CURVE_POINTS`, spread over the range)."""
    points = [(b * unit, e / total) for b, e in enumerate(least) if math.isfinite(e) and (b == 0 or e < least[b - 1])]
    if len(points) > CURVE_POINTS:
        step = (len(points) - 1) / (CURVE_POINTS - 1)
        points = [points[round(i * step)] for i in range(CURVE_POINTS)]
    return [[b, e] for b, e in points]


__all__ = ["Budget", "ladder", "level_bytes", "level_errors", "measurable", "solve"]
