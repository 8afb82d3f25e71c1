"""CompressedAdamW in one process, ranks as threads of the in-process transport, at 1, 2 and 4 ranks.

The warm-up is torch.optim.AdamW on the averaged gradient; after it the variance is frozen and, with the
momentum averaged exactly (codec ``none``), every step is the frozen-variance update of the reference below; a
parameter whose variance was never estimated takes AdamW steps; a run with skipped warm-up steps resumes
bit-identical, and so does a run resumed across a check of the compression monitor. What CompressedAdamW shares
with CompressedSGD (identical replicas, resume, non-finite gradients, skipped steps, missing gradients) is tested on
both in ``test_momentum.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from sylvie_comm.collectives.local import run_local
from sylvie_comm.optim import DEFAULT_DENOM_FLOOR, CompressedAdamW
from tests.optim.common import (
    ADAMW_HYPER,
    EF_CODECS,
    SHAPES,
    WORLDS,
    construction_error,
    first_step_skipped,
    grad,
    initial,
    make_adamw,
    meta_devices,
    params_of,
    resumed_run,
    run,
    set_grads,
    snapshot,
    stepped,
    torch_reference,
    without_a_gradient_for_b1,
)
from tests.optim.test_sgd import MONITOR_RESUMES, resumed_across_a_check


def mean_grad(name: str, world: int, step: int) -> torch.Tensor:
    return sum(grad(name, r, step) for r in range(world)) / world  # type: ignore[return-value]


def adamw(params: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params.values(), **ADAMW_HYPER)


# ---------------------------------------------------------------- the warm-up is AdamW


def adamw_reference(world: int, steps: int, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    return torch_reference(adamw, mean_grad, world, range(steps), skip=skip)


@pytest.mark.parametrize("world", WORLDS)
def test_a_warmup_over_every_step_is_adamw_on_the_averaged_gradient(world: int) -> None:
    ref = adamw_reference(world, 8)
    for r in run(make_adamw, world, 8, codec="none", warmup=10):
        for n in SHAPES:
            torch.testing.assert_close(r["params"][n], ref[n], rtol=1e-6, atol=1e-7)
        assert r["stats"]["phase"] == "warmup" and r["stats"]["warmup_steps"] == 10


@pytest.mark.parametrize("world", [1, 2])
def test_parameters_without_a_gradient_are_skipped_as_adamw_skips_them(world: int) -> None:
    ref = adamw_reference(world, 5, skip=("b1",))

    for got in without_a_gradient_for_b1(make_adamw, world, 5, codec="none", warmup=10):
        for n in SHAPES:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- after the warm-up


def frozen_reference(world: int, steps: int, warmup: int, floor: float) -> dict[str, torch.Tensor]:
    """The frozen-variance update written out in float64: AdamW for ``warmup`` steps, then the momentum of the
    averaged gradients with v and the bias corrections of step ``warmup``."""
    lr, (b1, b2), eps, wd = (ADAMW_HYPER[k] for k in ("lr", "betas", "eps", "weight_decay"))
    p = {n: v.double() for n, v in initial().items()}
    m = {n: torch.zeros_like(v) for n, v in p.items()}
    v = {n: torch.zeros_like(t) for n, t in p.items()}
    for step in range(steps):
        t = min(step + 1, warmup)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        for n in p:
            g = mean_grad(n, world, step).double()
            p[n] = p[n] * (1 - lr * wd)
            m[n] = b1 * m[n] + (1 - b1) * g
            if step < warmup:
                v[n] = b2 * v[n] + (1 - b2) * g * g
            denom = (v[n] / bc2).sqrt() + eps
            if step >= warmup and floor:
                denom = torch.maximum(denom, floor * denom.mean())
            p[n] = p[n] - lr / bc1 * m[n] / denom
    return {n: t.float() for n, t in p.items()}


@pytest.mark.parametrize("floor", [DEFAULT_DENOM_FLOOR, 0.0])
@pytest.mark.parametrize("world", WORLDS)
def test_with_exact_averaging_after_the_warmup_each_step_is_the_frozen_variance_update(
    world: int, floor: float
) -> None:
    ref = frozen_reference(world, 10, 4, floor)
    for r in run(make_adamw, world, 10, codec="none", warmup=4, denom_floor=floor):
        for n in SHAPES:
            torch.testing.assert_close(r["params"][n], ref[n], rtol=2e-5, atol=1e-6)
        assert r["stats"]["phase"] == "compressed"


@pytest.mark.parametrize("world", WORLDS)
def test_the_variance_is_frozen_after_the_warmup(world: int) -> None:
    def observe(opt: CompressedAdamW, params: dict[str, Any], step: int) -> Any:
        return {n: (opt.state[p]["exp_avg_sq"].clone(), opt.state[p]["exp_avg"].clone()) for n, p in params.items()}

    for r in run(make_adamw, world, 8, observe, codec="onebit", warmup=3):
        seen = r["seen"]
        for n in SHAPES:
            assert not torch.equal(seen[1][n][0], seen[2][n][0])  # the warm-up moves v
            for later in seen[3:]:
                assert torch.equal(later[n][0], seen[2][n][0]), n  # then v stays
            assert not torch.equal(seen[6][n][1], seen[7][n][1])  # while the momentum moves


def test_a_parameter_first_stepped_after_the_freeze_takes_adamw_steps() -> None:
    """Its variance was never estimated: it keeps AdamW on the fp32-averaged gradient (sent raw)."""
    world = 2

    def body(tr: Any) -> torch.Tensor:
        params, opt = stepped(
            tr, make_adamw, 6, skip=lambda step: ("b2",) if step < 3 else (), codec="onebit", warmup=2
        )
        opt.close()
        return params["b2"].detach().clone()

    ref = torch_reference(adamw, mean_grad, world, range(3, 6), names=("b2",))["b2"]
    for got in run_local(world, body):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- configuration


def test_ranks_that_disagree_fail_fast_on_every_rank() -> None:
    def other_warmups(tr: Any) -> str:
        return construction_error(lambda: make_adamw(tr, params_of(initial()), codec="onebit", warmup=4 + tr.rank))

    for msg in run_local(2, other_warmups):
        assert "'warmup_steps' is 4 on rank 0 but 5 on rank 1" in msg, msg

    def bad_lr(tr: Any) -> str:
        lr = -1.0 if tr.rank == 1 else 1e-3
        return construction_error(lambda: make_adamw(tr, params_of(initial()), codec="onebit", warmup=2, lr=lr))

    r0, r1 = run_local(2, bad_lr)
    assert "rank 1 could not set up" in r0 and "lr must be" in r0
    assert "lr must be a finite number >= 0" in r1

    def other_shapes(tr: Any) -> str:
        values = initial()
        if tr.rank == 1:
            values["w2"] = torch.zeros(3, 7)
        return construction_error(lambda: make_adamw(tr, params_of(values), warmup=2))

    for msg in run_local(2, other_shapes):
        assert "'optimizer.parameter_digest'" in msg, msg


# ---------------------------------------------------------------- devices


@pytest.mark.parametrize("codec", ["onebit", "none", "qsgd"])
@pytest.mark.parametrize("world", [1, 2])
def test_every_buffer_follows_the_parameters_device(codec: str, world: int) -> None:
    """On the ``meta`` device a buffer made on the CPU, or a value read on the host, fails."""
    for devices in run_local(world, lambda tr: meta_devices(tr, make_adamw, codec=codec, warmup=2)):
        assert devices and all(d == torch.device("meta") for d in devices), set(devices)


def test_a_copy_of_the_optimizer_is_not_needed_for_its_state() -> None:
    """state_dict() returns copies of the compression state (a later step does not change a saved checkpoint)."""

    def body(tr: Any) -> bool:
        params, opt = stepped(tr, make_adamw, 3, codec="onebit", warmup=1)
        saved = copy.deepcopy(opt.state_dict()["sylvie_comm"]["params"])
        held = opt.state_dict()["sylvie_comm"]["params"]
        set_grads(params, tr.rank, 3)
        opt.step()
        same = all(torch.equal(held[n][k], saved[n][k]) for n in saved for k in saved[n])
        opt.close()
        return same

    assert all(run_local(2, body))


# ---------------------------------------------------------------- skipped steps and the warm-up


def test_a_parameter_whose_only_warmup_gradient_was_skipped_is_not_frozen() -> None:
    """'b2' has a gradient only in a skipped warm-up step: its variance was never estimated (step 0), so it is not
    frozen with bias corrections of 0 (NaN): it takes AdamW steps, as a parameter first stepped after the freeze."""

    def body(tr: Any, skip_first: bool) -> dict[str, torch.Tensor]:
        return first_step_skipped(
            tr,
            make_adamw,
            skip_first,
            nan_on=lambda rank: rank == 0,
            skip=lambda step: ("b2",) if step in (1, 2) else (),
            codec="onebit",
            warmup=2,
        )

    got = run_local(2, lambda tr: body(tr, True))
    want = run_local(2, lambda tr: body(tr, False))
    for g, w in zip(got, want, strict=True):
        for n in SHAPES:
            assert torch.isfinite(g[n]).all(), n
            assert torch.equal(g[n], w[n]), n


@pytest.mark.parametrize("at", [2, 6], ids=["in-warmup", "compressed"])
@pytest.mark.parametrize("skipped", [(1,), (0, 1, 2)], ids=["one", "all-warmup"])
def test_a_run_with_skipped_warmup_steps_resumes_bit_identical(skipped: tuple[int, ...], at: int) -> None:
    def body(tr: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
        def poison(params: dict[str, torch.nn.Parameter], step: int) -> None:
            if step in skipped and tr.rank == 0:
                params["b1"].grad[0] = float("nan")  # type: ignore[index]

        return resumed_run(tr, make_adamw, 9, at, poison, codec="qsgd", warmup=3)

    for whole, resumed, ckpt in run_local(2, body):
        phase = ckpt["opt"]["sylvie_comm"]["phase"]
        assert phase == ("warmup" if at - len([s for s in skipped if s < at]) < 3 else "compressed")
        for n in SHAPES:
            assert torch.isfinite(whole[n]).all(), n
            assert torch.equal(whole[n], resumed[n]), n


@pytest.mark.parametrize("case", list(MONITOR_RESUMES))
@pytest.mark.parametrize("codec", EF_CODECS)
def test_a_run_resumed_across_a_monitor_check_is_bit_identical(codec: str, case: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """See test_sgd.py's: the checkpoint after the warm-up, the variance frozen in it."""
    resumed_across_a_check(make_adamw, case, codec, monkeypatch)


def test_checkpoints_without_the_count_of_skipped_warmup_steps_load_and_bad_counts_are_refused() -> None:
    def body(tr: Any) -> str:
        _, opt = stepped(tr, make_adamw, 5, codec="onebit", warmup=2)
        ckpt = snapshot(opt.state_dict())
        assert ckpt["sylvie_comm"]["warmup_skipped"] == 0
        old = snapshot(ckpt)
        del old["sylvie_comm"]["warmup_skipped"]  # written before skipped steps were counted: none were
        other = make_adamw(tr, params_of(initial()), codec="onebit", warmup=2)
        other.load_state_dict(old)
        assert other.phase == "compressed"
        bad = snapshot(ckpt)
        bad["sylvie_comm"]["warmup_skipped"] = 7
        with pytest.raises(ValueError, match=r"warmup_skipped must be an integer in \[0, 5\] \(the checkpoint's "
                                             r"step\), got 7"):  # fmt: skip
            other.load_state_dict(bad)
        zero = snapshot(ckpt)
        first = next(iter(zero["state"]))
        zero["state"][first]["freeze_step"] = torch.tensor(0.0)  # a variance frozen before any step was taken
        with pytest.raises(ValueError, match=r"freeze_step 0\.0 of parameter 'w1' must be at least 1"):
            other.load_state_dict(zero)
        opt.close()
        other.close()
        return "ok"

    assert run_local(2, body) == ["ok", "ok"]


def test_ranks_resuming_from_different_steps_name_load_state_dict_once() -> None:
    def body(tr: Any) -> str:
        params, opt = stepped(tr, make_adamw, 3, codec="onebit", warmup=2)
        ckpt = snapshot(opt.state_dict())
        set_grads(params, tr.rank, 3)
        opt.step()
        if tr.rank == 1:
            ckpt = snapshot(opt.state_dict())  # one step later than rank 0's
        other = make_adamw(tr, params_of(initial()), codec="onebit", warmup=2)
        try:
            other.load_state_dict(ckpt)
        except ValueError as exc:
            return str(exc)
        finally:
            opt.close()
            other.close()
        return "loaded"

    for msg in run_local(2, body):
        assert "ranks disagree on the checkpoint: 'step' is 3 on rank 0 but 4 on rank 1" in msg, msg
        assert msg.count("load_state_dict") == 1, msg


# ---------------------------------------------------------------- which parameters have a gradient


def test_a_parameter_without_gradients_on_every_rank_at_once_is_agreed_without_a_skipped_step() -> None:
    """Every rank loses, then regains, the same gradients: the ranks agree on the new set and step with it."""

    def body(tr: Any) -> dict[str, Any]:
        params, opt = stepped(
            tr, make_adamw, 7, skip=lambda step: ("b2", "w1") if step in (1, 4) else (), codec="onebit", warmup=2
        )
        out = {"stats": opt.stats(), "b2": opt.state[params["b2"]]["step"].item()}
        opt.close()
        return out

    for r in run_local(2, body):
        assert r["stats"]["skipped_nonfinite"] == 0
        assert r["b2"] == 5  # seven steps, two without its gradient


def test_a_rank_without_any_gradient_is_a_value_error_and_a_step_without_any_on_every_rank_does_nothing() -> None:
    every = tuple(SHAPES)

    def body(tr: Any) -> dict[str, Any]:
        # no gradient anywhere at step 1: no step
        params, opt = stepped(tr, make_adamw, 4, skip=lambda step: every if step == 1 else (), codec="onebit", warmup=2)
        steps, error = opt.stats()["step"], None
        for step in (4, 5):  # the rank whose gradients did not change learns of the others' at its next step
            set_grads(params, tr.rank, step, skip=every if tr.rank == 1 else ())
            try:
                opt.step()
            except ValueError as exc:
                error = str(exc)
                break
        opt.close()
        return {"steps": steps, "error": error}

    for r in run_local(2, body):
        assert r["steps"] == 3
        assert "parameter 'w1' has a gradient on rank 0 but none (grad None) on rank 1" in r["error"], r["error"]
