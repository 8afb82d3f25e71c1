"""qsgd's ``error_feedback`` option as the hooks read it: off, no residual is kept, so the DDP hook's rule for error
feedback (``warmup_steps >= 2``: DDP rebuilds its buckets after the first iteration, and residuals are laid out
per bucket) does not apply, and ``warmup_steps=0`` compresses from the first step."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from sylvie_comm.algorithms.registry import ALGORITHMS, make_algorithm
from sylvie_comm.collectives.local import LocalGroup
from tests.integrations import workloads as wl


def _registration_error(options: dict[str, Any]) -> str:
    """What registering the DDP hook's state for qsgd with ``options`` raises on one in-process rank (its checks
    need no process group)."""
    from sylvie_comm.algorithms.session import merge_config
    from sylvie_comm.integrations.ddp import HookState

    try:
        state = HookState(merge_config("ddp", "qsgd", None, options), LocalGroup(1).transport(0),  # type: ignore[arg-type]
                          wl.mlp().named_parameters())  # fmt: skip
    except ValueError as exc:
        return str(exc)
    state.close()
    return "no error"


def test_an_instance_keeps_error_feedback_as_its_option_says() -> None:
    assert ALGORITHMS["qsgd"].record.error_feedback  # what qsgd can do, on by default
    on = make_algorithm("qsgd", LocalGroup(1).transport(0), {})
    off = make_algorithm("qsgd", LocalGroup(1).transport(0), {"error_feedback": False})
    assert on.error_feedback and not off.error_feedback


def test_without_error_feedback_the_hook_takes_no_warmup() -> None:
    assert _registration_error({"error_feedback": False, "warmup_steps": 0}) == "no error"
    assert _registration_error({"error_feedback": False, "bits": 2, "warmup_steps": 1}) == "no error"
    with_feedback = _registration_error({"warmup_steps": 0})
    assert "ddp[qsgd]: warmup_steps must be >= 2 with error feedback (got 0)" in with_feedback


def test_without_error_feedback_ddp_compresses_from_the_first_step() -> None:
    """DDP on one in-process rank: every step compressed (8-bit stochastic rounding: a small error, never 0),
    before and after DDP rebuilds its buckets."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        r = wl.compare_with_default(0, 1, "qsgd", {"bits": 8, "error_feedback": False, "warmup_steps": 0})
    finally:
        dist.destroy_process_group()
    assert r["steps"] == 6 and len(r["errors"]) == 6 and r["buckets"] >= 3, r
    assert all(0 < e <= 0.02 for e in r["errors"]), r["errors"]
