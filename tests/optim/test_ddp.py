"""CompressedAdamW and CompressedSGD on gloo, 2 ranks. Under DDP: DDP's all-reduce is off, replicas stay identical,
the loss falls, and with the momentum averaged exactly CompressedSGD's run is torch.optim.SGD on the mean gradient.
On a process group of their own: a gradient missing on one rank is a ValueError on both."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import sylvie_comm
from sylvie_comm.collectives import ProcessGroupTransport
from sylvie_comm.optim import CompressedAdamW, CompressedSGD
from tests.dist_utils import run_distributed
from tests.integrations import workloads as wl
from tests.optim import workloads as ow

pytestmark = pytest.mark.multiprocess

CODECS = ["onebit", "none"]
SGD_HYPER = {"lr": 0.2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}
ADAPTERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "adamw": (sylvie_comm.ddp.compressed_adamw, {"lr": 3e-3}),
    "sgd": (sylvie_comm.ddp.compressed_sgd, SGD_HYPER),
}


def ddp_worker(rank: int, world: int, optimizer: str) -> dict[str, Any]:
    adapter, hyper = ADAPTERS[optimizer]
    out = {}
    for codec in CODECS:
        model = wl.mlp()
        plain = copy.deepcopy(model)
        ddp = DDP(model, bucket_cap_mb=wl.TINY_BUCKET_MB)
        opt = adapter(ddp, **hyper, codec=codec, warmup=ow.WARMUP)
        res = ow.train_fixed_batch(rank, model, opt, ddp)
        res["local"] = ow.local_gradients(rank, plain, res.pop("before"))
        res["state_names"] = sorted(opt.state_dict()["sylvie_comm"]["params"])
        res["names"] = sorted(n for n, _ in model.named_parameters())
        opt.close()
        out[codec] = res
    return out


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Each rank's runs of ``ddp_worker`` (per codec) with the optimizer the test names (indirect parameter)."""
    return run_distributed(ddp_worker, 2, request.param, timeout=240)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("results", list(ADAPTERS), indirect=True)
def test_ddp_leaves_the_gradients_local_and_the_optimizer_averages_the_momentum(results, codec: str) -> None:
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


def sgd_on_the_mean_gradient() -> list[torch.Tensor]:
    """torch.optim.SGD on the mean of both ranks' fixed-batch gradients, as one process."""
    model = wl.mlp()
    opt = torch.optim.SGD(model.parameters(), **SGD_HYPER)
    batches = [wl.batch(r, 0) for r in range(2)]
    for _ in range(ow.STEPS):
        grads = []
        for x, y in batches:
            model.zero_grad()
            F.cross_entropy(model(x)[:, :8], y % 8).backward()
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
            p.grad = (g0 + g1) / 2
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("results", ["sgd"], indirect=True)
def test_with_exact_averaging_compressed_sgd_under_ddp_is_torch_sgd_on_the_mean_gradient(results) -> None:
    """Nesterov and weight decay through DDP and gloo (codec ``none``): SGD on the mean gradient."""
    for got, want in zip(results[0]["none"]["params"], sgd_on_the_mean_gradient(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# The optimizers of missing_worker: each class with the arguments it needs.
OPTIMIZERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "adamw": (CompressedAdamW, {}),
    "sgd": (CompressedSGD, {"lr": 0.1}),
}


def missing_worker(rank: int, world: int, optimizer: str, missing_from: int) -> list[str]:
    """Rank 1 has no gradient for 'head.bias' from step ``missing_from`` on (a branch its batch did not take), in
    the warm-up of 2 steps or after it."""
    cls, hyper = OPTIMIZERS[optimizer]
    transport = ProcessGroupTransport(dist.group.WORLD)
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("body", torch.nn.Linear(4, 3))
    model.add_module("head", torch.nn.Linear(3, 2))
    opt = cls(model.named_parameters(), **hyper, transport=transport, warmup=2, codec="onebit")
    errors = []
    for step in range(5):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1 * (rank + 1))
        if rank == 1 and step >= missing_from:
            model.head.bias.grad = None
        try:
            opt.step()
        except ValueError as exc:
            errors.append(str(exc))
            break
    opt.close()
    transport.close()
    return errors


@pytest.mark.parametrize("missing_from", [1, 3], ids=["warmup", "compressed"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_gradient_missing_on_one_rank_raises_on_every_rank_instead_of_aborting(
    optimizer: str, missing_from: int
) -> None:
    what = OPTIMIZERS[optimizer][0].what
    for errors in run_distributed(missing_worker, 2, optimizer, missing_from, timeout=60):
        assert len(errors) == 1, errors
        assert (
            f"{what}[onebit] step: parameter 'head.bias' has a gradient on rank 0 but none (grad None) on rank 1"
            in errors[0]
        )
