"""DiLoCo and Streaming DiLoCo (``sylvie_comm.diloco``) on the in-process transport, against a plain reference.

The reference below is the method as published, written with nothing of the library: ``w`` replicas stepped in
turn in one thread, pseudo-gradients ``global - local`` averaged in rank order, torch's Nesterov SGD on the global
parameters, fragments in turn every ``sync_every // fragments`` steps, a fragment's average started ``delay`` steps
before it is applied, ``alpha`` of the replica's own parameters lerped back in. With the fp32 codec the library
must give its bits on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from sylvie_comm.collectives import wire_bytes
from sylvie_comm.collectives.local import run_local
from sylvie_comm.diloco import DiLoCo
from sylvie_comm.optim.fragments import split as _split
from tests.optim.common import snapshot

LR, MOMENTUM = 0.05, 0.9


def model_of(seed: int) -> nn.Module:
    """A replica of its own seed (its values from a generator of its own: ranks are threads here)."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 6, generator=g)
    return x, (x[:, :3] * (1 + 0.3 * rank)).tanh()


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference(world: int, steps: int, sync_every: int, fragments: int, delay: int, alpha: float) -> list[dict]:
    """Each replica's parameters after ``steps`` inner steps of DiLoCo (fp32 averages), as published."""
    models = [model_of(0) for _ in range(world)]  # every replica starts from rank 0's parameters
    inner = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in models]
    holder = model_of(0)  # the global parameters, stepped by the outer optimizer
    outer = torch.optim.SGD(holder.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    names = [n for n, _ in holder.named_parameters()]
    parts = [[n for n, _ in part] for part in _split(list(holder.named_parameters()), fragments)]
    period = sync_every // fragments
    pending: dict[int, dict[str, torch.Tensor]] = {}
    for t in range(1, steps + 1):
        for r in range(world):
            inner_step(models[r], inner[r], r, t)
        frag = ((t - 1) // period) % fragments
        glob = dict(holder.named_parameters())
        if t % period == (period - delay) % period:
            avg = {}
            for n in parts[frag]:
                total = None
                for r in range(world):
                    d = (glob[n].detach() - dict(models[r].named_parameters())[n].detach()) / world
                    total = d if total is None else total + d
                avg[n] = total
            pending[frag] = avg
        if t % period == 0:
            avg = pending.pop(frag)
            for n in names:
                glob[n].grad = avg[n].clone() if n in avg else None
            outer.step()
            for r in range(world):
                mine = dict(models[r].named_parameters())
                with torch.no_grad():
                    for n in parts[frag]:
                        mine[n].copy_(torch.lerp(glob[n].detach(), mine[n].detach(), alpha))
    return [state(m) for m in models]


def train(
    transport: Any, steps: int, *, resume_at: int | None = None, seed: int | None = None, **kwargs: Any
) -> dict[str, Any]:
    """One rank's run: a model of its own seed (DiLoCo starts every rank from rank 0's), ``steps`` inner steps;
    with ``resume_at`` everything is saved there and a fresh model, optimizer and DiLoCo load it and go on."""
    rank = transport.rank
    model = model_of(rank if seed is None else seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    dl = DiLoCo(model, opt, transport=transport, **kwargs)
    for t in range(1, steps + 1):
        inner_step(model, opt, rank, t)
        if t == resume_at:
            saved = snapshot({"model": model.state_dict(), "opt": opt.state_dict(), "dl": dl.state_dict()})
            dl.close()
            model = model_of(100 + rank)
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            dl = DiLoCo(model, opt, transport=transport, **kwargs)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            dl.load_state_dict(saved["dl"])
    out = {"params": state(model), "stats": dl.stats(), "memory": dl.memory_bytes(), "state": dl.state_dict()}
    dl.close()
    return out


SCHEDULES = [(1, 0, 0.0), (2, 0, 0.0), (2, 1, 0.5), (4, 1, 0.0), (4, 0, 0.25)]


@pytest.mark.parametrize(("fragments", "delay", "alpha"), SCHEDULES)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fp32_outer_steps_give_the_reference_bits(world: int, fragments: int, delay: int, alpha: float) -> None:
    steps, h = 26, 8  # ends mid-cycle, with a fragment in flight where delay > 0
    expected = reference(world, steps, h, fragments, delay, alpha)
    kw = {"sync_every": h, "fragments": fragments, "delay": delay, "alpha": alpha}
    runs = run_local(world, lambda t: train(t, steps, **kw))
    for rank, run in enumerate(runs):
        for n, v in expected[rank].items():
            assert torch.equal(run["params"][n], v), (rank, n)
    assert runs[0]["stats"]["outer_steps"] == steps // (h // fragments)


def test_one_inner_step_and_plain_sgd_outer_is_parameter_averaging() -> None:
    """H = 1 with an outer SGD of lr 1 and no momentum: every step the replicas take the mean of their parameters."""

    def run(transport: Any) -> dict[str, torch.Tensor]:
        model = model_of(0)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        with DiLoCo(model, opt, sync_every=1, outer_optimizer=outer, transport=transport):
            before = state(model)
            x, y = batch(transport.rank, 1)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            local = {n: p.detach() - LR * p.grad for n, p in model.named_parameters()}
            opt.step()
            return {"before": before, "local": local, "after": state(model)}

    runs = run_local(3, run)
    for n in runs[0]["after"]:
        mean = sum(r["local"][n] for r in runs) / 3
        for r in runs:
            torch.testing.assert_close(r["after"][n], mean, rtol=0, atol=1e-6)
            assert torch.equal(r["after"][n], runs[0]["after"][n])


def test_bytes_against_plain_data_parallel() -> None:
    steps, h = 16, 8
    runs = run_local(2, lambda t: train(t, steps, sync_every=h))
    numel = sum(p.numel() for p in model_of(0).parameters())
    s = runs[0]["stats"]
    assert s["outer_steps"] == 2 and s["inner_steps"] == steps
    assert s["bytes_sent"] == 2 * wire_bytes("all_reduce", 4 * numel, 2)
    assert s["ddp_bytes"] == steps * wire_bytes("all_reduce", 4 * numel, 2)
    assert s["reduction_vs_ddp"] == h
    q = run_local(2, lambda t: train(t, steps, sync_every=h, codec="qsgd", bits=2))[0]["stats"]
    # 2 bits a value plus the rows' scales and the raw biases of a model of 155 parameters
    assert q["compression_ratio"] > 2.5 and q["reduction_vs_ddp"] == q["ddp_bytes"] / q["bytes_sent"] > 2.5 * h


@pytest.mark.parametrize(("codec", "options"), [("qsgd", {"bits": 2}), ("topk", {"ratio": 0.1}), ("acpsgd", {})])
def test_error_feedback_carries_a_residual_from_one_outer_step_to_the_next(codec: str, options: dict) -> None:
    runs = run_local(2, lambda t: train(t, 16, sync_every=4, codec=codec, **options))
    params = runs[0]["state"]["fragments"][0]["session"]["params"]
    residuals = [t for entry in params.values() for t in _tensors(entry)]
    assert residuals and any(bool(t.abs().sum() > 0) for t in residuals)
    for n, v in runs[0]["params"].items():  # the replicas agree on the global parameters they continue from
        assert torch.isfinite(v).all()
        assert torch.equal(runs[0]["state"]["fragments"][0]["outer"][n], runs[1]["state"]["fragments"][0]["outer"][n])


def _tensors(entry: Any) -> list[torch.Tensor]:
    if isinstance(entry, torch.Tensor):
        return [entry]
    if isinstance(entry, dict):
        return [t for v in entry.values() for t in _tensors(v)]
    if isinstance(entry, (list, tuple)):
        return [t for v in entry for t in _tensors(v)]
    return []


@pytest.mark.parametrize(
    ("resume_at", "kwargs"),
    [
        (8, {"sync_every": 8}),  # right after an outer step
        (11, {"sync_every": 8, "codec": "qsgd", "bits": 2}),  # between outer steps, a residual carried
        (7, {"sync_every": 8, "fragments": 2, "delay": 1, "alpha": 0.5, "codec": "qsgd", "bits": 4}),  # in flight
        (13, {"sync_every": 8, "fragments": 4, "delay": 1, "codec": "topk", "ratio": 0.2}),
    ],
)
def test_resume_is_bit_identical(resume_at: int, kwargs: dict) -> None:
    steps = 24
    straight = run_local(2, lambda t: train(t, steps, **kwargs))
    resumed = run_local(2, lambda t: train(t, steps, resume_at=resume_at, **kwargs))
    for a, b in zip(straight, resumed, strict=True):
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), n
        assert a["stats"]["bytes_sent"] == b["stats"]["bytes_sent"]


def test_a_nonfinite_pseudo_gradient_is_skipped_on_every_rank() -> None:
    """Rank 1 diverges (NaN) just before an outer step: no rank applies it, both go back to the global parameters,
    the outer optimizer's state is untouched, and training goes on from there."""

    def run(transport: Any) -> dict[str, Any]:
        rank = transport.rank
        model = model_of(0)
        opt = torch.optim.SGD(model.parameters(), lr=LR)  # no momentum: the inner state holds no NaN
        dl = DiLoCo(model, opt, sync_every=4, transport=transport, codec="qsgd", bits=4)
        seen = {}
        for t in range(1, 13):
            x, y = batch(rank, t)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if t == 8 and rank == 1:
                next(model.parameters()).grad[0, 0] = float("nan")
            if t == 8:
                seen["outer_before"] = {n: o.clone() for n, o in dl.state_dict()["fragments"][0]["outer"].items()}
                seen["momentum_before"] = snapshot(dl.outer_optimizer.state_dict())
            opt.step()
            if t == 8:
                seen["after"] = state(model)
        seen["stats"] = dl.stats()
        seen["final"] = state(model)
        dl.close()
        return seen

    runs = run_local(2, run)
    for r in runs:
        assert r["stats"]["skipped_nonfinite"] == 1 and r["stats"]["outer_steps"] == 3
        for n, v in r["after"].items():
            assert torch.equal(v, r["outer_before"][n]), n  # back to the global parameters
            assert torch.isfinite(r["final"][n]).all()
    assert torch.equal(
        runs[0]["momentum_before"]["state"][0]["momentum_buffer"],
        runs[1]["momentum_before"]["state"][0]["momentum_buffer"],
    )


def test_ranks_that_disagree_fail_together() -> None:
    with pytest.raises(Exception, match="sync_every"):
        run_local(2, lambda t: train(t, 1, sync_every=4 + t.rank))
    with pytest.raises(Exception, match="bits"):
        run_local(2, lambda t: train(t, 1, sync_every=4, codec="qsgd", bits=2 + 2 * t.rank))


def _one(fn: Any) -> Any:
    """``fn`` on one in-process rank, raising the rank's own error."""
    try:
        return run_local(1, fn)[0]
    except RuntimeError as exc:
        raise exc.__cause__ or exc from None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 0}, "sync_every must be an integer >= 1, got 0"),
        ({"sync_every": 8, "fragments": 3}, r"sync_every \(8\) must be a multiple of fragments \(3\)"),
        ({"sync_every": 8, "fragments": 2, "delay": 4}, r"delay must be an integer in \[0, .* = 4\), got 4"),
        ({"sync_every": 8, "alpha": 1.5}, r"alpha must be a number in \[0, 1\], got 1.5"),
        ({"sync_every": 14, "fragments": 7}, r"fragments \(7\) exceeds the model's 6 trainable parameters"),
        ({"sync_every": 8, "codec": "nope"}, "nope"),
        ({"sync_every": 8, "codec": "auto"}, "codec 'auto' measures the link step by step"),
        ({"sync_every": 8, "codec": "qsgd", "warmup": "auto"}, "warmup 'auto' watches each gradient settle"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    def build(t: Any) -> None:
        model = model_of(0)
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), transport=t, **kwargs)

    with pytest.raises((ValueError, TypeError), match=match):
        _one(build)


def test_optimizers_that_do_not_fit_the_model_are_refused() -> None:
    def other_inner(t: Any) -> None:
        model = model_of(0)
        DiLoCo(model, torch.optim.SGD(model[0].parameters(), lr=0.1), sync_every=2, transport=t)

    def other_outer(t: Any) -> None:
        model = model_of(0)
        outer = torch.optim.SGD(model_of(1).parameters(), lr=0.1)
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, outer_optimizer=outer, transport=t)

    with pytest.raises(ValueError, match=r"inner optimizer does not step parameter '2\.weight'"):
        _one(other_inner)
    with pytest.raises(ValueError, match="outer_optimizer must step exactly the model's trainable parameters"):
        _one(other_outer)


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 10])
def test_fragments_cover_the_parameters_in_order_none_empty(parts: int) -> None:
    named = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate([50, 1, 1, 30, 30, 4, 100, 2, 2, 9])]
    cut = _split(named, parts)
    assert len(cut) == parts and all(cut)
    assert [n for part in cut for n, _ in part] == [n for n, _ in named]
    if parts == 2:
        sizes = [sum(p.numel() for _, p in part) for part in cut]
        assert max(sizes) <= 0.75 * sum(sizes)


def test_no_warm_up_and_no_monitor_unless_asked() -> None:
    runs = run_local(1, lambda t: train(t, 8, sync_every=4, codec="qsgd", bits=2))
    assert runs[0]["state"]["fragments"][0]["session"]["config"]["warmup_steps"] == 0
    assert runs[0]["state"]["fragments"][0]["session"]["config"]["monitor"]["period"] == 0
    asked = run_local(1, lambda t: train(t, 8, sync_every=4, codec="qsgd", bits=2, warmup_steps=1,
                                         monitor={"period": 1}))  # fmt: skip
    assert asked[0]["state"]["fragments"][0]["session"]["config"]["warmup_steps"] == 1
    assert asked[0]["state"]["fragments"][0]["session"]["config"]["monitor"]["period"] == 1


def test_memory_is_one_copy_of_the_parameters_and_the_buffer() -> None:
    run = run_local(1, lambda t: train(t, 2, sync_every=2))[0]
    numel = sum(p.numel() for p in model_of(0).parameters())
    assert run["memory"] == 4 * numel + 4 * numel  # the global copy (fp32 here) and the pseudo-gradient buffer
