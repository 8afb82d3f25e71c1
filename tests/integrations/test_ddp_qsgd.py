"""QSGD under DDP: written as an algorithm file and a registry line, registered like every other hook."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist_utils import run_distributed
from tests.integrations import workloads as wl

pytestmark = pytest.mark.multiprocess

# bits -> tolerance on the largest gradient error relative to the largest gradient: a quantization level is at
# most 2 max |g| / (2 ** bits - 1) of a row, and error feedback moves at most two levels between steps.
TOLERANCE = {4: 0.3, 8: 0.02}


def _qsgd_worker(rank: int, world: int) -> dict[int, Any]:
    return {bits: wl.compare_with_default(rank, world, "qsgd", {"bits": bits}) for bits in TOLERANCE}


def test_qsgd_registers_and_stays_close_to_the_default_allreduce():
    """``sylvie_comm.ddp.register(model, "qsgd", bits=4)``: gradients within a few quantization levels of the
    default all-reduce, on every rank alike, at a fraction of the bytes."""
    for res in run_distributed(_qsgd_worker, 2):
        for bits, tol in TOLERANCE.items():
            r = res[bits]
            assert r["buckets"] >= 3 and len(r["errors"]) == 4, (bits, r)
            assert max(r["errors"]) <= tol, (bits, r["errors"])
            last = r["stats"]["last_step"]
            assert last["bytes_sent"] < last["bytes_uncompressed"], bits
