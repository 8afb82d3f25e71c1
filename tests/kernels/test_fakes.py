"""Every compiled op has a fake (shape-only) implementation and passes ``torch.library.opcheck``.

``opcheck`` runs the op on real inputs and checks its schema (declared mutations and aliasing), that its fake
implementation gives outputs of the real outputs' shapes, dtypes and devices, its autograd registration, and
that it traces through AOT dispatch: what ``torch.compile`` needs of it. Each op is also run under
``FakeTensorMode`` on shapes alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from sylvie_comm import _ops
from tests.kernels.fake_shapes import assert_fake_gives_real_shapes

pytestmark = pytest.mark.skipif(not _ops.HAS_EXTENSION, reason="needs the compiled extension")
OPS = torch.ops.sylvie_comm


def _cases() -> dict[str, Callable[[], tuple[Any, ...]]]:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    n, chunk = 100, 16
    return {
        "pack_bits": lambda: (torch.randint(0, 4, (5, 13), generator=g, dtype=torch.uint8), 2),
        "unpack_bits": lambda: (u8(5, 4), 2, 13),
        "onebit_encode": lambda: (rnd(n), chunk, False),
        "onebit_decode": lambda: (u8(13), torch.rand(7, generator=g), n, chunk, torch.float32),
        "onebit_decode_into": lambda: (u8(13), torch.rand(7, generator=g), chunk, torch.empty(n)),
        "qbit_encode": lambda: (rnd(6, 11), 4, 3, 0, torch.float32),
        "qbit_decode": lambda: (u8(6, 6), torch.rand(6, generator=g), rnd(6), 4, 11, torch.float32),
        "qbit_decode_into": lambda: (u8(6, 6), torch.rand(6, generator=g), rnd(6), 4, torch.empty(6, 11)),
        "onebit_feedback_encode": lambda: (
            rnd(n),
            rnd(n),
            chunk,
            False,
            torch.empty(13, dtype=torch.uint8),
            torch.empty(7),
            torch.empty(n),
        ),
        "onebit_mean_feedback_encode": lambda: (
            rnd(n),
            u8(3, 13),
            torch.rand(3, 7, generator=g),
            chunk,
            True,
            torch.empty(13, dtype=torch.uint8),
            torch.empty(7),
            None,
        ),
        "lowrank_project": lambda: (
            rnd(9, 7),
            rnd(9, 7),
            rnd(7, 3),
            torch.empty(9, 3),
            True,
            rnd(9, 2),
            rnd(7, 2),
            torch.empty(9, 7),
        ),
        "lowrank_gram": lambda: (rnd(9, 7), rnd(9, 7), rnd(9, 3), torch.empty(7, 3), torch.empty(9, 7)),
        "lowrank_outer_into": lambda: (rnd(9, 7), rnd(9, 3), rnd(7, 3), -1.0, True, torch.tensor(True)),
        "copy_if": lambda: (rnd(10), rnd(10), torch.tensor(True)),
    }


CASES = _cases()


def test_every_op_has_a_case() -> None:
    defined = {s.name.split("::")[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("sylvie_comm::")}
    assert defined == set(CASES), (defined - set(CASES), set(CASES) - defined)


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name: str) -> None:
    torch.library.opcheck(getattr(OPS, name), CASES[name]())


@pytest.mark.parametrize("name", sorted(CASES))
def test_fake_tensor_mode_gives_the_real_shapes(name: str) -> None:
    assert_fake_gives_real_shapes(getattr(OPS, name), CASES[name](), device=False)


@pytest.mark.parametrize("name", ["onebit_encode", "qbit_encode", "pack_bits"])
def test_the_op_compiles_in_one_graph(name: str) -> None:
    """``torch.compile(fullgraph=True)`` traces the op through its fake (no graph break) and runs the kernel."""
    args = CASES[name]()
    op = getattr(OPS, name)
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True, backend="aot_eager")
    got, want = compiled(*args), op(*args)
    flat_got = [got] if isinstance(got, torch.Tensor) else list(got)
    flat_want = [want] if isinstance(want, torch.Tensor) else list(want)
    for a, b in zip(flat_got, flat_want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
