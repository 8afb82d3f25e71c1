"""DDP hooks under ``torch.compile``: the hook sees the same traffic and computes the same function as in eager
mode, and the Python reducer is refused.

``torch.compile(DDP(model))`` with the default ``optimize_ddp`` (DDPOptimizer) splits the graph at DDP's bucket
boundaries and keeps the C++ reducer, so every hook gets its buckets as in eager mode; the compiled forward and
backward differ from eager only in float rounding. DDP's Python reducer (``optimize_ddp="python_reducer"``,
meant for compiled autograd) would call a bucket hook once per parameter and drop its result: registration
refuses such a model, and the hook itself refuses the Python reducer's ``(grad, param)`` call.

What is compared, and why not the trained weights: the compiled backward sums in another order than eager, so
the gradients a hook receives differ in their last bits; a stochastic or discontinuous codec (qsgd's rounding
and per-row range, one-bit's and sign's signs, top-k's selection, fp16's rounding) turns such an ulp into a whole
quantization step, and a few steps later the two runs' weights differ by far more than rounding, on some
machines and not on others. So the test asserts what is stable:

* the same traffic: every hook sends the same bytes in both runs, over several buckets, with the same number of
  hook calls per step (the hook ran on every bucket, none was skipped or split per parameter);
* the same function: each hook call of either run, replayed in eager mode into a fresh hook state (same
  configuration and seed, the recorded bucket's index, parameters and gradient bits), hands back the same bits
  as it did in training; and the gradients the optimizer read after ``backward()`` are those bits (the result
  was written back);
* the same bits in, the same bits out: for a step where every rank's hook inputs so far were the same bits in
  both runs, the hook's outputs are the same bits;
* the same start: the first step's gradients (the same weights and data; warm-up's plain average) agree within
  fp32 rounding.
"""

from __future__ import annotations

import hashlib
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


class _Call:
    """One hook call: the bucket as the hook saw it (index, parameters, last or not, the gradient bits it was
    given) and the bits it handed back. :meth:`replay` is a bucket with the same parts and a copy of the bits."""

    def __init__(self, bucket: Any, step: int) -> None:
        self.step = step
        self._index, self._params, self._last = bucket.index(), list(bucket.parameters()), bucket.is_last()
        self.given = bucket.buffer().detach().clone()
        self.returned: torch.Tensor | None = None
        self._buffer = self.given

    # The part of DDP's GradBucket the hook reads.
    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def replay(self) -> _Call:
        again = object.__new__(_Call)
        again.__dict__.update(self.__dict__)
        again._buffer = self.given.clone()
        return again

    def slices(self, names: dict[int, str]) -> dict[str, slice]:
        out, at = {}, 0
        for p in self._params:
            out[names[id(p)]] = slice(at, at + p.numel())
            at += p.numel()
        return out


def _record(state: Any) -> list[_Call]:
    """Record every call of ``state``'s hook (a wrapper around the state's ``communicate``, which the hook calls)."""
    calls: list[_Call] = []
    communicate = state.communicate

    def recording(bucket: Any) -> torch.futures.Future[torch.Tensor]:
        call = _Call(bucket, state.step)
        calls.append(call)

        def keep(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            out = fut.value()
            call.returned = out.detach().clone()
            return out

        return communicate(bucket).then(keep)

    state.communicate = recording
    return calls


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _train(rank: int, name: str, compiled: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    net = _Net(WIDTH)
    # 1 MiB per weight matrix: DDPOptimizer needs buckets no smaller than DDP's first (1 MiB); three buckets.
    ddp = DDP(net, bucket_cap_mb=1)
    kw = {"warmup_steps": 2, "seed": 0, **OPTIONS.get(name, {})}
    state = sylvie_comm.ddp.register(ddp, name, **kw)
    calls = _record(state)
    names = {id(p): n for n, p in net.named_parameters()}
    torch._dynamo.reset()  # compile afresh for this hook: the count below then says it compiled
    graphs = torch._dynamo.utils.counters["aot_autograd"]["total"]
    model = torch.compile(ddp) if compiled else ddp
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    given: list[dict[str, torch.Tensor]] = []  # per step, per parameter name: the gradient the hook was given
    returned: list[dict[str, torch.Tensor]] = []  # ... and the one it handed back
    written_back = True
    try:
        for step in range(STEPS):
            x, y = wl.batch(rank, step, width=WIDTH)
            F.cross_entropy(model(x), y).backward()
            this = [c for c in calls if c.step == step]
            given.append({n: c.given[s] for c in this for n, s in c.slices(names).items()})
            returned.append({n: c.returned[s] for c in this for n, s in c.slices(names).items()})  # type: ignore[index]
            # What the optimizer reads is what the hook handed back.
            written_back &= all(torch.equal(p.grad.reshape(-1), returned[-1][n]) for n, p in net.named_parameters())
            opt.step()
            opt.zero_grad()
        stats = state.stats()
        graphs = torch._dynamo.utils.counters["aot_autograd"]["total"] - graphs
    finally:
        state.close()
    # Every call replayed, in order, into a fresh state in eager mode: the same bits back.
    fresh, hook = sylvie_comm.ddp.make_hook(name, model=ddp, **kw)
    try:
        replayed = [hook(fresh, c.replay()).wait() for c in calls]  # type: ignore[arg-type]
    finally:
        fresh.close()
    return {
        "bytes": stats["bytes_sent"],
        "buckets": len(state._plans),
        "calls": [sum(c.step == s for c in calls) for s in range(STEPS)],
        # per step: how many times each parameter's gradient went through the hook
        "coverage": [sorted(n for c in calls if c.step == s for n in c.slices(names)) for s in range(STEPS)],
        "parameters": sorted(names.values()),
        "graphs": graphs,
        "last_ratio": stats["last_step"]["compression_ratio"],
        "replayed_same": all(torch.equal(r, c.returned) for r, c in zip(replayed, calls, strict=True)),
        "written_back": written_back,
        "given": given,
        "returned": returned,
    }


def _compare(eager: dict[str, Any], compiled: dict[str, Any]) -> dict[str, Any]:
    """What one rank can tell of the two runs: per step, which names had the same input / output bits; how far the
    first step's inputs were apart."""
    out: dict[str, Any] = {k: (eager[k], compiled[k]) for k in ("bytes", "buckets", "calls", "coverage", "graphs")}
    out["parameters"] = eager["parameters"]
    out["last_ratio"] = compiled["last_ratio"]
    out["replayed_same"] = (eager["replayed_same"], compiled["replayed_same"])
    out["written_back"] = (eager["written_back"], compiled["written_back"])
    out["same_in"] = [
        {n: _digest(e[n]) == _digest(c[n]) for n in e} for e, c in zip(eager["given"], compiled["given"], strict=True)
    ]
    out["same_out"] = [
        {n: torch.equal(e[n], c[n]) for n in e} for e, c in zip(eager["returned"], compiled["returned"], strict=True)
    ]
    first_e, first_c = eager["given"][0], compiled["given"][0]
    out["first_step"] = {
        n: ((first_e[n] - first_c[n]).abs().max().item(), first_e[n].abs().max().item()) for n in first_e
    }
    return out


def _compile_worker(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    return {name: _compare(_train(rank, name, False), _train(rank, name, True)) for name in names}


def test_every_hook_sends_and_computes_the_same_under_torch_compile():
    """Each hook under torch.compile(DDP(model)) against eager, on two gloo ranks at SGD momentum 0.9: the same
    traffic, the same function of its inputs, the same bits out where the inputs were the same bits."""
    names = sorted(HOOKS)
    results = run_distributed(_compile_worker, 2, names, timeout=600)
    for name in names:
        for rank, res in enumerate(results):
            r = res[name]
            eager_bytes, compiled_bytes = r["bytes"]
            assert compiled_bytes == eager_bytes > 0, (name, rank, r["bytes"])
            # Every gradient through the hook once a step, in both runs, over several buckets after DDP's
            # rebuild (the compiled backward may finish gradients in another order: DDP's rebuilt buckets, and so
            # the number of calls, may then differ; the state is per parameter name, so the average does not).
            assert r["coverage"] == ([r["parameters"]] * STEPS,) * 2, (name, rank, r["coverage"])
            assert min(r["buckets"]) >= 3 and min(r["calls"][0][2:] + r["calls"][1][2:]) >= 3, (name, rank, r)
            # Compiled, and DDPOptimizer split the graph at the bucket boundaries: one compiled piece per bucket.
            assert r["graphs"][0] == 0 and r["graphs"][1] >= 3, (name, rank, r["graphs"])
            assert r["replayed_same"] == (True, True), (name, rank, "a replayed call handed back other bits")
            assert r["written_back"] == (True, True), (name, rank, "the optimizer read other gradients")
            # The first step: the same weights and data; the gradients differ by fp32 rounding only (sums of 512
            # products, each within 512 eps of the exact value: far below 1e-4 of the largest gradient).
            for pname, (diff, top) in r["first_step"].items():
                assert diff <= 1e-4 * top, (name, rank, pname, diff, top)
        # Every input of every rank the same bits so far (the state then is too): the same bits out.
        for step in range(STEPS):
            if all(all(res[name]["same_in"][s].values()) for res in results for s in range(step + 1)):
                for rank, res in enumerate(results):
                    assert all(res[name]["same_out"][step].values()), (name, rank, step, res[name]["same_out"][step])
    # The compressing hooks compressed after warm-up (not a run of plain all-reduces).
    for name in ("acpsgd", "onebit", "qsgd", "sign", "topk", "fp16"):
        assert results[0][name]["last_ratio"] > 1.5, (name, results[0][name]["last_ratio"])


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
