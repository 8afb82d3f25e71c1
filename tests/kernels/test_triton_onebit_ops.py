"""The Triton one-bit ops as registered (``sylvie_comm_triton::onebit_*``): their declared schemas, the compiled
ops' argument checks and messages, and their fakes (``torch.library.opcheck``, ``FakeTensorMode``,
``torch.compile``). Their bits against the reference: ``test_triton_onebit.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from sylvie_comm import _ops
from sylvie_comm.kernels.triton import NAMESPACE
from tests.kernels.fake_shapes import assert_fake_gives_real_shapes
from tests.kernels.triton_onebit_env import DEVICE, MARKS, OPS, U8
from tests.kernels.triton_onebit_env import WHY_NOT as _WHY_NOT

pytestmark = MARKS


# ---------------------------------------------------------------- registration


def test_schemas_are_the_compiled_ops() -> None:
    names = ("onebit_encode", "onebit_decode", "onebit_decode_into", "onebit_feedback_encode",
             "onebit_mean_feedback_encode")  # fmt: skip
    for name in names:
        schema = str(getattr(OPS, name).default._schema)
        assert schema.startswith(f"{NAMESPACE}::{name}(")
        if _ops.HAS_EXTENSION:
            compiled = str(getattr(torch.ops.sylvie_comm, name).default._schema)
            assert schema == compiled.replace("sylvie_comm::", f"{NAMESPACE}::", 1)


# ---------------------------------------------------------------- argument checks


def _bad_calls() -> list[tuple[str, Callable[[Any], Any], str]]:
    """(name, call on an op namespace, expected message fragment): the same calls on both op sets."""
    d = DEVICE

    def z(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=d)

    res = z(16)
    return [
        ("encode float64", lambda o: o.onebit_encode(z(8, dtype=torch.float64), 8, False), "expected a float32"),
        ("encode int", lambda o: o.onebit_encode(z(8, dtype=torch.int32), 8, False), "expected a float32"),
        ("encode chunk 12", lambda o: o.onebit_encode(z(8), 12, False), "chunk_size must be a positive multiple"),
        ("encode chunk 0", lambda o: o.onebit_encode(z(8), 0, False), "chunk_size"),
        ("encode chunk -8", lambda o: o.onebit_encode(z(8), -8, False), "chunk_size"),
        ("decode dtype", lambda o: o.onebit_decode(z(1, dtype=U8), z(1), 8, 8, torch.float64), "dtype must be"),
        ("decode numel", lambda o: o.onebit_decode(z(1, dtype=U8), z(1), -1, 8, torch.float32), "numel must be"),
        ("decode bytes", lambda o: o.onebit_decode(z(2, dtype=U8), z(1), 8, 8, torch.float32), "uint8 bytes"),
        ("decode scales", lambda o: o.onebit_decode(z(1, dtype=U8), z(2), 8, 8, torch.float32), "float32 scales"),
        ("decode chunk", lambda o: o.onebit_decode(z(1, dtype=U8), z(1), 8, 4, torch.float32), "chunk_size"),
        ("into strided", lambda o: o.onebit_decode_into(z(1, dtype=U8), z(1), 8, z(16)[::2]), "contiguous"),
        ("into int", lambda o: o.onebit_decode_into(z(1, dtype=U8), z(1), 8, z(8, dtype=torch.int32)),
         "dtype must be"),
        ("into packed dtype", lambda o: o.onebit_decode_into(z(1, dtype=torch.int8), z(1), 8, z(8)), "uint8 bytes"),
        ("fb chunk", lambda o: o.onebit_feedback_encode(res, None, 3, False, z(2, dtype=U8), z(1)), "chunk_size"),
        ("fb packed", lambda o: o.onebit_feedback_encode(res, None, 16, False, z(3, dtype=U8), z(1)),
         "packed must be"),
        ("fb scales", lambda o: o.onebit_feedback_encode(res, None, 8, False, z(2, dtype=U8), z(1)),
         "scales must be"),
        ("fb residual", lambda o: o.onebit_feedback_encode(z(16, dtype=torch.float16), None, 8, False,
                                                           z(2, dtype=U8), z(2)), "residual must be"),
        ("fb residual strided", lambda o: o.onebit_feedback_encode(z(32)[::2], None, 8, False, z(2, dtype=U8),
                                                                   z(2)), "residual must be"),
        ("fb grad", lambda o: o.onebit_feedback_encode(res, z(15), 8, False, z(2, dtype=U8), z(2)), "grad has"),
        ("fb grad dtype", lambda o: o.onebit_feedback_encode(res, z(16, dtype=torch.float64), 8, False,
                                                             z(2, dtype=U8), z(2)), "grad must be"),
        ("fb saved", lambda o: o.onebit_feedback_encode(res, None, 8, False, z(2, dtype=U8), z(2), z(15)),
         "saved has"),
        ("fb saved self", lambda o: o.onebit_feedback_encode(res, None, 8, False, z(2, dtype=U8), z(2), res),
         "saved must not be the residual"),
        ("mean bytes", lambda o: o.onebit_mean_feedback_encode(res, z(2, 3, dtype=U8), z(2, 1), 16, False,
                                                               z(2, dtype=U8), z(1)), r"parts_packed must be \(w"),
        ("mean no rows", lambda o: o.onebit_mean_feedback_encode(res, z(0, 2, dtype=U8), z(0, 1), 16, False,
                                                                 z(2, dtype=U8), z(1)), "parts_packed must be"),
        ("mean strided", lambda o: o.onebit_mean_feedback_encode(res, z(2, 4, dtype=U8)[:, ::2], z(2, 1), 16,
                                                                 False, z(2, dtype=U8), z(1)), "contiguous rows"),
        ("mean scales", lambda o: o.onebit_mean_feedback_encode(res, z(2, 2, dtype=U8), z(3, 1), 16, False,
                                                                z(2, dtype=U8), z(1)), r"parts_scales must be \(2"),
        ("mean chunk", lambda o: o.onebit_mean_feedback_encode(res, z(2, 2, dtype=U8), z(2, 1), 12, False,
                                                               z(2, dtype=U8), z(1)), "chunk_size"),
    ]  # fmt: skip


BAD_CALLS = _bad_calls() if _WHY_NOT is None else []


@pytest.mark.parametrize(("name", "call", "error"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_checks_match_the_compiled_ops(name: str, call: Callable[[Any], Any], error: str) -> None:
    """The compiled ops' checks, with their messages word for word where the extension is built here."""
    with pytest.raises(RuntimeError, match=error) as triton_error:
        call(OPS)
    compiled = _ops.HAS_EXTENSION and DEVICE == "cpu"
    if compiled:
        with pytest.raises(RuntimeError) as compiled_error:
            call(torch.ops.sylvie_comm)
        assert str(triton_error.value).splitlines()[0] == str(compiled_error.value).splitlines()[0]


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        OPS.onebit_encode(torch.zeros(8), 8, False)


# ---------------------------------------------------------------- fakes


def _cases() -> dict[str, Callable[[], tuple[Any, ...]]]:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(DEVICE)

    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, dtype=U8).to(DEVICE)

    def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=DEVICE)

    n, chunk = 100, 16
    return {
        "onebit_encode": lambda: (rnd(n), chunk, False),
        "onebit_decode": lambda: (u8(13), rnd(7).abs(), n, chunk, torch.float32),
        "onebit_decode_into": lambda: (u8(13), rnd(7).abs(), chunk, empty(n)),
        "onebit_feedback_encode": lambda: (rnd(n), rnd(n), chunk, False, empty(13, dtype=U8), empty(7), empty(n)),
        "onebit_mean_feedback_encode": lambda: (rnd(n), u8(3, 13), rnd(3, 7).abs(), chunk, True, empty(13, dtype=U8),
                                                empty(7), None),
    }  # fmt: skip


CASES = _cases() if _WHY_NOT is None else {}


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name: str) -> None:
    torch.library.opcheck(getattr(OPS, name), CASES[name]())


@pytest.mark.parametrize("name", sorted(CASES))
def test_fake_tensor_mode_gives_the_real_shapes(name: str) -> None:
    assert_fake_gives_real_shapes(getattr(OPS, name), CASES[name]())


def test_encode_compiles_in_one_graph() -> None:
    x = torch.randn(100, device=DEVICE)
    compiled = torch.compile(lambda t: OPS.onebit_encode(t, 16, True), fullgraph=True, backend="aot_eager")
    got, want = compiled(x), OPS.onebit_encode(x, 16, True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
