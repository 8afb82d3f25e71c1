"""DDP hooks under ``torch.compile``: the same training as eager, and the Python reducer refused.

``torch.compile(DDP(model))`` with the default ``optimize_ddp`` (DDPOptimizer) splits the graph at DDP's bucket
boundaries and keeps the C++ reducer, so every hook gets its buckets as in eager mode; the compiled forward and
backward differ from eager only in float rounding. DDP's Python reducer (``optimize_ddp="python_reducer"``,
meant for compiled autograd) would call a bucket hook once per parameter and drop its result: registration
refuses such a model, and the hook itself refuses the Python reducer's ``(grad, param)`` call.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sylvie_comm
from sylvie_comm.integrations.ddp import HOOKS
from tests.dist_utils import run_distributed
from tests.integrations import workloads as wl

pytestmark = pytest.mark.multiprocess

WIDTH = 512
STEPS = 4  # two warm-up steps (plain averaging), then two compressed steps
# Every hook, at settings where it compresses from step 2 on this small model.
OPTIONS: dict[str, dict[str, Any]] = {
    "acpsgd": {"rank": 2, "min_compression_rate": 0},
    "powersgd": {"rank": 2, "min_compression_rate": 0},
    "onebit": {"chunk_size": 8},
    "topk": {"ratio": 0.25},
}


class _Net(nn.Module):
    """A model class of the user's own. (Dynamo traces the ``forward`` of a user's class; it skips the frames of
    ``torch.nn`` modules it meets outside a traced frame, so ``torch.compile(DDP(nn.Sequential(...)))``, whose
    DDP frame breaks the graph before calling the module, would compile nothing.)"""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))  # type: ignore[no-any-return]


def _train(rank: int, name: str, compiled: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    net = _Net(WIDTH)
    # 1 MiB per weight matrix: DDPOptimizer needs buckets no smaller than DDP's first (1 MiB); three buckets.
    ddp = DDP(net, bucket_cap_mb=1)
    state = sylvie_comm.ddp.register(ddp, name, warmup_steps=2, seed=0, **OPTIONS.get(name, {}))
    torch._dynamo.reset()  # compile afresh for this hook: the count below then says it compiled
    graphs = torch._dynamo.utils.counters["aot_autograd"]["total"]
    model = torch.compile(ddp) if compiled else ddp
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses = []
    try:
        for step in range(STEPS):
            x, y = wl.batch(rank, step, width=WIDTH)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        stats = state.stats()
        graphs = torch._dynamo.utils.counters["aot_autograd"]["total"] - graphs
    finally:
        state.close()
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in net.parameters()],
        "bytes": stats["bytes_sent"],
        "buckets": len(state._plans),
        "graphs": graphs,
        "last_ratio": stats["last_step"]["compression_ratio"],
    }


def _compile_worker(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    return {name: {"eager": _train(rank, name, False), "compiled": _train(rank, name, True)} for name in names}


def test_every_hook_trains_the_same_under_torch_compile():
    """Each hook under torch.compile(DDP(model)): the losses and weights of eager within rounding, the same
    bytes on the wire (the hook ran on every bucket), on two gloo ranks at SGD momentum 0.9."""
    names = sorted(HOOKS)
    results = run_distributed(_compile_worker, 2, names, timeout=600)
    for res in results:
        for name in names:
            eager, compiled = res[name]["eager"], res[name]["compiled"]
            assert compiled["bytes"] == eager["bytes"] > 0, (name, compiled["bytes"], eager["bytes"])
            # Several buckets (the compiled backward may finish gradients in another order: DDP's rebuilt
            # buckets may then differ; the state is per parameter name, so the average does not).
            assert min(compiled["buckets"], eager["buckets"]) >= 3, (name, compiled["buckets"], eager["buckets"])
            # Compiled, and DDPOptimizer split the graph at the bucket boundaries: one compiled piece per bucket.
            assert eager["graphs"] == 0 and compiled["graphs"] >= 3, (name, compiled["graphs"])
            torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=1e-5, msg=name)
            for a, b in zip(compiled["params"], eager["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
        # The compressing hooks compressed after warm-up (not a run of plain all-reduces).
        for name in ("acpsgd", "onebit", "qsgd", "sign", "topk", "fp16"):
            assert res[name]["compiled"]["last_ratio"] > 1.5, (name, res[name]["compiled"]["last_ratio"])


def _python_reducer_worker(rank: int, world: int) -> dict[str, str]:
    out = {}
    old = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        ddp = DDP(wl.square_mlp(width=8, depth=1))
    finally:
        torch._dynamo.config.optimize_ddp = old
    try:
        sylvie_comm.ddp.register(ddp, "acpsgd")
    except RuntimeError as e:
        out["register"] = str(e)
    # The lower-level route registers the hook itself: the first call refuses the per-parameter form.
    state, hook = sylvie_comm.ddp.make_hook("acpsgd")
    try:
        p = next(ddp.parameters())
        hook(state, (torch.zeros_like(p), p))  # type: ignore[arg-type]
    except RuntimeError as e:
        out["call"] = str(e)
    finally:
        state.close()
    return out


def test_the_python_reducer_is_refused_with_what_to_do():
    results = run_distributed(_python_reducer_worker, 2)
    for res in results:
        assert set(res) == {"register", "call"}, res
        for message in res.values():
            assert "python_reducer" in message and "optimize_ddp = True" in message, message
