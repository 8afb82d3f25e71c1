"""The reduce-scatter form (sharded data parallel): each rank ends with its shard of the average.

In one process through the in-process transport at 1, 2 and 4 ranks: plain averaging exact, the 16-bit
casts summed in fp32 (rounded once), the wire bytes exact against the fp32 reduce-scatter's, buffers on
the ``meta`` device, and the algorithms without a form refused with the reason. ``qsgd`` and ``onebit``:
within their codes' error of the mean, per row or per block, per-segment options and uncompressed segments,
qsgd unbiased without error feedback, the error-feedback invariant, exact bytes, bit-identical resume,
checkpoint checks, non-finite steps skipped on every rank, layouts that do not fit refused.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import ALGORITHMS, make_algorithm
from sylvie_comm.algorithms.base import Segment, ShardLayout
from sylvie_comm.codecs.onebit import row_layout
from sylvie_comm.collectives import wire_bytes
from sylvie_comm.collectives.local import run_local
from tests.algorithms.shard_cases import (
    BLOCK,
    LAYOUT,
    ONEBIT_LAYOUT,
    ONEBIT_UNIT,
    SHARD,
    UNIT,
    WORLDS,
    default_layout,
    exact_mean,
    grad,
    inputs,
    onebit_row_bytes,
    qsgd_row_bytes,
    rank_order_mean,
    run_rs,
    shards,
)


@pytest.mark.parametrize("world", WORLDS)
def test_plain_averaging_gives_each_rank_its_exact_shard_of_the_mean(world):
    for rank, (out, st) in enumerate(shards("none", world)):
        expected = inputs(0, world) / world
        for r in range(1, world):  # the in-process transport adds in rank order
            expected += inputs(r, world) / world
        assert torch.equal(out, expected[rank * SHARD : (rank + 1) * SHARD])
        assert st.bytes_sent == wire_bytes("reduce_scatter", 4 * world * SHARD, world) == st.bytes_uncompressed


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name,half", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_the_casts_send_16_bits_and_add_them_up_in_fp32_once(world, name, half):
    for rank, (out, st) in enumerate(shards(name, world)):
        # What each rank sent, x / w in 16 bits, added up in fp32 in rank order: rounded once, at the end.
        expected = torch.zeros(SHARD)
        for r in range(world):
            expected += (inputs(r, world) / world).to(half)[rank * SHARD : (rank + 1) * SHARD].float()
        assert torch.equal(out, expected)
        exact = sum(inputs(r, world).double() for r in range(world))[rank * SHARD : (rank + 1) * SHARD] / world
        tol = 1e-3 if half == torch.float16 else 1e-2
        torch.testing.assert_close(out.double(), exact, rtol=tol, atol=tol)
        assert st.bytes_sent == wire_bytes("all_to_all", 2 * world * SHARD, world)  # a 16-bit reduce-scatter's
        assert st.bytes_uncompressed == wire_bytes("reduce_scatter", 4 * world * SHARD, world)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_a_bf16_shard_takes_the_average_too(name):
    """FSDP's ``reduce_dtype`` may be bf16: input and output in bf16, the result that of fp32 rounded."""
    got = shards(name, 2, torch.bfloat16)
    exact = (inputs(0, 2).bfloat16().double() + inputs(1, 2).bfloat16().double()) / 2
    for rank, (out, _) in enumerate(got):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), exact[rank * SHARD : (rank + 1) * SHARD], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "qsgd", "onebit"])
def test_the_shard_stays_on_the_inputs_device(name):
    def body(tr: Any) -> torch.Tensor:
        alg = make_algorithm(name, tr, {})
        out = torch.empty(SHARD, device="meta")
        alg.reduce_scatter(torch.empty(2 * SHARD, device="meta"), out, 0).wait()
        alg.close()
        return out

    assert all(out.device.type == "meta" for out in run_local(2, body))


def test_qsgd_block_keeps_the_shard_on_the_inputs_device():
    """Merged rows (``a.weight``'s 3 rows under one scale) and wider vector blocks on ``meta``."""

    def body(tr: Any) -> torch.Tensor:
        alg = make_algorithm("qsgd", tr, {"block": 4096})
        out = torch.empty(UNIT, device="meta")
        for step in range(2):  # the residual made, then read
            alg.reduce_scatter(torch.empty(2 * UNIT, device="meta"), out, step, None, LAYOUT).wait()
        alg.close()
        return out

    assert all(out.device.type == "meta" for out in run_local(2, body))


def test_algorithms_without_a_form_are_refused_with_the_reason():
    having = [n for n, cls in ALGORITHMS.items() if cls.record.shards]
    assert having == ["none", "fp16", "bf16", "onebit", "qsgd"]

    def body(tr: Any) -> dict[str, str]:
        said = {}
        for name in ALGORITHMS:
            alg = make_algorithm(name, tr, {})
            try:
                alg.reduce_scatter(torch.zeros(2 * SHARD), torch.empty(SHARD), 0)
            except ValueError as exc:
                said[name] = str(exc)
            finally:
                alg.close()
        return said

    said = run_local(2, body)[0]
    assert set(said) == set(ALGORITHMS) - set(having)
    for name in ("acpsgd", "powersgd"):
        assert said[name].startswith(f"{name}: no reduce-scatter form (it factors whole matrices")
        assert "HSDP" in said[name] and said[name].endswith("algorithms with one: none, fp16, bf16, onebit, qsgd")
    for name in ("sign", "topk"):
        assert said[name].startswith(f"{name}: no reduce-scatter form (its encoding has no reduce-scatter form yet)")


def test_buffers_that_do_not_fit_are_refused():
    def body(tr: Any) -> list[str]:
        alg, said = make_algorithm("fp16", tr, {}), []
        for flat, out in ((torch.zeros(5), torch.empty(2)), (torch.zeros(4, dtype=torch.int32), torch.empty(2))):
            with pytest.raises(ValueError) as exc:
                alg.reduce_scatter(flat, out, 0)
            said.append(str(exc.value))
        alg.close()
        return said

    first, second = run_local(2, body)[0]
    assert "input has 5 elements, expected world_size * out.numel() = 2 * 2 = 4" in first
    assert "floating-point input and output on one device, got torch.int32 on cpu" in second


# ---------------------------------------------------------------------------------------------- qsgd and onebit


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("feedback", [True, False])
def test_qsgd_gives_each_rank_its_shard_of_the_mean_within_one_level(world, bits, feedback):
    """A first step (no residual yet): each element within the mean over ranks of one quantization level of its
    block (``(max - min) / (2 ** bits - 1)`` of the rank's slice); the bytes those of the formula."""
    got = run_rs("qsgd", world, [0], options={"bits": bits, "error_feedback": feedback})
    xs = [grad(r, 0, world, SHARD).view(world, SHARD) for r in range(world)]
    exact = exact_mean(world, 0, SHARD)
    for k, r in enumerate(got):
        level = sum((x[k].max() - x[k].min()) / (2**bits - 1) for x in xs) / world
        assert (r["outs"][0].double() - exact[k]).abs().max() <= level + 1e-5
        st = r["stats"].step(0)
        row = qsgd_row_bytes(default_layout(), bits)
        assert st.bytes_sent == wire_bytes("all_to_all", world * row, world) == (world - 1) * row
        assert st.bytes_uncompressed == wire_bytes("reduce_scatter", 4 * world * SHARD, world)
        assert st.collectives == 1  # one all-to-all


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scale", ["norm", "mean"])
def test_onebit_sends_signs_and_one_scale_per_chunk_of_each_shard(world, scale):
    """Without a layout each rank's shard is one unit cut into chunks of at most ``chunk_size``: the decode is
    the mean over ranks of ``sign(x) * scale``, the scale the RMS (``norm``) or mean |x| of the rank's slice."""
    got = run_rs("onebit", world, [0], options={"scale": scale})
    xs = [grad(r, 0, world, SHARD).view(world, SHARD).double() for r in range(world)]
    for k, r in enumerate(got):
        parts = []
        for x in xs:
            s = x[k].square().mean().sqrt() if scale == "norm" else x[k].abs().mean()
            parts.append(torch.where(x[k] >= 0, s, -s).float())
        torch.testing.assert_close(r["outs"][0], rank_order_mean(parts), rtol=1e-6, atol=1e-6)
        row = onebit_row_bytes(default_layout())
        assert row == 4 + 40 // 8 + 3  # one scale, 37 signs padded to 40, padded to a word
        assert r["stats"].step(0).bytes_sent == wire_bytes("all_to_all", world * row, world)


@pytest.mark.parametrize("world", WORLDS)
def test_qsgd_scales_per_row_of_a_segment_and_per_block_of_a_vector(world):
    """Values constant along each row of ``a.weight`` (and along each 2048-block of ``emb``) but different
    between rows and ranks: a per-row (per-block) scale is 0 there and the code exact, which a scale
    shared by two rows (two blocks) would not be. The bias and the raw norm travel too, the norm exactly."""

    def data(rank: int, step: int, w: int, shard: int) -> torch.Tensor:
        x = grad(rank, step, w, shard).view(w, shard)
        rows = torch.arange(w * 3, dtype=torch.float32).view(w, 3, 1) * (rank + 1) - 2.5
        x[:, :24] = rows.expand(w, 3, 8).reshape(w, 24)
        for b, at in enumerate((33, 33 + BLOCK)):
            x[:, at : at + BLOCK] = (torch.arange(w, dtype=torch.float32)[:, None] + 0.25 * b) * (rank - 1.5)
        return x.reshape(-1)

    got = run_rs("qsgd", world, [0], layout=LAYOUT, shard=UNIT, data=data)
    xs = [data(r, 0, world, UNIT).view(world, UNIT) for r in range(world)]
    for k, r in enumerate(got):
        out = r["outs"][0]
        exact = rank_order_mean([x[k] for x in xs])  # the receiver's own fp32 arithmetic
        assert torch.equal(out[:24], exact[:24]), "per-row scales: constant rows decode exactly"
        assert torch.equal(out[33 : 33 + 2 * BLOCK], exact[33 : 33 + 2 * BLOCK]), "per-block scales"
        assert torch.equal(out[29:33], exact[29:33]), "the uncompressed segment is the fp32 mean"
        torch.testing.assert_close(out, exact, atol=4.0, rtol=0)  # the 2-bit bias, the 3-element rest
        row = qsgd_row_bytes(LAYOUT)
        # 3 rows of 8 at 2 bits, a 5-element row at 4, the raw norm, 2 blocks + a rest of 3 at 8 bits
        assert row == 4 * (2 * 3 + 2 + 4 + 2 * 3) + 3 * 2 + 3 + 2 * BLOCK + 3  # (a whole number of words)
        assert r["stats"].step(0).bytes_sent == wire_bytes("all_to_all", world * row, world)


@pytest.mark.parametrize("world", WORLDS)
def test_qsgd_block_merges_a_segments_rows_under_one_scale(world):
    """``block`` 16: ``a.weight``'s 3 rows of 8 share one scale and minimum (3 is the smallest divisor of 3
    reaching 16 values), 16 bytes fewer to each peer. Values constant over the 24 decode exactly; values constant
    per row but different between rows, exact with a scale per row, are not once the rows share one."""

    def data(per_row: bool):
        def make(rank: int, step: int, w: int, shard: int) -> torch.Tensor:
            x = grad(rank, step, w, shard).view(w, shard)
            level = torch.arange(w * 3, dtype=torch.float32).view(w, 3, 1) if per_row else (
                torch.arange(w, dtype=torch.float32).view(w, 1, 1).expand(w, 3, 1))  # fmt: skip
            x[:, :24] = (level * (rank + 1) - 2.5).expand(w, 3, 8).reshape(w, 24)
            return x.reshape(-1)

        return make

    for per_row in (False, True):
        got = run_rs("qsgd", world, [0], layout=LAYOUT, shard=UNIT, data=data(per_row), options={"block": 16})
        xs = [data(per_row)(r, 0, world, UNIT).view(world, UNIT) for r in range(world)]
        for k, r in enumerate(got):
            exact = rank_order_mean([x[k] for x in xs])
            assert torch.equal(r["outs"][0][:24], exact[:24]) != per_row, per_row
            row = qsgd_row_bytes(LAYOUT, merge=3)
            assert row == qsgd_row_bytes(LAYOUT) - 4 * 2 * 2  # 2 scales and 2 minimums fewer
            assert r["stats"].step(0).bytes_sent == wire_bytes("all_to_all", world * row, world)


@pytest.mark.parametrize("world", [2, 4])
def test_qsgd_honours_the_bits_of_each_segment(world):
    """``emb`` at 8 bits lands within 1/255 of its range, ``a.weight`` at 2 bits within 1/3, as their bytes say."""
    got = run_rs("qsgd", world, [0], layout=LAYOUT, shard=UNIT, options={"error_feedback": False})
    exact = exact_mean(world, 0, UNIT)
    xs = [grad(r, 0, world, UNIT).view(world, UNIT) for r in range(world)]
    for k, r in enumerate(got):
        err = (r["outs"][0].double() - exact[k]).abs()
        emb = slice(33, UNIT)
        assert err[emb].max() <= max(float(x[k, emb].max() - x[k, emb].min()) for x in xs) / 255 + 1e-5
        rows = [x[k, :24].view(3, 8) for x in xs]
        assert err[:24].max() <= max(float((r.amax(1) - r.amin(1)).max()) for r in rows) / 3 + 1e-5
        assert err[:24].max() > 10 * err[emb].max()  # 2 bits: visibly coarser
    segments = [Segment(s.name, s.offset, s.numel, s.row, s.compress, {"bits": 8}) for s in LAYOUT.segments]
    wider = ShardLayout("unit", tuple(segments))
    assert qsgd_row_bytes(wider) - qsgd_row_bytes(LAYOUT) == 3 * (8 - 2) + math.ceil(5 * 8 / 8) - math.ceil(5 * 4 / 8)
    assert run_rs("qsgd", world, [0], layout=wider, shard=UNIT)[0]["stats"].step(0).bytes_sent == (
        world - 1
    ) * qsgd_row_bytes(wider)


@pytest.mark.parametrize("world", WORLDS)
def test_onebit_scales_per_row_and_per_chunk_with_per_segment_options(world):
    """Rows of 64 get a scale each (constant rows decode exactly), rows of 8 are grouped up to 64 elements, a
    vector's slice is chunked by its own ``chunk_size``, the raw norm is the fp32 mean: all as the formula."""

    def data(rank: int, step: int, w: int, shard: int) -> torch.Tensor:
        x = grad(rank, step, w, shard).view(w, shard)
        rows = (torch.arange(w * 3, dtype=torch.float32).view(w, 3, 1) - 1.0) * (rank + 1)
        x[:, :192] = rows.expand(w, 3, 64).reshape(w, 192)
        return x.reshape(-1)

    got = run_rs("onebit", world, [0], layout=ONEBIT_LAYOUT, shard=ONEBIT_UNIT, data=data)
    xs = [data(r, 0, world, ONEBIT_UNIT).view(world, ONEBIT_UNIT) for r in range(world)]
    for k, r in enumerate(got):
        out = r["outs"][0]
        exact = rank_order_mean([x[k] for x in xs])
        assert torch.equal(out[:192], exact[:192])
        assert torch.equal(out[232:236], exact[232:236])
        row = onebit_row_bytes(ONEBIT_LAYOUT)
        # 3 rows of 64: 3 scales, 24 bytes; 5 rows of 8 (40 elements, under 64: one unit): 1 scale, 5 bytes;
        # the norm's 4 words; 4099 elements in 9 chunks of 456 (at most 512): 9 scales, 513 bytes; 2 to a word
        emb = row_layout((2 * BLOCK + 3,), 512)
        assert (emb.units, emb.nchunks) == (1, 9)
        assert (emb.chunk, emb.width) == (456, 4104)
        assert row == 4 * (3 + 1 + 4 + 9) + 24 + 5 + 513 + 2
        assert r["stats"].step(0).bytes_sent == wire_bytes("all_to_all", world * row, world)


def test_the_compressed_reduce_scatters_against_the_fp32_one_at_a_realistic_size():
    """4 ranks, 2**16 elements per shard: onebit sends at least 16x fewer bytes than the fp32 reduce-scatter,
    qsgd about 32 / bits fewer (the scales cost 8 bytes per 2048 values)."""
    world, shard = 4, 2**16
    fp32 = wire_bytes("reduce_scatter", 4 * world * shard, world)
    ratios = {}
    for name, options in [("onebit", {}), ("qsgd", {"bits": 2}), ("qsgd", {"bits": 4}), ("qsgd", {"bits": 8})]:
        st = run_rs(name, world, [0], options=options, shard=shard)[0]["stats"].step(0)
        assert st.bytes_uncompressed == fp32
        ratios[name + str(options.get("bits", ""))] = fp32 / st.bytes_sent
    assert ratios["onebit"] >= 16
    assert ratios["onebit"] == fp32 / (3 * (shard // 8 + 4 * (shard // 2048)))  # ~31.5x
    for bits in (2, 4, 8):
        assert ratios[f"qsgd{bits}"] == fp32 / (3 * (shard * bits // 8 + 8 * (shard // BLOCK)))
        assert 0.98 * 32 / bits < ratios[f"qsgd{bits}"] < 32 / bits


@pytest.mark.parametrize("world", WORLDS)
def test_qsgd_without_error_feedback_is_unbiased(world):
    """The same input, 8 seeds x 32 steps of fresh noise at 2 bits: the mean of the decoded shards is within six
    standard deviations of the true shard average (the rounding's variance is at most ``level**2 / 4`` per
    rank, so the mean's at most ``sum level**2 / (4 w**2 n)``), while one draw is far off. Fixed seeds: the
    check is deterministic, and the bound is wide enough that no seed would fail it."""
    seeds, steps = 8, 32

    def same(rank: int, step: int, w: int, shard: int) -> torch.Tensor:
        return grad(rank, 0, w, shard)

    draws = [run_rs("qsgd", world, range(steps), options={"bits": 2, "error_feedback": False}, data=same, seed=s)
             for s in range(seeds)]  # fmt: skip
    xs = [grad(r, 0, world, SHARD).view(world, SHARD) for r in range(world)]
    exact = exact_mean(world, 0, SHARD)
    n = seeds * steps
    for k in range(world):
        outs = torch.stack([d[k]["outs"][t].double() for d in draws for t in range(steps)])
        levels = torch.tensor([float(x[k].max() - x[k].min()) / 3 for x in xs], dtype=torch.float64)
        sd = math.sqrt(float((levels**2).sum()) / (4 * world**2 * n))
        assert (outs.mean(0) - exact[k]).abs().max() <= 6 * sd
        assert (outs[0] - exact[k]).abs().max() > 4 * (outs.mean(0) - exact[k]).abs().max()
        assert draws[0][k]["state"] == {} and draws[0][k]["memory"] == 0  # no residual is kept


# ---------------------------------------------------------------------------------------------- row plans


def _layout_case(name: str) -> tuple[ShardLayout, int]:
    return (LAYOUT, UNIT) if name == "qsgd" else (ONEBIT_LAYOUT, ONEBIT_UNIT)


@pytest.mark.parametrize("name", ["qsgd", "onebit"])
def test_a_row_plan_is_found_by_the_layouts_identity(name):
    """Steps through one layout object run one row plan; an equal layout of another object (what the monitor's
    rewrite makes) builds its own, with the same rows; changed per-name options, a plan of their bytes; the
    tiling of a layout object checked at its first step only."""
    layout, shard = _layout_case(name)
    twin = ShardLayout(layout.key, tuple(layout.segments))
    opts = {"bits": 8} if name == "qsgd" else {"chunk_size": 64}
    wider = ShardLayout(layout.key, tuple(Segment(s.name, s.offset, s.numel, s.row, s.compress, opts)
                                          for s in layout.segments))  # fmt: skip

    def body(tr: Any) -> None:
        alg = make_algorithm(name, tr, {})
        out = torch.empty(shard)
        alg.reduce_scatter(grad(tr.rank, 0, 1, shard), out, 0, None, layout).wait()
        first = alg._shard_rows[(layout.key, shard)]
        for step in range(1, 4):
            alg.reduce_scatter(grad(tr.rank, step, 1, shard), out, step, None, layout).wait()
            assert alg._shard_rows[(layout.key, shard)] is first
        assert twin == layout and twin is not layout
        alg.reduce_scatter(grad(tr.rank, 4, 1, shard), out, 4, None, twin).wait()
        second = alg._shard_rows[(layout.key, shard)]
        assert second is not first and second.layout is twin and second.row_bytes == first.row_bytes
        alg.reduce_scatter(grad(tr.rank, 5, 1, shard), out, 5, None, wider).wait()
        third = alg._shard_rows[(layout.key, shard)]
        assert third.layout is wider and third.row_bytes != first.row_bytes
        alg.close()

    run_local(1, body)
    assert layout._tiles == shard == twin._tiles == wider._tiles  # each object checked once, for its shard
    cut = ShardLayout("cut", (Segment("x", 0, 5), Segment("y", 5, 7)))
    cut.check(12, "test")
    with pytest.raises(ValueError, match="covers 12 elements, the shard has 13"):
        cut.check(13, "test")  # another shard size: checked again
    assert cut._tiles == 12


@pytest.mark.parametrize("name", ["qsgd", "onebit"])
def test_a_loaded_checkpoint_has_its_residuals_checked_at_the_next_step(name, monkeypatch):
    """The residuals are checked against a row plan once, and again after a checkpoint is loaded into the
    algorithm: a residual of another shape is refused naming the segment, before anything changes; the
    algorithm's own state loaded back runs on, and is checked once more only."""
    from sylvie_comm.algorithms import onebit, qsgd

    layout, shard = _layout_case(name)
    first = layout.segments[0]
    module = qsgd if name == "qsgd" else onebit
    checks: list[str] = []
    original = module.check_residuals

    def counted(*args: Any) -> None:
        checks.append(args[2])
        original(*args)

    monkeypatch.setattr(module, "check_residuals", counted)

    def body(tr: Any) -> str:
        alg = make_algorithm(name, tr, {})
        out = torch.empty(shard)
        for step in range(3):
            alg.reduce_scatter(grad(tr.rank, step, 1, shard), out, step, None, layout).wait()
        assert len(checks) == 1
        good = alg.state_dict()
        bad = {n: dict(e) for n, e in good.items()}
        bad[first.name]["residual"] = torch.zeros(1, first.numel)  # the same elements, another shape
        alg.load_state_dict(bad)
        with pytest.raises(ValueError) as exc:
            alg.reduce_scatter(grad(tr.rank, 3, 1, shard), out, 3, None, layout)
        assert len(checks) == 2
        assert torch.equal(alg.state_dict()[first.name]["residual"], torch.zeros(1, first.numel))
        alg.load_state_dict(good)
        for step in range(3, 5):
            alg.reduce_scatter(grad(tr.rank, step, 1, shard), out, step, None, layout).wait()
        assert len(checks) == 3 and torch.isfinite(out).all()
        alg.close()
        return str(exc.value)

    said = run_local(1, body)[0]
    assert f"segment '{first.name}': its residual has shape (1, {first.numel})" in said
