"""What the in-process tests of CompressedAdamW and CompressedSGD share: the parameters and per-rank gradients, each
optimizer's hyperparameters and a maker for it, and the runs (ranks as threads of the in-process transport)."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from sylvie_comm.collectives.local import LocalGroup, run_local
from sylvie_comm.optim import CompressedAdamW, CompressedSGD, MomentumOptimizer

Params = dict[str, torch.nn.Parameter]

WORLDS = [1, 2, 4]
SHAPES = {"w1": (6, 5), "b1": (6,), "w2": (3, 6), "b2": (3,)}
EF_CODECS = ["onebit", "sign", "topk", "qsgd"]
ADAMW_HYPER: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
# torch.optim.SGD's conventions, each exercised: plain momentum; Nesterov with weight decay; dampening with decay.
SGD_VARIANTS: dict[str, dict[str, Any]] = {
    "momentum": {"lr": 0.01, "momentum": 0.9},
    "nesterov": {"lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
    "dampening": {"lr": 0.01, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1},
}


def initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def grad(name: str, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + list(SHAPES).index(name))
    return torch.randn(SHAPES[name], generator=g) * (1 + rank)


def params_of(values: dict[str, torch.Tensor], device: str | torch.device = "cpu") -> Params:
    return {n: torch.nn.Parameter(v.clone().to(device)) for n, v in values.items()}


def set_grads(params: Params, rank: int, step: int, skip: tuple[str, ...] = ()) -> None:
    for n, p in params.items():
        p.grad = None if n in skip else grad(n, rank, step)


def detached(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of the parameters' values (of any tensors by name)."""
    return {n: p.detach().clone() for n, p in params.items()}


def snapshot(state: Any) -> Any:
    """A deep copy through torch.save, as a checkpoint on disk would be."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def full_state(opt: MomentumOptimizer, params: Params) -> dict[str, Any]:
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


def one_rank() -> Any:
    return LocalGroup(1).transport(0)


# ---------------------------------------------------------------- the optimizers


@dataclass(frozen=True)
class Optimizer:
    """One of the optimizers with its test hyperparameters: ``make(transport, params, **options)`` builds it on the
    named ``params`` (``options`` over ``hyper``)."""

    cls: type[MomentumOptimizer]
    hyper: dict[str, Any]

    def make(self, tr: Any, params: Params, **kw: Any) -> Any:
        return self.cls(list(params.items()), **{**self.hyper, **kw}, transport=tr)


ADAMW = Optimizer(CompressedAdamW, ADAMW_HYPER)
SGD_BY_VARIANT = {variant: Optimizer(CompressedSGD, hyper) for variant, hyper in SGD_VARIANTS.items()}


def make_adamw(tr: Any, params: Params, **kw: Any) -> CompressedAdamW:
    return ADAMW.make(tr, params, **kw)  # type: ignore[no-any-return]


def make_sgd(tr: Any, params: Params, variant: str = "nesterov", **kw: Any) -> CompressedSGD:
    return SGD_BY_VARIANT[variant].make(tr, params, **kw)  # type: ignore[no-any-return]


# The two, CompressedSGD in its default variant here (Nesterov, weight decay), and the parametrizations of a test of
# both: by these names, or with CompressedSGD in two variants (plain momentum too) where they take other paths.
OPTIMIZERS = {"adamw": ADAMW, "sgd": SGD_BY_VARIANT["nesterov"]}
BOTH = [pytest.param(optimizer, id=name) for name, optimizer in OPTIMIZERS.items()]
BOTH_SGD_VARIANTS = [
    pytest.param(ADAMW, id="adamw"),
    pytest.param(SGD_BY_VARIANT["momentum"], id="sgd-momentum"),
    pytest.param(SGD_BY_VARIANT["nesterov"], id="sgd-nesterov"),
]

Maker = Callable[..., Any]


# ---------------------------------------------------------------- runs


def stepped(tr: Any, make: Maker, steps: int, skip: Callable[[int], tuple[str, ...]] = lambda step: (),
            **kw: Any) -> tuple[Params, Any]:  # fmt: skip
    """Parameters and an optimizer (``make(tr, params, **kw)``) after ``steps`` steps of this rank's gradients, less
    the parameters ``skip(step)`` names at each."""
    params = params_of(initial())
    opt = make(tr, params, **kw)
    for step in range(steps):
        set_grads(params, tr.rank, step, skip=skip(step))
        opt.step()
    return params, opt


def run(make: Maker, world: int, steps: int, observe: Callable[[Any, dict[str, Any], int], Any] | None = None,
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
        return {"params": detached(params), "stats": opt.stats(), "seen": seen}

    return run_local(world, body)


def torch_reference(
    build: Callable[[Params], torch.optim.Optimizer],
    mean_grad: Callable[[str, int, int], torch.Tensor],
    world: int,
    steps: Iterable[int],
    names: Iterable[str] = SHAPES,
    skip: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """torch's optimizer ``build(params)`` on the parameters ``names`` (from :func:`initial`), fed
    ``mean_grad(name, world, step)`` at each of ``steps`` (none for the parameters in ``skip``): their values."""
    params = {n: p for n, p in params_of(initial()).items() if n in names}
    opt = build(params)
    for step in steps:
        for n, p in params.items():
            p.grad = None if n in skip else mean_grad(n, world, step)
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def without_a_gradient_for_b1(make: Maker, world: int, steps: int, **kw: Any) -> list[dict[str, torch.Tensor]]:
    """Per rank: the parameters after ``steps`` steps in which 'b1' never has a gradient, checked to have left 'b1' as
    it was, with no state for it (as torch's optimizers skip a parameter without a gradient)."""

    def body(tr: Any) -> tuple[dict[str, torch.Tensor], bool]:
        params, opt = stepped(tr, make, steps, skip=lambda step: ("b1",), **kw)
        opt.close()
        return detached(params), params["b1"] in opt.state

    out = []
    for got, has_state in run_local(world, body):
        assert not has_state
        assert torch.equal(got["b1"], initial()["b1"])
        out.append(got)
    return out


def resumed_run(tr: Any, make: Maker, steps: int, at: int, poison: Callable[[Params, int], None] = lambda p, s: None,
                **kw: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:  # fmt: skip
    """A run of ``steps`` steps (``poison(params, step)`` after each step's gradients are set), and a fresh optimizer
    resumed from its checkpoint before step ``at`` that takes the rest: the parameters of both and the checkpoint."""
    params = params_of(initial())
    opt = make(tr, params, **kw)
    ckpt = None
    for step in range(steps):
        if step == at:
            ckpt = full_state(opt, params)
        set_grads(params, tr.rank, step)
        poison(params, step)
        opt.step()
    opt.close()
    assert ckpt is not None
    resumed = params_of(ckpt["params"])
    opt2 = make(tr, resumed, **kw)  # a fresh optimizer
    opt2.load_state_dict(ckpt["opt"])
    for step in range(at, steps):
        set_grads(resumed, tr.rank, step)
        poison(resumed, step)
        opt2.step()
    opt2.close()
    return detached(params), detached(resumed), ckpt


def first_step_skipped(
    tr: Any,
    make: Maker,
    skip_first: bool,
    nan_on: Callable[[int], bool] = lambda rank: True,
    skip: Callable[[int], tuple[str, ...]] = lambda step: (),
    **kw: Any,
) -> dict[str, torch.Tensor]:
    """Six steps whose first has a NaN gradient (on the ranks ``nan_on(rank)`` picks) and is skipped, or (``skip_first``
    False) is left out; no gradient at each step for the parameters ``skip(step)`` names. The final parameters."""
    params = params_of(initial())
    opt = make(tr, params, **kw)
    for step in range(6):
        if step == 0 and not skip_first:
            continue
        set_grads(params, tr.rank, step, skip=skip(step))
        if step == 0 and nan_on(tr.rank):
            params["w1"].grad[0, 0] = float("nan")  # type: ignore[index]
        opt.step()
    opt.close()
    return detached(params)


def run_missing(make: Maker, world: int, missing: str, rank: int, at: int, steps: int = 6,
                **kw: Any) -> list[Any]:  # fmt: skip
    """Rank ``rank`` has no gradient for ``missing`` from step ``at`` on; the others have every gradient. Per rank:
    the error (or None), the parameters before step ``at`` and after the error."""

    def body(tr: Any) -> dict[str, Any]:
        params = params_of(initial())
        opt = make(tr, params, **kw)
        before, error = None, None
        try:
            for step in range(steps):
                if step == at:
                    before = detached(params)
                set_grads(params, tr.rank, step, skip=(missing,) if tr.rank == rank and step >= at else ())
                opt.step()
        except ValueError as exc:
            error = str(exc)
        after = detached(params)
        opt.close()
        return {"error": error, "before": before, "after": after}

    return run_local(world, body)


def meta_devices(tr: Any, make: Maker, **kw: Any) -> list[torch.device]:
    """The devices of every tensor of the state, the compression state and the parameters after five steps on the
    ``meta`` device (where a buffer made on the CPU, or a value read on the host, fails)."""
    params = params_of(initial(), torch.device("meta"))
    opt = make(tr, params, **kw)
    for _ in range(5):
        for p in params.values():
            p.grad = torch.empty_like(p)
        opt.step()
    state = opt.state_dict()
    opt.close()
    devices = [t.device for s in state["state"].values() for t in s.values()]
    devices += [t.device for s in state["sylvie_comm"]["params"].values() for t in s.values()]
    return devices + [p.device for p in params.values()]


def construction_error(build: Callable[[], Any]) -> str:
    """The ValueError's message of ``build()``, or ``built``."""
    try:
        build()
    except ValueError as exc:
        return str(exc)
    return "built"
