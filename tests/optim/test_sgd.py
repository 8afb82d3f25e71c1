"""CompressedSGD in one process, ranks as threads of the in-process transport, at 1, 2 and 4 ranks.

The warm-up is torch.optim.SGD on the averaged gradient, bit for bit; with the momentum averaged exactly (codec
``none``) so is every later step (bit for bit on one rank, to fp32 rounding on more), Nesterov and weight decay
included; the buffer is the ranks' average; a checkpoint whose buffers do not fit is refused; a run resumed across a
check of the compression monitor is bit-identical, the monitor's figures and decisions too (and CompressedAdamW's, in
``test_adamw.py``, with :func:`resumed_across_a_check`). What CompressedSGD shares with CompressedAdamW (identical
replicas, resume, non-finite gradients, skipped steps, missing gradients) is tested on both in ``test_momentum.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import MONITOR_DEFAULTS
from sylvie_comm.optim import CompressedSGD
from tests.optim.common import (
    EF_CODECS,
    SGD_VARIANTS,
    SHAPES,
    WORLDS,
    Maker,
    construction_error,
    detached,
    first_step_skipped,
    full_state,
    grad,
    initial,
    make_adamw,
    make_sgd,
    meta_devices,
    one_rank,
    params_of,
    run,
    set_grads,
    snapshot,
    stepped,
    torch_reference,
    without_a_gradient_for_b1,
)


def mean_grad(name: str, world: int, step: int) -> torch.Tensor:
    """The ranks' mean gradient as the fp32 all-reduce computes it: each divided by the world size, then added
    in rank order (the in-process transport's order), so the reference sees the optimizer's bits."""
    total = grad(name, 0, step) / world
    for r in range(1, world):
        total.add_(grad(name, r, step) / world)
    return total


def sgd(variant: str) -> Any:
    """torch.optim.SGD in ``variant`` (its single-tensor form, as CompressedSGD's ops) on the given parameters."""
    return lambda params: torch.optim.SGD(params.values(), **SGD_VARIANTS[variant], foreach=False)


def sgd_reference(world: int, steps: int, variant: str, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """torch.optim.SGD fed the mean gradient."""
    return torch_reference(sgd(variant), mean_grad, world, range(steps), skip=skip)


# ---------------------------------------------------------------- the warm-up and exact averaging are torch's SGD


@pytest.mark.parametrize("variant", list(SGD_VARIANTS))
@pytest.mark.parametrize("world", WORLDS)
def test_the_warmup_is_torch_sgd_on_the_averaged_gradient_bit_for_bit(world: int, variant: str) -> None:
    ref = sgd_reference(world, 8, variant)
    for r in run(make_sgd, world, 8, variant=variant, codec="onebit", warmup=10):
        for n in SHAPES:
            assert torch.equal(r["params"][n], ref[n]), (n, (r["params"][n] - ref[n]).abs().max().item())
        assert r["stats"]["phase"] == "warmup" and r["stats"]["warmup_steps"] == 10


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("variant", list(SGD_VARIANTS))
@pytest.mark.parametrize("world", WORLDS)
def test_with_exact_averaging_every_step_is_torch_sgd(world: int, variant: str, warmup: int) -> None:
    """The average of the ranks' buffers is SGD's buffer on the mean gradient (linear in the gradients), and the
    Nesterov step recovered from this step's and the last step's averaged buffers is SGD's Nesterov step. On one rank
    the arithmetic is torch's, op for op (Nesterov's excepted); on more the buffers are averaged instead of the
    gradients: fp32 rounding apart."""
    ref = sgd_reference(world, 10, variant)
    for r in run(make_sgd, world, 10, variant=variant, codec="none", warmup=warmup):
        assert r["stats"]["phase"] == "compressed"
        for n in SHAPES:
            if world == 1 and variant != "nesterov":
                assert torch.equal(r["params"][n], ref[n]), n
            else:
                torch.testing.assert_close(r["params"][n], ref[n], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world", [1, 2])
def test_parameters_without_a_gradient_are_skipped_as_sgd_skips_them(world: int) -> None:
    ref = sgd_reference(world, 5, "dampening", skip=("b1",))

    for got in without_a_gradient_for_b1(make_sgd, world, 5, variant="dampening", codec="none", warmup=10):
        for n in SHAPES:
            assert torch.equal(got[n], ref[n]), n


def test_a_parameter_first_stepped_after_the_warmup_starts_its_buffer_as_sgd_does() -> None:
    """'b2' gets its first gradient at a compressed step: its buffer is that step's (dampened or not) gradient."""
    world = 2

    def body(tr: Any) -> torch.Tensor:
        params, opt = stepped(tr, make_sgd, 6, skip=lambda step: ("b2",) if step < 3 else (), variant="dampening",
                              codec="none", warmup=2)  # fmt: skip
        opt.close()
        return params["b2"].detach().clone()

    ref = torch_reference(sgd("dampening"), mean_grad, world, range(3, 6), names=("b2",))["b2"]
    for got in run_local(world, body):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_parameter_groups_keep_their_own_hyperparameters() -> None:
    """Each group's lr, momentum, Nesterov and weight decay, as torch.optim.SGD's groups (exact averaging)."""
    world, own = 2, {"lr": 0.05, "momentum": 0.5, "nesterov": False, "weight_decay": 0.0}

    def groups(params: dict[str, Any], named: bool) -> list[dict[str, Any]]:
        first = [(n, params[n]) if named else params[n] for n in ("w1", "b1")]
        second = [(n, params[n]) if named else params[n] for n in ("w2", "b2")]
        return [{"params": first}, {"params": second, **own}]

    def body(tr: Any) -> dict[str, torch.Tensor]:
        params = params_of(initial())
        opt = CompressedSGD(groups(params, True), **SGD_VARIANTS["nesterov"], transport=tr, codec="none", warmup=2)
        assert [n for n, _ in opt._named] == list(SHAPES)
        for step in range(6):
            set_grads(params, tr.rank, step)
            opt.step()
        opt.close()
        return detached(params)

    def grouped(params: dict[str, Any]) -> torch.optim.Optimizer:
        return torch.optim.SGD(groups(params, False), **SGD_VARIANTS["nesterov"], foreach=False)

    ref = torch_reference(grouped, mean_grad, world, range(6))
    for got in run_local(world, body):
        for n in SHAPES:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-6)
    params = params_of(initial())
    with pytest.raises(ValueError, match=r"CompressedSGD: param_groups\[1\]: momentum must be > 0, got 0"):
        CompressedSGD([{"params": [params["w1"]]}, {"params": [params["w2"]], "momentum": 0}], lr=0.1,
                      transport=one_rank(), warmup=1)  # fmt: skip


# ---------------------------------------------------------------- compressed


def test_the_buffer_is_the_average_on_every_rank_and_moves_after_the_warmup() -> None:
    def observe(opt: CompressedSGD, params: dict[str, Any], step: int) -> Any:
        return {n: opt.state[p]["momentum_buffer"].clone() for n, p in params.items()}

    results = run(make_sgd, 2, 6, observe, codec="onebit", warmup=2)
    for step in range(6):
        for n in SHAPES:
            assert torch.equal(results[0]["seen"][step][n], results[1]["seen"][step][n]), (step, n)
            if step:
                assert not torch.equal(results[0]["seen"][step][n], results[0]["seen"][step - 1][n]), (step, n)


@pytest.mark.parametrize("world", [2, 4])
def test_onebit_sends_at_least_sixteen_times_fewer_bytes_than_fp32_on_matrices(world: int) -> None:
    shapes = {"w1": (64, 256), "w2": (128, 64)}

    def body(tr: Any) -> dict[str, Any]:
        g = torch.Generator().manual_seed(3)
        params = {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in shapes.items()}
        opt = CompressedSGD(list(params.items()), lr=0.01, transport=tr, warmup=1)
        for step in range(3):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + tr.rank))
            opt.step()
        stats = opt.stats()
        opt.close()
        return stats

    for stats in run_local(world, body):
        assert stats["phase"] == "compressed" and stats["codec"] == "onebit"
        last = stats["last_step"]
        assert last["bytes_uncompressed"] >= 16 * last["bytes_sent"] > 0, last


def test_memory_counts_the_buffers_and_the_compression_state() -> None:
    def body(tr: Any) -> tuple[int, int]:
        params, opt = stepped(tr, make_sgd, 3, codec="onebit", warmup=1)
        held = sum(4 * p.numel() + 4 for p in params.values())  # fp32 buffers and step counts
        out = opt.memory_bytes(), held + opt.algorithm.memory_bytes()
        opt.close()
        return out

    for got, want in run_local(2, body):
        assert got == want


# ---------------------------------------------------------------- resume


def test_a_checkpoint_whose_buffers_do_not_fit_is_refused_on_every_rank() -> None:
    """Buffers of another shape, non-finite buffers, CompressedAdamW's moments (a checkpoint of another codec or
    phase: test_momentum.py)."""

    def body(tr: Any) -> str:
        _, opt = stepped(tr, make_sgd, 3, codec="onebit", warmup=2)
        ckpt = snapshot(opt.state_dict())
        assert set(ckpt["state"][0]) == {"step", "momentum_buffer"}
        bad = snapshot(ckpt)
        bad["state"][0]["momentum_buffer"] = torch.zeros(3)
        with pytest.raises(ValueError, match=r"momentum_buffer of parameter 'w1' is \(3,\), expected a tensor of"):
            opt.load_state_dict(bad)
        bad = snapshot(ckpt)
        bad["state"][1]["momentum_buffer"][0] = float("nan")
        with pytest.raises(ValueError, match="momentum_buffer of parameter 'b1' holds NaN or Inf"):
            opt.load_state_dict(bad)
        # CompressedAdamW's checkpoint of the same codec and warm-up: its compression state fits, its moments do not
        _, adam = stepped(tr, make_adamw, 3, codec="onebit", warmup=2)
        adam_message = r"'w1' holds exp_avg, exp_avg_sq, freeze_step, step; expected momentum_buffer and step \(a Co"
        with pytest.raises(ValueError, match=adam_message):
            opt.load_state_dict(snapshot(adam.state_dict()))
        opt.load_state_dict(ckpt)  # nothing was loaded by the refused ones: the good one still loads
        for o in (opt, adam):
            o.close()
        return "ok"

    assert run_local(2, body) == ["ok", "ok"]


# ---------------------------------------------------------------- resume across a check of the compression monitor

# The monitor watches the average of the momenta at the library's defaults (MONITOR_DEFAULTS, the bound calibrated for
# a momentum) unless the optimizer's monitor= settings change them. name -> (changes to the defaults, steps, the step
# the checkpoint is taken before), at a warm-up of 3 steps. "defaults": the first check at compressed step 10 (step
# 13), its figures taken on steps 8-13, across the checkpoint (before step 11). "adapting": checks every 5 compressed
# steps (steps 8 and 13), patience 1 and a bound every lag exceeds, the checkpoint right after the first (before step
# 9): its decisions (top-k's ratio, qsgd's bits; raw for one-bit and sign, which have no safer level) apply at the
# resumed run's first step, and the second check falls after the resume (where a tensor still compresses).
MONITOR_RESUMES: dict[str, tuple[dict[str, Any], int, int]] = {
    "defaults": ({}, 16, 11),
    "adapting": ({"first": 5, "period": 5, "adapt": True, "max_lag": 0.05, "patience": 1}, 16, 9),
}


def resumed_across_a_check(make: Maker, case: str, codec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of MONITOR_RESUMES[case] on 2 ranks and a fresh optimizer resumed from its checkpoint: the same
    parameters, and the same monitor report (checks, decisions in their order, per tensor its setting and figures),
    with a check or decisions after the checkpoint."""
    changes, steps, at = MONITOR_RESUMES[case]
    for key, value in changes.items():
        monkeypatch.setitem(MONITOR_DEFAULTS, key, value)

    def body(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = make(tr, params, codec=codec, warmup=3)
        for step in range(steps):
            if step == at:
                ckpt = full_state(opt, params)
            set_grads(params, tr.rank, step)
            opt.step()
        straight = opt.stats()["monitor"]
        opt.close()
        resumed = params_of(ckpt["params"])
        opt = make(tr, resumed, codec=codec, warmup=3)
        opt.load_state_dict(ckpt["opt"])
        for step in range(at, steps):
            set_grads(resumed, tr.rank, step)
            opt.step()
        got = opt.stats()["monitor"]
        opt.close()
        return {"params": (detached(params), detached(resumed)), "monitor": (ckpt["opt"]["sylvie_comm"]["monitor"],
                straight, got)}  # fmt: skip

    for r in run_local(2, body):
        whole, resumed = r["params"]
        for n in SHAPES:
            assert torch.equal(whole[n], resumed[n]), (codec, n)
        saved, straight, got = r["monitor"]
        assert (got["checks"], got["adapted"]) == (straight["checks"], straight["adapted"]), codec
        assert got["tensors"].keys() == straight["tensors"].keys() == set(SHAPES), codec
        for n, figures in straight["tensors"].items():
            # Figures of the checks since the resume (one-bit's and sign's tensors, sent raw, have none there).
            assert {k: v for k, v in figures.items() if k in got["tensors"][n]} == got["tensors"][n], (codec, n)
        if case == "defaults":
            assert (saved["checks"], straight["checks"]) == (0, 1), codec
            assert got == straight and not straight["adapted"], codec
        else:
            assert saved["checks"] == 1 and len(saved["events"]) < len(straight["adapted"]), (codec, straight)
            assert straight["checks"] == (1 if codec in ("onebit", "sign") else 2), (codec, straight)


@pytest.mark.parametrize("case", list(MONITOR_RESUMES))
@pytest.mark.parametrize("codec", EF_CODECS)
def test_a_run_resumed_across_a_monitor_check_is_bit_identical(codec: str, case: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    resumed_across_a_check(make_sgd, case, codec, monkeypatch)


# ---------------------------------------------------------------- non-finite gradients


def test_a_skipped_first_step_leaves_no_buffer_behind() -> None:
    """With dampening the first taken step sets the buffer to the gradient (torch.optim.SGD's None buffer): a
    first step skipped for a NaN leaves the step count at 0, so the next taken step is that first step."""

    def body(tr: Any, skip_first: bool) -> dict[str, torch.Tensor]:
        return first_step_skipped(tr, make_sgd, skip_first, variant="dampening", codec="onebit", warmup=2)

    for g, w in zip(run_local(2, lambda tr: body(tr, True)), run_local(2, lambda tr: body(tr, False)), strict=True):
        for n in SHAPES:
            assert torch.equal(g[n], w[n]), n


# ---------------------------------------------------------------- configuration


def test_a_warmup_of_zero_compresses_from_the_first_step() -> None:
    assert make_sgd(one_rank(), params_of(initial()), warmup=0).phase == "compressed"


def test_ranks_that_disagree_fail_fast_on_every_rank() -> None:
    def nesterov_on_one(tr: Any) -> str:
        return construction_error(
            lambda: make_sgd(tr, params_of(initial()), "momentum", warmup=2, nesterov=tr.rank == 1)
        )

    for msg in run_local(2, nesterov_on_one):
        assert "'optimizer.nesterov' is False on rank 0 but True on rank 1" in msg, msg

    def bad_momentum(tr: Any) -> str:
        momentum = 0.0 if tr.rank == 1 else 0.9
        return construction_error(lambda: make_sgd(tr, params_of(initial()), warmup=2, momentum=momentum))

    r0, r1 = run_local(2, bad_momentum)
    assert "rank 1 could not set up" in r0 and "momentum must be > 0" in r0
    assert "CompressedSGD: momentum must be > 0, got 0.0" in r1


# ---------------------------------------------------------------- devices


@pytest.mark.parametrize("variant", ["nesterov", "dampening"])
@pytest.mark.parametrize("codec", ["onebit", "none"])
def test_every_buffer_follows_the_parameters_device(codec: str, variant: str) -> None:
    """On the ``meta`` device a buffer made on the CPU, or a value read on the host, fails."""
    for devices in run_local(2, lambda tr: meta_devices(tr, make_sgd, variant=variant, codec=codec, warmup=2)):
        assert devices and all(d == torch.device("meta") for d in devices), set(devices)


def test_bf16_parameters_step_in_their_dtype_and_stay_identical() -> None:
    def body(tr: Any) -> dict[str, torch.Tensor]:
        params = {n: torch.nn.Parameter(v.to(torch.bfloat16)) for n, v in initial().items()}
        opt = make_sgd(tr, params, codec="onebit", warmup=2)
        for step in range(5):
            for n, p in params.items():
                p.grad = grad(n, tr.rank, step).to(torch.bfloat16)
            opt.step()
        assert all(opt.state[p]["momentum_buffer"].dtype == torch.bfloat16 for p in params.values())
        opt.close()
        return detached(params)

    r0, r1 = run_local(2, body)
    for n in SHAPES:
        assert r0[n].dtype == torch.bfloat16 and torch.isfinite(r0[n].float()).all()
        assert torch.equal(r0[n], r1[n]), n
