"""The state of the compressed reduce-scatter forms (``qsgd``, ``onebit``), in one process at 2 and 4 ranks.

The error-feedback invariant, bit-identical resume, checkpoints and layouts that do not fit refused, non-finite
steps skipped on every rank with the residuals as they were, state on the input's device, and the residual
updated after the step's verdict with the bits of the one-pass formula and no copy kept.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import ALGORITHMS, make_algorithm
from sylvie_comm.algorithms.base import Segment, ShardLayout
from sylvie_comm.collectives.local import run_local
from tests.algorithms.shard_cases import (
    BLOCK,
    LAYOUT,
    ONEBIT_LAYOUT,
    ONEBIT_UNIT,
    SHARD,
    UNIT,
    WORLDS,
    bits_equal,
    default_layout,
    exact_mean,
    grad,
    onebit_reference,
    qsgd_reference,
    run_rs,
    with_nonfinite,
)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name,options,layout,shard", [
    ("qsgd", {"bits": 2}, None, SHARD),
    ("qsgd", {}, LAYOUT, UNIT),
    ("onebit", {}, None, SHARD),
    ("onebit", {}, ONEBIT_LAYOUT, ONEBIT_UNIT),
])  # fmt: skip
def test_error_feedback_keeps_what_was_not_sent(world, name, options, layout, shard):
    """Over any number of steps, what reached every rank's shard plus the mean of every rank's residual of that
    shard is the sum of the true averages (to fp32 rounding): nothing is lost, only delayed."""
    steps = 6
    got = run_rs(name, world, range(steps), options=options, layout=layout, shard=shard)
    lay = layout or default_layout(shard)
    for k, r in enumerate(got):
        total = sum(exact_mean(world, t, shard)[k] for t in range(steps))
        sent = sum(r["outs"][t].double() for t in range(steps))
        for seg in lay.segments:
            if seg.compress:
                held = [got[j]["state"][seg.name]["residual"].view(world, seg.numel)[k].double() for j in range(world)]
                assert held[0].abs().max() > 0, "something is held back"
                sent[seg.offset : seg.offset + seg.numel] += sum(held) / world
        torch.testing.assert_close(sent, total, rtol=0, atol=1e-4)
        res = {n: tuple(e["residual"].shape) for n, e in r["state"].items()}
        assert res == {s.name: (world * s.numel // s.row, s.row) for s in lay.segments if s.compress}
        assert r["memory"] == 4 * world * sum(s.numel for s in lay.segments if s.compress)  # the residuals alone


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name,options,layout,shard", [
    ("qsgd", {}, LAYOUT, UNIT),
    ("qsgd", {"error_feedback": False}, LAYOUT, UNIT),
    ("onebit", {}, ONEBIT_LAYOUT, ONEBIT_UNIT),
    ("onebit", {}, None, 2 * BLOCK),  # an exact layout: the fused kernels' path
])  # fmt: skip
def test_a_resumed_run_continues_bit_for_bit(world, name, options, layout, shard):
    """Three steps, a checkpoint (checked against the layout's segments first), a new algorithm that loads it
    and runs three more: the same outputs and state as six steps without a break, noise included."""
    whole = run_rs(name, world, range(6), options=options, layout=layout, shard=shard)
    first = run_rs(name, world, range(3), options=options, layout=layout, shard=shard)
    segments = {s.name: s for s in (layout or default_layout(shard)).segments}
    states = [r["state"] for r in first]

    def check(tr: Any) -> None:
        alg = make_algorithm(name, tr, options)
        alg.check_state_dict(states[tr.rank], {}, True, shards=segments)
        alg.close()

    run_local(world, check)
    rest = run_rs(name, world, range(3, 6), options=options, layout=layout, shard=shard, state=states)
    for a, b in zip(whole, rest, strict=True):
        for t in range(3, 6):
            assert torch.equal(a["outs"][t], b["outs"][t]), t
        assert a["state"].keys() == b["state"].keys()
        for n in a["state"]:
            assert torch.equal(a["state"][n]["residual"], b["state"][n]["residual"]), n


@pytest.mark.parametrize("name,layout,shard", [("qsgd", LAYOUT, UNIT), ("onebit", ONEBIT_LAYOUT, ONEBIT_UNIT)])
def test_a_shard_checkpoint_that_does_not_fit_is_refused_naming_the_field(name, layout, shard):
    state = run_rs(name, 2, range(2), layout=layout, shard=shard)[0]["state"]  # rank 0's, checked as rank 0 and 1
    segments = {s.name: s for s in layout.segments}

    def check(tampered: Any, stepped: bool = True, options: dict[str, Any] | None = None) -> str:
        said = []

        def body(tr: Any) -> None:
            alg = make_algorithm(name, tr, options or {})
            try:
                alg.check_state_dict(tampered, {}, stepped, shards=segments)
                said.append("ok")
            except ValueError as exc:
                said.append(str(exc))
            finally:
                alg.close()

        run_local(2, body)
        assert said[0] == said[1]
        return said[0]

    assert check(state) == "ok"
    assert sorted(state) == sorted(s.name for s in layout.segments if s.compress)
    wrong = {**state, "a.weight": {"residual": state["a.weight"]["residual"].view(-1, 1)}}
    said = check(wrong)
    assert "checkpoint entry 'a.weight'" in said and "shape (" in said
    assert str(tuple(state["a.weight"]["residual"].shape)) in said
    missing = {n: e for n, e in state.items() if n != "emb"}
    assert "no state for 'emb'" in check(missing)
    assert check(missing, stepped=False) == "ok"
    assert "holds state for 'norm'" in check({**state, "norm": state["a.weight"]})  # sent uncompressed
    assert "holds state for 'other'" in check({**state, "other": state["a.weight"]})
    if name == "qsgd":
        assert "expected []" in check(state, options={"error_feedback": False})
        assert check({}, options={"error_feedback": False}) == "ok"


@pytest.mark.parametrize("name", ["qsgd", "onebit"])
def test_a_layout_that_does_not_fit_is_refused_before_anything_changes(name):
    """Segments that do not tile the shard, a name twice, an invalid per-name option, a segment whose residual
    has another shape (a changed layout): each a ValueError naming it, and the algorithm runs on after."""
    layout = LAYOUT if name == "qsgd" else ONEBIT_LAYOUT
    shard = UNIT if name == "qsgd" else ONEBIT_UNIT
    first = layout.segments[0]
    bad_option = {"bits": 3} if name == "qsgd" else {"chunk_size": 7}
    cases = {
        "gap": ShardLayout("unit", (Segment("x", 0, 5), Segment("y", 6, shard - 6))),
        "short": ShardLayout("unit", (Segment("x", 0, shard - 1),)),
        "rows": ShardLayout("unit", (Segment("x", 0, 3, 2), Segment("y", 3, shard - 3))),
        "twice": ShardLayout("unit", (Segment("x", 0, 5), Segment("x", 5, shard - 5))),
        "option": ShardLayout("unit", (Segment("x", 0, 5, 1, True, bad_option), Segment("y", 5, shard - 5))),
        "reshaped": ShardLayout(
            "unit2",
            (
                Segment(first.name, 0, first.numel - first.row, first.row),
                Segment("y", first.numel - first.row, shard - first.numel + first.row),
            ),
        ),
    }

    def body(tr: Any) -> dict[str, str]:
        alg, said = make_algorithm(name, tr, {}), {}
        out = torch.empty(shard)
        alg.reduce_scatter(grad(tr.rank, 0, 2, shard), out, 0, None, layout).wait()
        before = {n: e["residual"].clone() for n, e in alg.state_dict().items()}
        for case, bad in cases.items():
            with pytest.raises(ValueError) as exc:
                alg.reduce_scatter(grad(tr.rank, 1, 2, shard), torch.empty(shard), 1, None, bad)
            said[case] = str(exc.value)
        after = alg.state_dict()
        assert all(torch.equal(before[n], after[n]["residual"]) for n in before)
        alg.reduce_scatter(grad(tr.rank, 1, 2, shard), out, 1, None, layout).wait()
        assert torch.isfinite(out).all() and alg.report()["skipped_nonfinite"] == 0
        alg.close()
        return said

    said = run_local(2, body)[0]
    assert "segment 'y' (offset 6" in said["gap"] and "does not follow at offset 5" in said["gap"]
    assert f"covers {shard - 1} elements, the shard has {shard}" in said["short"]
    assert "segment 'x' (offset 0, 3 elements in rows of 2)" in said["rows"]
    assert "names segment 'x' twice" in said["twice"]
    why = "bits must be 2, 4 or 8" if name == "qsgd" else "chunk_size must be a positive multiple of 8"
    assert "segment 'x'" in said["option"] and why in said["option"]
    assert f"segment '{first.name}': its residual has shape" in said["reshaped"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name,options,layout,shard,where", [
    ("qsgd", {}, LAYOUT, UNIT, "compressed"),
    ("qsgd", {}, LAYOUT, UNIT, "raw"),
    ("qsgd", {"error_feedback": False}, LAYOUT, UNIT, "compressed"),
    ("onebit", {}, ONEBIT_LAYOUT, ONEBIT_UNIT, "compressed"),
    ("onebit", {}, ONEBIT_LAYOUT, ONEBIT_UNIT, "raw"),
    ("onebit", {}, None, 2 * BLOCK, "compressed"),  # the fused kernels' path
])  # fmt: skip
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nonfinite_input_on_one_rank_skips_the_step_on_every_rank(world, name, options, layout, shard, where,
                                                                     value):  # fmt: skip
    """One NaN (Inf) in one element of rank 1's input, in shard 0 (only rank 0 receives it): every rank's shard is
    not finite, every rank's residual is bit for bit as before, the step is counted, and the next step is that
    of a run that never had it."""
    lay = layout or default_layout(shard)
    raw = [s for s in lay.segments if not s.compress]
    at = raw[0].offset + 1 if where == "raw" else lay.segments[-1].offset + 7
    bad = run_rs(name, world, range(4), layout=layout, shard=shard, options=options, data=with_nonfinite(at, value))
    before = run_rs(name, world, range(2), layout=layout, shard=shard, options=options)
    clean = run_rs(name, world, [0, 1, 3], layout=layout, shard=shard, options=options)
    for r, c in zip(bad, clean, strict=True):
        assert not torch.isfinite(r["outs"][2]).all()
        assert r["report"]["skipped_nonfinite"] == 1
        assert torch.equal(r["outs"][3], c["outs"][3])
        for n in c["state"]:
            assert torch.equal(r["state"][n]["residual"], c["state"][n]["residual"]), n
    # The state right after the skipped step is the state before it: a run stopped there.
    stopped = run_rs(name, world, range(3), layout=layout, shard=shard, options=options,
                     data=with_nonfinite(at, value))  # fmt: skip
    for r, b in zip(stopped, before, strict=True):
        assert r["state"].keys() == b["state"].keys()
        for n in b["state"]:
            assert torch.equal(r["state"][n]["residual"], b["state"][n]["residual"]), n


@pytest.mark.parametrize("name,options", [("qsgd", {}), ("qsgd", {"error_feedback": False}), ("onebit", {})])
def test_the_compressed_forms_keep_their_state_on_the_inputs_device(name, options):
    """Two steps on ``meta`` through a layout with an uncompressed segment: output, residuals and every
    temporary on ``meta`` (a buffer made on the CPU would fail to mix with them); no guard copy is kept."""
    layout = LAYOUT if name == "qsgd" else ONEBIT_LAYOUT
    shard = UNIT if name == "qsgd" else ONEBIT_UNIT

    def body(tr: Any) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        alg = make_algorithm(name, tr, options)
        out = torch.empty(shard, device="meta")
        for step in range(2):
            alg.reduce_scatter(torch.empty(2 * shard, device="meta"), out, step, None, layout).wait()
        state = [t for e in alg.state_dict().values() for t in e.values()]
        memory = alg.memory_bytes()
        alg.close()
        return out, state, memory

    for out, state, memory in run_local(2, body):
        assert out.device.type == "meta" and all(t.device.type == "meta" for t in state)
        compressed = sum(s.numel for s in layout.segments if s.compress)
        assert len(state) == (0 if options else 3) and memory == (0 if options else 4 * 2 * compressed)


@pytest.mark.parametrize("name", ["qsgd", "onebit"])
def test_a_bf16_shard_of_a_compressed_form(name):
    """FSDP's ``reduce_dtype`` may be bf16: the residual stays fp32, the shard comes back in bf16."""

    def body(tr: Any) -> torch.Tensor:
        alg = make_algorithm(name, tr, {"bits": 8} if name == "qsgd" else {})
        out = torch.empty(SHARD, dtype=torch.bfloat16)
        alg.reduce_scatter(grad(tr.rank, 0, 2, SHARD).bfloat16(), out, 0).wait()
        assert alg.state_dict()[""]["residual"].dtype == torch.float32
        alg.close()
        return out

    exact = (grad(0, 0, 2, SHARD).bfloat16().double() + grad(1, 0, 2, SHARD).bfloat16().double()) / 2
    for rank, out in enumerate(run_local(2, body)):
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        err = (out.double() - exact[rank * SHARD : (rank + 1) * SHARD]).abs().max()
        assert err < (0.2 if name == "qsgd" else 10.0)


def test_qsgd_error_feedback_is_an_option_of_both_forms():
    """``error_feedback`` must be a bool; off, the all-reduce form keeps no residual either (only its wire buffers:
    a row of 80 bytes for a (6, 10) tensor at 4 bits, sent and gathered from 2 ranks, and the fp32 sum)."""
    from sylvie_comm.algorithms import Group, Member

    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=f"qsgd: error_feedback must be True or False, got {bad!r}"):
            ALGORITHMS["qsgd"].validate_options({"error_feedback": bad})

    def body(tr: Any) -> tuple[dict[str, Any], int, dict[str, Any], int]:
        out = []
        for feedback in (False, True):
            alg = make_algorithm("qsgd", tr, {"error_feedback": feedback})
            g = torch.Generator().manual_seed(tr.rank)
            alg(Group(0, [Member("w", torch.randn(6, 10, generator=g))]), 0).wait()
            out += [alg.state_dict(), alg.memory_bytes()]
            alg.close()
        return tuple(out)  # type: ignore[return-value]

    for off, off_memory, on, on_memory in run_local(2, body):
        assert off == {} and off_memory == 80 * (1 + 2) + 4 * 60
        assert tuple(on["w"]["residual"].shape) == (6, 10) and on_memory >= off_memory + 4 * 60


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,options,layout,shard", [
    ("qsgd", {}, LAYOUT, UNIT),  # per-row bits, a raw segment, 2048-blocks and a rest
    ("qsgd", {"bits": 2}, None, SHARD),
    ("onebit", {}, ONEBIT_LAYOUT, ONEBIT_UNIT),  # exact layouts (the fused kernel's) and a padded one
    ("onebit", {"scale": "mean"}, None, 2 * BLOCK),  # an exact layout
    ("onebit", {}, None, SHARD),  # a padded one
])  # fmt: skip
def test_the_residual_updated_after_the_decode_has_the_bits_of_the_one_pass_formula(world, dtype, name, options,
                                                                                     layout, shard):  # fmt: skip
    """Six steps, the fourth with a NaN on rank 1: outputs and residuals bit for bit those of the formula the
    form had, which updated the residual as it encoded (and restored a copy of it on a skip), qsgd's noise
    included; the skipped step's output not finite. The form now changes the residual only after the decode."""
    lay = layout or default_layout(shard)
    nan = with_nonfinite(lay.segments[-1].offset + 7, float("nan"), bad_step=3)

    def data(rank: int, step: int, w: int, n: int) -> torch.Tensor:
        return nan(rank, step, w, n).to(dtype)

    steps = range(6)
    got = run_rs(name, world, steps, options=options, layout=layout, shard=shard, data=data)
    reference = qsgd_reference if name == "qsgd" else onebit_reference
    outs, residuals = reference(world, steps, options, lay, shard, data)
    for k, r in enumerate(got):
        for t in steps:
            expected = outs[t]
            if expected is None:
                assert not torch.isfinite(r["outs"][t]).all() and r["report"]["skipped_nonfinite"] == 1
            else:
                assert bits_equal(r["outs"][t], expected[k]), (k, t)
        assert r["state"].keys() == residuals[k].keys()
        for n, e in r["state"].items():
            assert bits_equal(e["residual"].view(world, -1), residuals[k][n]), (k, n)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name,layout,shard", [
    ("qsgd", LAYOUT, UNIT), ("qsgd", None, 2**16), ("onebit", ONEBIT_LAYOUT, ONEBIT_UNIT), ("onebit", None, 2**16),
])  # fmt: skip
def test_the_compressed_forms_keep_the_residuals_and_no_copy_of_them(world, name, layout, shard):
    """Four steps, the third skipped (a NaN on rank 1): ``memory_bytes()`` is exactly the bytes of the residuals,
    each rank's slice of every compressed segment in every shard, fp32 (``4 * w * numel``): no guard copy."""
    lay = layout or default_layout(shard)
    data = with_nonfinite(lay.segments[-1].offset + 7, float("inf"), bad_step=2)
    compressed = sum(s.numel for s in lay.segments if s.compress)
    for r in run_rs(name, world, range(4), layout=layout, shard=shard, data=data):
        assert r["report"]["skipped_nonfinite"] == 1
        held = sum(e["residual"].numel() * e["residual"].element_size() for e in r["state"].values())
        assert held == 4 * world * compressed
        assert r["memory"] == held


@pytest.mark.parametrize("name", ["qsgd", "onebit"])
def test_a_nonfinite_unit_skips_the_later_units_of_its_step_too(name):
    """Two units per step, the first with a NaN on rank 1 at step 1: the second unit's residual is left as it
    was that step too (the verdict is the step's so far), and the next step runs as one that never had it."""
    shard = 2 * BLOCK
    units = [ShardLayout(u, (Segment(f"{u}.w", 0, shard),)) for u in ("u1", "u2")]

    def body(tr: Any) -> list[dict[str, torch.Tensor]]:
        alg, states = make_algorithm(name, tr, {}), []
        for step in range(3):
            for i, layout in enumerate(units):
                flat = grad(tr.rank, 10 * step + i, 2, shard)
                if (tr.rank, step, i) == (1, 1, 0):
                    flat[5] = float("nan")
                alg.reduce_scatter(flat, torch.empty(shard), step, None, layout).wait()
            states.append({n: e["residual"].clone() for n, e in alg.state_dict().items()})
        assert alg.report()["skipped_nonfinite"] == 1
        alg.close()
        return states

    for states in run_local(2, body):
        for n in ("u1.w", "u2.w"):
            assert bits_equal(states[1][n], states[0][n]), n
            assert not bits_equal(states[2][n], states[1][n]), n
