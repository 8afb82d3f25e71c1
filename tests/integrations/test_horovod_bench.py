"""The Horovod rows of ``sylvie-comm bench ddp``: measured under horovodrun, same bytes as the DDP hooks."""

from __future__ import annotations

import shutil

import pytest

from sylvie_comm.bench import horovod
from sylvie_comm.bench.ddp import mlp_17m
from sylvie_comm.collectives import wire_bytes

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(shutil.which("horovodrun") is None, reason="Horovod is not installed (scripts/horovod.sh)"),
]


def test_horovod_rows_measure_every_run_and_count_the_bytes_of_the_algorithm():
    res = horovod.run(rank=4, steps=1, warmup=2)
    assert res is not None and list(res) == list(horovod.RUNS)
    params = sum(p.numel() for p in mlp_17m().parameters())
    assert res["ours none"]["bytes_sent"] == wire_bytes("all_reduce", 4 * params, 2)
    # Horovod's optimizer with our compressor sends what our optimizer sends: one algorithm, two adapters.
    assert res["hvd+acpsgd"]["bytes_sent"] == res["ours acpsgd"]["bytes_sent"] < params / 50
    assert all(r["backward_s"] > 0 for r in res.values())
    rows = horovod.format_rows(res)
    assert len(rows) == len(horovod.RUNS) and rows[4].startswith("ours acpsgd")
