"""What the reduce-scatter tests share: inputs, shard layouts, exact means, byte counts, references."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from sylvie_comm.algorithms import make_algorithm
from sylvie_comm.algorithms.base import Segment, ShardLayout
from sylvie_comm.codecs.onebit import row_layout
from sylvie_comm.collectives import Stats
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


def qsgd_row_bytes(layout: ShardLayout, bits: int = 4, merge: int = 1) -> int:
    """What a rank sends each peer: fp32 scale and minimum per row (per 2048-block of a vector's slice) and the
    raw segments' values, then the packed values, padded to whole words; ``merge``: rows taken that many at a
    time (what qsgd's ``block`` option makes of them; a vector's blocks as they are)."""
    words = packed = 0
    for seg in layout.segments:
        if not seg.compress:
            words += seg.numel
            continue
        b = seg.options.get("bits", bits)
        if seg.row > 1:
            blocks = [(seg.numel // seg.row // merge, seg.row * merge)]
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


def with_nonfinite(at: int, value: float, bad_step: int = 2, bad_rank: int = 1) -> Data:
    """``grad``, with ``value`` at element ``at`` of shard 0 of rank ``bad_rank``'s input at ``bad_step``: only
    rank 0 receives it."""

    def data(rank: int, step: int, w: int, shard: int) -> torch.Tensor:
        x = grad(rank, step, w, shard)
        if (rank, step) == (bad_rank, bad_step):
            x[at] = value
        return x

    return data


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
