"""The trainer's weight update from its caller: the gradient averager and the optimizer it is given are the ones it
uses, and a run with them equals the default run where they build the same thing."""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from sylvie_comm.collectives import Transport
from sylvie_comm.collectives.local import LocalTransport, run_local
from sylvie_comm.gnn.partition import Partition, partition
from sylvie_comm.gnn.train import TrainConfig, Trainer, default_optimizer
from sylvie_comm.integrations.average import GradientAverage
from tests.dist_utils import run_distributed
from tests.gnn import workloads as gw

CONFIG = {"hidden": 8, "backend": "torch"}
EPOCHS = 3


def parts(world: int) -> list[Partition]:
    g = gw.small_graph()
    return partition((g.src, g.dst), world, "random", num_nodes=g.num_nodes, ndata=g.ndata, seed=1)


class CountingAverage:
    """A :class:`GradientAverage` that counts its averages and keeps the transport it was given."""

    def __init__(self, model: torch.nn.Module, transport: Transport, codec: str = "none") -> None:
        self.transport = transport
        self.inner = GradientAverage(model, transport, codec)
        self.calls = 0

    def average(self) -> None:
        self.calls += 1
        self.inner.average()

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], *, agreed: bool = True) -> None:
        self.inner.load_state_dict(state, agreed=agreed)

    def close(self) -> None:
        self.inner.close()


def fp32_average(model: torch.nn.Module, transport: Transport) -> GradientAverage:
    return GradientAverage(model, transport, "none")


def averaged_run(rank: int, world: int, config: dict[str, Any], epochs: int) -> dict[str, Any]:
    """:func:`tests.gnn.workloads.run` with the caller's fp32 average (a worker of ``run_distributed``)."""
    return gw.run(rank, world, config, epochs, averager=fp32_average)


def train_in_process(config: dict[str, Any], world: int = 2, **trainer_args: Any) -> list[dict[str, Any]]:
    """``EPOCHS`` epochs on ``world`` in-process ranks; per rank its losses, weights and what the trainer used."""
    ps = parts(world)

    def rank(transport: LocalTransport) -> dict[str, Any]:
        tr = Trainer(ps[transport.rank], TrainConfig(**config), transport=transport, **trainer_args)
        try:
            history = [tr.train_epoch() for _ in range(EPOCHS)]
            return {"losses": [h["loss"] for h in history], "grad_bytes": [h["grad_bytes"] for h in history],
                    "weights": [p.detach().clone() for p in tr.model.parameters()], "averager": tr.averager,
                    "state": tr.hook_state, "runs_model": tr.net is tr.model, "opt": tr.opt,
                    "checkpoint": tr.state_dict()}  # fmt: skip
        finally:
            tr.close()

    return run_local(world, rank)


def assert_same_training(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a["losses"] == b["losses"]
        assert a["grad_bytes"] == b["grad_bytes"]
        for p, q in zip(a["weights"], b["weights"], strict=True):
            assert torch.equal(p, q)


@pytest.mark.parametrize("codec", ["none", "qsgd"])
def test_a_given_averager_is_used_and_equals_the_default_of_the_same_algorithm(codec):
    """In-process ranks: the caller's averager averages every epoch's gradients (once per epoch, on a transport of
    its own), is checkpointed and closed; training equals the default's (``grad_hook``'s average) bit for bit."""
    default = train_in_process({**CONFIG, "grad_hook": None if codec == "none" else codec})
    given = train_in_process(CONFIG, averager=lambda model, transport: CountingAverage(model, transport, codec))
    for r in given:
        assert isinstance(r["averager"], CountingAverage) and r["state"] is r["averager"]
        assert r["averager"].calls == EPOCHS
        assert r["runs_model"]
        assert r["checkpoint"]["grad_hook"]["codec"] == codec
    assert isinstance(default[0]["averager"], GradientAverage)
    assert_same_training(given, default)


def test_a_given_optimizer_is_used():
    """SGD with momentum 0.9: each epoch's step is the heavy-ball step of that epoch's averaged gradient (Adam's,
    the default, would be another), with its momentum buffer in the checkpoint."""
    ps = parts(2)

    def rank(transport: LocalTransport) -> None:
        tr = Trainer(ps[transport.rank], TrainConfig(**CONFIG), transport=transport,
                     optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))  # fmt: skip
        try:
            assert isinstance(tr.opt, torch.optim.SGD)
            params = list(tr.model.parameters())
            weights = [p.detach().clone() for p in params]
            buffers = [torch.zeros_like(p) for p in params]
            for _ in range(2):
                tr.train_epoch()
                for i, p in enumerate(params):
                    buffers[i] = buffers[i] * 0.9 + p.grad if tr.epoch else p.grad.clone()
                    weights[i] = weights[i] - 0.1 * buffers[i]
                    torch.testing.assert_close(p.detach(), weights[i], rtol=1e-6, atol=1e-7)
            assert "momentum_buffer" in tr.state_dict()["optimizer"]["state"][0]
        finally:
            tr.close()

    run_local(2, rank)


def test_the_default_optimizer_given_by_the_caller_equals_the_default():
    """``default_optimizer(config)`` (Adam with its lr and weight decay) passed as the optimizer trains as the
    trainer does without one, and so does the caller's own Adam of the same settings."""
    config = {**CONFIG, "lr": 0.02, "weight_decay": 1e-3}
    default = train_in_process(config)
    assert all(isinstance(r["opt"], torch.optim.Adam) for r in default)
    assert_same_training(train_in_process(config, optimizer=default_optimizer(TrainConfig(**config))), default)
    own = train_in_process(config, optimizer=lambda params: torch.optim.Adam(params, lr=0.02, weight_decay=1e-3))
    assert_same_training(own, default)


def test_bad_arguments_are_refused_naming_them():
    part = parts(1)[0]
    with pytest.raises(TypeError, match="optimizer must be a factory params -> torch"):
        Trainer(part, TrainConfig(**CONFIG), optimizer=lambda params: list(params))  # type: ignore[arg-type,return-value]
    ps = parts(2)

    def refusal(transport: LocalTransport, config: dict[str, Any], averager: Any) -> str:
        with pytest.raises(ValueError) as info:
            Trainer(ps[transport.rank], TrainConfig(**config), transport=transport, averager=averager)
        return str(info.value)

    said = run_local(2, lambda t: refusal(t, {**CONFIG, "grad_hook": "qsgd"}, fp32_average))
    assert all("grad_hook='qsgd' and an averager given" in s for s in said), said
    # One rank with an averager, the other without: both refuse at the agreement, naming the field.
    said = run_local(2, lambda t: refusal(t, CONFIG, fp32_average if t.rank else None))
    assert all("averager" in s for s in said), said


def test_a_checkpoint_of_another_optimizer_is_refused():
    """Adam's state into an SGD trainer: torch alone would load it without a word."""
    part = parts(1)[0]
    adam = Trainer(part, TrainConfig(**CONFIG))
    adam.train_epoch()
    sgd = Trainer(part, TrainConfig(**CONFIG), optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="expected a checkpoint written with the same optimizer"):
        sgd.load_state_dict(adam.state_dict())
    again = Trainer(part, TrainConfig(**CONFIG), optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    sgd.train_epoch()
    again.load_state_dict(sgd.state_dict())
    assert again.epoch == sgd.epoch


def test_the_trainer_does_not_look_for_horovod(monkeypatch):
    """Horovod imported and initialized, no transport given, no process group: one process trains alone (the
    caller passes ``transport=horovod_transport()`` to train over Horovod)."""
    fake: Any = types.ModuleType("horovod.torch")
    fake.is_initialized = lambda: True
    monkeypatch.setitem(sys.modules, "horovod.torch", fake)
    tr = Trainer(parts(1)[0], TrainConfig(**CONFIG))
    assert tr.transport is None and tr.world == 1
    tr.close()


@pytest.mark.multiprocess
def test_a_given_averager_replaces_ddp_on_a_process_group():
    """gloo processes: with the caller's averager the model is not wrapped in DDP, and training (fp32 average)
    still reproduces single-process full-graph training."""
    config = {"model": "sage", "hidden": 16, "layers": 3, "backend": "torch"}
    ref = gw.single_process(config, 3)
    res = run_distributed(averaged_run, 2, config, 3)
    assert not any(r["ddp"] for r in res)
    gw.assert_matches_single_process(res, ref)
