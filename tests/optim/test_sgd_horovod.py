"""CompressedSGD over Horovod, 2 ranks under horovodrun: the same run as in one process, replicas identical."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("horovod.torch")

from sylvie_comm.collectives.local import run_local
from sylvie_comm.optim import CompressedSGD
from tests.integrations import workloads as wl
from tests.optim import horovod_worker as hw
from tests.optim import workloads as ow
from tests.optim.test_horovod import run_horovod

pytestmark = pytest.mark.multiprocess


def test_horovod_trains_as_the_in_process_run(tmp_path: Path) -> None:
    results = run_horovod(tmp_path, "sgd")
    base = wl.mlp()

    def local(tr: Any) -> dict[str, Any]:
        def make(model: torch.nn.Module) -> CompressedSGD:
            return CompressedSGD(model.named_parameters(), **hw.SGD, transport=tr, codec=hw.CODEC, warmup=ow.WARMUP)

        return hw.train(tr.rank, make, copy.deepcopy(base))

    expected = run_local(2, local)
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)  # replicas identical
    for got, want in zip(results, expected, strict=True):
        assert got["phase"] == "compressed"
        assert got["stats"]["last_step"]["compression_ratio"] > 10
        assert sum(got["losses"][-3:]) < 0.8 * sum(got["losses"][:3]), got["losses"]
        # One algorithm, whatever the transport: the same gradient bits in, the same bits out (see test_horovod.py).
        for a, b in zip(got["params"], want["params"], strict=True):
            assert torch.equal(a, b), (a - b).abs().max().item()
