"""DiLoCo under faults, on the in-process transport: a NaN on one replica (streaming, AdamW, momentum), GradScaler's
skipped steps, per-rank checkpoints of different inner steps, ``sync()`` with a fragment in flight, a second DiLoCo
on the same model, a collective that fails, a configuration that does not match a checkpoint's."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn

from sylvie_comm.collectives import CollectiveError
from sylvie_comm.collectives.local import LocalTransport, run_local
from sylvie_comm.diloco import DiLoCo
from tests.optim.common import snapshot
from tests.optim.test_diloco import LR, MOMENTUM, batch, model_of, state, train

Maker = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

SGD: Maker = lambda ps: torch.optim.SGD(ps, lr=LR)  # noqa: E731
SGD_MOMENTUM: Maker = lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM)  # noqa: E731
ADAMW: Maker = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731


def globals_of(dl: DiLoCo) -> dict[str, torch.Tensor]:
    return {n: o.clone() for f in dl.state_dict()["fragments"] for n, o in f["outer"].items()}


def nan_run(
    transport: Any, steps: int, make: Maker, nan_at: Callable[[int, int], bool], **kwargs: Any
) -> dict[str, Any]:
    """One rank's run with a NaN written into its first gradient at the steps ``nan_at(rank, step)`` names; an
    error raised by ``opt.step()`` ends it and is returned with its step."""
    rank = transport.rank
    model = model_of(0)
    opt = make(model.parameters())
    dl = DiLoCo(model, opt, transport=transport, **kwargs)
    error = None
    for t in range(1, steps + 1):
        x, y = batch(rank, t)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if nan_at(rank, t):
            next(model.parameters()).grad[0, 0] = float("nan")
        try:
            opt.step()
        except RuntimeError as exc:
            error = (t, str(exc))
            break
    out = {"params": state(model), "stats": dl.stats(), "global": globals_of(dl), "error": error}
    dl.close()
    return out


def once(rank: int, step: int) -> bool:
    return rank == 0 and step == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sync_every": 4, "fragments": 2},
        {"sync_every": 4, "fragments": 2, "delay": 1, "codec": "qsgd", "bits": 2},
        {"sync_every": 8, "fragments": 4},
        {"sync_every": 8, "fragments": 4, "delay": 1, "alpha": 0.5},
        {"sync_every": 4},
    ],
    ids=["F2", "F2-delay-qsgd2", "H8-F4", "H8-F4-delay-alpha", "F1"],
)
def test_streaming_recovers_from_one_nan_on_one_replica(kwargs: dict[str, Any]) -> None:
    """One NaN in rank 0's gradient at inner step 3: one outer step is skipped, every fragment of every replica
    goes back to its global copy, and every later outer step is applied: both replicas end finite."""
    steps = 3 * kwargs["sync_every"]
    period = kwargs["sync_every"] // kwargs.get("fragments", 1)
    runs = run_local(2, lambda t: nan_run(t, steps, SGD, once, **kwargs))
    for run in runs:
        assert run["error"] is None
        assert run["stats"]["skipped_nonfinite"] == 1, run["stats"]
        assert run["stats"]["outer_steps"] == steps // period
        for n, v in run["params"].items():
            assert torch.isfinite(v).all(), n
            assert torch.isfinite(run["global"][n]).all(), n
            assert torch.equal(run["global"][n], runs[0]["global"][n]), n  # the replicas share the global point


@pytest.mark.parametrize(
    ("make", "fragments"), [(ADAMW, 1), (ADAMW, 2), (SGD_MOMENTUM, 1)], ids=["adamw", "adamw-F2", "sgd-momentum"]
)
def test_a_replica_whose_inner_optimizer_state_went_nan_recovers(make: Maker, fragments: int) -> None:
    """AdamW's moments (or SGD's momentum) hold the NaN after the step that saw it: the skip clears that replica's
    non-finite inner optimizer state, so the next outer steps are applied instead of skipped for good."""
    runs = run_local(2, lambda t: nan_run(t, 24, make, once, sync_every=4, fragments=fragments))
    for run in runs:
        assert run["error"] is None
        assert run["stats"]["skipped_nonfinite"] == 1, run["stats"]
        assert run["stats"]["outer_steps"] == 24 // (4 // fragments)
        for n, v in run["params"].items():
            assert torch.isfinite(v).all(), n


def test_a_skipped_outer_step_logs_one_warning_per_rank(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sylvie_comm"):
        run_local(2, lambda t: nan_run(t, 12, SGD, once, sync_every=4, fragments=2))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("sylvie_comm") and "skipped" in r.getMessage()]
    assert len(lines) == 2, lines  # one skip event, seen by each of the two ranks: not one line per tensor
    assert any("rank 0" in line and "not finite" in line for line in lines), lines
    assert all("fragment 1" in line and "global parameters" in line for line in lines), lines


def test_outer_steps_skipped_again_and_again_fail_every_rank() -> None:
    """A replica whose gradient is NaN at every step cannot recover: after three cycles of skipped outer steps in a
    row every rank raises, at the same inner step, instead of training on with nothing applied."""

    def always(rank: int, step: int) -> bool:
        return rank == 0 and step >= 3

    runs = run_local(2, lambda t: nan_run(t, 40, SGD, always, sync_every=4, fragments=2))
    for run in runs:
        assert run["error"] is not None, run["stats"]
        step, message = run["error"]
        assert step == 14  # skips at steps 4, 6, ..., 14: the sixth in a row is 3 cycles of 2 fragments
        assert "6 outer steps in a row skipped" in message and "sync_every=4" in message, message


# ---------------------------------------------------------------------------------------------------- GradScaler


def scaled_run(transport: Any, steps: int, *, inf_at: int | None, unscale: bool, **kwargs: Any) -> dict[str, Any]:
    """One rank's run under ``torch.amp.GradScaler``; rank 1's gradient holds an Inf at ``inf_at`` (the scaler skips
    that step there); with ``unscale`` the loop unscales before stepping (as for gradient clipping)."""
    rank = transport.rank
    model = model_of(rank)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    dl = DiLoCo(model, opt, transport=transport, **kwargs)
    for t in range(1, steps + 1):
        x, y = batch(rank, t)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if rank == 1 and t == inf_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    out = {"params": state(model), "stats": dl.stats(), "global": globals_of(dl), "scale": scaler.get_scale()}
    dl.close()
    return out


@pytest.mark.parametrize("unscale", [False, True], ids=["scaler-unscales", "loop-unscales"])
def test_a_step_the_scaler_skips_on_one_replica_is_still_an_inner_step(unscale: bool) -> None:
    """The scaler skips rank 1's step 3: it still counts as an inner step there, so both replicas sync at the same
    steps (a replica one step behind would pair its syncs with the others' next steps, and its last one with
    nothing)."""
    kwargs = {"sync_every": 4, "fragments": 2, "delay": 1}
    runs = run_local(2, lambda t: scaled_run(t, 15, inf_at=3, unscale=unscale, **kwargs), timeout=30)
    for run in runs:
        assert run["stats"]["inner_steps"] == 15, run["stats"]
        assert run["stats"]["outer_steps"] == 7, run["stats"]
        for n, v in run["params"].items():
            assert torch.isfinite(v).all(), n
            assert torch.equal(run["global"][n], runs[0]["global"][n]), n
    assert runs[1]["scale"] < runs[0]["scale"]  # the scaler did skip rank 1's step


@pytest.mark.parametrize("unscale", [False, True], ids=["scaler-unscales", "loop-unscales"])
def test_a_scaler_that_skips_nothing_gives_the_unscaled_bits(unscale: bool) -> None:
    """Scales are powers of two: with no step skipped the scaled run gives the plain run's bits, DiLoCo's own
    unscaling (the scaler steps DiLoCo's inner optimizer itself) included."""
    kwargs = {"sync_every": 4, "fragments": 2, "delay": 1, "codec": "qsgd", "bits": 4}
    scaled = run_local(2, lambda t: scaled_run(t, 14, inf_at=None, unscale=unscale, **kwargs))
    plain = run_local(2, lambda t: train(t, 14, **kwargs))
    for a, b in zip(scaled, plain, strict=True):
        assert a["scale"] > 2.0**10  # it grew: no step skipped
        for n, v in b["params"].items():
            assert torch.equal(a["params"][n], v), n


@pytest.mark.parametrize("scheduler_first", [True, False], ids=["scheduler-first", "diloco-first"])
def test_lr_schedulers_and_close_work_with_the_scaled_step(scheduler_first: bool) -> None:
    """The step() GradScaler calls is a bound method that carries an LR scheduler's mark: a scheduler built before or
    after DiLoCo warns of nothing and steps; close() gives the optimizer its own step() back where it can."""

    def run(transport: Any) -> dict[str, Any]:
        model = model_of(0)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if scheduler_first else None
        dl = DiLoCo(model, opt, transport=transport, sync_every=4)
        sched = sched or torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for t in range(1, 9):
                x, y = batch(0, t)
                opt.zero_grad()
                scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
        steps = dl.stats()["inner_steps"]
        dl.close()
        return {"warnings": [str(w.message) for w in caught], "steps": steps, "lr": opt.param_groups[0]["lr"],
                "marked": "_step_supports_amp_scaling" in opt.__dict__}  # fmt: skip

    got = run_local(1, run)[0]
    assert got["warnings"] == [] and got["steps"] == 8, got
    assert got["lr"] == LR * 0.5**8
    assert got["marked"] is not scheduler_first  # a scheduler built after wrapped DiLoCo's step(): it stays


# ---------------------------------------------------------------------------------------------------- resume


def resume_run(transport: Any, save_at: int, **kwargs: Any) -> str:
    """Train ``save_at`` inner steps, save, build afresh and load; returns the load's error (or 'loaded')."""
    rank = transport.rank
    model = model_of(rank)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    dl = DiLoCo(model, opt, transport=transport, **kwargs)
    for t in range(1, save_at + 1):
        x, y = batch(rank, t)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    saved = snapshot({"model": model.state_dict(), "opt": opt.state_dict(), "dl": dl.state_dict()})
    dl.close()
    dl = DiLoCo(model, opt, transport=transport, **kwargs)
    try:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        dl.load_state_dict(saved["dl"])
    except ValueError as exc:
        return str(exc)
    finally:
        dl.close()
    return "loaded"


def test_checkpoints_of_different_inner_steps_are_refused_on_every_rank() -> None:
    """Rank 0's checkpoint is of inner step 9, rank 1's of 10 (one outer step each): loaded, the ranks would sync out
    of phase and the last sync would wait out the timeout. Every rank refuses it, naming the inner step."""
    got = run_local(2, lambda t: resume_run(t, 9 + t.rank, sync_every=8, fragments=2, delay=1))
    for message in got:
        assert "inner_step" in message and "9" in message and "10" in message, message
    assert run_local(2, lambda t: resume_run(t, 9, sync_every=8, fragments=2, delay=1)) == ["loaded", "loaded"]


def test_a_configuration_mismatch_names_the_differing_fields_only() -> None:
    def run(transport: Any) -> str:
        model = model_of(0)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        with DiLoCo(model, opt, transport=transport, sync_every=8, fragments=2) as dl:
            saved = dl.state_dict()
        with DiLoCo(model, opt, transport=transport, sync_every=4, fragments=2) as dl:
            try:
                dl.load_state_dict(saved)
            except ValueError as exc:
                return str(exc)
        return "loaded"

    message = run_local(1, run)[0]
    assert "diloco.sync_every" in message and "8" in message and "4" in message, message
    assert "parameter_digest" not in message and "outer_defaults" not in message, message  # not the whole dicts


# ---------------------------------------------------------------------------------------------------- sync()


def test_sync_with_a_fragment_in_flight_applies_it_and_the_schedule_goes_on() -> None:
    """``sync()`` right after fragment 1's average started (delay 1): it is applied then, its scheduled apply does
    nothing, and training goes on with the schedule."""

    def run(transport: Any) -> dict[str, Any]:
        rank = transport.rank
        model = model_of(0)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        seen: dict[str, Any] = {}
        with DiLoCo(model, opt, transport=transport, sync_every=4, fragments=2, delay=1) as dl:
            for t in range(1, 13):
                x, y = batch(rank, t)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if t == 3:  # fragment 1's average is in flight
                    dl.sync()
                    seen["params"], seen["global"] = state(model), globals_of(dl)
            seen["stats"] = dl.stats()
            seen["final"] = state(model)
        return seen

    runs = run_local(2, run)
    for run in runs:
        assert run["stats"]["outer_steps"] == 6  # steps 2, 3 (the sync), 6, 8, 10, 12
        for n in ("2.bias", "4.weight", "4.bias"):  # fragment 1, applied: the replicas are at the global point
            assert torch.equal(run["params"][n], run["global"][n]), n
            assert torch.equal(run["params"][n], runs[0]["params"][n]), n
        for n, v in run["final"].items():
            assert torch.isfinite(v).all(), n


# ---------------------------------------------------------------------------------------------------- a second one


def test_a_second_diloco_on_the_same_model_is_refused_on_every_rank() -> None:
    def run(transport: Any) -> list[str]:
        model = model_of(0)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        first = DiLoCo(model, opt, transport=transport, sync_every=4)
        got = []
        for other in (opt, torch.optim.SGD(model.parameters(), lr=LR)):  # the same optimizer, and another one
            try:
                DiLoCo(model, other, transport=transport, sync_every=4)
                got.append("built")
            except ValueError as exc:
                got.append(str(exc))
        first.close()
        with DiLoCo(model, opt, transport=transport, sync_every=4):  # once closed, the model is free again
            got.append("built")
        return got

    for got in run_local(2, run):
        assert got[-1] == "built"
        for message in got[:2]:
            assert "an open DiLoCo" in message and "close()" in message, message


# ---------------------------------------------------------------------------------------------------- a peer fails


class FailingTransport:
    """The in-process transport, whose collectives fail with a CollectiveError once ``armed`` (as the process-group
    transport's do when a peer is gone)."""

    def __init__(self, inner: LocalTransport) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.armed = False

    def _maybe(self, kind: str, issue: Callable[[], Any]) -> Any:
        if not self.armed:
            return issue()
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_exception(CollectiveError(f"sylvie_comm: {kind} on rank {self.rank} failed: a peer is gone"))
        return fut

    def all_reduce(self, t: torch.Tensor) -> Any:
        return self._maybe("all_reduce", lambda: self.inner.all_reduce(t))

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> Any:
        return self._maybe("all_gather", lambda: self.inner.all_gather(out, t))

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor) -> Any:
        return self._maybe("reduce_scatter", lambda: self.inner.reduce_scatter(out, t))

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> Any:
        return self._maybe("all_to_all", lambda: self.inner.all_to_all(out, t))

    def all_to_all_v(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> Any:
        return self._maybe("all_to_all_v", lambda: self.inner.all_to_all_v(out, t, out_splits, in_splits))

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.inner.all_gather_object(obj)

    def fork(self) -> Any:
        return FailingTransport(self.inner.fork())


@pytest.mark.parametrize(
    "kwargs", [{"codec": "none"}, {"codec": "qsgd", "bits": 2}, {"codec": "topk", "ratio": 0.2, "fragments": 2,
                                                                  "delay": 1}],
    ids=["fp32", "qsgd2", "topk-streaming"],
)  # fmt: skip
def test_a_failed_collective_raises_the_collective_error_itself(kwargs: dict[str, Any]) -> None:
    def run(inner: LocalTransport) -> tuple[int, str, bool]:
        transport = FailingTransport(inner)
        model = model_of(0)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        dl = DiLoCo(model, opt, transport=transport, sync_every=4, **kwargs)
        transport.armed = True  # every collective from now on fails: the peers are gone
        try:
            for t in range(1, 9):
                x, y = batch(transport.rank, t)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                try:
                    opt.step()
                except Exception as exc:
                    return t, f"{type(exc).__name__}: {exc}", isinstance(exc, CollectiveError)
        finally:
            dl.__exit__(RuntimeError, None, None)  # unhook without another collective
        return 0, "no error", False

    for step, message, caught in run_local(2, run):
        assert caught and 1 <= step <= 4, (step, message)  # the first outer step
        assert message.startswith("CollectiveError: sylvie_comm:") and "a peer is gone" in message, message
        assert "\n" not in message, message  # the error's own words, not the callback's traceback
