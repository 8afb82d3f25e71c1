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
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import ALGORITHMS, make_algorithm
from sylvie_comm.algorithms.base import Segment, ShardLayout
from sylvie_comm.codecs.onebit import row_layout
from sylvie_comm.collectives import Stats, wire_bytes
from sylvie_comm.collectives.local import run_local

WORLDS = [1, 2, 4]
SHARD = 37  # elements per rank: not a multiple of anything the codecs care about


def inputs(rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(world * SHARD, generator=g) * 3


def shards(name: str, world: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, Any]]:
    def body(tr: Any) -> tuple[torch.Tensor, Any]:
        alg, stats = make_algorithm(name, tr, {}), Stats()
        out = torch.empty(SHARD, dtype=dtype)
        alg.reduce_scatter(inputs(tr.rank, world).to(dtype), out, 0, stats.meter(0, world)).wait()
        alg.close()
        return out, stats.step(0)

    return run_local(world, body)


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


def test_algorithms_without_a_form_are_refused_with_the_reason():
    having = [n for n, cls in ALGORITHMS.items() if cls.shards]
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

BLOCK = 2048  # qsgd's elements per scale where a segment has rows of one element
# One FSDP unit's shard: a weight's rows (8 per row, 2 bits), a bias, a norm sent raw, a long vector (8 bits).
LAYOUT = ShardLayout(
    "unit",
    (
        Segment("a.weight", 0, 24, 8, True, {"bits": 2}),
        Segment("a.bias", 24, 5),
        Segment("norm", 29, 4, 1, False),
        Segment("emb", 33, 2 * BLOCK + 3, 1, True, {"bits": 8}),
    ),
)
UNIT = 33 + 2 * BLOCK + 3  # elements of LAYOUT's shard
# The same for onebit: rows of 64 (one scale each), 8-element rows (grouped up to 64), chunk_size per name.
ONEBIT_LAYOUT = ShardLayout(
    "unit",
    (
        Segment("a.weight", 0, 192, 64),
        Segment("b.weight", 192, 40, 8),
        Segment("norm", 232, 4, 1, False),
        Segment("emb", 236, 2 * BLOCK + 3, 1, True, {"chunk_size": 512}),
    ),
)
ONEBIT_UNIT = 236 + 2 * BLOCK + 3
Data = Callable[[int, int, int, int], torch.Tensor]


def grad(rank: int, step: int, world: int, shard: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + world)
    return torch.randn(world * shard, generator=g) * 3


def run_rs(
    name: str, world: int, steps: Any, *, options: dict[str, Any] | None = None, layout: ShardLayout | None = None,
    shard: int = SHARD, data: Data = grad, state: list[Any] | None = None, seed: int = 0,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per rank: the output of every step of ``steps``, the bytes, the state and memory after them."""

    def body(tr: Any) -> dict[str, Any]:
        alg, stats = make_algorithm(name, tr, options or {}, seed=seed), Stats()
        if state is not None:
            alg.load_state_dict(state[tr.rank])
        outs = {}
        for step in steps:
            out = torch.empty(shard)
            flat = data(tr.rank, step, world, shard)
            alg.reduce_scatter(flat, out, step, stats.meter(step, world), layout).wait()
            outs[step] = out
        st = alg.state_dict()
        result = {"outs": outs, "stats": stats, "state": st, "memory": alg.memory_bytes(), "report": alg.report()}
        alg.close()
        return result

    return run_local(world, body)


def rank_order_mean(parts: list[torch.Tensor]) -> torch.Tensor:
    """``(parts[0] + ... + parts[w - 1]) / w`` in fp32, in order (what the receiving rank computes)."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    return acc / len(parts) if len(parts) > 1 else acc


def exact_mean(world: int, step: int, shard: int, data: Data = grad) -> torch.Tensor:
    """The true average, ``(world, shard)``: row ``k`` is rank ``k``'s shard of it."""
    return (sum(data(r, step, world, shard).double() for r in range(world)) / world).view(world, shard)


def qsgd_row_bytes(layout: ShardLayout, bits: int = 4) -> int:
    """What a rank sends each peer: fp32 scale and minimum per row (per 2048-block of a vector's slice) and the
    raw segments' values, then the packed values, padded to whole words."""
    words = packed = 0
    for seg in layout.segments:
        if not seg.compress:
            words += seg.numel
            continue
        b = seg.options.get("bits", bits)
        if seg.row > 1:
            blocks = [(seg.numel // seg.row, seg.row)]
        else:
            blocks = [(seg.numel // BLOCK, BLOCK), (1, seg.numel % BLOCK)]
        for rows, cols in blocks:
            if rows and cols:
                words += 2 * rows
                packed += rows * math.ceil(cols * b / 8)
    return 4 * words + packed + (-packed) % 4


def onebit_row_bytes(layout: ShardLayout, chunk_size: int = 2048) -> int:
    """What a rank sends each peer: the scales of the all-reduce form's units (a segment's rows; one unit for a
    vector's slice) and the raw values in fp32, then a sign bit per element of every padded unit."""
    words = bits = 0
    for seg in layout.segments:
        if not seg.compress:
            words += seg.numel
            continue
        shape = (seg.numel // seg.row, seg.row) if seg.row > 1 else (seg.numel,)
        lay = row_layout(shape, seg.options.get("chunk_size", chunk_size))
        words += lay.units * lay.nchunks
        bits += lay.units * lay.width // 8
    return 4 * words + bits + (-bits) % 4


def default_layout(shard: int = SHARD) -> ShardLayout:
    return ShardLayout("", (Segment("", 0, shard),))


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


def with_nonfinite(at: int, value: float, bad_step: int = 2, bad_rank: int = 1) -> Data:
    """``grad``, with ``value`` at element ``at`` of shard 0 of rank ``bad_rank``'s input at ``bad_step``: only
    rank 0 receives it."""

    def data(rank: int, step: int, w: int, shard: int) -> torch.Tensor:
        x = grad(rank, step, w, shard)
        if (rank, step) == (bad_rank, bad_step):
            x[at] = value
        return x

    return data


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
    """``error_feedback`` must be a bool; off, the all-reduce form keeps no residual either."""
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
        assert off == {} and off_memory == 0
        assert tuple(on["w"]["residual"].shape) == (6, 10) and on_memory > 0


# ------------------------------------------------- the residual's update, once the step is decided, without a copy


# Every rank's outputs of each step (None: skipped) and its residuals after them, by name, as (w, numel).
Reference = tuple[list[list[torch.Tensor] | None], list[dict[str, torch.Tensor]]]


def qsgd_blocks(seg: Segment) -> list[tuple[int, int, int]]:
    """``(at, rows, cols)`` of each scale block of a segment's slice (its rows; 2048-blocks of a vector's)."""
    if seg.row > 1:
        return [(0, seg.numel // seg.row, seg.row)]
    full, rest = divmod(seg.numel, BLOCK)
    return ([(0, full, BLOCK)] if full else []) + ([(full * BLOCK, 1, rest)] if rest else [])


def qsgd_reference(world: int, steps: Any, options: dict[str, Any], layout: ShardLayout, shard: int,
                   data: Data, seed: int = 0) -> Reference:  # fmt: skip
    """Every rank's outputs (None for a skipped step) and residuals, by the formula the reduce-scatter form
    always had: ``residual = (residual + x) - decode(encode(residual + x))`` per block, in one go, with the
    noise of each name's stream (the agreed seed, the name, the rank) at ``step * w * numel + w * at``; a step
    with a non-finite input on some rank leaves every residual as it was."""
    import zlib

    from sylvie_comm.codecs.quant import QBitCodec

    compressed = [s for s in layout.segments if s.compress]
    res = [{s.name: torch.zeros(world, s.numel) for s in compressed} for _ in range(world)]
    outs: list[list[torch.Tensor] | None] = []
    for step in steps:
        xs = [data(r, step, world, shard).view(world, shard) for r in range(world)]
        good = all(bool(torch.isfinite(x).all()) for x in xs)
        decoded: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
        for r, x in enumerate(xs):
            for seg in compressed:
                stream = (seed * 1_000_003 + zlib.crc32(seg.name.encode()) * 131 + r) % 2**31
                codec = QBitCodec(bits=seg.options.get("bits", options.get("bits", 4)), seed=stream)
                comp = res[r][seg.name] + x[:, seg.offset : seg.offset + seg.numel]
                new, dec = comp.clone(), torch.empty(world, seg.numel)
                for at, rows, cols in qsgd_blocks(seg):
                    codec.offset = step * world * seg.numel + world * at
                    enc = codec.encode(comp[:, at : at + rows * cols].reshape(world * rows, cols))
                    dec[:, at : at + rows * cols] = codec.decode(enc).view(world, rows * cols)
                    new[:, at : at + rows * cols] -= dec[:, at : at + rows * cols]
                decoded[r][seg.name] = dec
                if good:
                    res[r][seg.name] = new
        outs.append(reference_outs(world, layout, shard, xs, decoded) if good else None)
    return outs, res


def onebit_reference(world: int, steps: Any, options: dict[str, Any], layout: ShardLayout, shard: int,
                     data: Data) -> Reference:  # fmt: skip
    """As :func:`qsgd_reference` for onebit: an exact layout through the fused kernel, which updates the
    residual in place as it encodes (what the form did), the others by the plain formula."""
    from sylvie_comm import kernels

    compressed = [s for s in layout.segments if s.compress]
    res = [{s.name: torch.zeros(world, s.numel) for s in compressed} for _ in range(world)]
    outs: list[list[torch.Tensor] | None] = []
    for step in steps:
        xs = [data(r, step, world, shard).view(world, shard) for r in range(world)]
        good = all(bool(torch.isfinite(x).all()) for x in xs)
        decoded: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
        for r, x in enumerate(xs):
            for seg in compressed:
                opts = {"chunk_size": 2048, "scale": "norm", **options, **seg.options}
                lay = row_layout((seg.numel // seg.row, seg.row) if seg.row > 1 else (seg.numel,), opts["chunk_size"])
                norm, xseg = opts["scale"] == "norm", x[:, seg.offset : seg.offset + seg.numel]
                dec = torch.empty(world, seg.numel)
                if lay.units and lay.span == lay.width and lay.last == lay.span:
                    new = res[r][seg.name].clone()
                    for k in range(world):
                        packed = torch.empty(lay.units * lay.width // 8, dtype=torch.uint8)
                        scales = torch.empty(lay.units * lay.nchunks)
                        kernels.onebit_feedback_encode(new[k], xseg[k], lay.chunk, norm, packed, scales)
                        dec[k] = kernels.onebit_decode(packed, scales, seg.numel, lay.chunk, torch.float32)
                else:
                    comp = res[r][seg.name] + xseg
                    new = torch.empty(world, seg.numel)
                    for k in range(world):
                        packed, scales = lay.encode_units(lay.to_units(comp[k]), norm)
                        local = lay.zero_padding_(lay.decode_units(packed, scales, lay.units))
                        new[k] = comp[k] - lay.from_units(local)
                        dec[k] = lay.from_units(lay.decode_units(packed, scales, lay.units))
                decoded[r][seg.name] = dec
                if good:
                    res[r][seg.name] = new
        outs.append(reference_outs(world, layout, shard, xs, decoded) if good else None)
    return outs, res


def reference_outs(world: int, layout: ShardLayout, shard: int, xs: list[torch.Tensor],
                   decoded: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:  # fmt: skip
    """Each rank's shard: the rank-order fp32 mean of every rank's decode (of its raw values where uncompressed)."""
    outs = []
    for k in range(world):
        out = torch.empty(shard)
        for seg in layout.segments:
            at = slice(seg.offset, seg.offset + seg.numel)
            parts = [decoded[j][seg.name][k] if seg.compress else xs[j][k, at].float() for j in range(world)]
            out[at] = rank_order_mean(parts)
        outs.append(out)
    return outs


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same fp32 words (``torch.equal`` would take -0.0 for 0.0)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


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
