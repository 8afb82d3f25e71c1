"""The monitor's checkpoint checked field by field, and its report as flat metrics for a logger."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from sylvie_comm.algorithms.budget import RAW
from sylvie_comm.algorithms.monitor_figures import FIGURES

STATE_KEYS = frozenset({"tensors", "overrides", "raw", "flush", "carry", "cursor", "checks", "bytes", "events"})
OPTIONAL_KEYS = frozenset({"verdicts", "budget", "owed"})  # (an older release's has no verdicts)


def check_state(state: Any) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Check a monitor's ``state_dict`` (a ValueError names the first field that does not fit); return its
    overrides and raw names (what the checkpoint's per-name state must fit)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"monitor state must be a mapping, got {type(state).__name__}")
    if set(state) - OPTIONAL_KEYS != STATE_KEYS:
        raise ValueError(f"monitor state has {sorted(state)}; expected {sorted(STATE_KEYS | {'verdicts'})} (and "
                         "'budget' with a byte budget)")  # fmt: skip
    for v in state.get("verdicts", ()):
        ok = isinstance(v, (list, tuple)) and len(v) == 4 and isinstance(v[0], str) and v[1] in ("up", "down")
        if not ok or not all(_finite(x) for x in v[2:]):
            raise ValueError(f"monitor state: a verdict must be [name, 'up' or 'down', figure, bound], got {v!r}")
    overrides, raw = state["overrides"], state["raw"]
    if not isinstance(overrides, Mapping) or not all(isinstance(v, Mapping) for v in overrides.values()):
        raise ValueError("monitor state: 'overrides' must map names to option dicts")
    if not isinstance(raw, (list, tuple)) or not all(isinstance(n, str) for n in raw):
        raise ValueError("monitor state: 'raw' must be a list of names")
    for n, s in dict(state["tensors"]).items():
        if not _tensor_state(s):
            raise ValueError(f"monitor state of '{n}' must hold finite sums and counts >= 0, got {s!r}")
    for k in ("checks", "bytes"):
        if not _count(state[k]):
            raise ValueError(f"monitor state: '{k}' must be an integer >= 0, got {state[k]!r}")
    return {str(n): dict(o) for n, o in overrides.items()}, set(raw)


def _tensor_state(s: Any) -> bool:
    """A tensor's checkpoint (``TensorFigures.state``): finite sums, counts >= 0, its shape and start if any."""
    return (
        isinstance(s, Mapping)
        and all(_finite(s.get(k)) for k in ("lag_sum", "err_sum", "count"))
        and all(_count(s.get(k)) for k in ("over", "under"))
        and ("shape" not in s or (isinstance(s["shape"], (list, tuple)) and all(map(_count, s["shape"]))
                                  and isinstance(s.get("base"), Mapping)))
        and _figures(s.get("last", {}))
    )  # fmt: skip


def metrics(stats: Mapping[str, Any], prefix: str = "sylvie_comm") -> dict[str, float]:
    """An integration's ``stats()`` as flat scalar metrics for a logger (Lightning's ``log_dict``, Accelerate's
    ``log``, TensorBoard): the compression ratio, the bytes sent, the skipped steps and, per tensor, the
    monitor's last figures (``{prefix}/monitor/<tensor>/lag``, ``error``, ``exact_error``, ``exact_cos``; a
    tensor adaptation sent raw logs ``raw`` 1)."""
    out: dict[str, float] = {}
    for key in ("compression_ratio", "bytes_sent", "skipped_nonfinite"):
        if isinstance(stats.get(key), (int, float)):
            out[f"{prefix}/{key}"] = float(stats[key])
    mon = stats.get("monitor")
    if isinstance(mon, Mapping):
        out[f"{prefix}/monitor/checks"] = float(mon["checks"])
        out[f"{prefix}/monitor/bytes"] = float(mon["bytes"])
        for name, t in mon["tensors"].items():
            for k in FIGURES:
                if t.get(k) is not None:
                    out[f"{prefix}/monitor/{name}/{k}"] = float(t[k])
            if t.get("setting") == RAW:
                out[f"{prefix}/monitor/{name}/raw"] = 1.0
    return out


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _figures(x: Any) -> bool:
    """A tensor's last figures: names to finite floats, or None where not measured."""
    return isinstance(x, Mapping) and all(
        isinstance(k, str) and (v is None or (isinstance(v, float) and math.isfinite(v))) for k, v in x.items()
    )


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


__all__ = ["check_state", "metrics"]
