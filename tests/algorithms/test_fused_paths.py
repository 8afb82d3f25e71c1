"""The fused paths of one-bit, ACP-SGD and PowerSGD against their unfused forms, at 1, 2 and 4 ranks.

One-bit's fused paths (worker: compensate, encode and residual update in one kernel, decoding straight into
the tensor; server: the received parts' mean added in the same kernel) must give the same bits as the
unfused ones, outputs and residuals alike. The low-rank algorithms'
fused kernels sum in another order than ``torch.matmul``, so they agree to float rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm import kernels
from sylvie_comm.algorithms import Group, Member, make_algorithm
from sylvie_comm.algorithms import onebit as onebit_mod
from sylvie_comm.collectives.local import run_local

# Row-wise units of whole chunks (the fused one-bit path), rows shorter than 64 (grouped), vectors.
SHAPES = {"w1": (48, 256), "w2": (16, 4096), "w3": (10, 24), "b1": (256,), "b2": (10,), "w4": (3, 5, 8)}


def run(name: str, world: int, steps: int, options: dict[str, Any] | None = None,
        shapes: dict[str, tuple[int, ...]] = SHAPES) -> list[Any]:  # fmt: skip
    """Per rank: the averaged tensors of each step (one group of ``shapes``) and the algorithm's final state."""

    def body(tr: Any) -> list[Any]:
        alg = make_algorithm(name, tr, options)
        out = []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + tr.rank)
            members = [Member(n, torch.randn(s, generator=g)) for n, s in shapes.items()]
            alg(Group(0, members), step).wait()
            out.append({m.name: m.tensor.clone() for m in members})
        state = alg.state_dict()
        alg.close()
        return [out, state]

    return run_local(world, body)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("scale", ["mean", "norm"])
def test_onebit_fused_same_bits(world: int, scale: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fused = run("onebit", world, 4, {"scale": scale})
    monkeypatch.setattr(onebit_mod, "_exact_layout", lambda *a, **k: False)  # worker and server sides
    plain = run("onebit", world, 4, {"scale": scale})
    for (out_f, state_f), (out_p, state_p) in zip(fused, plain, strict=True):
        for a, b in zip(out_f, out_p, strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
        assert state_f.keys() == state_p.keys()
        for n in state_f:
            assert state_f[n].keys() == state_p[n].keys()
            assert all(torch.equal(state_f[n][k], state_p[n][k]) for k in state_f[n])


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", ["acpsgd", "powersgd"])
def test_lowrank_fused_matches_reference(world: int, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fused = run(name, world, 4)
    monkeypatch.setattr(kernels, "_fused", lambda *a: None)
    monkeypatch.setattr(kernels, "direct", lambda *a: None)  # the plan's unchecked calls take the references too
    plain = run(name, world, 4)
    for (out_f, state_f), (out_p, state_p) in zip(fused, plain, strict=True):
        for a, b in zip(out_f, out_p, strict=True):
            for n in a:
                torch.testing.assert_close(a[n], b[n], rtol=1e-4, atol=1e-4 * float(b[n].abs().max()))
        for n in state_f:
            for k in state_f[n]:
                # Residuals of full-rank factors are rounding noise, and orthogonalization amplifies rounding in the
                # factors step by step: compare at the gradients' scale (~1).
                torch.testing.assert_close(state_f[n][k], state_p[n][k], rtol=1e-3, atol=1e-4)


def test_fused_kernels_take_fp32_contiguous_tensors_on_one_device_that_has_them():
    from sylvie_comm import _ops

    a, b = torch.zeros(4, 3), torch.zeros(3, 2)
    assert (kernels._fused(a, None, b) is not None) == _ops.HAS_EXTENSION
    assert kernels._fused(a.double(), b) is None  # another dtype: the reference
    assert kernels._fused(a.t(), b) is None  # a strided view: the reference
    assert kernels._fused(torch.zeros(4, 3, device="meta"), torch.zeros(3, 2, device="meta")) is None
    assert not kernels._fused(None, None)
    if torch.cuda.is_available():  # mixed devices never reach a kernel; CUDA ones only where built
        assert not kernels._fused(a, b.cuda())
        assert kernels._fused(a.cuda(), b.cuda()) is not None


def test_the_unchecked_route_is_the_cpu_kernels_route_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernels.direct`` hands out a C++ kernel only where the entry point would take it: a CPU tensor with the
    extension, not routed through Triton, not under a trace (where the checked op must be recorded)."""
    from sylvie_comm import _ops
    from sylvie_comm.kernels import compiled

    cpu = torch.device("cpu")
    if not _ops.HAS_EXTENSION:
        assert kernels.direct("lowrank_gram", cpu) is None
        return
    assert kernels.direct("lowrank_gram", cpu) is compiled.KERNELS["lowrank_gram"]
    assert kernels.direct("lowrank_gram", torch.device("meta")) is None
    monkeypatch.setattr(kernels, "_ops_for", lambda device: torch.ops.sylvie_comm)  # a trace's namespace
    assert kernels.direct("lowrank_gram", cpu) is None


def test_where_the_triton_kernels_serve_a_device_the_unchecked_route_is_their_host_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    from sylvie_comm.kernels import triton as kt

    if not kt.load():
        pytest.skip(f"no Triton kernels here: {kt.load_error()}")
    monkeypatch.setattr(kernels, "_ops_for", lambda device: torch.ops.sylvie_comm_triton)
    route = kernels.direct("qbit_encode", torch.device("cpu"))
    from sylvie_comm.kernels.triton import qbit

    assert route.func is qbit.qbit_encode and route.keywords == {"checked": False}
    assert kernels.direct("onebit_feedback_encode", torch.device("cpu")) is None  # not a plan's unchecked op

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    with Watching():
        assert kernels.direct("qbit_encode", torch.device("cpu")) is None  # a mode sees the checked op


@pytest.mark.parametrize("name", ["acpsgd", "powersgd", "qsgd"])
def test_the_plans_unchecked_calls_give_the_bits_of_the_checked_ones(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    direct = run(name, 2, 4)
    monkeypatch.setattr(kernels, "direct", lambda *a: None)
    checked = run(name, 2, 4)
    for (out_d, state_d), (out_c, state_c) in zip(direct, checked, strict=True):
        for a, b in zip(out_d, out_c, strict=True):
            assert all(torch.equal(a[n], b[n]) for n in a)
        for n in state_d:
            assert all(torch.equal(state_d[n][k], state_c[n][k]) for k in state_d[n])
