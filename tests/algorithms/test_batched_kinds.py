"""Small tensors of one kind run as one batch: their residuals the rows of one arena, a launch per kind.

One-bit's batches (tensors of at most ``BATCH_MAX`` elements sharing a layout, scale mode and dtype) must give the
bits of the same tensors run one by one, outputs and every residual, at 1 to 4 ranks (3: parts that end in padding
units), across a resume and across a residual forgotten mid-run; and the number of kernel launches a group makes
must not grow with its number of tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from sylvie_comm import _ops
from sylvie_comm.algorithms import Group, Member, make_algorithm
from sylvie_comm.algorithms import onebit as onebit_mod
from sylvie_comm.collectives.local import run_local
from sylvie_comm.kernels import compiled

# Layers of a small model: three of one weight shape, three biases, a 1-D tensor of another size, one over
# BATCH_MAX (alone), a weight whose rows are grouped (span 64 of 16-element rows).
SHAPES = {
    "l0.w": (16, 64), "l0.b": (16,), "l1.w": (16, 64), "l1.b": (16,), "l2.w": (16, 64), "l2.b": (16,),
    "n.w": (40,), "emb": (300, 256), "g.w": (12, 16), "h.w": (12, 16),
}  # fmt: skip


def _grads(step: int, rank: int, dtype: torch.dtype) -> list[Member]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [Member(n, torch.randn(s, generator=g).to(dtype)) for n, s in SHAPES.items()]


def _run(world: int, steps: int, options: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32,
         between: Callable[[Any, int], Any] | None = None) -> list[Any]:  # fmt: skip
    """Per rank: each step's averaged tensors and the final state; ``between(alg, step)`` runs before each step
    and may hand back a new algorithm (a resume)."""

    def body(tr: Any) -> list[Any]:
        alg = make_algorithm("onebit", tr, options)
        out = []
        for step in range(steps):
            if between is not None:
                alg = between(alg, step) or alg
            members = _grads(step, tr.rank, dtype)
            alg(Group(0, members), step).wait()
            out.append({m.name: m.tensor.clone() for m in members})
        state = alg.state_dict()
        alg.close()
        return [out, state]

    return run_local(world, body)


def _same(a: list[Any], b: list[Any]) -> None:
    for (out_a, state_a), (out_b, state_b) in zip(a, b, strict=True):
        for x, y in zip(out_a, out_b, strict=True):
            assert x.keys() == y.keys()
            for n in x:
                assert torch.equal(x[n], y[n]), n
        assert state_a.keys() == state_b.keys()
        for n in state_a:
            assert state_a[n].keys() == state_b[n].keys(), n
            for k in state_a[n]:
                assert torch.equal(state_a[n][k], state_b[n][k]), (n, k)


def _alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onebit_mod, "BATCH_MAX", -1)  # every tensor runs alone


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("scale", ["mean", "norm"])
def test_onebit_batches_give_the_bits_of_tensors_run_alone(world: int, scale: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    batched = _run(world, 4, {"scale": scale})
    _alone(monkeypatch)
    _same(batched, _run(world, 4, {"scale": scale}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_onebit_batches_of_half_gradients_give_the_bits_of_tensors_run_alone(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    batched = _run(2, 3, dtype=dtype)
    _alone(monkeypatch)
    _same(batched, _run(2, 3, dtype=dtype))


def test_a_batch_resumes_bit_exact() -> None:
    saved: dict[int, Any] = {}

    def resume(alg: Any, step: int) -> Any:
        if step != 2:
            return None
        state = alg.state_dict()
        fresh = make_algorithm("onebit", alg.transport, None)
        fresh.load_state_dict(state)
        saved[alg.transport.rank] = state
        alg.close()
        return fresh

    _same(_run(2, 4, between=resume), _run(2, 4))
    assert saved and all("l1.w" in s and "residual" in s["l1.w"] for s in saved.values())


def test_a_forgotten_residual_leaves_the_batch_and_rejoins_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor's ``forget`` (a tensor sent raw once) takes a residual out of its arena: it is handed back and
    the tensor starts again from zero, as when it runs alone."""
    owed: dict[int, torch.Tensor] = {}  # by rank: the ranks run as threads, in no set order

    def forget(alg: Any, step: int) -> None:
        if step == 2:
            owed[alg.transport.rank] = alg.forget("l1.w").clone()

    batched = _run(2, 4, between=forget)
    got = dict(owed)
    owed.clear()
    _alone(monkeypatch)
    _same(batched, _run(2, 4, between=forget))
    assert got.keys() == owed.keys() == {0, 1} and all(torch.equal(got[r], owed[r]) for r in got)


@pytest.mark.skipif(not _ops.HAS_EXTENSION, reason="counts the C++ kernels' calls")
def test_a_group_makes_as_many_launches_whatever_its_number_of_small_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: dict[str, int] = {}
    for op in ("onebit_feedback_encode", "onebit_mean_feedback_encode", "onebit_decode_into"):
        kernel = compiled.KERNELS[op]

        def counted(*args: Any, _kernel: Any = kernel, _op: str = op, **kwargs: Any) -> Any:
            calls[_op] = calls.get(_op, 0) + 1
            return _kernel(*args, **kwargs)

        monkeypatch.setitem(compiled.KERNELS, op, counted)

    def launches(layers: int) -> dict[str, int]:
        def body(tr: Any) -> None:
            alg = make_algorithm("onebit", tr, None)
            shapes = [(n, s) for i in range(layers) for n, s in ((f"{i}.w", (16, 16)), (f"{i}.b", (16,)))]
            for step in range(2):
                members = [Member(n, torch.randn(s)) for n, s in shapes]
                alg(Group(0, members), step).wait()
            alg.close()

        calls.clear()
        run_local(1, body)
        return dict(calls)

    few, many = launches(4), launches(24)
    assert few == many and few["onebit_feedback_encode"] == 2 * 2  # two kinds, two steps
