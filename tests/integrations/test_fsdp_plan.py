"""An FSDP unit's reduce-scatter runs a plan built once: its layout, tiling and checks at the unit's first call,
checked in O(1) after (the group, op, sizes, dtypes, device), built again only for a call that differs; the
algorithms' row plans found by the layout's identity; the session's step moved once per training step, to the
values a maximum over the units gives; a step's cost linear in the units (its Python calls counted).

One process: a gloo group of one rank and FSDP2's ``fully_shard`` on the CPU. At one rank FSDP2 does not call
the comm itself (it copies the gradients out), so the tests call each unit's comm as ``foreach_reduce`` does.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sylvie_comm
from sylvie_comm.algorithms import qsgd as qsgd_module
from sylvie_comm.bench.hooks_fsdp import sharded_linears
from sylvie_comm.collectives.local import LocalGroup
from sylvie_comm.integrations import fsdp as sc_fsdp

SHARDED = ("none", "fp16", "qsgd", "onebit")


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A default process group of one gloo rank, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a default process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(units: int, width: int = 8) -> nn.Module:
    """``units`` Linear layers, ``fully_shard`` on each and on the root (which holds no parameters)."""
    return sharded_linears(units, width)


def _call(unit: Any, inp: torch.Tensor | None = None, *, op: Any = None, group: Any = None,
          out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Call ``unit``'s comm as FSDP's ``foreach_reduce`` does; return its input (a copy, as the comm may change
    it) and output."""
    numel = sum(p.sharded_param.numel() for p in unit.group.fsdp_params)
    inp = torch.randn(numel) if inp is None else inp
    out = torch.empty(numel, dtype=inp.dtype) if out is None else out
    comm = unit.group._reduce_scatter_comm
    given = inp.clone()
    comm(output_tensor=out, input_tensor=inp, group=group if group is not None else unit.shard_group,
         op=op if op is not None else dist.ReduceOp.SUM)  # fmt: skip
    return given, out


def _step(state: sc_fsdp.FSDPState) -> None:
    """One training step's reduce-scatters: every unit once, the last first (the backward's order)."""
    for unit in reversed(state.units):
        _call(unit)


def _counting(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[Any]:
    """Replace ``owner.name`` by a wrapper that records each call's first argument (or None); return the record."""
    calls: list[Any] = []
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1] if len(args) > 1 else None)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("codec", SHARDED)
def test_a_units_plan_is_built_at_its_first_reduce_scatter_and_reused(one_rank, monkeypatch, codec):
    """Three units, six steps (two of the warm-up, four compressed): one plan and one layout per unit, the same
    objects every step; qsgd's and onebit's row plan built once per unit and its residuals checked once."""
    plans = _counting(monkeypatch, sc_fsdp.FSDPState, "_plan")
    layouts = _counting(monkeypatch, sc_fsdp._Unit, "segments")
    checks = _counting(monkeypatch, qsgd_module, "check_residuals")
    from sylvie_comm.algorithms import onebit as onebit_module

    checks_onebit = _counting(monkeypatch, onebit_module, "check_residuals")
    state = sylvie_comm.fsdp.register(_model(3), codec)
    try:
        _step(state)
        first = [u.plan for u in state.units]
        assert all(p is not None and p.layout is u.layout for p, u in zip(first, state.units, strict=True))
        rows: list[Any] = []
        for step in range(1, 6):
            _step(state)
            assert [u.plan for u in state.units] == first and all(
                a is b for a, b in zip(first, (u.plan for u in state.units), strict=True)
            )
            if step == 3:
                rows = list(getattr(state.algorithm, "_shard_rows", {}).values())
        assert len(plans) == 3 and len(layouts) == 3, (len(plans), len(layouts))
        assert [u.step for u in state.units] == [6, 6, 6] and state.session.step == 6
        if codec in ("qsgd", "onebit"):
            after = list(state.algorithm._shard_rows.values())
            assert len(after) == 3 and all(a is b for a, b in zip(rows, after, strict=True))
            assert {id(r.layout) for r in after} == {id(u.layout) for u in state.units}
            assert len(checks if codec == "qsgd" else checks_onebit) == 3  # once per unit, at its first step
    finally:
        state.close()


def test_plain_averaging_through_the_plan_is_the_input_at_one_rank(one_rank):
    """At one rank the average is the input itself, bit for bit, at every step (the plan changes no value)."""
    state = sylvie_comm.fsdp.register(_model(2), "none")
    try:
        for _ in range(4):
            for unit in state.units:
                given, out = _call(unit)
                assert torch.equal(out, given)
    finally:
        state.close()


def test_a_call_that_differs_builds_a_new_plan_and_a_bad_one_is_refused(one_rank, monkeypatch):
    """Another op, dtype or group builds the unit's plan again (its checks with it), the layout kept; a call
    whose size does not fit the unit is refused naming the cause, and leaves the plan as it was."""
    plans = _counting(monkeypatch, sc_fsdp.FSDPState, "_plan")
    state = sylvie_comm.fsdp.register(_model(1), "none")
    try:
        unit = state.units[0]
        _call(unit)
        _call(unit)
        first = unit.plan
        assert len(plans) == 1 and first is not None
        _call(unit, op=dist.ReduceOp.AVG)
        assert len(plans) == 2 and unit.plan is not first and unit.plan.layout is first.layout
        assert unit.plan.op == dist.ReduceOp.AVG and unit.plan.scale == 1.0
        _call(unit, op=dist.ReduceOp.AVG)
        assert len(plans) == 2  # the same call again: the plan it built
        given, out = _call(unit, torch.randn(first.numel, dtype=torch.bfloat16), op=dist.ReduceOp.AVG)
        assert len(plans) == 3 and unit.plan.dtype == torch.bfloat16 and torch.equal(out, given)
        other = dist.new_group([0])
        _call(unit, op=dist.ReduceOp.AVG, group=other)
        assert len(plans) == 4 and unit.plan.group is other
        kept = unit.plan
        with pytest.raises(ValueError, match=r"reduces 3 elements per rank where its parameters hold 72: .*"
                                             r"set_reduce_scatter_unused_params\(True\)"):  # fmt: skip
            _call(unit, torch.randn(3), op=dist.ReduceOp.AVG, group=other, out=torch.empty(3))
        assert unit.plan is kept and unit.step == 6  # a refused call is no step
        with pytest.raises(ValueError, match=r"FSDP asked for a reduce-scatter with op .*MAX"):
            _call(unit, op=dist.ReduceOp.MAX, group=other)
        assert unit.plan is kept
    finally:
        state.close()


def test_a_plan_sees_a_changed_layout(one_rank):
    """A unit whose layout is built again (a new object: per-name options changed) gets a new plan, and the
    algorithm a new row plan for it, found by the new object's identity."""
    state = sylvie_comm.fsdp.register(_model(1), "qsgd", warmup_steps=0)
    try:
        unit = state.units[0]
        _call(unit)
        _call(unit)
        row = state.algorithm._shard_rows[(unit.key, unit.plan.shard)]
        assert row.layout is unit.layout
        old, plan = unit.layout, unit.plan
        unit.layout = unit.segments(unit.world, state.policy)  # equal to the old one, another object
        assert unit.layout == old and unit.layout is not old
        _call(unit)
        assert unit.plan is not plan
        again = state.algorithm._shard_rows[(unit.key, unit.plan.shard)]
        assert again is not row and again.layout is unit.layout and unit.plan.layout is unit.layout
        assert again.row_bytes == row.row_bytes
    finally:
        state.close()


def _old_step(units: list[Any]) -> int:
    """The session's step as a maximum over every unit's steps (what each call computed before the plan)."""
    return max(u.step for u in units)


def test_the_session_step_is_the_most_steps_any_unit_has_taken(one_rank):
    """Units stepping in any order (the backward's, a unit skipped, one ahead), through the reduce-scatter and
    the replica hook: after every call the session's step is the maximum over the units; a checkpoint's
    per-unit steps come back, and the session's step with them."""
    state = sylvie_comm.fsdp.register(_model(3), "none")
    try:
        units = state.units
        order = [2, 1, 0, 2, 1, 0, 2, 2, 0, 1, 1, 1, 0, 2, 1]
        seen = []
        for i in order:
            _call(units[i])
            assert state.session.step == _old_step(units), (i, [u.step for u in units], state.session.step)
            seen.append(state.session.step)
        assert seen == [1, 1, 1, 2, 2, 2, 3, 4, 4, 4, 4, 5, 5, 5, 6]
        hook = state._replica_hook(units[0])
        for _ in range(3):
            hook(torch.randn(sum(s.numel for s in units[0].layout.segments)))
            assert state.session.step == _old_step(units)
        assert [u.step for u in units] == [7, 6, 5] and state.session.step == 7
        saved = state.state_dict()
        assert saved["step"] == {"0": 7, "1": 6, "2": 5}
    finally:
        state.close()
    resumed = sylvie_comm.fsdp.register(_model(3), "none")
    try:
        resumed.load_state_dict(saved)
        assert [u.step for u in resumed.units] == [7, 6, 5] and resumed.session.step == 7
        _call(resumed.units[2])
        assert resumed.session.step == 7 and resumed.units[2].step == 6
        _call(resumed.units[0])
        assert resumed.session.step == 8
    finally:
        resumed.close()


def _calls_per_step(units: int, codec: str, monkeypatch: pytest.MonkeyPatch, steps: int = 2) -> list[int]:
    """Python and C calls made on this thread by each of ``steps`` training steps' reduce-scatters (after four
    steps: the warm-up and the plans behind), on a model of ``units`` units, everything on this thread (the
    in-process transport of one rank completes each collective as it is issued)."""
    monkeypatch.setattr(sc_fsdp, "ProcessGroupTransport", lambda *args, **kwargs: LocalGroup(1).transport(0))
    state = sylvie_comm.fsdp.register(_model(units, 4), codec, monitor={"period": 0})
    counts = []
    try:
        for _ in range(4):
            _step(state)
        inputs = [[torch.randn(sum(s.numel for s in u.layout.segments)) for u in state.units] for _ in range(steps)]
        for step in range(steps):
            calls = [0]

            def count(frame: Any, event: str, arg: Any, calls: list[int] = calls) -> None:
                if event in ("call", "c_call"):
                    calls[0] += 1

            # Garbage of earlier tests collected mid-step (an executor's finalizer) would count calls that are
            # not the step's: collected before, and no collection while counting.
            gc.collect()
            gc.disable()
            sys.setprofile(count)
            try:
                for unit, inp in zip(reversed(state.units), reversed(inputs[step]), strict=True):
                    _call(unit, inp)
            finally:
                sys.setprofile(None)
                gc.enable()
            counts.append(calls[0])
    finally:
        state.close()
    return counts


@pytest.mark.parametrize("codec", ["none", "qsgd"])
def test_a_steps_cost_is_linear_in_units(one_rank, monkeypatch, codec):
    """The calls of a step at 4, 8 and 16 units: the same from step to step, and growing by the same number per
    unit (what a maximum over the units on every unit, or any other per-unit walk over them, would not)."""
    counts = {n: _calls_per_step(n, codec, monkeypatch) for n in (4, 8, 16)}
    for n, (a, b) in counts.items():
        assert a == b, (n, counts)
    c4, c8, c16 = (counts[n][0] for n in (4, 8, 16))
    per_unit = (c8 - c4) // 4
    assert c8 - c4 == 4 * per_unit and c16 - c8 == 8 * per_unit, counts
    assert c4 - 4 * per_unit >= 0  # what a step costs besides its units: a constant


class _OldState:
    """FSDP2's state before torch 2.13: one optional parameter group, no list."""

    def __init__(self, group: object) -> None:
        self._fsdp_param_group = group


class _NewState:
    def __init__(self, groups: list[object]) -> None:
        self._fsdp_param_groups = groups


@pytest.mark.parametrize(
    "state,want",
    [(_NewState(["a", "b"]), ["a", "b"]), (_NewState([]), []), (_OldState("a"), ["a"]), (_OldState(None), [])],
)
def test_a_units_parameter_groups_read_on_either_form_of_fsdp2s_state(state: object, want: list[object]) -> None:
    from sylvie_comm.fsdp import param_groups

    module = nn.Module()
    module._get_fsdp_state = lambda: state  # type: ignore[assignment,method-assign]
    assert param_groups(module) == want
