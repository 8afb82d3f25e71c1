"""Every DDP hook under torch.amp.GradScaler, with one NaN in one gradient element on one rank.

Before: the error-feedback hooks kept the NaN in their residuals and factors, so every later step came back
non-finite and the scaler skipped them all (its scale fell 1024 -> 2 in 9 steps). Now the scaler skips that
one step and the hook's state after it is what it was before it, on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import ALGORITHMS
from tests.dist_utils import run_distributed
from tests.integrations import workloads as wl

pytestmark = pytest.mark.multiprocess

HOOKS = sorted(ALGORITHMS)


def assert_same(after: Any, before: Any, where: str) -> None:
    """``after`` is ``before`` bit for bit; state the skipped step created where there was none is fresh
    (its residuals zero; auto's candidates start when first probed)."""
    if isinstance(after, torch.Tensor):
        assert torch.equal(after, before), f"{where} changed"
    elif isinstance(after, dict):
        assert set(before) <= set(after), f"{where}: {sorted(after)} lacks some of {sorted(before)}"
        for k in after:
            if k in before:
                assert_same(after[k], before[k], f"{where}/{k}")
            else:
                assert_fresh(after[k], f"{where}/{k}")
    else:
        assert after == before, where


def assert_fresh(state: Any, where: str) -> None:
    if isinstance(state, dict):
        for k, v in state.items():
            if "residual" in k:
                assert not v.any(), f"{where}/{k}: not zero"
            else:
                assert_fresh(v, f"{where}/{k}")


def check_one_skipped_step(results: list[dict[str, Any]], codecs: list[str]) -> None:
    """Shared by the DDP and Horovod tests: exactly the poisoned step is skipped, on every rank."""
    for codec in codecs:
        runs = [r[codec] for r in results]
        for rank, run in enumerate(runs):
            where = f"{codec} rank {rank}"
            # The scaler saw non-finite gradients at the poisoned step only: one back-off, 1024 -> 512.
            assert run["finite"] == [s != wl.NAN_STEP for s in range(wl.AMP_STEPS)], (where, run["finite"])
            assert run["scales"] == [1024.0] * wl.NAN_STEP + [512.0] * (wl.AMP_STEPS - wl.NAN_STEP), where
            assert run["stats"]["skipped_nonfinite"] == 1, where
            state = run["states"]
            if codec == "auto":  # its probe timings are measurements, not state: compare its candidates
                state = [s["candidates"] for s in state]
            assert_same(state[wl.NAN_STEP], state[wl.NAN_STEP - 1], where)
            assert all(bool(torch.isfinite(p).all()) for p in run["params"]), where
        for a, b in zip(runs[0]["params"], runs[1]["params"], strict=True):
            assert torch.equal(a, b), f"{codec}: replicas differ"


def test_every_hook_skips_one_nonfinite_step_under_grad_scaler() -> None:
    results = run_distributed(wl.amp_ddp_run, 2, HOOKS, timeout=300)
    check_one_skipped_step(results, HOOKS)
