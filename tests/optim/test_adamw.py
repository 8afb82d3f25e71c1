"""CompressedAdamW in one process, ranks as threads of the in-process transport, at 1, 2 and 4 ranks.

The warm-up is torch.optim.AdamW on the averaged gradient; after it the variance is frozen and, with the
momentum averaged exactly (codec ``none``), every step is the frozen-variance update of the reference below;
replicas stay identical with every codec; a resumed run is bit-identical; a non-finite gradient on one rank
skips the step on every rank with every state tensor as it was.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sylvie_comm.collectives.local import LocalGroup, run_local
from sylvie_comm.optim import DEFAULT_DENOM_FLOOR, CompressedAdamW

WORLDS = [1, 2, 4]
SHAPES = {"w1": (6, 5), "b1": (6,), "w2": (3, 6), "b2": (3,)}
HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
EF_CODECS = ["onebit", "sign", "topk", "qsgd"]


def initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def grad(name: str, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + list(SHAPES).index(name))
    return torch.randn(SHAPES[name], generator=g) * (1 + rank)


def mean_grad(name: str, world: int, step: int) -> torch.Tensor:
    return sum(grad(name, r, step) for r in range(world)) / world  # type: ignore[return-value]


def params_of(values: dict[str, torch.Tensor], device: str | torch.device = "cpu") -> dict[str, torch.nn.Parameter]:
    return {n: torch.nn.Parameter(v.clone().to(device)) for n, v in values.items()}


def make(tr: Any, params: dict[str, torch.nn.Parameter], **kw: Any) -> CompressedAdamW:
    return CompressedAdamW(list(params.items()), **{**HYPER, **kw}, transport=tr)


def set_grads(params: dict[str, torch.nn.Parameter], rank: int, step: int, skip: tuple[str, ...] = ()) -> None:
    for n, p in params.items():
        p.grad = None if n in skip else grad(n, rank, step)


def stepped(tr: Any, steps: int, **kw: Any) -> tuple[dict[str, torch.nn.Parameter], CompressedAdamW]:
    """Parameters and an optimizer (``make``'s options) after ``steps`` steps of this rank's gradients."""
    params = params_of(initial())
    opt = make(tr, params, **kw)
    for step in range(steps):
        set_grads(params, tr.rank, step)
        opt.step()
    return params, opt


def run(world: int, steps: int, observe: Callable[[CompressedAdamW, dict[str, Any], int], Any] | None = None,
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


# ---------------------------------------------------------------- the warm-up is AdamW


def adamw_reference(world: int, steps: int, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    params = params_of(initial())
    opt = torch.optim.AdamW(params.values(), **HYPER)
    for step in range(steps):
        for n, p in params.items():
            p.grad = None if n in skip else mean_grad(n, world, step)
        opt.step()
    return {n: p.detach() for n, p in params.items()}


@pytest.mark.parametrize("world", WORLDS)
def test_a_warmup_over_every_step_is_adamw_on_the_averaged_gradient(world: int) -> None:
    ref = adamw_reference(world, 8)
    for r in run(world, 8, codec="none", warmup=10):
        for n in SHAPES:
            torch.testing.assert_close(r["params"][n], ref[n], rtol=1e-6, atol=1e-7)
        assert r["stats"]["phase"] == "warmup" and r["stats"]["warmup_steps"] == 10


@pytest.mark.parametrize("world", [1, 2])
def test_parameters_without_a_gradient_are_skipped_as_adamw_skips_them(world: int) -> None:
    ref = adamw_reference(world, 5, skip=("b1",))

    def body(tr: Any) -> tuple[dict[str, torch.Tensor], bool]:
        params = params_of(initial())
        opt = make(tr, params, codec="none", warmup=10)
        for step in range(5):
            set_grads(params, tr.rank, step, skip=("b1",))
            opt.step()
        opt.close()
        return {n: p.detach().clone() for n, p in params.items()}, params["b1"] in opt.state

    for got, has_state in run_local(world, body):
        assert not has_state
        assert torch.equal(got["b1"], initial()["b1"])
        for n in SHAPES:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- after the warm-up


def frozen_reference(world: int, steps: int, warmup: int, floor: float) -> dict[str, torch.Tensor]:
    """The frozen-variance update written out in float64: AdamW for ``warmup`` steps, then the momentum of the
    averaged gradients with v and the bias corrections of step ``warmup``."""
    lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
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
    for r in run(world, 10, codec="none", warmup=4, denom_floor=floor):
        for n in SHAPES:
            torch.testing.assert_close(r["params"][n], ref[n], rtol=2e-5, atol=1e-6)
        assert r["stats"]["phase"] == "compressed"


@pytest.mark.parametrize("world", WORLDS)
def test_the_variance_is_frozen_after_the_warmup(world: int) -> None:
    def observe(opt: CompressedAdamW, params: dict[str, Any], step: int) -> Any:
        return {n: (opt.state[p]["exp_avg_sq"].clone(), opt.state[p]["exp_avg"].clone()) for n, p in params.items()}

    for r in run(world, 8, observe, codec="onebit", warmup=3):
        seen = r["seen"]
        for n in SHAPES:
            assert not torch.equal(seen[1][n][0], seen[2][n][0])  # the warm-up moves v
            for later in seen[3:]:
                assert torch.equal(later[n][0], seen[2][n][0]), n  # then v stays
            assert not torch.equal(seen[6][n][1], seen[7][n][1])  # while the momentum moves


@pytest.mark.parametrize("codec", [*EF_CODECS, "fp16", "none"])
@pytest.mark.parametrize("world", WORLDS)
def test_replicas_stay_identical_and_the_compressed_steps_send_less(codec: str, world: int) -> None:
    results = run(world, 8, codec=codec, warmup=2)
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


def test_bytes_are_counted_as_the_algorithms_count_them() -> None:
    world, numel = 2, sum(torch.Size(s).numel() for s in SHAPES.values())
    stats = run(world, 4, codec="onebit", warmup=2)[0]["stats"]
    ring = 2 * (world - 1) * 4 * numel // world  # the fp32 all-reduce of every gradient, per step
    assert stats["bytes_uncompressed"] == 4 * ring
    assert stats["bytes_sent"] > 2 * ring  # two fp32 warm-up steps and two compressed ones
    assert stats["compression_ratio"] == stats["bytes_uncompressed"] / stats["bytes_sent"]
    assert stats["warmup_steps"] == 2 and stats["step"] == 4 and stats["skipped_nonfinite"] == 0


def test_a_parameter_first_stepped_after_the_freeze_takes_adamw_steps() -> None:
    """Its variance was never estimated: it keeps AdamW on the fp32-averaged gradient (sent raw)."""
    world = 2

    def body(tr: Any) -> torch.Tensor:
        params = params_of(initial())
        opt = make(tr, params, codec="onebit", warmup=2)
        for step in range(6):
            set_grads(params, tr.rank, step, skip=("b2",) if step < 3 else ())
            opt.step()
        opt.close()
        return params["b2"].detach().clone()

    p = torch.nn.Parameter(initial()["b2"].clone())
    ref = torch.optim.AdamW([p], **HYPER)
    for step in range(3, 6):
        p.grad = mean_grad("b2", world, step)
        ref.step()
    for got in run_local(world, body):
        torch.testing.assert_close(got, p.detach(), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- resume


def snapshot(state: Any) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("at", [1, 5], ids=["in-warmup", "compressed"])
@pytest.mark.parametrize("codec", ["onebit", "qsgd", "topk", "sign"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_resumed_run_is_bit_identical(codec: str, world: int, at: int) -> None:
    steps = 9

    def body(tr: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        params = params_of(initial())
        opt = make(tr, params, codec=codec, warmup=3)
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
        opt2 = make(tr, resumed, codec=codec, warmup=3)
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
        _, opt = stepped(tr, 3, codec="onebit", warmup=2)
        ckpt = snapshot(opt.state_dict())
        other = make(tr, params_of(initial()), codec="sign", warmup=2)
        with pytest.raises(ValueError, match="checkpoint is for 'onebit', not 'sign'"):
            other.load_state_dict(ckpt)
        ckpt["sylvie_comm"]["phase"] = "warmup"
        with pytest.raises(ValueError, match="phase 'warmup' does not fit its step 3"):
            opt.load_state_dict(ckpt)
        opt.close()
        other.close()
        return "ok"

    assert run_local(2, body) == ["ok", "ok"]


# ---------------------------------------------------------------- non-finite gradients


def full_state(opt: CompressedAdamW, params: dict[str, torch.nn.Parameter]) -> dict[str, Any]:
    return snapshot({"params": {n: p.detach() for n, p in params.items()}, "opt": opt.state_dict()})


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    else:
        assert a == b, where


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("bad_step", [1, 4], ids=["warmup", "compressed"])
@pytest.mark.parametrize("codec", ["onebit", "none", "topk", "qsgd"])
@pytest.mark.parametrize("world", WORLDS)
def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(
    codec: str, world: int, bad_step: int, bad: float
) -> None:
    def body(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = make(tr, params, codec=codec, warmup=3)
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


# ---------------------------------------------------------------- configuration


def one_rank() -> Any:
    return LocalGroup(1).transport(0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
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
)
def test_bad_input_is_refused_with_the_rule(kwargs: dict[str, Any], message: str) -> None:
    kw = {"warmup": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        make(one_rank(), params_of(initial()), **kw)


def test_the_warmup_defaults_to_a_fraction_of_the_run() -> None:
    opt = make(one_rank(), params_of(initial()), warmup=None, total_steps=300)
    assert opt.warmup == 30
    assert make(one_rank(), params_of(initial()), warmup=None, total_steps=5).warmup == 1
    assert make(one_rank(), params_of(initial()), warmup=None, total_steps=10, warmup_fraction=0.5).warmup == 5


def test_parameters_it_cannot_step_are_refused() -> None:
    with pytest.raises(TypeError, match="parameter 'x' is float64"):
        CompressedAdamW([("x", torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)))], transport=one_rank(),
                        warmup=1)  # fmt: skip
    with pytest.raises(TypeError, match="transport must be a sylvie_comm Transport"):
        CompressedAdamW(params_of(initial()).values(), transport=object(), warmup=1)  # type: ignore[arg-type]
    opt = make(one_rank(), params_of(initial()), warmup=1)
    with pytest.raises(RuntimeError, match="cannot be added after construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_ranks_that_disagree_fail_fast_on_every_rank() -> None:
    def body(tr: Any) -> str:
        try:
            make(tr, params_of(initial()), codec="onebit", warmup=4 + tr.rank)
        except ValueError as exc:
            return str(exc)
        return "built"

    for msg in run_local(2, body):
        assert "'warmup_steps' is 4 on rank 0 but 5 on rank 1" in msg, msg

    def bad_lr(tr: Any) -> str:
        try:
            make(tr, params_of(initial()), codec="onebit", warmup=2, lr=-1.0 if tr.rank == 1 else 1e-3)
        except ValueError as exc:
            return str(exc)
        return "built"

    r0, r1 = run_local(2, bad_lr)
    assert "rank 1 could not set up" in r0 and "lr must be" in r0
    assert "lr must be a finite number >= 0" in r1

    def other_shapes(tr: Any) -> str:
        values = initial()
        if tr.rank == 1:
            values["w2"] = torch.zeros(3, 7)
        try:
            make(tr, params_of(values), warmup=2)
        except ValueError as exc:
            return str(exc)
        return "built"

    for msg in run_local(2, other_shapes):
        assert "'optimizer.parameter_digest'" in msg, msg


# ---------------------------------------------------------------- devices


@pytest.mark.parametrize("codec", ["onebit", "none", "qsgd"])
@pytest.mark.parametrize("world", [1, 2])
def test_every_buffer_follows_the_parameters_device(codec: str, world: int) -> None:
    """On the ``meta`` device a buffer made on the CPU, or a value read on the host, fails."""
    meta = torch.device("meta")

    def body(tr: Any) -> list[torch.device]:
        params = params_of(initial(), meta)
        opt = make(tr, params, codec=codec, warmup=2)
        for _ in range(5):
            for p in params.values():
                p.grad = torch.empty_like(p)
            opt.step()
        state = opt.state_dict()
        opt.close()
        devices = [t.device for s in state["state"].values() for t in s.values()]
        devices += [t.device for s in state["sylvie_comm"]["params"].values() for t in s.values()]
        return devices + [p.device for p in params.values()]

    for devices in run_local(world, body):
        assert devices and all(d == meta for d in devices), set(devices)


def test_a_copy_of_the_optimizer_is_not_needed_for_its_state() -> None:
    """state_dict() returns copies of the compression state (a later step does not change a saved checkpoint)."""

    def body(tr: Any) -> bool:
        params, opt = stepped(tr, 3, codec="onebit", warmup=1)
        saved = copy.deepcopy(opt.state_dict()["sylvie_comm"]["params"])
        held = opt.state_dict()["sylvie_comm"]["params"]
        set_grads(params, tr.rank, 3)
        opt.step()
        same = all(torch.equal(held[n][k], saved[n][k]) for n in saved for k in saved[n])
        opt.close()
        return same

    assert all(run_local(2, body))


# ---------------------------------------------------------------- skipped steps and the warm-up


class _SkippedByTheScaler(CompressedAdamW):
    """Without ``_step_supports_amp_scaling`` GradScaler unscales itself and does not call step() at all on a
    step whose gradients overflowed (every rank overflows here, so every rank skips the call)."""

    _step_supports_amp_scaling = False


def run_skipping(tr: Any, steps: int, skipped: tuple[int, ...], route: str, **kw: Any) -> dict[str, Any]:
    """``steps`` steps whose ``skipped`` ones are not finite: NaN in one rank's gradient (``nonfinite``), or an
    overflow on every rank under GradScaler, which calls step() (``scaler``) or not (``not_called``)."""
    params = params_of(initial())
    cls = _SkippedByTheScaler if route == "not_called" else CompressedAdamW
    opt = cls(list(params.items()), **{**HYPER, **kw}, transport=tr)
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
    out = {"params": {n: p.detach().clone() for n, p in params.items()}, "stats": opt.stats(),
           "v": {n: opt.state[p]["exp_avg_sq"].clone() for n, p in params.items()}}  # fmt: skip
    opt.close()
    return out


def run_without(tr: Any, steps: int, skipped: tuple[int, ...], **kw: Any) -> dict[str, Any]:
    """The same run with the ``skipped`` steps left out."""
    params = params_of(initial())
    opt = make(tr, params, **kw)
    for step in range(steps):
        if step not in skipped:
            set_grads(params, tr.rank, step)
            opt.step()
    out = {"params": {n: p.detach().clone() for n, p in params.items()}, "stats": opt.stats(),
           "v": {n: opt.state[p]["exp_avg_sq"].clone() for n, p in params.items()}}  # fmt: skip
    opt.close()
    return out


@pytest.mark.parametrize("route", ["nonfinite", "scaler", "not_called"])
@pytest.mark.parametrize("codec", ["onebit", "qsgd"])
@pytest.mark.parametrize("skipped", [(0, 1, 2), (1,), (2, 3)], ids=["all-warmup", "one", "at-the-freeze"])
def test_skipped_steps_do_not_count_towards_the_warmup(skipped: tuple[int, ...], codec: str, route: str) -> None:
    """The variance freezes after ``warmup`` steps *taken*: a run whose warm-up steps are skipped (GradScaler's
    first steps with a large initial scale) is, bit for bit, the run without those steps, and finite."""
    steps, kw = 8, {"codec": codec, "warmup": 3}
    got = run_local(2, lambda tr: run_skipping(tr, steps, skipped, route, **kw))
    want = run_local(2, lambda tr: run_without(tr, steps, skipped, **kw))
    for g, w in zip(got, want, strict=True):
        for n in SHAPES:
            assert torch.isfinite(g["params"][n]).all(), n
            assert torch.equal(g["params"][n], w["params"][n]), n
            assert torch.equal(g["v"][n], w["v"][n]), n  # the variance of three taken steps, frozen
        assert g["stats"]["phase"] == "compressed"
        assert g["stats"]["skipped_nonfinite"] == (0 if route == "not_called" else len(skipped))


def test_a_parameter_whose_only_warmup_gradient_was_skipped_is_not_frozen() -> None:
    """'b2' has a gradient only in a skipped warm-up step: its variance was never estimated (step 0), so it is not
    frozen with bias corrections of 0 (NaN): it takes AdamW steps, as a parameter first stepped after the freeze."""

    def body(tr: Any, skip_first: bool) -> dict[str, torch.Tensor]:
        params = params_of(initial())
        opt = make(tr, params, codec="onebit", warmup=2)
        for step in range(6):
            if step == 0 and not skip_first:
                continue
            set_grads(params, tr.rank, step, skip=("b2",) if step in (1, 2) else ())
            if step == 0 and tr.rank == 0:
                params["w1"].grad[0, 0] = float("nan")  # type: ignore[index]
            opt.step()
        opt.close()
        return {n: p.detach().clone() for n, p in params.items()}

    got = run_local(2, lambda tr: body(tr, True))
    want = run_local(2, lambda tr: body(tr, False))
    for g, w in zip(got, want, strict=True):
        for n in SHAPES:
            assert torch.isfinite(g[n]).all(), n
            assert torch.equal(g[n], w[n]), n


@pytest.mark.parametrize("at", [2, 6], ids=["in-warmup", "compressed"])
@pytest.mark.parametrize("skipped", [(1,), (0, 1, 2)], ids=["one", "all-warmup"])
def test_a_run_with_skipped_warmup_steps_resumes_bit_identical(skipped: tuple[int, ...], at: int) -> None:
    steps = 9

    def body(tr: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], str]:
        params = params_of(initial())
        opt = make(tr, params, codec="qsgd", warmup=3)
        ckpt = None
        for step in range(steps):
            if step == at:
                ckpt = snapshot({"params": {n: p.detach() for n, p in params.items()}, "opt": opt.state_dict()})
            set_grads(params, tr.rank, step)
            if step in skipped and tr.rank == 0:
                params["b1"].grad[0] = float("nan")  # type: ignore[index]
            opt.step()
        opt.close()
        whole = {n: p.detach().clone() for n, p in params.items()}
        assert ckpt is not None
        resumed = params_of(ckpt["params"])
        opt2 = make(tr, resumed, codec="qsgd", warmup=3)
        opt2.load_state_dict(ckpt["opt"])
        for step in range(at, steps):
            set_grads(resumed, tr.rank, step)
            if step in skipped and tr.rank == 0:
                resumed["b1"].grad[0] = float("nan")  # type: ignore[index]
            opt2.step()
        opt2.close()
        return whole, {n: p.detach().clone() for n, p in resumed.items()}, ckpt["opt"]["sylvie_comm"]["phase"]

    for whole, resumed, phase in run_local(2, body):
        assert phase == ("warmup" if at - len([s for s in skipped if s < at]) < 3 else "compressed")
        for n in SHAPES:
            assert torch.isfinite(whole[n]).all(), n
            assert torch.equal(whole[n], resumed[n]), n


def test_checkpoints_without_the_count_of_skipped_warmup_steps_load_and_bad_counts_are_refused() -> None:
    def body(tr: Any) -> str:
        _, opt = stepped(tr, 5, codec="onebit", warmup=2)
        ckpt = snapshot(opt.state_dict())
        assert ckpt["sylvie_comm"]["warmup_skipped"] == 0
        old = snapshot(ckpt)
        del old["sylvie_comm"]["warmup_skipped"]  # written before skipped steps were counted: none were
        other = make(tr, params_of(initial()), codec="onebit", warmup=2)
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
        params, opt = stepped(tr, 3, codec="onebit", warmup=2)
        ckpt = snapshot(opt.state_dict())
        set_grads(params, tr.rank, 3)
        opt.step()
        if tr.rank == 1:
            ckpt = snapshot(opt.state_dict())  # one step later than rank 0's
        other = make(tr, params_of(initial()), codec="onebit", warmup=2)
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


def run_missing(world: int, missing: str, rank: int, at: int, steps: int = 6, **kw: Any) -> list[Any]:
    """Rank ``rank`` has no gradient for ``missing`` from step ``at`` on; the others have every gradient. Per rank:
    the error (or None), the parameters before step ``at`` and after the error."""

    def body(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = make(tr, params, **kw)
        before, error = None, None
        try:
            for step in range(steps):
                if step == at:
                    before = {n: p.detach().clone() for n, p in params.items()}
                set_grads(params, tr.rank, step, skip=(missing,) if tr.rank == rank and step >= at else ())
                opt.step()
        except ValueError as exc:
            error = str(exc)
        after = {n: p.detach().clone() for n, p in params.items()}
        opt.close()
        return {"error": error, "before": before, "after": after}

    return run_local(world, body)


@pytest.mark.parametrize("codec", ["onebit", "topk", "fp16"])
@pytest.mark.parametrize(("at", "warmup"), [(0, 2), (1, 4), (3, 2)], ids=["first-step", "warmup", "compressed"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_gradient_missing_on_one_rank_is_a_value_error_on_every_rank(
    world: int, at: int, warmup: int, codec: str
) -> None:
    """Ranks that would send payloads of different sizes (gloo aborts the process) agree first: a ValueError on every
    rank names the parameter and the ranks with and without its gradient; no rank stepped with the others' data."""
    for r in run_missing(world, "w2", world - 1, at, codec=codec, warmup=warmup):
        msg = r["error"]
        assert msg is not None
        assert "parameter 'w2' has a gradient on rank" in msg and f"but none (grad None) on rank {world - 1}" in msg
        assert "every rank must hold gradients for the same parameters" in msg
        for n in SHAPES:  # the step the ranks disagreed in changed nothing
            assert torch.equal(r["after"][n], r["before"][n]), n


def test_a_parameter_without_gradients_on_every_rank_at_once_is_agreed_without_a_skipped_step() -> None:
    """Every rank loses, then regains, the same gradients: the ranks agree on the new set and step with it."""

    def body(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = make(tr, params, codec="onebit", warmup=2)
        for step in range(7):
            set_grads(params, tr.rank, step, skip=("b2", "w1") if step in (1, 4) else ())
            opt.step()
        out = {"stats": opt.stats(), "b2": opt.state[params["b2"]]["step"].item()}
        opt.close()
        return out

    for r in run_local(2, body):
        assert r["stats"]["skipped_nonfinite"] == 0
        assert r["b2"] == 5  # seven steps, two without its gradient


def test_a_rank_without_any_gradient_is_a_value_error_and_a_step_without_any_on_every_rank_does_nothing() -> None:
    every = tuple(SHAPES)

    def body(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = make(tr, params, codec="onebit", warmup=2)
        for step in range(4):
            set_grads(params, tr.rank, step, skip=every if step == 1 else ())  # no gradient anywhere: no step
            opt.step()
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
