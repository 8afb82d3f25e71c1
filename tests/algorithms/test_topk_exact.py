"""topk's batched step against the codec it is built on: per tensor ``TopKCodec`` with ``ErrorFeedback``, every
rank's values and indices gathered, each tensor's entries added in rank order and divided by the world size. The
algorithm selects, sends and decodes each kind of tensor (ratio, shape, dtype) as one batch: the same bits out,
the same residuals, ties (a row of zeros wider than ``k``) and per-name ratios included."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import Group, Member, make_algorithm
from sylvie_comm.codecs.feedback import ErrorFeedback
from sylvie_comm.codecs.topk import TopKCodec
from sylvie_comm.collectives.local import run_local
from tests.algorithms.exact_cases import assert_same_bits, run_algorithm

SHAPES = {
    "l0.w": (16, 16), "l0.b": (16,), "l1.w": (16, 16), "l1.b": (16,), "conv": (8, 3, 3, 3), "l2.w": (16, 16),
    "zeros": (40,), "zeros2": (40,), "dense.w": (16, 16),
}  # fmt: skip
STEPS = 4
RATIOS = {"dense.w": 0.5}  # a per-name rule


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(71 * step + rank)
    out = {n: torch.randn(s, generator=g) * (1 + rank) for n, s in SHAPES.items()}
    for n in ("zeros", "zeros2"):
        out[n][: 36 - step].zero_()  # more zeros than the rest of k: the selection breaks ties among equal values
    return out


def run(world: int, ratio: float) -> list[dict[str, Any]]:
    rules = {n: {"ratio": r} for n, r in RATIOS.items()}
    return run_algorithm("topk", world, {"ratio": ratio}, STEPS, grads, rules)


def reference(world: int, ratio: float) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    efs = [ErrorFeedback() for _ in range(world)]
    codecs = {n: TopKCodec(ratio=RATIOS.get(n, ratio)) for n in SHAPES}
    outs = []
    for step in range(STEPS):
        encs = [{n: efs[r].encode(codecs[n], n, g) for n, g in grads(r, step).items()} for r in range(world)]
        out = {}
        for n, shape in SHAPES.items():
            values = torch.cat([e[n].payload[0] for e in encs])
            idx = torch.cat([e[n].payload[1] for e in encs]).long()
            dense = torch.zeros(torch.Size(shape).numel()).index_add_(0, idx, values)
            out[n] = dense.div_(world).view(shape)
        outs.append(out)
    return outs, [{n: ef.residual(n) for n in SHAPES} for ef in efs]


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_topk_batched_gives_the_codecs_bits_and_residuals(world: int, ratio: float) -> None:
    got = run(world, ratio)
    want, residuals = reference(world, ratio)
    assert_same_bits(got, want, residuals, SHAPES)


def test_topk_sends_each_kind_as_one_batch() -> None:
    def body(tr: Any) -> list[tuple[Any, ...]]:
        alg = make_algorithm("topk", tr, {"ratio": 0.1})
        members = [Member(n, v.clone(), True, {"ratio": RATIOS[n]} if n in RATIOS else {})
                   for n, v in grads(tr.rank, 0).items()]  # fmt: skip
        group = Group(0, members)
        alg(group, 0).wait()
        kinds = alg._layout(group)
        alg.close()
        return [(tuple(kind.shape), kind.k, len(kind.members)) for kind in kinds]

    (kinds,) = run_local(1, body)
    assert kinds == [((16, 16), 26, 3), ((16,), 2, 2), ((8, 3, 3, 3), 22, 1), ((40,), 4, 2), ((16, 16), 128, 1)]
