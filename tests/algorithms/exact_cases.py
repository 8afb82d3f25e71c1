"""What the batched algorithms' exactness tests (``test_{sign,topk}_exact.py``) compare: every rank's outputs at
every step and its residuals at the end, bit for bit, against the codec's reference."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch


def assert_same_bits(got: Sequence[Mapping[str, Any]], want: Sequence[Mapping[str, torch.Tensor]],
                     residuals: Sequence[Mapping[str, torch.Tensor]], names: Iterable[str]) -> None:  # fmt: skip
    """``got[rank]``: ``{"outs": [per step {name: tensor}], "residuals": {name: tensor}}``; ``want``: per step the
    outputs every rank must hold; ``residuals``: per rank the residuals."""
    names = list(names)
    for rank, ours in enumerate(got):
        for step, outs in enumerate(want):
            for n in names:
                assert torch.equal(ours["outs"][step][n], outs[n]), (rank, step, n)
        for n in names:
            assert torch.equal(ours["residuals"][n], residuals[rank][n]), (rank, n)


def run_algorithm(name: str, world: int, options: Mapping[str, Any], steps: int,
                  grads: Callable[[int, int], dict[str, torch.Tensor]],
                  member_options: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:  # fmt: skip
    """``steps`` steps of algorithm ``name`` at ``world`` in-process ranks, each step's ``grads(rank, step)`` as one
    group of views of a flat buffer (``member_options`` per name): per rank its outputs per step and its residuals
    at the end (the shape :func:`assert_same_bits` reads)."""
    from sylvie_comm.algorithms import Group, Member, make_algorithm
    from sylvie_comm.collectives.local import run_local

    def body(tr: Any) -> dict[str, Any]:
        alg = make_algorithm(name, tr, options)
        outs = []
        for step in range(steps):
            values = grads(tr.rank, step)
            flat = torch.cat([v.reshape(-1) for v in values.values()])
            members, at = [], 0
            for n, v in values.items():
                members.append(Member(n, flat[at : at + v.numel()].view(v.shape), True, member_options.get(n, {})))
                at += v.numel()
            alg(Group(0, members, flat=flat), step).wait()
            outs.append({m.name: m.tensor.clone() for m in members})
        residuals = {n: alg.feedback.residual(n).clone() for n in values}
        alg.close()
        return {"outs": outs, "residuals": residuals}

    return run_local(world, body)
