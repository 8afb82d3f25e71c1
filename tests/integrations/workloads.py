"""Models, data and training loops shared by the multi-process DDP tests (run inside workers)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sylvie_comm

# Small enough that every parameter gets a bucket of its own: several buckets on gloo.
TINY_BUCKET_MB = 0.0005


def square_mlp(width: int = 16, depth: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Square weight matrices only, so full-rank ACP-SGD is exact on P and Q steps alike."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers).to(dtype)


def batch(rank: int, step: int, width: int = 16, n: int = 32, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, width, generator=g).to(dtype)
    y = torch.randint(0, width, (n,), generator=g)
    return x, y


def grads(model: nn.Module) -> list[torch.Tensor]:
    """Gradients, zeros where DDP left an unused parameter's gradient unset."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))
    den = max(y.float().abs().max().item() for y in b)
    return num / den


def compare_with_default(
    rank: int, world: int, hook_name: str, options: dict[str, Any], steps: int = 6, dtype: torch.dtype = torch.float32,
    accumulate: int = 1, unused: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Gradients of a hooked DDP model against DDP's default all-reduce, at the same parameters each step."""
    base, test = square_mlp(dtype=dtype), square_mlp(dtype=dtype)
    if unused:
        base.add_module("unused", nn.Linear(16, 16).to(dtype))
        test.add_module("unused", nn.Linear(16, 16).to(dtype))
        base.forward = _skip_unused(base)  # type: ignore[method-assign]
        test.forward = _skip_unused(test)  # type: ignore[method-assign]
    kw = {"bucket_cap_mb": TINY_BUCKET_MB, "find_unused_parameters": unused}
    ddp_base, ddp_test = DDP(base, **kw), DDP(test, **kw)
    state = sylvie_comm.ddp.register(ddp_test, hook_name, **options)
    opt = torch.optim.SGD(base.parameters(), lr=0.05)
    errors, buckets = [], set()
    for step in range(steps):
        for model in (ddp_base, ddp_test):
            model.zero_grad()
            for micro in range(accumulate):
                x, y = batch(rank, step * accumulate + micro, dtype=dtype)
                if micro < accumulate - 1:
                    with model.no_sync():
                        F.cross_entropy(model(x).float(), y).backward()
                else:
                    F.cross_entropy(model(x).float(), y).backward()
        if step >= state.config.warmup_steps:
            errors.append(relative_error(grads(test), grads(base)))
        buckets.add(len(state._plans))
        opt.step()
        with torch.no_grad():
            for pt, pb in zip(test.parameters(), base.parameters(), strict=True):
                pt.copy_(pb)
    return {"errors": errors, "stats": state.stats(), "buckets": max(buckets), "steps": state.step}


def _skip_unused(seq: nn.Sequential):
    layers = [m for name, m in seq.named_children() if name != "unused"]

    def forward(x: torch.Tensor) -> torch.Tensor:
        for m in layers:
            x = m(x)
        return x

    return forward


# ---------------------------------------------------------------- resume


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8))


def train_steps(ddp: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = batch(rank, step)
        opt.zero_grad()
        F.cross_entropy(ddp(x)[:, :8], y % 8).backward()
        opt.step()


def resume_run(
    rank: int, world: int, hooks: list[tuple[str, dict[str, Any]]], phase: str, folder: str, k: int,
    resume_bucket_mb: float = TINY_BUCKET_MB,
):  # fmt: skip
    """phase "first": k steps, checkpoint, k more. phase "resume": load the checkpoint, k steps."""
    finals = {}
    for name, opts in hooks:
        model = mlp()
        path = f"{folder}/{name}-rank{rank}.pt"
        ckpt = torch.load(path, weights_only=False) if phase == "resume" else None
        if ckpt is not None:
            model.load_state_dict(ckpt["model"])
        ddp = DDP(model, bucket_cap_mb=resume_bucket_mb if ckpt is not None else TINY_BUCKET_MB)
        state = sylvie_comm.ddp.register(ddp, name, **opts)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if ckpt is not None:
            opt.load_state_dict(ckpt["optim"])
            state.load_state_dict(ckpt["hook"])
            train_steps(ddp, opt, rank, range(k, 2 * k))
        else:
            train_steps(ddp, opt, rank, range(k))
            ckpt = {"model": model.state_dict(), "optim": opt.state_dict(), "hook": state.state_dict()}
            torch.save(ckpt, path)
            train_steps(ddp, opt, rank, range(k, 2 * k))
        finals[name] = [p.detach().clone() for p in model.parameters()]
        state.close()
    return finals


def monitor_resume_run(
    rank: int, world: int, hooks: list[tuple[str, dict[str, Any]]], steps: int, saves: list[int]
) -> dict[str, Any]:  # fmt: skip
    """Per hook: ``steps`` steps straight, and for each of ``saves`` that many steps, a checkpoint (model,
    optimizer, hook state), fresh objects that load it and the steps left: whether each resumed run ends with the
    straight run's parameters, checks and the monitor's decisions in their order."""

    def fresh(name: str, opts: dict[str, Any]) -> tuple[nn.Module, nn.Module, Any, torch.optim.Optimizer]:
        model = mlp()
        ddp = DDP(model, bucket_cap_mb=TINY_BUCKET_MB)
        state = sylvie_comm.ddp.register(ddp, name, **opts)
        return model, ddp, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    out: dict[str, Any] = {}
    for name, opts in hooks:
        model, ddp, state, opt = fresh(name, opts)
        train_steps(ddp, opt, rank, range(steps))
        straight = [p.detach().clone() for p in model.parameters()]
        mon = state.stats()["monitor"]
        state.close()
        runs = {}
        for k in saves:
            model, ddp, state, opt = fresh(name, opts)
            train_steps(ddp, opt, rank, range(k))
            saved = {"model": model.state_dict(), "optim": opt.state_dict(), "hook": state.state_dict()}
            state.close()
            model, ddp, state, opt = fresh(name, opts)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
            state.load_state_dict(saved["hook"])
            train_steps(ddp, opt, rank, range(k, steps))
            got = state.stats()["monitor"]
            state.close()
            runs[k] = {
                "bitwise": all(torch.equal(a, p) for a, p in zip(straight, model.parameters(), strict=True)),
                "checks": (mon["checks"], got["checks"]),
                "adapted": (mon["adapted"], got["adapted"]),
            }
        out[f"{name} {opts}"] = runs
    return out


# ---------------------------------------------------------------- convergence on a real data set


def digits_split(rank: int, world: int):
    """scikit-learn's digits, pixels / 16: 1400 training images dealt out to the ranks, 397 for testing."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train_idx, test_idx = perm[:1400], perm[1400:]
    shard = train_idx[rank::world]
    return x[shard], y[shard], x[test_idx], y[test_idx]


# Optimizers as users run them, each at a learning rate where plain DDP reaches about 97% in 300 steps.
OPTIMIZERS: dict[str, Any] = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}


def train_digits(
    rank: int, world: int, hook_name: str | None, options: dict[str, Any], optimizer: str = "sgd_momentum",
    steps: int = 300, seed: int = 0, torch_powersgd_rank: int = 0, bucket_mb: float = 25.0,
) -> dict[str, Any]:  # fmt: skip
    """Train an MLP 64-256-256-10 on digits, batch 64 per rank; return test accuracy, stats and collectives
    per step."""
    xtr, ytr, xte, yte = digits_split(rank, world)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    calls = {"all_reduce": 0}
    state = None
    if torch_powersgd_rank:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        original = dist.all_reduce

        def counting(*a: Any, **kw: Any) -> Any:
            calls["all_reduce"] += 1
            return original(*a, **kw)

        dist.all_reduce = counting  # type: ignore[assignment]
        ps_state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=torch_powersgd_rank,
                                    start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)  # fmt: skip
        ddp.register_comm_hook(ps_state, ps.powerSGD_hook)
    elif hook_name is not None:
        state = sylvie_comm.ddp.register(ddp, hook_name, **options)
    opt = OPTIMIZERS[optimizer](model.parameters())
    g = torch.Generator().manual_seed(rank + 100 * seed)
    last_calls = 0
    try:
        for step in range(steps):
            idx = torch.randint(0, len(xtr), (64,), generator=g)
            opt.zero_grad()
            F.cross_entropy(ddp(xtr[idx]), ytr[idx]).backward()
            opt.step()
            if step == steps - 2:
                last_calls = calls["all_reduce"]
    finally:
        if torch_powersgd_rank:
            dist.all_reduce = original  # type: ignore[assignment]
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
    out: dict[str, Any] = {"accuracy": acc}
    if state is not None:
        out["stats"] = state.stats()
        out["collectives_per_step"] = state.stats()["last_step"]["collectives"]
        state.close()
    if torch_powersgd_rank:
        out["collectives_per_step"] = calls["all_reduce"] - last_calls
    return out


def rules_run(rank: int, world: int, config_path: str) -> dict[str, Any]:
    """Train a few steps under a YAML config with per-name rules; report what each parameter became."""
    ddp = DDP(mlp(), bucket_cap_mb=TINY_BUCKET_MB)
    state = sylvie_comm.ddp.register(ddp, config=sylvie_comm.Config.from_yaml(config_path))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    train_steps(ddp, opt, rank, range(4))
    factors = {n: (tuple(p.shape), tuple(q.shape)) for n, (p, q) in state._factors.items()}
    state.close()
    return {"factors": factors, "stats": state.stats()}


# ---------------------------------------------------------------- GradScaler and one non-finite gradient

NAN_STEP = 4  # the step (from 0, warm-up included) at which rank 0's first weight gets one NaN
AMP_STEPS = 9


def _snapshot(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    return state


def amp_run(rank: int, make: Any, steps: int = AMP_STEPS) -> dict[str, Any]:
    """SGD momentum 0.9 under ``torch.amp.GradScaler`` with one NaN in one gradient element on rank 0 at
    ``NAN_STEP``. ``make(model, opt) -> (forward, step, close, stats, state)`` adapts a framework:
    ``forward(x)`` is the model's forward, ``step(scaler, loss)`` runs backward and the scaler's step,
    ``state()`` is the compression state after a step.

    Returns per step: the scale after it, whether the gradients the optimizer saw were finite, the
    compression state; at the end the parameters and ``stats()``.
    """
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    forward, step_fn, close, stats, state = make(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    target = next(p for p in model.parameters() if p.dim() == 2)
    scales, finite, states = [], [], []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        hook = None
        if rank == 0 and step == NAN_STEP:

            def poison(g: torch.Tensor) -> torch.Tensor:
                g = g.clone()
                g.view(-1)[3] = float("nan")
                return g

            hook = target.register_hook(poison)
        step_fn(scaler, F.cross_entropy(forward(x)[:, :8], y % 8))
        if hook is not None:
            hook.remove()
        finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None))
        scales.append(scaler.get_scale())
        states.append(_snapshot(state()))
    out = {"scales": scales, "finite": finite, "states": states, "stats": stats(),
           "params": [p.detach().clone() for p in model.parameters()]}  # fmt: skip
    close()
    return out


def amp_ddp_run(rank: int, world: int, codecs: list[str]) -> dict[str, Any]:
    """:func:`amp_run` for each hook, through DDP (several buckets)."""
    out = {}
    for codec in codecs:

        def make(model: nn.Module, opt: torch.optim.Optimizer, codec: str = codec) -> Any:
            ddp = DDP(model, bucket_cap_mb=TINY_BUCKET_MB)
            hook = sylvie_comm.ddp.register(ddp, codec)

            def step(scaler: Any, loss: torch.Tensor) -> None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()

            return ddp, step, hook.close, hook.stats, lambda: hook.state_dict()["params"]

        out[codec] = amp_run(rank, make)
    return out


# ---------------------------------------------------------------- complex parameters


class ComplexMLP(nn.Module):
    """A real input through a complex 16x16 weight (its modulus onwards): DDP's buckets hold the complex
    gradient as 2 x 256 floats."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(16, 16)
        self.mix = nn.Parameter(torch.randn(16, 16, dtype=torch.complex64) / 4)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)).to(torch.complex64) @ self.mix
        return self.out(h.abs())


def compare_complex(rank: int, world: int, hooks: list[tuple[str, dict[str, Any]]], steps: int = 5) -> dict[str, Any]:
    """Per hook: gradients (complex ones as their real pairs) against DDP's default all-reduce, at the same
    parameters each step, and the parameters replicas end with."""
    out: dict[str, Any] = {}
    for name, options in hooks:
        base, test = ComplexMLP(), ComplexMLP()
        ddp_base, ddp_test = DDP(base, bucket_cap_mb=TINY_BUCKET_MB), DDP(test, bucket_cap_mb=TINY_BUCKET_MB)
        state = sylvie_comm.ddp.register(ddp_test, name, **options)
        opt = torch.optim.SGD(test.parameters(), lr=0.05)
        errors = []
        for step in range(steps):
            x, y = batch(rank, step)
            for model in (ddp_base, ddp_test):
                model.zero_grad()
                F.cross_entropy(model(x), y).backward()
            got = [torch.view_as_real(p.grad) if p.is_complex() else p.grad for p in test.parameters()]
            want = [torch.view_as_real(p.grad) if p.is_complex() else p.grad for p in base.parameters()]
            if step >= state.config.warmup_steps:
                errors.append(relative_error(got, want))
            opt.step()
            with torch.no_grad():
                for pb, pt in zip(base.parameters(), test.parameters(), strict=True):
                    pb.copy_(pt)
        state.close()
        out[name] = {"errors": errors, "params": [p.detach().clone() for p in test.parameters()]}
    return out
