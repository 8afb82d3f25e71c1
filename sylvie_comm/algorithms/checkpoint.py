"""What every integration checks in a checkpoint before it loads one (the per-name state is the algorithm's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sylvie_comm.config import Config, differences

_NO_RANK = (
    "; a checkpoint without 'rank' was written by an older sylvie-comm: set ckpt['rank'] to the rank that wrote it "
    "(each rank's own file) and load it again"
)


def check_checkpoint(
    what: str, state: Any, name: str, config: Config, world_size: int, rank: int, *, name_key: str = "hook",
    step_key: str = "step",
) -> int:  # fmt: skip
    """The checkpoint's step, after checking its fields against this run; a ValueError naming the first that
    does not fit. ``state`` holds ``name_key`` (the algorithm), ``config``, ``world_size``, ``rank``,
    ``step_key`` (an int >= 0) and ``params``, and ``warmup`` (the adaptive warm-up's state) and ``monitor``
    (the compression monitor's) where the run has them, checked by the policy."""
    expected = {name_key, "config", "world_size", "rank", step_key, "params"}
    if not isinstance(state, Mapping):
        raise ValueError(f"{what}: a checkpoint must be a dict from state_dict(), got {type(state).__name__}")
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected - {"warmup", "monitor"})
    if missing or extra:
        raise ValueError(
            f"{what}: checkpoint fields {sorted(state)} are not those of state_dict() ({sorted(expected)})"
            + (f": missing {missing}" if missing else "")
            + (f": unknown {extra}" if extra else "")
            + (_NO_RANK if missing == ["rank"] else "")
        )
    if state[name_key] != name:
        raise ValueError(f"{what}: checkpoint is for {state[name_key]!r}, not {name!r}")
    if not isinstance(state["config"], Mapping):
        raise ValueError(f"{what}: checkpoint field 'config' must be a dict, got {type(state['config']).__name__}")
    # Written before the adaptive warm-up: those runs started every tensor at warmup_steps.
    # Written before the monitor: its defaults, as this release reads a config without one.
    theirs = {"warmup": "fixed", "total_steps": None, **state["config"]}
    if "monitor" not in theirs:
        theirs["monitor"] = Config().to_dict()["monitor"]
    mine_config = config.to_dict()
    # Written before the bound was per path: their default max_lag, 0.5, read as today's default (None: the bound
    # calibrated for the path, 0.5 for a gradient as before).
    old = theirs["monitor"]
    if isinstance(old, Mapping) and old.get("max_lag") == 0.5 and mine_config["monitor"].get("max_lag") is None:
        theirs["monitor"] = {**old, "max_lag": None}
    diff = differences(mine_config, theirs)
    if diff:
        field, mine, theirs = diff[0]
        raise ValueError(f"{what}: checkpoint config differs: '{field}' is {theirs!r}, this run has {mine!r}")
    if state["world_size"] != world_size:
        raise ValueError(
            f"{what}: checkpoint was written with world size {state['world_size']!r}, this run has {world_size}"
        )
    if state["rank"] != rank:
        raise ValueError(
            f"{what}: checkpoint was written by rank {state['rank']!r} and is loaded on rank {rank}: the state is "
            "per rank (each rank's residuals), so save state_dict() on every rank and load each rank's own"
        )
    step = state[step_key]
    if isinstance(step, Mapping):  # per-name steps (the Horovod compressor)
        bad = [n for n, v in step.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            raise ValueError(f"{what}: checkpoint step of '{bad[0]}' must be an integer >= 0, got {step[bad[0]]!r}")
        return max(step.values(), default=0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{what}: checkpoint field '{step_key}' must be an integer >= 0, got {step!r}")
    return step


__all__ = ["check_checkpoint"]
