"""qsgd's all-gather form against the codec it is built on: every rank's tensors encoded by ``QBitCodec`` with
``ErrorFeedback`` (the step's noise position ``step * numel``), every rank's code decoded and summed in rank order,
divided by the world size. The algorithm goes straight through the kernels into its wire buffers: the same bits out,
the same residuals, at every width and with the feedback off."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import Group, Member, make_algorithm
from sylvie_comm.algorithms.qsgd import QSGDAlgorithm, merged_rows
from sylvie_comm.codecs.feedback import ErrorFeedback
from sylvie_comm.codecs.quant import QBitCodec
from sylvie_comm.collectives.accounting import Meter, Stats
from sylvie_comm.collectives.local import run_local

SHAPES = {"w": (6, 10), "conv": (4, 3, 2, 2), "b": (7,)}
STEPS = 4


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(97 * step + rank)
    return {n: torch.randn(s, generator=g) * (1 + rank) for n, s in SHAPES.items()}


def run(world: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    def body(tr: Any) -> dict[str, Any]:
        alg = make_algorithm("qsgd", tr, options, seed=11)
        outs, seeds = [], {}
        for step in range(STEPS):
            values = grads(tr.rank, step)
            flat = torch.cat([v.reshape(-1) for v in values.values()])
            members, at = [], 0
            for n, v in values.items():
                members.append(Member(n, flat[at : at + v.numel()].view(v.shape)))
                at += v.numel()
            alg(Group(0, members, flat=flat), step).wait()
            outs.append({m.name: m.tensor.clone() for m in members})
            seeds = {n: alg._codec(n, alg.bits).seed for n in SHAPES}
        residuals = {n: alg.feedback.residual(n) for n in SHAPES} if alg.feedback_on else {}
        alg.close()
        return {"outs": outs, "seeds": seeds, "residuals": {n: r.clone() for n, r in residuals.items()}}

    return run_local(world, body)


def row_size(shape: tuple[int, ...], block: int) -> int | None:
    """The codec's rows for ``block``: a tensor's own rows (None) at 1, else the merged rows' length."""
    if block == 1:
        return None
    rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))
    return merged_rows(rows, cols, block)[1]


def reference(world: int, bits: int, feedback: bool, seeds: list[dict[str, int]],
              block: int = 1) -> tuple[list[Any], list[Any]]:  # fmt: skip
    efs = [ErrorFeedback() for _ in range(world)]
    codecs = [{n: QBitCodec(bits=bits, seed=seeds[r][n], row_size=row_size(shape, block))
               for n, shape in SHAPES.items()} for r in range(world)]  # fmt: skip
    outs = []
    for step in range(STEPS):
        encoded = []
        for r in range(world):
            per = {}
            for n, g in grads(r, step).items():
                codec = codecs[r][n]
                codec.offset = step * g.numel()
                per[n] = (efs[r].encode(codec, n, g) if feedback else codec.encode(g), codec)
            encoded.append(per)
        out = {}
        for n, shape in SHAPES.items():
            total = torch.zeros(shape)
            for r in range(world):
                enc, codec = encoded[r][n]
                total += codec.decode(enc)
            out[n] = total / world
        outs.append(out)
    return outs, [{n: ef.residual(n) for n in SHAPES} for ef in efs]


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("feedback", [True, False])
@pytest.mark.parametrize("block", [1, 20])
def test_qsgd_gives_the_codecs_bits_and_residuals(world: int, bits: int, feedback: bool, block: int) -> None:
    """``block`` 20: w's rows two at a time (3 x 20), conv's (2 x 24), the vector one row as before."""
    got = run(world, {"bits": bits, "error_feedback": feedback, "block": block})
    want, residuals = reference(world, bits, feedback, [g["seeds"] for g in got], block)
    for rank in range(world):
        for step in range(STEPS):
            for n in SHAPES:
                assert torch.equal(got[rank]["outs"][step][n], want[step][n]), (rank, step, n)
        if feedback:
            for n in SHAPES:
                assert torch.equal(got[rank]["residuals"][n], residuals[rank][n]), (rank, n)


def test_merged_rows_take_the_fewest_whole_rows_that_reach_the_block() -> None:
    assert merged_rows(384, 128, 1) == (384, 128)  # the default: each row its own
    assert merged_rows(384, 128, 2048) == (24, 2048)  # 16 rows at a time
    assert merged_rows(6, 10, 20) == (3, 20) and merged_rows(6, 10, 25) == (2, 30)  # 3 divides 6, 3 x 10 >= 25
    assert merged_rows(7, 10, 20) == (1, 70)  # no divisor of 7 reaches 20 below 7: the whole tensor
    assert merged_rows(4, 4096, 2048) == (4, 4096) and merged_rows(1, 100, 2048) == (1, 100)


def test_a_larger_block_sends_fewer_scales() -> None:
    """8 bytes (an fp32 scale and minimum) fewer per merged row, the packed values the same."""

    def sent(block: int) -> int:
        def body(tr: Any) -> int:
            alg = make_algorithm("qsgd", tr, {"bits": 2, "block": block}, seed=0)
            t = torch.randn(64, 32, generator=torch.Generator().manual_seed(tr.rank))
            stats = Stats()
            alg(Group(0, [Member("w", t)], flat=t.view(-1)), 0, Meter(2, stats, 0)).wait()
            alg.close()
            return int(stats.summary(1)["bytes_sent"])

        return run_local(2, body)[0]

    # 64 rows of 32 values at 2 bits: 8 packed bytes + 8 of metadata a row; block 256: 8 rows of 256.
    assert sent(1) == 64 * (8 + 8) and sent(256) == 8 * (64 + 8)


@pytest.mark.parametrize("block", [0, -2, 1.5, True, "2048"])
def test_a_bad_block_is_refused_naming_it(block: Any) -> None:
    said = rf"qsgd: block must be an integer >= 1 \(values per scale and minimum\), got {block!r}"
    with pytest.raises(ValueError, match=said):
        QSGDAlgorithm.validate_options({"block": block})
