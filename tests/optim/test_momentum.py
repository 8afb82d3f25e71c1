"""What CompressedAdamW and CompressedSGD share (their base, MomentumOptimizer), each test run on both, in one process
with ranks as threads of the in-process transport, at 1, 2 and 4 ranks.

Replicas stay identical with every codec and the compressed steps send less; the bytes are counted as the algorithms
count them; a resumed run is bit-identical; a checkpoint of another codec or phase is refused; a non-finite gradient
on one rank, or an overflow under GradScaler, skips the step on every rank with every state tensor as it was, and a
skipped step does not count towards the warm-up; a gradient missing on one rank is a ValueError on every rank; bad
arguments, parameters and transports are refused with the rule; the warm-up defaults to a fraction of the run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.collectives.local import run_local
from tests.optim.common import (
    BOTH,
    BOTH_SGD_VARIANTS,
    EF_CODECS,
    OPTIMIZERS,
    SHAPES,
    WORLDS,
    Optimizer,
    assert_same,
    detached,
    full_state,
    initial,
    one_rank,
    params_of,
    resumed_run,
    run,
    run_missing,
    set_grads,
    snapshot,
    stepped,
)

# ---------------------------------------------------------------- compressed


@pytest.mark.parametrize("optimizer", BOTH_SGD_VARIANTS)
@pytest.mark.parametrize("codec", [*EF_CODECS, "fp16", "none"])
@pytest.mark.parametrize("world", WORLDS)
def test_replicas_stay_identical_and_the_compressed_steps_send_less(
    codec: str, world: int, optimizer: Optimizer
) -> None:
    results = run(optimizer.make, world, 8, codec=codec, warmup=2)
    for r in results[1:]:
        for n in SHAPES:
            assert torch.equal(r["params"][n], results[0]["params"][n]), (codec, n)
    for r in results:
        for n in SHAPES:
            assert torch.isfinite(r["params"][n]).all()
        last = r["stats"]["last_step"]
        # qsgd and topk all-gather: on these small tensors at 4 ranks they send about what fp32 does
        if (world == 2 and codec != "none") or (world > 1 and codec in ("onebit", "sign", "fp16")):
            assert 0 < last["bytes_sent"] < last["bytes_uncompressed"], (codec, last)
        if world == 1:
            assert r["stats"]["bytes_sent"] == 0


@pytest.mark.parametrize("optimizer", BOTH)
def test_bytes_are_counted_as_the_algorithms_count_them(optimizer: Optimizer) -> None:
    world, numel = 2, sum(torch.Size(s).numel() for s in SHAPES.values())
    stats = run(optimizer.make, world, 4, codec="onebit", warmup=2)[0]["stats"]
    ring = 2 * (world - 1) * 4 * numel // world  # the fp32 all-reduce of every gradient, per step
    assert stats["bytes_uncompressed"] == 4 * ring
    assert stats["bytes_sent"] > 2 * ring  # two fp32 warm-up steps and two compressed ones
    assert stats["compression_ratio"] == stats["bytes_uncompressed"] / stats["bytes_sent"]
    assert stats["warmup_steps"] == 2 and stats["step"] == 4 and stats["skipped_nonfinite"] == 0


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("optimizer", BOTH_SGD_VARIANTS)
@pytest.mark.parametrize("at", [1, 5], ids=["in-warmup", "compressed"])
@pytest.mark.parametrize("codec", EF_CODECS)
@pytest.mark.parametrize("world", [2, 4])
def test_a_resumed_run_is_bit_identical(codec: str, world: int, at: int, optimizer: Optimizer) -> None:
    for whole, resumed, _ in run_local(world, lambda tr: resumed_run(tr, optimizer.make, 9, at, codec=codec, warmup=3)):
        for n in SHAPES:
            assert torch.equal(whole[n], resumed[n]), (codec, n)


@pytest.mark.parametrize("optimizer", BOTH)
def test_a_checkpoint_of_another_codec_or_phase_is_refused_on_every_rank(optimizer: Optimizer) -> None:
    def body(tr: Any) -> str:
        _, opt = stepped(tr, optimizer.make, 3, codec="onebit", warmup=2)
        ckpt = snapshot(opt.state_dict())
        other = optimizer.make(tr, params_of(initial()), codec="sign", warmup=2)
        with pytest.raises(ValueError, match="checkpoint is for 'onebit', not 'sign'"):
            other.load_state_dict(ckpt)
        bad = snapshot(ckpt)
        bad["sylvie_comm"]["phase"] = "warmup"
        with pytest.raises(ValueError, match="phase 'warmup' does not fit its step 3"):
            opt.load_state_dict(bad)
        opt.load_state_dict(ckpt)  # nothing was loaded by the refused ones: the good one still loads
        opt.close()
        other.close()
        return "ok"

    assert run_local(2, body) == ["ok", "ok"]


# What each optimizer says of the other's checkpoint: of its per-parameter state (a stepped one) and of its
# parameter groups' hyperparameters (one saved before any step holds no state).
OTHERS_STATE = {
    "adamw": r"'w1' holds momentum_buffer, step; expected exp_avg, exp_avg_sq and step, with or without freeze_step "
    r"\(a CompressedAdamW checkpoint\)",
    "sgd": r"'w1' holds exp_avg, exp_avg_sq, freeze_step, step; expected momentum_buffer and step \(a CompressedSGD "
    r"checkpoint\)",
}
OTHERS_GROUPS = {
    "adamw": r"param_groups\[0\] has no betas, eps, denom_floor \(it holds dampening, lr, momentum, nesterov, "
    r"weight_decay\); expected CompressedAdamW's hyperparameters lr, betas, eps, weight_decay, denom_floor",
    "sgd": r"param_groups\[0\] has no momentum, dampening, nesterov \(it holds betas, denom_floor, eps, lr, "
    r"weight_decay\); expected CompressedSGD's hyperparameters lr, momentum, dampening, weight_decay, nesterov",
}


@pytest.mark.parametrize(("name", "other"), [("adamw", "sgd"), ("sgd", "adamw")], ids=["adamw", "sgd"])
def test_the_other_optimizers_checkpoint_is_refused_naming_its_state_on_every_rank(name: str, other: str) -> None:
    """CompressedAdamW and CompressedSGD of the same codec and warm-up: the compression state of one's checkpoint
    fits the other, its torch.optim state and hyperparameters do not (loaded, the first step would fail on a
    missing key: KeyError 'betas')."""
    optimizer, theirs = OPTIMIZERS[name], OPTIMIZERS[other]

    def body(tr: Any) -> str:
        params, opt = stepped(tr, optimizer.make, 3, codec="onebit", warmup=2)
        ckpt = snapshot(opt.state_dict())
        _, stepped_other = stepped(tr, theirs.make, 3, codec="onebit", warmup=2)
        with pytest.raises(ValueError, match=OTHERS_STATE[name]):
            opt.load_state_dict(snapshot(stepped_other.state_dict()))
        _, fresh_other = stepped(tr, theirs.make, 0, codec="onebit", warmup=2)
        fresh_params, fresh = stepped(tr, optimizer.make, 0, codec="onebit", warmup=2)
        with pytest.raises(ValueError, match=OTHERS_GROUPS[name]):
            fresh.load_state_dict(snapshot(fresh_other.state_dict()))
        set_grads(fresh_params, tr.rank, 0)
        fresh.step()  # its own hyperparameters are still there
        opt.load_state_dict(ckpt)  # nothing was loaded by the refused ones: the good one still loads and steps
        set_grads(params, tr.rank, 3)
        opt.step()
        for o in (opt, stepped_other, fresh_other, fresh):
            o.close()
        return "ok"

    assert run_local(2, body) == ["ok", "ok"]


# ---------------------------------------------------------------- non-finite gradients and skipped steps


@pytest.mark.parametrize("optimizer", BOTH)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("bad_step", [1, 4], ids=["warmup", "compressed"])
@pytest.mark.parametrize("codec", ["onebit", "none", "topk", "qsgd"])
@pytest.mark.parametrize("world", WORLDS)
def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(
    codec: str, world: int, bad_step: int, bad: float, optimizer: Optimizer
) -> None:
    def body(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = optimizer.make(tr, params, codec=codec, warmup=3)
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
        return {"before": before, "after": after, "final": detached(params), "stats": opt.stats()}

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


@pytest.mark.parametrize("optimizer", BOTH)
@pytest.mark.parametrize("world", [1, 2])
def test_grad_scaler_steps_every_rank_and_a_local_overflow_skips_everywhere(world: int, optimizer: Optimizer) -> None:
    """torch.amp.GradScaler calls step() on every rank (``_step_supports_amp_scaling``); the gradients are
    unscaled inside it (a power of two: the same bits as unscaled gradients), and one rank's overflow skips
    the step on every rank."""
    bad_step, steps = 3, 6

    def body(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = optimizer.make(tr, params, codec="onebit", warmup=2)
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
        return {"params": detached(params), "stats": opt.stats()}

    def plain(tr: Any) -> dict[str, torch.Tensor]:
        params = params_of(initial())
        opt = optimizer.make(tr, params, codec="onebit", warmup=2)
        for step in range(steps):
            set_grads(params, tr.rank, step)
            if step == bad_step:
                params["w2"].grad[0, 0] = float("nan")  # type: ignore[index]
            opt.step()
        opt.close()
        return detached(params)

    scaled, unscaled = run_local(world, body), run_local(world, plain)
    for s, u in zip(scaled, unscaled, strict=True):
        assert s["stats"]["skipped_nonfinite"] == 1
        for n in SHAPES:
            assert torch.equal(s["params"][n], u[n]), n


def run_skipping(tr: Any, optimizer: Optimizer, steps: int, skipped: tuple[int, ...], route: str,
                 **kw: Any) -> dict[str, Any]:  # fmt: skip
    """``steps`` steps whose ``skipped`` ones are not finite: NaN in one rank's gradient (``nonfinite``), or an
    overflow on every rank under GradScaler, which calls step() (``scaler``) or not (``not_called``: without
    ``_step_supports_amp_scaling`` GradScaler unscales itself and does not call step() on a step that overflowed)."""
    params = params_of(initial())
    cls = optimizer.cls
    if route == "not_called":
        cls = type(f"{cls.__name__}SkippedByTheScaler", (cls,), {"_step_supports_amp_scaling": False})
    opt = cls(list(params.items()), **{**optimizer.hyper, **kw}, transport=tr)
    scaler = None if route == "nonfinite" else torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1000)
    for step in range(steps):
        set_grads(params, tr.rank, step)
        if scaler is not None:
            scaler.scale(torch.ones(()))  # sets the scaler up as a scaled loss would
            for p in params.values():
                p.grad.mul_(scaler.get_scale())  # type: ignore[union-attr]
        if step in skipped:
            if route == "nonfinite":
                if tr.rank == tr.world_size - 1:
                    params["w1"].grad[2, 3] = float("nan")  # type: ignore[index]
            else:  # a scale too large for the gradients: they overflow on every rank
                params["w2"].grad[0, 0] = float("inf")  # type: ignore[index]
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    out = {"params": detached(params), "stats": opt.stats(), "state": {n: opt.state[p] for n, p in params.items()}}
    opt.close()
    return snapshot(out)


def run_without(tr: Any, optimizer: Optimizer, steps: int, skipped: tuple[int, ...], **kw: Any) -> dict[str, Any]:
    """The same run with the ``skipped`` steps left out."""
    params = params_of(initial())
    opt = optimizer.make(tr, params, **kw)
    for step in range(steps):
        if step not in skipped:
            set_grads(params, tr.rank, step)
            opt.step()
    out = {"params": detached(params), "stats": opt.stats(), "state": {n: opt.state[p] for n, p in params.items()}}
    opt.close()
    return snapshot(out)


@pytest.mark.parametrize("optimizer", BOTH)
@pytest.mark.parametrize("route", ["nonfinite", "scaler", "not_called"])
@pytest.mark.parametrize("codec", ["onebit", "qsgd"])
@pytest.mark.parametrize("skipped", [(0, 1, 2), (1,), (2, 3)], ids=["all-warmup", "one", "at-the-freeze"])
def test_skipped_steps_do_not_count_towards_the_warmup(
    skipped: tuple[int, ...], codec: str, route: str, optimizer: Optimizer
) -> None:
    """The variance (AdamW) freezes, the momenta start compressing, after ``warmup`` steps *taken*: a run whose
    warm-up steps are skipped (GradScaler's first steps with a large initial scale) is, bit for bit, the run without
    those steps (its parameters and every state tensor: AdamW's variance of three taken steps, frozen), and finite."""
    steps, kw = 8, {"codec": codec, "warmup": 3}
    got = run_local(2, lambda tr: run_skipping(tr, optimizer, steps, skipped, route, **kw))
    want = run_local(2, lambda tr: run_without(tr, optimizer, steps, skipped, **kw))
    for g, w in zip(got, want, strict=True):
        for n in SHAPES:
            assert torch.isfinite(g["params"][n]).all(), n
            assert torch.equal(g["params"][n], w["params"][n]), n
        assert_same(g["state"], w["state"])
        assert g["stats"]["phase"] == "compressed"
        skipped_steps = 0 if route == "not_called" else len(skipped)
        assert g["stats"]["skipped_nonfinite"] == skipped_steps
        assert g["stats"]["warmup_skipped"] == skipped_steps  # each fell in the warm-up, which it prolonged


# ---------------------------------------------------------------- which parameters have a gradient


@pytest.mark.parametrize("optimizer", BOTH)
@pytest.mark.parametrize("codec", ["onebit", "topk", "fp16"])
@pytest.mark.parametrize(("at", "warmup"), [(0, 2), (1, 4), (3, 2)], ids=["first-step", "warmup", "compressed"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_gradient_missing_on_one_rank_is_a_value_error_on_every_rank(
    world: int, at: int, warmup: int, codec: str, optimizer: Optimizer
) -> None:
    """Ranks that would send payloads of different sizes (gloo aborts the process) agree first: a ValueError on every
    rank names the parameter and the ranks with and without its gradient; no rank stepped with the others' data."""
    for r in run_missing(optimizer.make, world, "w2", world - 1, at, codec=codec, warmup=warmup):
        msg = r["error"]
        assert msg is not None
        assert msg.startswith(f"{optimizer.cls.what}[{codec}] step: parameter 'w2' has a gradient on rank"), msg
        assert f"but none (grad None) on rank {world - 1}" in msg
        assert "every rank must hold gradients for the same parameters" in msg
        for n in SHAPES:  # the step the ranks disagreed in changed nothing
            assert torch.equal(r["after"][n], r["before"][n]), n


# ---------------------------------------------------------------- configuration


SGD = "CompressedSGD: "
# Per optimizer: arguments it refuses (with warmup=2 unless they set it) and the rule its ValueError states.
BAD_INPUT: dict[str, list[tuple[dict[str, Any], str]]] = {
    "adamw": [
        ({"lr": -1.0}, "lr must be a finite number >= 0, got -1.0"),
        ({"betas": (1.0, 0.999)}, r"betas\[0\] must be a number in \[0, 1\), got 1.0"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\] must be a number in \[0, 1\), got -0.1"),
        ({"betas": (0.9,)}, r"betas must be a pair"),
        ({"eps": -1e-8}, "eps must be a finite number >= 0"),
        ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0"),
        ({"denom_floor": -1}, "denom_floor must be a finite number >= 0"),
        ({"codec": "zstd"}, "codec 'zstd' cannot average the momentum; valid: bf16, fp16, none, onebit, qsgd, sign"),
        ({"codec": "acpsgd"}, "codec 'acpsgd' cannot average the momentum; valid: .*; the low-rank"),
        ({"warmup": -1}, "warmup must be an integer >= 1, got -1"),
        ({"warmup": 0}, "warmup must be an integer >= 1, got 0"),
        ({"warmup": None}, "pass warmup= .* or total_steps="),
        ({"warmup": None, "total_steps": 0}, "total_steps must be an integer >= 1, got 0"),
        ({"warmup": None, "total_steps": 10, "warmup_fraction": 1.5}, r"warmup_fraction must be a number in \(0, 1\]"),
        ({"chunk_size": 7}, "chunk_size"),
        ({"ratio": 0.1}, "onebit: unknown option"),
    ],
    "sgd": [
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
}  # fmt: skip


@pytest.mark.parametrize(
    ("optimizer", "kwargs", "message"),
    [
        pytest.param(OPTIMIZERS[name], kwargs, message, id=f"{name}-{'-'.join(f'{k}={v}' for k, v in kwargs.items())}")
        for name, rules in BAD_INPUT.items()
        for kwargs, message in rules
    ],
)
def test_bad_input_is_refused_with_the_rule(optimizer: Optimizer, kwargs: dict[str, Any], message: str) -> None:
    kw = {"warmup": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        optimizer.make(one_rank(), params_of(initial()), **kw)


@pytest.mark.parametrize(
    ("optimizer", "of_300"),
    [
        pytest.param(OPTIMIZERS["adamw"], 30, id="adamw-a-tenth"),
        pytest.param(OPTIMIZERS["sgd"], 15, id="sgd-a-twentieth"),
    ],
)
def test_the_warmup_defaults_to_a_fraction_of_the_run(optimizer: Optimizer, of_300: int) -> None:
    def warmup(**kw: Any) -> int:
        return optimizer.make(one_rank(), params_of(initial()), warmup=None, **kw).warmup  # type: ignore[no-any-return]

    assert warmup(total_steps=300) == of_300
    assert warmup(total_steps=5) == 1
    assert warmup(total_steps=10, warmup_fraction=0.5) == 5


@pytest.mark.parametrize("optimizer", BOTH)
def test_parameters_and_transports_it_cannot_use_are_refused(optimizer: Optimizer) -> None:
    what = optimizer.cls.what
    with pytest.raises(TypeError, match=f"{what}: parameter 'x' is float64"):
        optimizer.make(one_rank(), {"x": torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))}, warmup=1)
    with pytest.raises(TypeError, match=f"{what}: transport must be a sylvie_comm Transport"):
        optimizer.cls(params_of(initial()).values(), **optimizer.hyper, transport=object(), warmup=1)
    opt = optimizer.make(one_rank(), params_of(initial()), warmup=1)
    with pytest.raises(RuntimeError, match=f"{what}: parameter groups cannot be added after construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
