"""The GNN follows the device of its features: the halo exchange on ``meta``, the trainer's device choice.

A tensor on ``meta`` has a device, a shape and a dtype but no data. The halo exchanger and pipeline run here
with features on ``meta``, ranks as threads of the in-process transport, under a dispatch mode that fails any
operation touching a tensor off ``meta``: an index tensor, receive buffer or decoded row left on the CPU fails,
and so does any read of a value on the host (``.item()``, ``.tolist()``, ``float(t)``: meta has none to read),
as they would mix devices or stall the stream on a GPU. Set-up (the partition's index arithmetic) runs on the
host, outside the mode. The trainer's CUDA choice is checked with ``torch.cuda`` patched: no CUDA tensor is made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sylvie_comm.collectives import ProcessGroupTransport
from sylvie_comm.collectives.local import run_local
from sylvie_comm.gnn import gpu_check
from sylvie_comm.gnn import train as gtrain
from sylvie_comm.gnn.halo import (
    PRECISIONS,
    HaloExchanger,
    HaloPipeline,
    cuda_aware,
    halo_exchange,
    parse_precision,
)
from sylvie_comm.gnn.models import LocalGraph
from sylvie_comm.gnn.partition import partition
from sylvie_comm.gnn.train import TrainConfig, Trainer, resolve_device
from tests.gnn import workloads as gw

META = torch.device("meta")
WIDTH = 12
FORMS = sorted({parse_precision(p) for p in PRECISIONS})  # every halo precision once ("none" is fp32)


class OnlyMeta(TorchDispatchMode):
    """Fail every operation that takes or makes a tensor off ``meta`` (a 0-dim CPU scalar aside)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        stack = [args, kwargs.values(), out]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                if x.device.type != "meta" and not (x.dim() == 0 and x.device.type == "cpu"):
                    raise AssertionError(f"{func} touched a {x.device} tensor of shape {tuple(x.shape)}")
            elif isinstance(x, (list, tuple, type({}.values()))):
                stack.extend(x)
        return out


def watched(job: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``job`` run under :class:`OnlyMeta` (on whichever thread runs it: the pipeline's runs it on its own)."""

    def run() -> torch.Tensor:
        with OnlyMeta():
            return job()

    return run


class WatchedExchanger(HaloExchanger):
    """An exchanger whose encoding (now) and exchange (the job, later) both run under :class:`OnlyMeta`."""

    def features_job(self, *args: Any, **kwargs: Any) -> Callable[[], torch.Tensor]:
        with OnlyMeta():
            return watched(super().features_job(*args, **kwargs))

    def gradients_job(self, *args: Any, **kwargs: Any) -> Callable[[], torch.Tensor]:
        with OnlyMeta():
            return watched(super().gradients_job(*args, **kwargs))


def tensors_of(state: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(state)[0] if isinstance(t, torch.Tensor)]


def parts_for(world: int) -> list[Any]:
    g = gw.small_graph()
    return partition((g.src, g.dst), world, "random", num_nodes=g.num_nodes, ndata=g.ndata, seed=1)


def own_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors an object holds in its attributes (its partition, the host record, aside)."""
    return [t for k, v in vars(obj).items() if k != "part" for t in tensors_of(v)]


@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "ef"])
@pytest.mark.parametrize("precision", FORMS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_exchanger_encodes_exchanges_and_decodes_on_meta(world: int, precision: str, feedback: bool) -> None:
    parts = parts_for(world)

    def body(tr: Any) -> None:
        part = parts[tr.rank]
        ex = HaloExchanger(part, tr, precision, precision, error_feedback=feedback, seed=3, device="meta")
        assert ex.device == META and all(t.device == META for t in own_tensors(ex))
        with OnlyMeta():
            for _ in range(2):  # the second step reuses the error-feedback residuals
                inner = torch.empty(part.n_inner, WIDTH, device=META)
                halo = ex.features_job(inner, "1")()
                assert halo.device == META and halo.shape == (part.n_halo, WIDTH) and halo.dtype == torch.float32
                back = ex.gradients_job(torch.empty(part.n_halo, WIDTH, device=META), "1")()
                assert back.device == META and back.shape == (sum(part.send_counts), WIDTH)
            once = ex.features_job(inner, "once", feedback=False, precision="fp32")()
            assert once.device == META and once.shape == (part.n_halo, WIDTH)
        state = ex.state_dict()
        assert all(t.device == META for t in tensors_of(state))
        if feedback and precision.startswith("q") and world > 1:
            assert state["feedback"]["residuals"], "error feedback kept no residual"

    run_local(world, body)


@pytest.mark.parametrize("staleness", [0, 1])
# Every precision at two ranks, error feedback with two of the q-bit ones (the exchanger test covers the rest at
# every world size); one rank (no halo) and four with one-bit and fp32.
@pytest.mark.parametrize(
    "world,precision,feedback",
    [(2, p, p in ("q1", "q4")) for p in FORMS] + [(1, "q1", True), (4, "q1", True), (4, "fp32", False)],
)
def test_the_pipeline_runs_forward_and_backward_on_meta(world: int, precision: str, feedback: bool,
                                                        staleness: int) -> None:  # fmt: skip
    """Epochs of two exchanging layers through the autograd op, stale epochs included; state and a restore."""
    parts = parts_for(world)
    epochs = 3  # synchronous epoch 0, then (staleness 1) two epochs on stale halos

    def body(tr: Any) -> dict[str, Any]:
        part = parts[tr.rank]
        ex = WatchedExchanger(part, tr, precision, precision, error_feedback=feedback, device=META)
        pipeline = HaloPipeline(ex, staleness)
        assert pipeline.device == META and pipeline.stream is None
        graph = LocalGraph(part, pipeline)
        assert graph.device == META and all(t.device == META for t in own_tensors(graph))
        assert all(t.device == META for t in graph.edges_with_self_loops())
        try:
            with OnlyMeta():
                for epoch in range(epochs):
                    pipeline.begin_epoch(epoch)
                    leaves = [torch.empty(part.n_inner, WIDTH, device=META, requires_grad=True) for _ in range(2)]
                    outs = [halo_exchange(h, pipeline, layer) for layer, h in enumerate(leaves, start=1)]
                    assert all(o.device == META and o.shape == (part.n_inner + part.n_halo, WIDTH) for o in outs)
                    torch.autograd.backward(outs, [torch.empty_like(o) for o in outs])
                    assert all(h.grad is not None and h.grad.device == META for h in leaves)
                with pipeline.evaluating():
                    assert pipeline.features(1, leaves[0].detach()).device == META
            state = pipeline.state_dict()
            assert all(t.device == META for t in tensors_of(state))
            stats = pipeline.stats()
        finally:
            pipeline.close()
        # A checkpoint written on the CPU (its queued rows on the CPU) restores onto the features' device.
        cpu_rows = {kind: {layer: [{**e, "rows": torch.zeros(e["rows"].shape)} for e in entries]
                           for layer, entries in state[kind].items()}
                    for kind in ("features", "gradients")}  # fmt: skip
        fresh = HaloPipeline(HaloExchanger(part, tr, precision, precision, error_feedback=feedback, device=META),
                             staleness)  # fmt: skip
        try:
            fresh.load_state_dict({**state, **cpu_rows})
            restored = [e.future.wait() for q in fresh._queues.values() for e in q]
        finally:
            fresh.close()
        assert all(t.device == META for t in restored)
        return {"stats": stats, "queued_gradients": sum(len(v) for v in cpu_rows["gradients"].values())}

    for r in run_local(world, body):
        if world > 1:
            assert r["stats"]["max_observed_staleness"] == staleness
            assert (r["queued_gradients"] > 0) == (staleness > 0)


def test_the_exchanger_refuses_features_on_another_device() -> None:
    (part,) = parts_for(1)

    def body(tr: Any) -> str:
        ex = HaloExchanger(part, tr, device="meta")
        with pytest.raises(ValueError, match=r"features are on cpu but .* on meta; build the HaloExchanger with "
                                             r"device='cpu'"):  # fmt: skip
            ex.features_job(torch.zeros(part.n_inner, 3), "1")
        with pytest.raises(ValueError, match=r"device must be a torch\.device or a string"):
            HaloExchanger(part, tr, device="gpu")
        return "ok"

    assert run_local(1, body) == ["ok"]


# --- the trainer's device ---------------------------------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``torch.cuda`` that reports ``count`` devices (current device 0); nothing runs on them."""

    def install(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    return install


@pytest.mark.parametrize(
    "backend,local_rank,count,want",
    [
        (None, None, 2, "cpu"),  # no process group (one process, Horovod, in-process ranks)
        ("gloo", None, 2, "cpu"),
        ("gloo", "1", 2, "cpu"),
        ("nccl", None, 2, "cuda:0"),
        ("nccl", "1", 2, "cuda:1"),
        ("cpu:gloo,cuda:nccl", "1", 2, "cuda:1"),  # init_process_group() without a backend
        ("cpu:gloo,cuda:nccl", None, 0, "cpu"),
    ],
)
def test_the_default_device_is_cuda_local_rank_only_with_nccl_and_cuda(
    monkeypatch: pytest.MonkeyPatch, fake_cuda: Callable[[int], None], backend: str | None,
    local_rank: str | None, count: int, want: str,
) -> None:  # fmt: skip
    fake_cuda(count)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert resolve_device(None, backend) == torch.device(want)


def _group_transport() -> ProcessGroupTransport:
    """A process-group transport on the default group, without a process group (for reading its backend)."""
    transport = ProcessGroupTransport.__new__(ProcessGroupTransport)
    transport._closed, transport._group_ref, transport.rank = False, None, 0
    return transport


def test_the_backend_is_read_from_a_process_group_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process-group transport's group names the backend; the other transports have none."""
    monkeypatch.setattr(gtrain.dist, "get_backend", lambda group=None: "nccl")
    assert gtrain._backend_of(_group_transport()) == "nccl"
    assert gtrain._backend_of(None) is None
    assert run_local(1, gtrain._backend_of) == [None]


@pytest.mark.parametrize("backend,aware", [("nccl", True), ("cpu:gloo,cuda:nccl", True), ("gloo", False)])
def test_only_nccl_futures_count_as_cuda_aware(monkeypatch: pytest.MonkeyPatch, backend: str, aware: bool) -> None:
    """The pipeline takes a side stream of its own only where the transport's futures order streams (NCCL)."""
    monkeypatch.setattr(gtrain.dist, "get_backend", lambda group=None: backend)
    assert cuda_aware(_group_transport()) is aware
    assert run_local(1, cuda_aware) == [False]  # the in-process transport: plain futures


@pytest.mark.parametrize(
    "device,backend,count,message",
    [
        ("gpu", None, 1, "device must be a torch.device or a string such as 'cpu' or 'cuda:0', got 'gpu'"),
        (0, None, 1, "device must be a torch.device or a string"),
        ("meta", None, 1, "device must be 'cpu', 'cuda' or 'cuda:<index>', got 'meta'"),
        ("cuda", None, 0, "device 'cuda' asked for, but this process has no CUDA device"),
        ("cuda:2", None, 2, r"sees 2 CUDA device\(s\); expected an index in \[0, 2\)"),
        ("cpu", "nccl", 1, "backend is 'nccl', which carries CUDA tensors only"),
        (None, "nccl", 0, "backend is 'nccl', which carries CUDA tensors only"),
    ],
)
def test_unusable_devices_are_refused(fake_cuda: Callable[[int], None], device: Any, backend: str | None,
                                      count: int, message: str) -> None:  # fmt: skip
    fake_cuda(count)
    with pytest.raises(ValueError, match=message):
        resolve_device(device, backend)


@pytest.mark.parametrize("value", ["-1", "one", ""])
def test_a_bad_local_rank_is_refused(monkeypatch: pytest.MonkeyPatch, fake_cuda: Callable[[int], None],
                                     value: str) -> None:  # fmt: skip
    fake_cuda(1)
    monkeypatch.setenv("LOCAL_RANK", value)
    with pytest.raises(ValueError, match=f"LOCAL_RANK must be an integer >= 0 .*got {value!r}"):
        resolve_device(None, "nccl")


def test_explicit_cuda_devices_resolve_without_touching_a_gpu(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(2)
    assert resolve_device("cuda", "nccl") == torch.device("cuda:0")  # the current device
    assert resolve_device(torch.device("cuda", 1), "gloo") == torch.device("cuda:1")
    assert resolve_device("cpu", "gloo") == torch.device("cpu")


def test_in_process_ranks_are_refused_on_cuda(fake_cuda: Callable[[int], None]) -> None:
    """Two threads' CUDA backward passes share one autograd thread: the trainer says so before any CUDA work."""
    fake_cuda(1)
    parts = parts_for(2)

    def body(tr: Any) -> str:
        with pytest.raises(ValueError, match=r"in-process transport .* share the device's one autograd thread"):
            Trainer(parts[tr.rank], TrainConfig(hidden=8, backend="torch"), transport=tr, device="cuda:0")
        return "refused"

    assert run_local(2, body) == ["refused", "refused"]


TIMINGS = ("seconds", "compute_s", "halo_wait_s", "halo_exchange_s", "halo_hidden_s")


def _history(part: Any, config: TrainConfig, epochs: int, transport: Any = None, **device: Any) -> list[Any]:
    tr = Trainer(part, config, transport=transport, **device)
    try:
        assert tr.device == torch.device("cpu")
        assert all(t.device.type == "cpu" for t in [tr.x, tr.y, tr.train_idx, *tr.masks.values()])
        assert all(p.device.type == "cpu" for p in tr.model.parameters())
        out = []
        for _ in range(epochs):
            h = tr.train_epoch()
            assert h["peak_memory_mb"] is None  # CUDA only (see Trainer.train_epoch)
            out.append({k: v for k, v in h.items() if k not in TIMINGS})
        out.append(tr.evaluate())
        return out
    finally:
        tr.close()


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "device"])
def test_an_explicit_cpu_device_trains_exactly_as_the_default(device: Any) -> None:
    config = TrainConfig(model="sage", hidden=16, layers=3, dropout=0.3, backend="torch")
    (whole,) = parts_for(1)
    assert _history(whole, config, 3, device=device) == _history(whole, config, 3)
    parts = parts_for(2)
    config = TrainConfig(hidden=16, layers=3, backend="torch", forward="q1", backward="q2", staleness=1,
                         error_feedback=True)  # fmt: skip
    explicit = run_local(2, lambda tr: _history(parts[tr.rank], config, 4, tr, device=device), timeout=120)
    default = run_local(2, lambda tr: _history(parts[tr.rank], config, 4, tr), timeout=120)
    assert explicit == default


def test_the_gpu_check_fails_at_once_without_a_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(gpu_check.GPUUnavailableError, match=r"no CUDA device \(torch.cuda.is_available\(\) is False"):
        gpu_check.gpu_check(tmp_path / "out")
    assert gpu_check.main(["--gpu-check", str(tmp_path / "out")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
