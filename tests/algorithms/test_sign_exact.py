"""sign's batched step against the codec it is built on: per tensor ``SignCodec`` with ``ErrorFeedback``, the
ranks' int8 votes and scales summed, the scales divided by the world size, each tensor decoded. The algorithm
encodes and decodes each kind of tensor (scale mode, shape, dtype) as one batch, and sends the kinds one after
another: the same bits out, the same residuals, whatever the mix of shapes and per-name scale modes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import Group, Member, make_algorithm
from sylvie_comm.codecs.base import Encoded
from sylvie_comm.codecs.feedback import ErrorFeedback
from sylvie_comm.codecs.sign import SignCodec
from sylvie_comm.collectives.local import run_local
from tests.algorithms.exact_cases import assert_same_bits, run_algorithm

# interleaved kinds, rows shorter than 64 grouped (16 x 16: 4 scales), a padded last unit (10 x 7: 70 elements,
# spans of 70), a 4-D weight, vectors, a 0-d tensor, one tensor per name with the other scale mode
SHAPES = {
    "l0.w": (16, 16), "l0.b": (16,), "l1.w": (16, 16), "l1.b": (16,), "odd": (10, 7), "odd2": (10, 7),
    "conv": (8, 3, 3, 3), "l2.w": (16, 16), "s": (), "big": (3, 100), "norm.w": (16, 16),
}  # fmt: skip
STEPS = 4


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(131 * step + rank)
    out = {n: torch.randn(s, generator=g) * (1 + rank) for n, s in SHAPES.items()}
    out["l1.w"][3].zero_()  # a row of zeros: sign 0, scale 0
    return out


def per_name(default: str) -> dict[str, str]:
    other = "norm" if default == "mean" else "mean"
    return {n: (other if n.startswith("norm") else default) for n in SHAPES}


def run(world: int, scale: str) -> list[dict[str, Any]]:
    modes = per_name(scale)
    rules = {n: {"scale": m} for n, m in modes.items() if m != scale}
    return run_algorithm("sign", world, {"scale": scale}, STEPS, grads, rules)


def reference(world: int, scale: str) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    modes = per_name(scale)
    efs = [ErrorFeedback() for _ in range(world)]
    outs = []
    for step in range(STEPS):
        encs = [{n: efs[r].encode(SignCodec(scale=modes[n]), n, g) for n, g in grads(r, step).items()}
                for r in range(world)]  # fmt: skip
        out = {}
        for n in SHAPES:
            votes = sum(e[n].payload[0] for e in encs[1:]) + encs[0][n].payload[0]  # int8 sums, rank order
            scales = encs[0][n].payload[1].clone()
            for e in encs[1:]:
                scales += e[n].payload[1]
            scales.div_(world)
            out[n] = SignCodec(scale=modes[n]).decode(Encoded((votes.to(torch.int8), scales), encs[0][n].ctx))
        outs.append(out)
    return outs, [{n: ef.residual(n) for n in SHAPES} for ef in efs]


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("scale", ["mean", "norm"])
def test_sign_batched_gives_the_codecs_bits_and_residuals(world: int, scale: str) -> None:
    got = run(world, scale)
    want, residuals = reference(world, scale)
    assert_same_bits(got, want, residuals, SHAPES)


def test_sign_sends_each_kind_as_one_batch() -> None:
    """The group's kinds (scale mode, shape, dtype), in order of first appearance: one batch each."""

    def body(tr: Any) -> list[tuple[Any, ...]]:
        alg = make_algorithm("sign", tr, {})
        values = grads(tr.rank, 0)
        members = [Member(n, v.clone(), True, {"scale": "mean"} if n.startswith("norm") else {})
                   for n, v in values.items()]  # fmt: skip
        group = Group(0, members)
        alg(group, 0).wait()
        kinds = alg._layout(group)
        alg.close()
        return [(k.norm, tuple(k.shape), len(k.members)) for k in kinds]

    (kinds,) = run_local(1, body)
    assert kinds == [(True, (16, 16), 3), (True, (16,), 2), (True, (10, 7), 2), (True, (8, 3, 3, 3), 1),
                     (True, (), 1), (True, (3, 100), 1), (False, (16, 16), 1)]  # fmt: skip
