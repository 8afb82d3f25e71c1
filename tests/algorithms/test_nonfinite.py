"""A step whose input is not finite on some rank: every algorithm skips it, on every rank, and recovers.

Each algorithm runs in one process, ranks as threads of the in-process transport, behind its policy (warm-up
included) as the integrations drive it. One NaN (or Inf) in one element of one tensor on one rank at one step:
every rank gets a non-finite average back, every rank's state (residuals, factors, owed updates) is bit for bit
what it was before the step, the step is counted in ``skipped_nonfinite``, and the following steps are those of
a run whose state went through that step untouched (a run in which that step never happened), bit for bit.
The bad step is an even and an odd one: ACP-SGD alternates P and Q steps, and a Q step owes its residual
update to the next P step.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any

import pytest
import torch

from sylvie_comm import kernels
from sylvie_comm.algorithms import ALGORITHMS, Group, Member, Policy, make_algorithm
from sylvie_comm.algorithms.guard import StepGuard, nonfinite, poison
from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import Config

NAN, INF = float("nan"), float("inf")
SHAPES = {"a.weight": (12, 10), "a.bias": (12,), "b.weight": (6, 12), "b.bias": (6,)}
# Two groups per step (as DDP's buckets): a NaN in one must restore the state of both.
GROUPS = [["b.weight", "b.bias"], ["a.weight", "a.bias"]]
STEPS = 12
# Counted from 0, warm-up (2 steps) included, so compressed steps 6 and 7: ACP-SGD's P step and its Q step (whose
# residual update is owed to the P step after it), each followed by a P and a Q step. auto runs its candidates a
# second time from step 6 (none, fp16, acpsgd, onebit: step 8 is acpsgd's, 9 onebit's) and chooses by measured
# time from step 10 (AUTO_CHOOSES): its later steps are compared only before then.
BAD_STEPS = (8, 9)
AUTO_CHOOSES = 10
ALL = sorted(ALGORITHMS)
# PowerSGD at its default rank ("auto") would send these small matrices raw (they would not shrink 2x), which
# tests a plain average: rank 2 compresses both weights (test_the_weights_compress_here).
OPTIONS: dict[str, dict[str, Any]] = {
    "auto": {"candidates": ["none", "fp16", "acpsgd", "onebit"]},
    "powersgd": {"rank": 2},
}


def config(name: str) -> Config:
    return Config(codec=name, options=OPTIONS.get(name, {}))


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def as_group(key: int, names: list[str], values: dict[str, torch.Tensor], policy: Policy) -> Group:
    """A flat buffer whose slices are the members (as a DDP bucket)."""
    flat = torch.cat([values[n].reshape(-1) for n in names])
    members, at = [], 0
    for n in names:
        k = values[n].numel()
        compress, options = policy.member_options(n, values[n].shape)
        members.append(Member(n, flat[at : at + k].view(values[n].shape), compress, options))
        at += k
    return Group(key, members, flat=flat)


def snapshot(state: Any) -> Any:
    """A deep copy of a state dict with every tensor cloned (compared bit for bit)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    return state


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, where
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                           b.view(torch.uint8) if b.dtype != torch.bool else b), f"{where} changed"  # fmt: skip
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
        return
    assert a == b, f"{where}: {a!r} != {b!r}"


def run(
    name: str, world: int, poison_at: dict[tuple[int, int], tuple[str, float]], steps: int = STEPS,
    omit: Collection[int] = (), reload_at: int | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per rank: outputs and state after every step; ``poison_at[(rank, step)] = (tensor, value)``; the steps
    in ``omit`` are not run at all (their outputs and states are None); before step ``reload_at`` the
    algorithm loads its own state (as a resume into a running process)."""
    cfg = config(name)

    def body(tr: Any) -> dict[str, Any]:
        alg = make_algorithm(name, tr, cfg.options, seed=3)
        policy = Policy(alg, cfg)
        outs: list[dict[str, torch.Tensor] | None] = []
        states: list[Any] = []
        for step in range(steps):
            if step == reload_at:
                alg.load_state_dict(alg.state_dict())
            if step in omit:
                outs.append(None)
                states.append(None)
                continue
            values = grads(tr.rank, step)
            hit = poison_at.get((tr.rank, step))
            if hit is not None:
                values[hit[0]].view(-1)[5] = hit[1]
            groups = [as_group(k, names, values, policy) for k, names in enumerate(GROUPS)]
            for fut in [policy(g, step) for g in groups]:
                fut.wait()
            outs.append({m.name: m.tensor.clone() for g in groups for m in g.members})
            state = alg.state_dict()
            # auto's probe timings measure the link, a skipped step's too: its candidates hold the state
            states.append(snapshot(state["candidates"] if name == "auto" else state))
        result = {"outs": outs, "states": states, "skipped": alg.report()["skipped_nonfinite"]}
        alg.close()
        return result

    return run_local(world, body)


@functools.cache
def untouched(
    name: str, world: int, omit: tuple[int, ...], steps: int = STEPS, reload_at: int | None = None
) -> list[dict[str, Any]]:
    """A run with no bad input in which the steps ``omit`` never happen: what a skipped step must leave."""
    return run(name, world, {}, steps, omit, reload_at)


def assert_as_if_untouched(
    name: str, ranks: list[dict[str, Any]], omit: tuple[int, ...], steps: int = STEPS, reload_at: int | None = None
) -> None:
    """The steps after the skipped ones are those of a run in which they never happened, bit for bit."""
    ref = untouched(name, len(ranks), omit, steps, reload_at)
    last = min(steps, AUTO_CHOOSES) if name == "auto" else steps
    for rank, (r, e) in enumerate(zip(ranks, ref, strict=True)):
        for s in (s for s in range(min(omit) + 1, last) if s not in omit):
            assert_same(r["outs"][s], e["outs"][s], f"{name} rank {rank} step {s} output")
            assert_same(fresh_as_absent(r["states"][s], e["states"][s]), e["states"][s], f"{name} rank {rank} step {s}")


def fresh_as_absent(state: Any, ref: Any) -> Any:
    """``state`` without the entries that ``ref`` lacks, each of which must be fresh (all zeros): the state a
    skipped step created where there was none (auto's candidate whose first step was skipped)."""
    if not isinstance(state, dict) or not isinstance(ref, dict):
        return state
    for k in set(state) - set(ref):
        tensors = [t for t in tensors_in(state[k]) if t.any()]
        assert not tensors, f"{k}: state made by a skipped step is not fresh"
    return {k: fresh_as_absent(v, ref[k]) for k, v in state.items() if k in ref}


def tensors_in(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_in(v)]
    return []


def finite(outs: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in outs.values())


@pytest.mark.parametrize("bad_step", BAD_STEPS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ALL)
def test_a_nonfinite_step_is_skipped_on_every_rank(name: str, world: int, value: float, bad_step: int) -> None:
    bad_rank = world - 1
    where = "a.weight" if name not in ("none",) else "a.bias"
    ranks = run(name, world, {(bad_rank, bad_step): (where, value)})
    for rank, r in enumerate(ranks):
        # the average handed back is not finite (so a GradScaler skips the step), on every rank
        assert not finite(r["outs"][bad_step]), f"rank {rank}: step {bad_step} came back finite"
        bad = [s for s, o in enumerate(r["outs"]) if s != bad_step and not finite(o)]
        assert not bad, f"{name} rank {rank}: not recovered, steps {bad} not finite"
        # the state after the skipped step is the state before it, bit for bit
        assert_same(r["states"][bad_step], r["states"][bad_step - 1], f"{name} rank {rank}")
        assert r["skipped"] == 1
    assert_as_if_untouched(name, ranks, (bad_step,))
    for s in range(STEPS):  # replicas agree
        for rank in range(1, world):
            for n in SHAPES:
                a, b = ranks[0]["outs"][s][n], ranks[rank]["outs"][s][n]
                assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)), (s, n, rank)


@pytest.mark.parametrize("bad_step", BAD_STEPS)
@pytest.mark.parametrize("name", ALL)
def test_the_steps_after_a_skip_do_not_depend_on_where_the_nonfinite_value_was(name: str, bad_step: int) -> None:
    """A NaN on rank 0 or an Inf on rank 1, in either group: the same decision, the same later steps."""
    a = run(name, 2, {(0, bad_step): ("a.weight", float("nan"))})
    b = run(name, 2, {(1, bad_step): ("b.weight", float("inf"))})
    # auto chooses by measured time after its probes (steps 2-9): compare its probe steps only
    last = AUTO_CHOOSES if name == "auto" else STEPS
    for s in range(bad_step + 1, last):
        for n in SHAPES:
            assert torch.equal(a[0]["outs"][s][n], b[0]["outs"][s][n]), (name, s, n)
        assert_same(a[0]["states"][s], b[0]["states"][s], f"{name} step {s}")


@pytest.mark.parametrize("name", ALL)
def test_a_skipped_first_compressed_step_leaves_residuals_at_zero(name: str) -> None:
    """State that the skipped step created (where there was none) is left as a fresh state: zero residuals."""
    ranks = run(name, 2, {(1, 2): ("a.weight", float("nan"))})
    for r in ranks:
        assert not finite(r["outs"][2]) and all(finite(o) for o in r["outs"][3:])

        def residuals(state: Any) -> list[torch.Tensor]:
            if isinstance(state, dict):
                return [t for k, v in state.items() for t in
                        ([v] if "residual" in k and isinstance(v, torch.Tensor) else residuals(v))]  # fmt: skip
            return []

        for t in residuals(r["states"][2]):
            assert not t.any()
    assert_as_if_untouched(name, ranks, (2,))


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", ALL)
def test_overflows_as_a_grad_scaler_meets_them_cost_one_step_each(name: str, value: float) -> None:
    """What a GradScaler run on 2 ranks sees: rank 1's gradient overflows at steps 3 and 5 (compressed steps
    1 and 3: ACP-SGD's Q steps), then 10 finite steps. Each overflow is one skipped step; every later average
    is finite on every rank, and as if the two steps never happened."""
    steps = 16
    ranks = run(name, 2, {(1, 3): ("a.weight", value), (1, 5): ("a.weight", value)}, steps)
    for rank, r in enumerate(ranks):
        assert [s for s, o in enumerate(r["outs"]) if not finite(o)] == [3, 5], f"{name} rank {rank}"
        assert r["skipped"] == 2
    assert_as_if_untouched(name, ranks, (3, 5), steps)


@pytest.mark.parametrize("bad_step", BAD_STEPS)
@pytest.mark.parametrize("name", ALL)
def test_a_skipped_step_right_after_a_resume_owes_nothing(name: str, bad_step: int) -> None:
    """State loaded into a running algorithm, then a skipped step: the copies of an update owed before the
    load (the loaded residual has it applied) must not come back as owed."""
    ranks = run(name, 2, {(1, bad_step): ("a.weight", float("nan"))}, reload_at=bad_step)
    for r in ranks:
        assert [s for s, o in enumerate(r["outs"]) if not finite(o)] == [bad_step]
        assert r["skipped"] == 1
    assert_as_if_untouched(name, ranks, (bad_step,), reload_at=bad_step)


@pytest.mark.parametrize("name", ALL)
def test_the_weights_compress_here(name: str) -> None:
    """Else the tests above would test a plain average of the matrices (as they did PowerSGD's)."""

    def body(tr: Any) -> list[bool]:
        alg = make_algorithm(name, tr, config(name).options, seed=3)
        policy = Policy(alg, config(name))
        compress = [policy.member_options(n, SHAPES[n])[0] for n in ("a.weight", "b.weight")]
        alg.close()
        return compress

    assert run_local(1, body) == [[True, True]]


@pytest.mark.parametrize("name", ALL)
def test_a_nonfinite_step_in_warmup_is_counted(name: str) -> None:
    ranks = run(name, 2, {(0, 0): ("a.bias", float("nan"))})
    assert not finite(ranks[1]["outs"][0])
    assert all(finite(o) for o in ranks[1]["outs"][1:])
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == 1


def test_nonfinite_and_poison() -> None:
    assert nonfinite(torch.zeros(0)) is None
    assert not bool(nonfinite(torch.ones(3), torch.zeros(2)))
    assert bool(nonfinite(torch.ones(3), torch.tensor([0.0, float("-inf")])))
    assert bool(nonfinite(torch.tensor([float("nan")], dtype=torch.float16)))
    t, u = torch.ones(2, 3), torch.ones(4)
    poison([torch.zeros(0), t, u], torch.tensor(False))
    assert torch.equal(t, torch.ones(2, 3)) and torch.equal(u, torch.ones(4))
    poison([torch.zeros(0), t, u], torch.tensor(True))
    assert torch.isnan(t[0, 0]) and int(torch.isnan(t).sum()) == 1 and torch.equal(u, torch.ones(4))


@pytest.mark.parametrize("numel", [1, 300, (1 << 16) + 5])  # the boolean copy up to 2**16 elements, aminmax beyond
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nonfinite_flags_every_kind_of_value_at_every_size(numel: int, dtype: torch.dtype) -> None:
    clean = torch.linspace(-3e4, 3e4, numel).to(dtype)
    assert not bool(nonfinite(clean))
    for value in (float("nan"), float("inf"), float("-inf")):
        for at in {0, numel // 2, numel - 1}:
            t = clean.clone()
            t[at] = value
            flag = nonfinite(t)
            assert flag is not None and flag.dtype == torch.bool and flag.shape == () and bool(flag), (value, at)
    assert nonfinite(torch.empty(numel, device="meta", dtype=dtype)).device.type == "meta"  # no host read


def test_guard_counts_a_group_still_running_at_settle_as_failed() -> None:
    """A group's future is read at settle, not chained: one not yet completed puts the step back."""
    guard = StepGuard()
    state = torch.arange(3.0)
    guard.begin(0)
    guard.save("s", state)
    state.add_(1.0)
    running: torch.futures.Future[None] = torch.futures.Future()
    assert guard.track(running) is running  # no future of its own on the hot path
    guard.settle()
    assert torch.equal(state, torch.arange(3.0)) and guard.skipped() == 1


def test_guard_restores_a_step_whose_group_never_completed() -> None:
    """A group whose collective failed leaves the step half done: it is put back as a skipped step."""
    guard = StepGuard()
    state, made = torch.arange(6.0), torch.ones(3)
    guard.begin(0)
    guard.save("s", state)
    state.add_(100.0)
    guard.zero_on_skip(made)
    guard.report(torch.tensor(False))
    failed: torch.futures.Future[None] = torch.futures.Future()
    tracked = guard.track(failed)
    failed.set_exception(RuntimeError("peer died"))
    with pytest.raises(RuntimeError, match="peer died"):
        tracked.wait()
    guard.settle()
    assert torch.equal(state, torch.arange(6.0)) and torch.equal(made, torch.zeros(3))
    assert guard.skipped() == 1


def _settle_a_completed_group(guard: StepGuard, bad: bool) -> None:
    """One group of the step reports ``bad`` and completes; the step settles."""
    guard.report(torch.tensor(bad))
    fut: torch.futures.Future[None] = torch.futures.Future()
    tracked = guard.track(fut)
    fut.set_result(None)
    tracked.wait()
    guard.settle()


def test_guard_keeps_a_good_step_and_counts_a_bad_one() -> None:
    guard = StepGuard()
    state = torch.arange(4.0)
    for step, bad in enumerate([False, True, False, True]):
        before = state.clone()
        guard.begin(step)
        guard.save("s", state)
        state.mul_(2.0).add_(1.0)
        _settle_a_completed_group(guard, bad)
        expected = before if bad else before * 2 + 1
        assert torch.equal(state, expected), step
    assert guard.skipped() == 2
    assert guard.memory_bytes() == state.numel() * 4


@pytest.mark.parametrize("flag", [False, True])
def test_copy_if_matches_its_reference(flag: bool) -> None:
    for dtype in (torch.float32, torch.float16, torch.int32, torch.uint8):
        src = torch.arange(37).to(dtype)
        for source in (src, None):
            dst, ref = torch.full((37,), 5).to(dtype), torch.full((37,), 5).to(dtype)
            kernels.copy_if(dst, source, torch.tensor(flag))
            kernels.reference.copy_if(ref, source, torch.tensor(flag))
            assert torch.equal(dst, ref)
            want = (src if source is not None else torch.zeros_like(src)) if flag else torch.full((37,), 5).to(dtype)
            assert torch.equal(dst, want)


@pytest.mark.parametrize("flag", [False, True])
def test_lowrank_outer_into_when(flag: bool) -> None:
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(9, 3, generator=g), torch.randn(7, 3, generator=g)
    out, ref, plain = (torch.randn(9, 7, generator=torch.Generator().manual_seed(1)) for _ in range(3))
    kernels.lowrank_outer_into(out, p, q, -1.0, True, when=torch.tensor(flag))
    kernels.reference.lowrank_outer_into(ref, p, q, -1.0, True, when=torch.tensor(flag))
    expected = plain.clone()
    if flag:
        kernels.lowrank_outer_into(expected, p, q, -1.0, True)
    assert torch.equal(out, expected) and torch.equal(ref.nan_to_num(), ref.nan_to_num())
    assert torch.allclose(ref, expected, atol=1e-5)


@pytest.mark.skipif(not kernels.uses_extension(torch.zeros(1)), reason="compiled kernels unavailable")
def test_copy_if_argument_checks() -> None:
    op = torch.ops.sylvie_comm.copy_if
    with pytest.raises(RuntimeError, match="flag must be a one-element bool tensor"):
        op(torch.zeros(3), None, torch.tensor([True, False]))
    with pytest.raises(RuntimeError, match="flag must be a one-element bool tensor"):
        op(torch.zeros(3), None, torch.tensor(1))
    with pytest.raises(RuntimeError, match="src must be a contiguous"):
        op(torch.zeros(3), torch.zeros(4), torch.tensor(True))
    with pytest.raises(RuntimeError, match="dst must be a contiguous"):
        op(torch.zeros(3, 4).T, None, torch.tensor(True))
    with pytest.raises(RuntimeError, match="when must be a one-element bool tensor"):
        torch.ops.sylvie_comm.lowrank_outer_into(torch.zeros(2, 2), torch.zeros(2, 1), torch.zeros(2, 1), 1.0,
                                                 False, torch.tensor(1.0))  # fmt: skip


def test_new_ops_have_fake_implementations() -> None:
    if not kernels.uses_extension(torch.zeros(1)):
        pytest.skip("compiled kernels unavailable")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        dst, flag = torch.empty(4), torch.empty((), dtype=torch.bool)
        torch.ops.sylvie_comm.copy_if(dst, None, flag)
        torch.ops.sylvie_comm.lowrank_outer_into(torch.empty(3, 2), torch.empty(3, 1), torch.empty(2, 1), 1.0,
                                                 True, flag)  # fmt: skip


def test_guard_saves_a_groups_states_at_once_as_one_by_one() -> None:
    """``save_many`` (one lock, one multi-tensor copy) puts every state back on a bad step as ``save`` does, keeps a
    good one, and saves a key once per step (its first value)."""
    for bad in (True, False):
        guard = StepGuard()
        a, b = torch.arange(4.0), torch.arange(6.0).view(2, 3)
        guard.begin(0)
        guard.save_many([("a", a), ("b", b)])
        a.add_(1.0)
        guard.save_many([("a", a)])  # already saved this step: the value before the step stays
        b.mul_(3.0)
        _settle_a_completed_group(guard, bad)
        if bad:
            assert torch.equal(a, torch.arange(4.0)) and torch.equal(b, torch.arange(6.0).view(2, 3))
        else:
            assert torch.equal(a, torch.arange(4.0) + 1) and torch.equal(b, torch.arange(6.0).view(2, 3) * 3)
        assert guard.skipped() == int(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_guard_check_decides_as_nonfinite_does(dtype: torch.dtype) -> None:
    """A checked tensor's verdict (a witness now, the test at settle) is :func:`nonfinite`'s, for every kind of
    value, where the state is restored by it and where only the count reads it."""
    clean = torch.linspace(-3e4, 3e4, 301).to(dtype)
    cases = [clean] + [clean.clone().index_fill_(0, torch.tensor([at]), v) for v in (NAN, INF, -INF) for at in (0, 300)]
    cases.append(torch.full((5,), torch.finfo(dtype).max, dtype=dtype))  # finite at the limit: no overflow in the test
    for restores in (True, False):
        guard, taken = StepGuard(), 0
        state = torch.arange(3.0)
        for step, t in enumerate(cases):
            guard.begin(step)
            if restores:
                guard.save("s", state)
                state.add_(1.0)
            guard.check(torch.zeros(0, dtype=dtype))  # empty: no verdict
            guard.check(t)
            guard.finish()
            taken += not bool(nonfinite(t))
            if restores:
                guard.settle()
                assert torch.equal(state, torch.arange(3.0) + taken), step
        assert guard.skipped() == sum(bool(nonfinite(t)) for t in cases) == 6, restores


def test_guard_counts_checked_steps_across_folds_with_changing_groups() -> None:
    """Steps only counted are tested together, up to ``_FOLD`` at a time, grouped by their witnesses' layout (a
    bucket more, another dtype); the count is exact however the steps fall into folds, read at any time."""
    from sylvie_comm.algorithms.guard import _FOLD

    gen = torch.Generator().manual_seed(3)
    guard, expected = StepGuard(), 0
    for step in range(2 * _FOLD + 7):
        groups = 1 + step % 3
        bad_group = int(torch.randint(0, 2 * groups, (), generator=gen))  # about half the steps clean
        for g in range(groups):
            t = torch.randn(4 + g, generator=gen).to(torch.float16 if g == 2 else torch.float32)
            if g == bad_group:
                t[1] = NAN if step % 2 else INF
            guard.begin(step)
            guard.check(t)
            guard.finish()
        expected += bad_group < groups
        if step in (5, _FOLD + 1):  # a read mid-way folds what waits, and the count goes on from there
            guard.settle()
            assert guard.skipped() == expected
    guard.settle()
    assert len(guard._pending) < _FOLD  # what waits is bounded: folded as it reaches _FOLD steps
    assert guard.skipped() == expected > 0


def test_guard_check_reads_nothing_on_the_host() -> None:
    guard = StepGuard()
    for step in range(3):
        guard.begin(step)
        guard.check(torch.empty(10, device="meta"))
        guard.finish()
    guard.settle()
    guard._fold()
    assert guard._skipped is not None and guard._skipped.device.type == "meta"
