"""CompressedSGD in one process, ranks as threads of the in-process transport, at 1, 2 and 4 ranks.

The warm-up is torch.optim.SGD on the averaged gradient, bit for bit; with the momentum averaged exactly (codec
``none``) so is every later step (bit for bit on one rank, to fp32 rounding on more), Nesterov and weight decay
included; replicas stay identical with every codec; a resumed run is bit-identical; a non-finite gradient on one
rank skips the step on every rank with every state tensor as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from sylvie_comm.collectives.local import run_local
from sylvie_comm.optim import CompressedAdamW, CompressedSGD
from tests.optim.test_adamw import SHAPES, assert_same, grad, initial, one_rank, params_of, set_grads, snapshot

WORLDS = [1, 2, 4]
EF_CODECS = ["onebit", "sign", "topk", "qsgd"]
# torch.optim.SGD's conventions, each exercised: plain momentum; Nesterov with weight decay; dampening with decay.
VARIANTS: dict[str, dict[str, Any]] = {
    "momentum": {"lr": 0.01, "momentum": 0.9},
    "nesterov": {"lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
    "dampening": {"lr": 0.01, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1},
}


def make(tr: Any, params: dict[str, torch.nn.Parameter], variant: str = "nesterov", **kw: Any) -> CompressedSGD:
    return CompressedSGD(list(params.items()), **{**VARIANTS[variant], **kw}, transport=tr)


def mean_grad(name: str, world: int, step: int) -> torch.Tensor:
    """The ranks' mean gradient as the fp32 all-reduce computes it: each divided by the world size, then added
    in rank order (the in-process transport's order), so the reference sees the optimizer's bits."""
    total = grad(name, 0, step) / world
    for r in range(1, world):
        total.add_(grad(name, r, step) / world)
    return total


def sgd_reference(world: int, steps: int, variant: str, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """torch.optim.SGD (its single-tensor form, as CompressedSGD's ops) fed the mean gradient."""
    params = params_of(initial())
    opt = torch.optim.SGD(params.values(), **VARIANTS[variant], foreach=False)
    for step in range(steps):
        for n, p in params.items():
            p.grad = None if n in skip else mean_grad(n, world, step)
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def run(world: int, steps: int, observe: Callable[[CompressedSGD, dict[str, Any], int], Any] | None = None,
        **kw: Any) -> list[dict[str, Any]]:  # fmt: skip
    """Per rank: the final parameters, the optimizer's stats and ``observe(opt, params, step)`` after each step."""

    def body(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = make(tr, params, **kw)
        seen = []
        for step in range(steps):
            set_grads(params, tr.rank, step)
            opt.step()
            if observe is not None:
                seen.append(observe(opt, params, step))
        opt.close()
        return {"params": {n: p.detach().clone() for n, p in params.items()}, "stats": opt.stats(), "seen": seen}

    return run_local(world, body)


# ---------------------------------------------------------------- the warm-up and exact averaging are torch's SGD


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("world", WORLDS)
def test_the_warmup_is_torch_sgd_on_the_averaged_gradient_bit_for_bit(world: int, variant: str) -> None:
    ref = sgd_reference(world, 8, variant)
    for r in run(world, 8, variant=variant, codec="onebit", warmup=10):
        for n in SHAPES:
            assert torch.equal(r["params"][n], ref[n]), (n, (r["params"][n] - ref[n]).abs().max().item())
        assert r["stats"]["phase"] == "warmup" and r["stats"]["warmup_steps"] == 10


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("world", WORLDS)
def test_with_exact_averaging_every_step_is_torch_sgd(world: int, variant: str, warmup: int) -> None:
    """The average of the ranks' buffers is SGD's buffer on the mean gradient (linear in the gradients), and the
    Nesterov step recovered from this step's and the last step's averaged buffers is SGD's Nesterov step. On one rank
    the arithmetic is torch's, op for op (Nesterov's excepted); on more the buffers are averaged instead of the
    gradients: fp32 rounding apart."""
    ref = sgd_reference(world, 10, variant)
    for r in run(world, 10, variant=variant, codec="none", warmup=warmup):
        assert r["stats"]["phase"] == "compressed"
        for n in SHAPES:
            if world == 1 and variant != "nesterov":
                assert torch.equal(r["params"][n], ref[n]), n
            else:
                torch.testing.assert_close(r["params"][n], ref[n], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world", [1, 2])
def test_parameters_without_a_gradient_are_skipped_as_sgd_skips_them(world: int) -> None:
    ref = sgd_reference(world, 5, "dampening", skip=("b1",))

    def body(tr: Any) -> tuple[dict[str, torch.Tensor], bool]:
        params = params_of(initial())
        opt = make(tr, params, "dampening", codec="none", warmup=10)
        for step in range(5):
            set_grads(params, tr.rank, step, skip=("b1",))
            opt.step()
        opt.close()
        return {n: p.detach().clone() for n, p in params.items()}, params["b1"] in opt.state

    for got, has_state in run_local(world, body):
        assert not has_state
        assert torch.equal(got["b1"], initial()["b1"])
        for n in SHAPES:
            assert torch.equal(got[n], ref[n]), n


def test_a_parameter_first_stepped_after_the_warmup_starts_its_buffer_as_sgd_does() -> None:
    """'b2' gets its first gradient at a compressed step: its buffer is that step's (dampened or not) gradient."""
    world = 2

    def body(tr: Any) -> torch.Tensor:
        params = params_of(initial())
        opt = make(tr, params, "dampening", codec="none", warmup=2)
        for step in range(6):
            set_grads(params, tr.rank, step, skip=("b2",) if step < 3 else ())
            opt.step()
        opt.close()
        return params["b2"].detach().clone()

    p = torch.nn.Parameter(initial()["b2"].clone())
    ref = torch.optim.SGD([p], **VARIANTS["dampening"], foreach=False)
    for step in range(3, 6):
        p.grad = mean_grad("b2", world, step)
        ref.step()
    for got in run_local(world, body):
        torch.testing.assert_close(got, p.detach(), rtol=1e-6, atol=1e-7)


def test_parameter_groups_keep_their_own_hyperparameters() -> None:
    """Each group's lr, momentum, Nesterov and weight decay, as torch.optim.SGD's groups (exact averaging)."""
    world, own = 2, {"lr": 0.05, "momentum": 0.5, "nesterov": False, "weight_decay": 0.0}

    def groups(params: dict[str, Any], named: bool) -> list[dict[str, Any]]:
        first = [(n, params[n]) if named else params[n] for n in ("w1", "b1")]
        second = [(n, params[n]) if named else params[n] for n in ("w2", "b2")]
        return [{"params": first}, {"params": second, **own}]

    def body(tr: Any) -> dict[str, torch.Tensor]:
        params = params_of(initial())
        opt = CompressedSGD(groups(params, True), **VARIANTS["nesterov"], transport=tr, codec="none", warmup=2)
        assert [n for n, _ in opt._named] == list(SHAPES)
        for step in range(6):
            set_grads(params, tr.rank, step)
            opt.step()
        opt.close()
        return {n: p.detach().clone() for n, p in params.items()}

    params = params_of(initial())
    ref = torch.optim.SGD(groups(params, False), **VARIANTS["nesterov"], foreach=False)
    for step in range(6):
        for n, p in params.items():
            p.grad = mean_grad(n, world, step)
        ref.step()
    for got in run_local(world, body):
        for n in SHAPES:
            torch.testing.assert_close(got[n], params[n].detach(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"CompressedSGD: param_groups\[1\]: momentum must be > 0, got 0"):
        CompressedSGD([{"params": [params["w1"]]}, {"params": [params["w2"]], "momentum": 0}], lr=0.1,
                      transport=one_rank(), warmup=1)  # fmt: skip


# ---------------------------------------------------------------- compressed


@pytest.mark.parametrize("codec", [*EF_CODECS, "fp16", "none"])
@pytest.mark.parametrize("world", WORLDS)
def test_replicas_stay_identical_and_the_compressed_steps_send_less(codec: str, world: int) -> None:
    for variant in ("momentum", "nesterov"):
        results = run(world, 8, variant=variant, codec=codec, warmup=2)
        for r in results[1:]:
            for n in SHAPES:
                assert torch.equal(r["params"][n], results[0]["params"][n]), (codec, variant, n)
        for r in results:
            for n in SHAPES:
                assert torch.isfinite(r["params"][n]).all()
            last = r["stats"]["last_step"]
            # qsgd and topk all-gather: on these small tensors at 4 ranks they send about what fp32 does
            if (world == 2 and codec != "none") or (world > 1 and codec in ("onebit", "sign", "fp16")):
                assert 0 < last["bytes_sent"] < last["bytes_uncompressed"], (codec, last)
            if world == 1:
                assert r["stats"]["bytes_sent"] == 0


def test_the_buffer_is_the_average_on_every_rank_and_moves_after_the_warmup() -> None:
    def observe(opt: CompressedSGD, params: dict[str, Any], step: int) -> Any:
        return {n: opt.state[p]["momentum_buffer"].clone() for n, p in params.items()}

    results = run(2, 6, observe, codec="onebit", warmup=2)
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


def test_bytes_are_counted_as_the_algorithms_count_them() -> None:
    world, numel = 2, sum(torch.Size(s).numel() for s in SHAPES.values())
    stats = run(world, 4, codec="onebit", warmup=2)[0]["stats"]
    ring = 2 * (world - 1) * 4 * numel // world  # the fp32 all-reduce of every gradient, per step
    assert stats["bytes_uncompressed"] == 4 * ring
    assert stats["bytes_sent"] > 2 * ring  # two fp32 warm-up steps and two compressed ones
    assert stats["compression_ratio"] == stats["bytes_uncompressed"] / stats["bytes_sent"]
    assert stats["warmup_steps"] == 2 and stats["step"] == 4 and stats["skipped_nonfinite"] == 0


def test_memory_counts_the_buffers_and_the_compression_state() -> None:
    def body(tr: Any) -> tuple[int, int]:
        params = params_of(initial())
        opt = make(tr, params, codec="onebit", warmup=1)
        for step in range(3):
            set_grads(params, tr.rank, step)
            opt.step()
        held = sum(4 * p.numel() + 4 for p in params.values())  # fp32 buffers and step counts
        out = opt.memory_bytes(), held + opt.algorithm.memory_bytes()
        opt.close()
        return out

    for got, want in run_local(2, body):
        assert got == want


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("variant", ["momentum", "nesterov"])
@pytest.mark.parametrize("at", [1, 5], ids=["in-warmup", "compressed"])
@pytest.mark.parametrize("codec", EF_CODECS)
@pytest.mark.parametrize("world", [2, 4])
def test_a_resumed_run_is_bit_identical(codec: str, world: int, at: int, variant: str) -> None:
    steps = 9

    def body(tr: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        params = params_of(initial())
        opt = make(tr, params, variant, codec=codec, warmup=3)
        ckpt = None
        for step in range(steps):
            if step == at:
                ckpt = snapshot({"params": {n: p.detach() for n, p in params.items()}, "opt": opt.state_dict()})
            set_grads(params, tr.rank, step)
            opt.step()
        opt.close()
        whole = {n: p.detach().clone() for n, p in params.items()}
        assert ckpt is not None
        resumed = params_of(ckpt["params"])
        opt2 = make(tr, resumed, variant, codec=codec, warmup=3)  # a fresh optimizer
        opt2.load_state_dict(ckpt["opt"])
        for step in range(at, steps):
            set_grads(resumed, tr.rank, step)
            opt2.step()
        opt2.close()
        return whole, {n: p.detach().clone() for n, p in resumed.items()}

    for whole, resumed in run_local(world, body):
        for n in SHAPES:
            assert torch.equal(whole[n], resumed[n]), (codec, n)


def test_a_checkpoint_that_does_not_fit_is_refused_on_every_rank() -> None:
    def body(tr: Any) -> str:
        params = params_of(initial())
        opt = make(tr, params, codec="onebit", warmup=2)
        for step in range(3):
            set_grads(params, tr.rank, step)
            opt.step()
        ckpt = snapshot(opt.state_dict())
        assert set(ckpt["state"][0]) == {"step", "momentum_buffer"}
        other = make(tr, params_of(initial()), codec="sign", warmup=2)
        with pytest.raises(ValueError, match="checkpoint is for 'onebit', not 'sign'"):
            other.load_state_dict(ckpt)
        bad = snapshot(ckpt)
        bad["sylvie_comm"]["phase"] = "warmup"
        with pytest.raises(ValueError, match="phase 'warmup' does not fit its step 3"):
            opt.load_state_dict(bad)
        bad = snapshot(ckpt)
        bad["state"][0]["momentum_buffer"] = torch.zeros(3)
        with pytest.raises(ValueError, match=r"momentum_buffer of parameter 'w1' is \(3,\), expected a tensor of"):
            opt.load_state_dict(bad)
        bad = snapshot(ckpt)
        bad["state"][1]["momentum_buffer"][0] = float("nan")
        with pytest.raises(ValueError, match="momentum_buffer of parameter 'b1' holds NaN or Inf"):
            opt.load_state_dict(bad)
        # CompressedAdamW's checkpoint of the same codec and warm-up: its compression state fits, its moments do not
        adam_params = params_of(initial())
        adam = CompressedAdamW(list(adam_params.items()), transport=tr, codec="onebit", warmup=2)
        for step in range(3):
            set_grads(adam_params, tr.rank, step)
            adam.step()
        adam_message = r"'w1' holds exp_avg, exp_avg_sq, freeze_step, step; expected momentum_buffer and step \(a Co"
        with pytest.raises(ValueError, match=adam_message):
            opt.load_state_dict(snapshot(adam.state_dict()))
        opt.load_state_dict(ckpt)  # nothing was loaded by the refused ones: the good one still loads
        for o in (opt, other, adam):
            o.close()
        return "ok"

    assert run_local(2, body) == ["ok", "ok"]


# ---------------------------------------------------------------- non-finite gradients


def full_state(opt: CompressedSGD, params: dict[str, torch.nn.Parameter]) -> dict[str, Any]:
    return snapshot({"params": {n: p.detach() for n, p in params.items()}, "opt": opt.state_dict()})


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("bad_step", [1, 4], ids=["warmup", "compressed"])
@pytest.mark.parametrize("codec", ["onebit", "none", "topk", "qsgd"])
@pytest.mark.parametrize("world", WORLDS)
def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(
    codec: str, world: int, bad_step: int, bad: float
) -> None:
    def body(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = make(tr, params, "nesterov", codec=codec, warmup=3)
        before = after = None
        for step in range(7):
            set_grads(params, tr.rank, step)
            if step == bad_step:
                if tr.rank == world - 1:
                    params["w1"].grad[2, 3] = bad  # type: ignore[index]
                before = full_state(opt, params)
            opt.step()
            if step == bad_step:
                after = full_state(opt, params)
        opt.close()
        final = {n: p.detach().clone() for n, p in params.items()}
        return {"before": before, "after": after, "final": final, "stats": opt.stats()}

    results = run_local(world, body)
    for r in results:
        before, after = r["before"], r["after"]
        after["opt"]["sylvie_comm"]["step"] -= 1  # the step was taken (and skipped) by every rank
        if bad_step < 3:  # a skipped warm-up step does not count towards the warm-up
            after["opt"]["sylvie_comm"]["warmup_skipped"] -= 1
        after["opt"]["sylvie_comm"]["phase"] = before["opt"]["sylvie_comm"]["phase"]
        assert_same(before, after)
        assert r["stats"]["skipped_nonfinite"] == 1
        assert all(torch.isfinite(t).all() for t in r["final"].values())
        for n in SHAPES:
            assert torch.equal(r["final"][n], results[0]["final"][n])


def test_a_skipped_first_step_leaves_no_buffer_behind() -> None:
    """With dampening the first taken step sets the buffer to the gradient (torch.optim.SGD's None buffer): a
    first step skipped for a NaN leaves the step count at 0, so the next taken step is that first step."""

    def body(tr: Any, skip_first: bool) -> dict[str, torch.Tensor]:
        params = params_of(initial())
        opt = make(tr, params, "dampening", codec="onebit", warmup=2)
        for step in range(6):
            if step == 0 and not skip_first:
                continue
            set_grads(params, tr.rank, step)
            if step == 0:
                params["w1"].grad[0, 0] = float("nan")  # type: ignore[index]
            opt.step()
        opt.close()
        return {n: p.detach().clone() for n, p in params.items()}

    for g, w in zip(run_local(2, lambda tr: body(tr, True)), run_local(2, lambda tr: body(tr, False)), strict=True):
        for n in SHAPES:
            assert torch.equal(g[n], w[n]), n


@pytest.mark.parametrize("world", [1, 2])
def test_grad_scaler_steps_every_rank_and_a_local_overflow_skips_everywhere(world: int) -> None:
    """torch.amp.GradScaler calls step() on every rank (``_step_supports_amp_scaling``); the gradients are
    unscaled inside it (a power of two: the same bits as unscaled gradients), and one rank's overflow skips
    the step on every rank."""
    bad_step, steps = 3, 6

    def body(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = make(tr, params, codec="onebit", warmup=2)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
        for step in range(steps):
            scaler.scale(torch.ones(()))  # sets the scaler up as a scaled loss would
            scale = scaler.get_scale()
            set_grads(params, tr.rank, step)
            for p in params.values():
                p.grad.mul_(scale)  # type: ignore[union-attr]
            if step == bad_step and tr.rank == world - 1:
                params["w2"].grad[0, 0] = float("inf")  # type: ignore[index]
            scaler.step(opt)
            scaler.update()
        opt.close()
        return {"params": {n: p.detach().clone() for n, p in params.items()}, "stats": opt.stats()}

    def plain(tr: Any) -> dict[str, torch.Tensor]:
        params = params_of(initial())
        opt = make(tr, params, codec="onebit", warmup=2)
        for step in range(steps):
            set_grads(params, tr.rank, step)
            if step == bad_step:
                params["w2"].grad[0, 0] = float("nan")  # type: ignore[index]
            opt.step()
        opt.close()
        return {n: p.detach().clone() for n, p in params.items()}

    scaled, unscaled = run_local(world, body), run_local(world, plain)
    for s, u in zip(scaled, unscaled, strict=True):
        assert s["stats"]["skipped_nonfinite"] == 1
        for n in SHAPES:
            assert torch.equal(s["params"][n], u[n]), n


@pytest.mark.parametrize("route", ["nonfinite", "scaler"])
@pytest.mark.parametrize("skipped", [(0, 1, 2), (2, 3)], ids=["all-warmup", "at-the-end-of-the-warmup"])
def test_skipped_steps_do_not_count_towards_the_warmup(skipped: tuple[int, ...], route: str) -> None:
    """The momenta start compressing after ``warmup`` steps *taken*: a run whose warm-up steps are skipped is, bit
    for bit, the run without those steps."""
    steps = 8

    def skipping(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = make(tr, params, codec="onebit", warmup=3)
        scaler = None if route == "nonfinite" else torch.amp.GradScaler("cpu", init_scale=2.0**16)
        for step in range(steps):
            set_grads(params, tr.rank, step)
            if scaler is not None:
                scaler.scale(torch.ones(()))
                for p in params.values():
                    p.grad.mul_(scaler.get_scale())  # type: ignore[union-attr]
            if step in skipped and (route == "scaler" or tr.rank == 0):
                params["w1"].grad[2, 3] = float("nan") if route == "nonfinite" else float("inf")  # type: ignore[index]
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
        out = {"params": {n: p.detach().clone() for n, p in params.items()}, "stats": opt.stats()}
        opt.close()
        return out

    def without(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = make(tr, params, codec="onebit", warmup=3)
        for step in range(steps):
            if step not in skipped:
                set_grads(params, tr.rank, step)
                opt.step()
        out = {"params": {n: p.detach().clone() for n, p in params.items()}, "stats": opt.stats()}
        opt.close()
        return out

    for g, w in zip(run_local(2, skipping), run_local(2, without), strict=True):
        for n in SHAPES:
            assert torch.isfinite(g["params"][n]).all(), n
            assert torch.equal(g["params"][n], w["params"][n]), n
        assert g["stats"]["phase"] == "compressed"
        assert g["stats"]["skipped_nonfinite"] == len(skipped)
        assert g["stats"]["warmup_skipped"] == len(skipped)  # each fell in the warm-up, which it prolonged


# ---------------------------------------------------------------- which parameters have a gradient


@pytest.mark.parametrize(("at", "warmup"), [(0, 2), (1, 4), (3, 2)], ids=["first-step", "warmup", "compressed"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_gradient_missing_on_one_rank_is_a_value_error_on_every_rank(world: int, at: int, warmup: int) -> None:
    """Ranks that would send payloads of different sizes agree first: a ValueError on every rank names the parameter
    and the ranks with and without its gradient; the step they disagreed in changed nothing."""
    missing, lacking, steps = "w2", world - 1, 6

    def body(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = make(tr, params, codec="onebit", warmup=warmup)
        before, error = None, None
        try:
            for step in range(steps):
                if step == at:
                    before = {n: p.detach().clone() for n, p in params.items()}
                set_grads(params, tr.rank, step, skip=(missing,) if tr.rank == lacking and step >= at else ())
                opt.step()
        except ValueError as exc:
            error = str(exc)
        after = {n: p.detach().clone() for n, p in params.items()}
        opt.close()
        return {"error": error, "before": before, "after": after}

    for r in run_local(world, body):
        msg = r["error"]
        assert msg is not None
        assert msg.startswith("CompressedSGD[onebit] step: parameter 'w2' has a gradient on rank"), msg
        assert f"but none (grad None) on rank {lacking}" in msg and "every rank must hold gradients" in msg
        for n in SHAPES:
            assert torch.equal(r["after"][n], r["before"][n]), n


# ---------------------------------------------------------------- configuration


SGD = "CompressedSGD: "


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, SGD + "lr must be a finite number >= 0, got -1.0"),
        ({"lr": float("nan")}, SGD + "lr must be a finite number >= 0, got nan"),
        ({"momentum": 0.0}, SGD + "momentum must be > 0, got 0.0: without momentum there is nothing to average but "
                            r"the gradient; compress the gradient with a DDP comm hook \(sylvie_comm.ddp.register\)"),
        ({"momentum": -0.5}, SGD + r"momentum must be a number in \(0, 1\), got -0.5"),
        ({"momentum": 1.0}, SGD + r"momentum must be a number in \(0, 1\), got 1.0"),
        ({"dampening": 1.0, "nesterov": False}, SGD + r"dampening must be a number in \[0, 1\), got 1.0"),
        ({"dampening": 0.1}, SGD + r"nesterov=True requires dampening 0, got 0.1"),
        ({"nesterov": 1}, SGD + "nesterov must be True or False, got 1"),
        ({"weight_decay": -0.1}, SGD + "weight_decay must be a finite number >= 0, got -0.1"),
        ({"codec": "zstd"}, SGD + "codec 'zstd' cannot average the momentum; valid: bf16, fp16, none, onebit, qsgd"),
        ({"codec": "powersgd"}, SGD + "codec 'powersgd' cannot average the momentum; valid: .*; the low-rank"),
        ({"warmup": -1}, SGD + "warmup must be an integer >= 0, got -1"),
        ({"warmup": 1.5}, SGD + "warmup must be an integer >= 0, got 1.5"),
        ({"warmup": None}, SGD + r"pass warmup= \(the steps of SGD on the fp32-averaged gradient before the momenta "
                           r"compress\) or total_steps= \(warm-up 0.05 of them"),
        ({"warmup": None, "total_steps": 0}, SGD + "total_steps must be an integer >= 1, got 0"),
        ({"warmup": None, "total_steps": 9, "warmup_fraction": 0}, SGD + r"warmup_fraction must be a number in \(0, 1"),
        ({"chunk_size": 7}, "chunk_size"),
        ({"ratio": 0.1}, "onebit: unknown option"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_with_the_rule(kwargs: dict[str, Any], message: str) -> None:
    kw = {"warmup": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        make(one_rank(), params_of(initial()), **kw)


def test_the_warmup_defaults_to_a_twentieth_of_the_run() -> None:
    assert make(one_rank(), params_of(initial()), warmup=None, total_steps=300).warmup == 15
    assert make(one_rank(), params_of(initial()), warmup=None, total_steps=5).warmup == 1
    assert make(one_rank(), params_of(initial()), warmup=None, total_steps=10, warmup_fraction=0.5).warmup == 5
    assert make(one_rank(), params_of(initial()), warmup=0).phase == "compressed"


def test_parameters_and_transports_it_cannot_use_are_refused() -> None:
    with pytest.raises(TypeError, match="CompressedSGD: parameter 'x' is float64"):
        CompressedSGD([("x", torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)))], lr=0.1, transport=one_rank(),
                      warmup=1)  # fmt: skip
    with pytest.raises(TypeError, match="CompressedSGD: transport must be a sylvie_comm Transport"):
        CompressedSGD(params_of(initial()).values(), lr=0.1, transport=object(), warmup=1)  # type: ignore[arg-type]
    opt = make(one_rank(), params_of(initial()), warmup=1)
    with pytest.raises(RuntimeError, match="CompressedSGD: parameter groups cannot be added after construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_ranks_that_disagree_fail_fast_on_every_rank() -> None:
    def nesterov_on_one(tr: Any) -> str:
        try:
            make(tr, params_of(initial()), "momentum", warmup=2, nesterov=tr.rank == 1)
        except ValueError as exc:
            return str(exc)
        return "built"

    for msg in run_local(2, nesterov_on_one):
        assert "'optimizer.nesterov' is False on rank 0 but True on rank 1" in msg, msg

    def bad_momentum(tr: Any) -> str:
        try:
            make(tr, params_of(initial()), warmup=2, momentum=0.0 if tr.rank == 1 else 0.9)
        except ValueError as exc:
            return str(exc)
        return "built"

    r0, r1 = run_local(2, bad_momentum)
    assert "rank 1 could not set up" in r0 and "momentum must be > 0" in r0
    assert "CompressedSGD: momentum must be > 0, got 0.0" in r1


# ---------------------------------------------------------------- devices


@pytest.mark.parametrize("variant", ["nesterov", "dampening"])
@pytest.mark.parametrize("codec", ["onebit", "none"])
def test_every_buffer_follows_the_parameters_device(codec: str, variant: str) -> None:
    """On the ``meta`` device a buffer made on the CPU, or a value read on the host, fails."""
    meta = torch.device("meta")

    def body(tr: Any) -> list[torch.device]:
        params = params_of(initial(), meta)
        opt = make(tr, params, variant, codec=codec, warmup=2)
        for _ in range(5):
            for p in params.values():
                p.grad = torch.empty_like(p)
            opt.step()
        state = opt.state_dict()
        opt.close()
        devices = [t.device for s in state["state"].values() for t in s.values()]
        devices += [t.device for s in state["sylvie_comm"]["params"].values() for t in s.values()]
        return devices + [p.device for p in params.values()]

    for devices in run_local(2, body):
        assert devices and all(d == meta for d in devices), set(devices)


def test_bf16_parameters_step_in_their_dtype_and_stay_identical() -> None:
    def body(tr: Any) -> dict[str, torch.Tensor]:
        params = {n: torch.nn.Parameter(v.to(torch.bfloat16)) for n, v in initial().items()}
        opt = make(tr, params, codec="onebit", warmup=2)
        for step in range(5):
            for n, p in params.items():
                p.grad = grad(n, tr.rank, step).to(torch.bfloat16)
            opt.step()
        assert all(opt.state[p]["momentum_buffer"].dtype == torch.bfloat16 for p in params.values())
        opt.close()
        return {n: p.detach().clone() for n, p in params.items()}

    r0, r1 = run_local(2, body)
    for n in SHAPES:
        assert r0[n].dtype == torch.bfloat16 and torch.isfinite(r0[n].float()).all()
        assert torch.equal(r0[n], r1[n]), n
