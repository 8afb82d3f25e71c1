"""Every algorithm on the GPU code path, executed here: CPU tensors routed through the Triton kernels (run by
Triton's interpreter) at 2 in-process ranks, against the same run on the pure-torch references.

The Triton kernels return the references' bits for packing, one-bit and q-bit codes, so those algorithms must give
the same bits end to end, outputs and state alike. The low-rank kernels sum their products in their own fixed order
(:mod:`sylvie_comm.kernels.ordered`), which differs from ``torch.matmul``'s by float rounding: the low-rank
algorithms (continuous in their inputs) agree to it. ``auto`` runs with its clock stopped and its pick fixed, so
both runs probe every default candidate (ACP-SGD among them, hence the low-rank tolerance) and then take the same.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from sylvie_comm import kernels
from sylvie_comm.algorithms import ALGORITHMS
from sylvie_comm.algorithms import auto as auto_mod
from sylvie_comm.kernels import triton as kt
from tests.algorithms.test_fused_paths import run as run_algorithm

# Rows of whole one-bit chunks, rows shorter than 64, vectors, a 3-D tensor, one long row.
SHAPES = {"w1": (12, 64), "w2": (4, 300), "w3": (10, 24), "b1": (64,), "b2": (10,), "w4": (3, 5, 8)}
LOW_RANK = {"acpsgd", "powersgd", "auto"}
NAMES = sorted(ALGORITHMS)
AUTO_CHOICE = "qsgd"  # after one probe step of each default candidate


def run(name: str) -> list[Any]:
    if name == "auto":
        candidates = auto_mod.AutoAlgorithm.record.option_defaults["candidates"]
        return run_algorithm(name, 2, len(candidates) + 2, {"probe_steps": 1}, shapes=SHAPES)
    return run_algorithm(name, 2, 2, shapes=SHAPES)


@pytest.fixture
def fixed_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto times its candidates and picks by the clock: both stopped here, so two runs choose alike."""
    monkeypatch.setattr(auto_mod, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: 0.0)}))
    monkeypatch.setattr(auto_mod, "pick", lambda names, seconds: AUTO_CHOICE)


@pytest.fixture
def routes(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run a body with CPU tensors on the Triton kernels, then on the references; count the Triton routings."""
    if torch.cuda.is_available():  # no interpreter there: CUDA tensors take the compiled kernels (tests/gpu)
        pytest.skip("a GPU machine: the Triton kernels compile for the GPU, CPU tensors cannot take them")
    assert kt.load() and kt.interpreted(), kt.load_error()
    real = kernels._ops_for
    calls = {"triton": 0}

    def triton_route(device: torch.device) -> Any:
        calls["triton"] += 1
        return torch.ops.sylvie_comm_triton if device.type == "cpu" else real(device)

    def go(fn: Any) -> tuple[Any, Any, int]:
        monkeypatch.setattr(kernels, "_ops_for", triton_route)
        on_triton = fn()
        monkeypatch.setattr(kernels, "_ops_for", lambda device: None)
        on_reference = fn()
        monkeypatch.setattr(kernels, "_ops_for", real)
        return on_triton, on_reference, calls["triton"]

    return go


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        return a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    return torch.equal(a, b)


def _pairs(state: Any, other: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        return [(state, other)]
    if isinstance(state, dict):
        assert state.keys() == other.keys()
        return [p for k in state for p in _pairs(state[k], other[k])]
    if isinstance(state, list | tuple):
        assert len(state) == len(other)
        return [p for a, b in zip(state, other, strict=True) for p in _pairs(a, b)]
    assert state == other
    return []


@pytest.mark.parametrize("name", NAMES)
def test_every_algorithm_runs_the_triton_kernels_as_the_references(name: str, routes: Any, fixed_auto: None) -> None:
    on_triton, on_reference, routed = routes(lambda: run(name))
    if name == "auto":
        assert on_triton[0][1]["auto"]["choices"] == {0: AUTO_CHOICE}, on_triton[0][1]["auto"]
    if name not in ("none", "fp16", "bf16"):  # the codecs without a kernel of their own
        assert routed > 0, f"{name}: no kernel call reached the Triton route"
    for (out_t, state_t), (out_r, state_r) in zip(on_triton, on_reference, strict=True):
        for a, b in zip(out_t, out_r, strict=True):
            assert a.keys() == b.keys()
            for n in a:
                if name in LOW_RANK:
                    torch.testing.assert_close(a[n], b[n], rtol=1e-4, atol=1e-4 * float(b[n].abs().max()))
                else:
                    assert _same(a[n], b[n]), f"{name}: {n} differs between the Triton and reference kernels"
        for x, y in _pairs(state_t, state_r):
            if name in LOW_RANK:
                # Orthogonalization amplifies rounding in the factors step by step: compare at the gradients' scale.
                torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-4)
            else:
                assert _same(x, y), f"{name}: its state differs between the Triton and reference kernels"


def test_the_cpu_switch_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kt.load(), kt.load_error()  # the kernel modules read the interpreter switch as they are imported: first
    monkeypatch.setattr(kt, "interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="only through Triton's interpreter"):
        kernels.route_cpu_through_triton(True)
    monkeypatch.undo()
    try:
        kernels.route_cpu_through_triton(True)
        assert kernels.backend(torch.zeros(1)) == "triton"
        packed = kernels.pack_bits(torch.tensor([[1, 0, 1]], dtype=torch.uint8), 1)
        assert packed.tolist() == [[5]]
    finally:
        kernels.route_cpu_through_triton(None)
    assert kernels.backend(torch.zeros(1)) in ("compiled", "reference")
    assert kernels.backend(torch.zeros(1, device="meta")) == "reference"
