"""SparseLoCo (``sparseloco``): the codec against a plain per-chunk reference, the algorithm against the recipe
written with nothing of the library, the bytes on the wire, options, state."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import ALGORITHMS, Group, Member, make_algorithm
from sylvie_comm.algorithms.sparseloco import row_bytes
from sylvie_comm.codecs import sparse
from sylvie_comm.codecs.sparse import ChunkPlan
from sylvie_comm.collectives import Meter, wire_bytes
from sylvie_comm.collectives.accounting import Stats
from sylvie_comm.collectives.local import run_local

SHAPES = {"w": (12, 50), "v": (37,), "m": (3, 4, 5)}


def ref_compress(x: torch.Tensor, chunk: int, density: float) -> torch.Tensor:
    """The recipe, chunk by chunk in Python: keep the k largest magnitudes, each rounded to the nearer of the
    chunk's smallest and largest kept magnitude, with its sign; zeros elsewhere."""
    flat = x.reshape(-1).tolist()
    n = len(flat)
    width = min(chunk, n)
    k = max(1, min(width, math.floor(density * width + 0.5)))
    out = [0.0] * n
    for start in range(0, n, width):
        part = flat[start : start + width] + [0.0] * max(0, start + width - n)
        kept = sorted(range(width), key=lambda i: -abs(part[i]))[:k]
        mags = [torch.tensor(abs(part[i]), dtype=torch.float32) for i in kept]
        low, high = min(mags), max(mags)
        for i in kept:
            if start + i >= n:
                continue
            mag = torch.tensor(abs(part[i]), dtype=torch.float32)
            level = high if 2 * mag >= low + high else low
            out[start + i] = float(-level if part[i] < 0 else level)
    return torch.tensor(out, dtype=torch.float32).view(x.shape)


@pytest.mark.parametrize(("numel", "chunk", "density"), [(1000, 64, 0.05), (4096 * 3, 4096, 1 / 64), (37, 4096, 0.1),
                                                         (130, 16, 0.25), (5, 2, 1.0)])  # fmt: skip
def test_the_codec_gives_the_reference_recipe(numel: int, chunk: int, density: float) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    plan = ChunkPlan.of(numel, chunk, density)
    enc = sparse.encode(x, plan)
    assert torch.equal(sparse.decode(enc, plan), ref_compress(x, chunk, density))
    # through the wire's bytes: the same encoding back
    meta = torch.empty(2 * plan.chunks)
    offsets = torch.empty(plan.offset_bytes, dtype=torch.uint8)
    codes = torch.empty(plan.code_bytes, dtype=torch.uint8)
    sparse.write(enc, plan, meta, offsets, codes)
    back = sparse.read(plan, meta, offsets, codes)
    assert torch.equal(back.offsets, enc.offsets) and torch.equal(back.codes, enc.codes)
    assert torch.equal(sparse.decode(back, plan), sparse.decode(enc, plan))


def test_offsets_take_log2_chunk_bits_packed() -> None:
    plan = ChunkPlan.of(4096 * 8, 4096, 1 / 64)
    assert (plan.k, plan.offset_bits, plan.chunks) == (64, 12, 8)
    assert plan.offset_bytes == 8 * 64 * 12 // 8 and plan.code_bytes == 8 * 64 * 2 // 8
    assert plan.payload_bytes == 8 * 8 + 768 + 128
    assert ChunkPlan.of(100, 4096, 0.1).offset_bits == 7  # one chunk of 100: offsets below 128
    for bits in (1, 2, 5, 12, 16):
        v = torch.randint(0, 1 << bits, (101,), generator=torch.Generator().manual_seed(bits))
        packed = sparse.pack_bits(v, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == -(-101 * bits // 8)
        assert torch.equal(sparse.unpack_bits(packed, bits, 101), v)


def test_stochastic_rounding_is_unbiased_between_the_two_magnitudes() -> None:
    x = torch.linspace(-1, 1, 64)
    plan = ChunkPlan.of(64, 64, 1.0)
    total = torch.zeros(64)
    draws = 400
    for s in range(draws):
        total += sparse.decode(sparse.encode(x, plan, "stochastic", seed=s), plan)
    assert (total / draws - x).abs().max() < 0.1
    again = sparse.decode(sparse.encode(x, plan, "stochastic", seed=7), plan)
    assert torch.equal(again, sparse.decode(sparse.encode(x, plan, "stochastic", seed=7), plan))


def inputs(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {n: torch.randn(s, generator=g) * (1 + rank) for n, s in SHAPES.items()}


def run(world: int, steps: int, options: dict[str, Any], resume_at: int | None = None) -> list[list[dict]]:
    def body(tr: Any) -> list[dict]:
        alg = make_algorithm("sparseloco", tr, options)
        out = []
        for step in range(steps):
            if step == resume_at:
                state = alg.state_dict()
                alg.close()
                alg = make_algorithm("sparseloco", tr, options)
                alg.check_state_dict(state, {n: (s, alg.options) for n, s in SHAPES.items()}, True)
                alg.load_state_dict(state)
            x = inputs(tr.rank, step)
            stats = Stats()
            alg(Group(0, [Member(n, t) for n, t in x.items()]), step, Meter(tr.world_size, stats, step)).wait()
            out.append({"out": x, "bytes": stats.step(step).bytes_sent})
        alg.close()
        return out

    return run_local(world, body)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("decay", [0.95, 1.0])
def test_the_average_is_the_recipe_in_rank_order_on_every_rank(world: int, decay: float) -> None:
    chunk, density, steps = 64, 0.1, 3
    runs = run(world, steps, {"chunk": chunk, "density": density, "decay": decay})
    residual = [{n: torch.zeros(s) for n, s in SHAPES.items()} for _ in range(world)]
    for step in range(steps):
        for n in SHAPES:
            total = torch.zeros(SHAPES[n])
            for r in range(world):
                e = decay * residual[r][n] + inputs(r, step)[n]
                sent = ref_compress(e, chunk, density)
                residual[r][n] = e - sent
                total = total + sent
            expected = total / world
            for r in range(world):
                assert torch.equal(runs[r][step]["out"][n], expected), (n, step, r)


def test_bytes_on_the_wire_are_the_declared_layout() -> None:
    options = {"chunk": 64, "density": 0.1}
    plans = [ChunkPlan.of(math.prod(s), 64, 0.1) for s in SHAPES.values()]

    def body(tr: Any) -> int:
        alg = make_algorithm("sparseloco", tr, options)
        stats = Stats()
        x = inputs(tr.rank, 0)
        alg(Group(0, [Member(n, t) for n, t in x.items()]), 0, Meter(tr.world_size, stats, 0)).wait()
        alg.close()
        return int(stats.step(0).bytes_sent)

    sent = run_local(3, body)
    assert sent == [wire_bytes("all_gather", row_bytes(plans), 3)] * 3
    # 12-bit offsets, 2-bit codes and two fp32 magnitudes per chunk of 4096: 0.0293 bytes per element
    per = ALGORITHMS["sparseloco"].record.payload_per_element({})
    assert per == (8 + 64 * 12 / 8 + 64 * 2 / 8) / 4096


def test_resume_from_the_state_dict_is_bit_exact() -> None:
    for rounding in ("deterministic", "stochastic"):
        options = {"chunk": 64, "density": 0.1, "rounding": rounding}
        straight = run(2, 4, options)
        resumed = run(2, 4, options, resume_at=2)
        for a, b in zip(straight, resumed, strict=True):
            for sa, sb in zip(a, b, strict=True):
                for n in SHAPES:
                    assert torch.equal(sa["out"][n], sb["out"][n]), (rounding, n)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"density": 0}, "density must be a number in \\(0, 1\\]"),
        ({"density": 1.5}, "density"),
        ({"density": True}, "density"),
        ({"chunk": 1000}, "chunk must be a power of two"),
        ({"chunk": 1 << 17}, "chunk"),
        ({"chunk": 4096.0}, "chunk"),
        ({"decay": -0.1}, "decay must be a number in \\[0, 1\\]"),
        ({"decay": 1.5}, "decay"),
        ({"rounding": "nearest"}, "rounding must be one of deterministic, stochastic, got 'nearest'"),
        ({"ratio": 0.1}, "unknown option"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ALGORITHMS["sparseloco"].validate_options(options)  # what the constructor runs first


def test_a_nonfinite_input_is_skipped_and_the_residual_restored() -> None:
    def body(tr: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        alg = make_algorithm("sparseloco", tr, {"chunk": 64, "density": 0.1})
        x = inputs(tr.rank, 0)
        alg(Group(0, [Member(n, t) for n, t in x.items()]), 0).wait()
        alg.guard.settle()
        before = alg.state_dict()["w"]["residual"]
        y = inputs(tr.rank, 1)
        if tr.rank == 1:
            y["w"][0, 0] = float("nan")
        alg(Group(0, [Member(n, t) for n, t in y.items()]), 1).wait()
        alg.guard.settle()
        after = alg.state_dict()["w"]["residual"]
        alg.close()
        return before, after, torch.cat([t.reshape(-1) for t in y.values()])

    for before, after, out in run_local(2, body):
        assert torch.equal(before, after)
        assert not bool(torch.isfinite(out).all())  # the average written non-finite, on every rank
