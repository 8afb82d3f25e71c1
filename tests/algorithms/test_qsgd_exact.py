"""qsgd's all-gather form against the codec it is built on: every rank's tensors encoded by ``QBitCodec`` with
``ErrorFeedback`` (the step's noise position ``step * numel``), every rank's code decoded and summed in rank order,
divided by the world size. The algorithm goes straight through the kernels into its wire buffers: the same bits out,
the same residuals, at every width and with the feedback off."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import Group, Member, make_algorithm
from sylvie_comm.codecs.feedback import ErrorFeedback
from sylvie_comm.codecs.quant import QBitCodec
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


def reference(world: int, bits: int, feedback: bool, seeds: list[dict[str, int]]) -> tuple[list[Any], list[Any]]:
    efs = [ErrorFeedback() for _ in range(world)]
    codecs = [{n: QBitCodec(bits=bits, seed=seeds[r][n]) for n in SHAPES} for r in range(world)]
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
def test_qsgd_gives_the_codecs_bits_and_residuals(world: int, bits: int, feedback: bool) -> None:
    got = run(world, {"bits": bits, "error_feedback": feedback})
    want, residuals = reference(world, bits, feedback, [g["seeds"] for g in got])
    for rank in range(world):
        for step in range(STEPS):
            for n in SHAPES:
                assert torch.equal(got[rank]["outs"][step][n], want[step][n]), (rank, step, n)
        if feedback:
            for n in SHAPES:
                assert torch.equal(got[rank]["residuals"][n], residuals[rank][n]), (rank, n)
