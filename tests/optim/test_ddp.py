"""CompressedAdamW under DDP on gloo, 2 ranks: DDP's all-reduce is off, replicas stay identical, the loss falls."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import sylvie_comm
from tests.dist_utils import run_distributed
from tests.integrations import workloads as wl
from tests.optim import workloads as ow

pytestmark = pytest.mark.multiprocess

CODECS = ["onebit", "none"]


def ddp_worker(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for codec in CODECS:
        model = wl.mlp()
        plain = copy.deepcopy(model)
        ddp = DDP(model, bucket_cap_mb=wl.TINY_BUCKET_MB)
        opt = sylvie_comm.ddp.compressed_adamw(ddp, lr=3e-3, codec=codec, warmup=ow.WARMUP)
        res = ow.train_fixed_batch(rank, model, opt, ddp)
        res["local"] = ow.local_gradients(rank, plain, res.pop("before"))
        names = [n for n, _ in model.named_parameters()]
        res["state_names"] = sorted(opt.state_dict()["sylvie_comm"]["params"])
        res["names"] = sorted(names)
        opt.close()
        out[codec] = res
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(ddp_worker, 2, timeout=240)


@pytest.mark.parametrize("codec", CODECS)
def test_ddp_leaves_the_gradients_local_and_the_optimizer_averages(results, codec: str) -> None:
    r0, r1 = results[0][codec], results[1][codec]
    for r in (r0, r1):
        for got, own in zip(r["grads"], r["local"], strict=True):  # after backward: this rank's own gradient
            for g, o in zip(got, own, strict=True):
                torch.testing.assert_close(g, o, rtol=1e-6, atol=1e-7)
    # the ranks fit different batches: gradients differ, so DDP did not average them
    assert any(not torch.equal(a, b) for a, b in zip(r0["grads"][0], r1["grads"][0], strict=True))
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)  # the optimizer's collective keeps the replicas identical
    for r in (r0, r1):
        losses = r["losses"]
        assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
        stats = r["stats"]
        assert stats["phase"] == "compressed" and stats["warmup_steps"] == ow.WARMUP
        if codec == "onebit":
            assert stats["last_step"]["compression_ratio"] > 10, stats["last_step"]
            assert r["state_names"] == r["names"]  # the compression state is keyed by the model's names
        else:
            assert stats["compression_ratio"] == 1.0
