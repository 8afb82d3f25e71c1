"""The Triton bit-packing and masked-copy ops (``torch.ops.sylvie_comm_triton``) against the pure-torch reference,
bit for bit: on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` where
there is no CUDA device), on the GPU where there is one.

Every op runs on views into buffers with guard regions: the guards must come out unchanged, and the results must
not depend on what the guards hold (the interpreter does not catch an out-of-bounds access).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from sylvie_comm.kernels import reference as ref
from sylvie_comm.kernels.triton import interpreted, unavailable_reason

_UNAVAILABLE = unavailable_reason()
if _UNAVAILABLE is not None:
    pytest.skip(_UNAVAILABLE, allow_module_level=True)
if not interpreted() and not torch.cuda.is_available():
    pytest.skip("no CUDA device and TRITON_INTERPRET unset: the Triton kernels cannot run", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sylvie_comm.kernels.triton import bits as tb  # noqa: E402

OPS = torch.ops.sylvie_comm_triton
_jit: Callable[..., Any] = triton.jit
# The interpreter runs the kernels on CPU tensors; without it they compile for the GPU.
DEVICE = torch.device("cpu") if interpreted() else torch.device("cuda")
BITS = [1, 2, 4, 8]
# Rows 0, 1 and many; columns 0, 1, never a multiple of 8 (so never of 8 / bits for bits < 8) but for 8 and 16, and
# enough columns for several column tiles (_PACK_COLS each).
SHAPES = [(0, 5), (3, 0), (1, 1), (1, 13), (4, 7), (9, 33), (5, 16), (300, 3), (2, 1000), (3, 2 * tb._PACK_COLS + 5)]
# Tiles filled exactly (no mask: a whole number of rows per program and of columns per tile), in rows of 4-byte words.
FULL_SHAPES = [(4, 64), (8, 2 * tb._PACK_COLS)]
GUARD = 67  # guard bytes before and after each view, and the extra row stride of strided views


def u8(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(DEVICE)


def guarded(rows: int, cols: int, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``(rows, cols)`` uint8 view with row stride ``cols + GUARD`` into a buffer of ``fill`` with ``GUARD``
    bytes before and after: ``(view, buffer)``."""
    stride = cols + GUARD
    buf = torch.full((2 * GUARD + rows * stride,), fill, dtype=torch.uint8, device=DEVICE)
    return buf[GUARD : GUARD + rows * stride].view(rows, stride)[:, :cols], buf


def inner(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The guard-free copy of :func:`guarded`'s buffer: what the guards must not have changed."""
    stride = cols + GUARD
    out = buf.clone()
    out[GUARD : GUARD + rows * stride].view(rows, stride)[:, :cols] = 0
    return out


def contiguous_in_guards(numel: int, fill: int, dtype: torch.dtype = torch.uint8) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous flat view of ``numel`` elements between ``GUARD`` elements of ``fill``: ``(view, buffer)``."""
    buf = torch.full((2 * GUARD + numel,), fill, device=DEVICE).to(dtype)
    return buf[GUARD : GUARD + numel], buf


def guards_of(buf: torch.Tensor) -> torch.Tensor:
    return torch.cat([buf[:GUARD], buf[-GUARD:]])


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    assert torch.equal(a, b)


# ---------------------------------------------------------------- pack_bits / unpack_bits


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rows,cols", SHAPES + FULL_SHAPES)
def test_pack_unpack_match_the_reference(bits: int, rows: int, cols: int) -> None:
    """Any byte values (masked to their low bits), the reference's bytes, and back."""
    values = u8(rows, cols, seed=rows * 1000 + cols)
    packed = OPS.pack_bits(values, bits)
    assert_same(packed, ref.pack_bits(values, bits))
    masked = values & ((1 << bits) - 1)
    assert_same(OPS.unpack_bits(packed, bits, cols), masked)
    noise = u8(rows, ref.packed_cols(cols, bits), seed=cols)  # padding bits set too: ignored
    assert_same(OPS.unpack_bits(noise, bits, cols), ref.unpack_bits(noise, bits, cols))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rows,cols", [(1, 13), (9, 33), (300, 3), (3, 2 * tb._PACK_COLS + 5), *FULL_SHAPES[:1]])
def test_pack_reads_and_writes_inside_its_views(bits: int, rows: int, cols: int) -> None:
    """Strided input views between guards of 0x00 and of 0xFF give the same bytes; the output, a view between guards,
    is the only memory written."""
    pc = ref.packed_cols(cols, bits)
    want = ref.pack_bits(u8(rows, cols, seed=1), bits)
    for fill in (0x00, 0xFF):
        values, vbuf = guarded(rows, cols, fill)
        values.copy_(u8(rows, cols, seed=1))
        before = vbuf.clone()
        out, obuf = contiguous_in_guards(rows * pc, fill)
        tb._pack_into(values, bits, out.view(rows, pc))
        assert_same(out.view(rows, pc), want)
        assert torch.equal(guards_of(obuf), torch.full((2 * GUARD,), fill, dtype=torch.uint8, device=DEVICE))
        assert torch.equal(vbuf, before)
        assert_same(OPS.pack_bits(values, bits), want)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rows,cols", [(1, 13), (9, 33), (300, 3), (3, 2 * tb._PACK_COLS + 5), *FULL_SHAPES[:1]])
def test_unpack_reads_and_writes_inside_its_views(bits: int, rows: int, cols: int) -> None:
    pc = ref.packed_cols(cols, bits)
    src = u8(rows, pc, seed=2)
    want = ref.unpack_bits(src, bits, cols)
    for fill in (0x00, 0xFF):
        packed, pbuf = guarded(rows, pc, fill)
        packed.copy_(src)
        before = pbuf.clone()
        out, obuf = contiguous_in_guards(rows * cols, fill)
        tb._unpack_into(packed, bits, out.view(rows, cols))
        assert_same(out.view(rows, cols), want)
        assert torch.equal(guards_of(obuf), torch.full((2 * GUARD,), fill, dtype=torch.uint8, device=DEVICE))
        assert torch.equal(pbuf, before)
        assert_same(OPS.unpack_bits(packed, bits, cols), want)


@pytest.mark.parametrize("bits", BITS)
def test_unpack_reads_aligned_strided_rows_as_words(bits: int) -> None:
    """Packed rows of whole words inside wider rows (a row stride of whole words), and the same one byte off: read a
    word at a time, then a byte at a time."""
    rows, cols = 6, 96
    pc = ref.packed_cols(cols, bits)
    wide = u8(rows, pc + 8, seed=bits)
    want = ref.unpack_bits(wide[:, :pc].contiguous(), bits, cols)
    assert_same(OPS.unpack_bits(wide[:, :pc], bits, cols), want)
    assert_same(OPS.unpack_bits(wide[:, 1 : pc + 1], bits, cols), ref.unpack_bits(wide[:, 1 : pc + 1].contiguous(),
                                                                                   bits, cols))  # fmt: skip


@pytest.mark.parametrize("bits", BITS)
def test_pack_takes_any_strides(bits: int) -> None:
    """A transposed view (column stride > 1) and an expanded one (row stride 0)."""
    values = u8(37, 11, seed=3)
    assert_same(OPS.pack_bits(values.t(), bits), ref.pack_bits(values.t().contiguous(), bits))
    row = u8(1, 19, seed=4).expand(5, 19)
    assert_same(OPS.pack_bits(row, bits), ref.pack_bits(row.contiguous(), bits))
    packed = ref.pack_bits(values, bits)
    assert_same(OPS.unpack_bits(packed.t().contiguous().t(), bits, 11), values & ((1 << bits) - 1))


def test_pack_unpack_argument_checks() -> None:
    z = torch.zeros(2, 3, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"pack_bits: bits must be one of \{1, 2, 4, 8\}, got 3"):
        OPS.pack_bits(z, 3)
    with pytest.raises(RuntimeError, match="pack_bits: expected a 2-D tensor, got 1 dimensions"):
        OPS.pack_bits(z.view(-1), 2)
    with pytest.raises(RuntimeError, match="pack_bits: expected uint8 values, got Int"):
        OPS.pack_bits(z.int(), 2)
    with pytest.raises(RuntimeError, match="unpack_bits: bits must be one of"):
        OPS.unpack_bits(z, 0, 3)
    with pytest.raises(RuntimeError, match="unpack_bits: expected uint8, got Float"):
        OPS.unpack_bits(z.float(), 8, 3)
    with pytest.raises(RuntimeError, match="unpack_bits: cols must be >= 0, got -1"):
        OPS.unpack_bits(z, 8, -1)
    with pytest.raises(RuntimeError, match="unpack_bits: 13 values of 2 bits need 4 bytes per row, got 3"):
        OPS.unpack_bits(z, 2, 13)


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="pack_bits: values is a CPU tensor, which the Triton kernels take only"):
        OPS.pack_bits(torch.zeros(2, 3, dtype=torch.uint8), 2)
    with pytest.raises(RuntimeError, match="copy_if: dst is a CPU tensor"):
        OPS.copy_if(torch.zeros(3), None, torch.tensor(True))


# ---------------------------------------------------------------- the @triton.jit helpers, from another kernel


@_jit
def _helpers_kernel(  # type: ignore[no-untyped-def]
    packed, values, repacked, per_value, rows, cols, packed_cols, BITS: tl.constexpr, BLOCK: tl.constexpr
):
    # One row per program: unpack a row's bytes with unpack_tile, pack them again with pack_tile, and decode
    # each value on its own with value_at, as another family's kernel would.
    r = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCK)
    inside = b < packed_cols
    byte = tl.load(packed + r * packed_cols + b, mask=inside, other=0)
    c = tb.tile_columns(b, BITS)
    v = tb.unpack_tile(byte, BITS)
    live = inside[:, None] & (c < cols)
    tl.store(values + r * cols + c, v, mask=live)
    tl.store(repacked + r * packed_cols + b, tb.pack_tile(tl.where(live, v, 0), BITS), mask=inside)
    col = tl.arange(0, BLOCK * (8 // BITS))
    one = tl.load(packed + r * packed_cols + (col * BITS) // 8, mask=col < cols, other=0)
    tl.store(per_value + r * cols + col, tb.value_at(one, col, BITS), mask=col < cols)


@pytest.mark.parametrize("bits", BITS)
def test_the_jit_helpers_pack_and_unpack_inside_a_kernel(bits: int) -> None:
    rows, cols = 5, 29
    pc = ref.packed_cols(cols, bits)
    packed = u8(rows, pc, seed=5)
    values = torch.empty(rows, cols, dtype=torch.uint8, device=DEVICE)
    repacked = torch.empty_like(packed)
    per_value = torch.empty_like(values)
    _helpers_kernel[(rows,)](packed, values, repacked, per_value, rows, cols, pc, BITS=bits,
                             BLOCK=triton.next_power_of_2(pc))  # fmt: skip
    want = ref.unpack_bits(packed, bits, cols)
    assert_same(values, want)
    assert_same(per_value, want)
    assert_same(repacked, ref.pack_bits(want, bits))


# ---------------------------------------------------------------- copy_if

DTYPES = [torch.float32, torch.int64, torch.bool, torch.float16, torch.uint8, torch.int32]


def _fill(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 100, (n,), generator=g)
    return (values % 2 if dtype == torch.bool else values).to(dtype).to(DEVICE)


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 37, tb._COPY_BLOCK // 8, tb._COPY_BLOCK + 3])
def test_copy_if_matches_the_reference_inside_guards(flag: bool, dtype: torch.dtype, n: int) -> None:
    """``src`` (or zeros) where the flag is set, nothing otherwise; dst and src views between guards."""
    for with_src in (True, False):
        src, sbuf = contiguous_in_guards(n, 3, dtype)
        src.copy_(_fill(n, dtype, seed=n))
        sbefore = sbuf.clone()
        dst, dbuf = contiguous_in_guards(n, 5, dtype)
        dst.copy_(_fill(n, dtype, seed=n + 1))
        dbefore = dbuf.clone()
        want = dst.clone()
        ref.copy_if(want, src if with_src else None, torch.tensor(flag, device=DEVICE))
        OPS.copy_if(dst, src if with_src else None, torch.tensor(flag, device=DEVICE))
        assert_same(dst, want)
        assert torch.equal(guards_of(dbuf), guards_of(dbefore))
        assert torch.equal(sbuf, sbefore)
        if flag:
            assert_same(dst, src if with_src else torch.zeros_like(src))


@pytest.mark.parametrize("flag", [False, True])
def test_copy_if_any_shape_and_unaligned_views(flag: bool) -> None:
    """A 0-d tensor, an n-d one, and views that start one element into their storage."""
    for shape in [(), (3, 4, 5), (2, 0, 3)]:
        dst, src = torch.full(shape, 7.0, device=DEVICE), torch.full(shape, 2.0, device=DEVICE)
        OPS.copy_if(dst, src, torch.tensor(flag, device=DEVICE))
        assert torch.equal(dst, src if flag else torch.full(shape, 7.0, device=DEVICE))
    whole = torch.arange(41, dtype=torch.int16, device=DEVICE)
    dst = whole[1:40]
    OPS.copy_if(dst, None, torch.tensor([flag], device=DEVICE))  # a one-element flag of shape (1,) too
    assert torch.equal(dst, torch.zeros_like(dst) if flag else torch.arange(1, 40, dtype=torch.int16, device=DEVICE))
    assert whole[0] == 0 and whole[40] == 40


@pytest.mark.parametrize("flag", [False, True])
def test_copy_if_programs_stride_over_the_rest(flag: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With fewer programs than blocks each program copies several blocks (the grid-stride loop)."""
    monkeypatch.setattr(tb, "_COPY_PROGRAMS", 2)
    n = (5 * tb._COPY_BLOCK + 17) // 4
    dst, src = _fill(n, torch.float32, seed=6), _fill(n, torch.float32, seed=7)
    want = src.clone() if flag else dst.clone()
    OPS.copy_if(dst, src, torch.tensor(flag, device=DEVICE))
    assert_same(dst, want)


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Reading a tensor's value on the host (``item``, ``bool``, ``tolist``) fails inside; on CUDA, so does any
    synchronisation with the device."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("read a tensor's value on the host")

    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "__bool__", "tolist"):
            mp.setattr(torch.Tensor, name, refuse)
        if DEVICE.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            if DEVICE.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("flag", [False, True])
def test_copy_if_reads_the_flag_on_the_device(flag: bool) -> None:
    dst, src = torch.zeros(100, device=DEVICE), torch.ones(100, device=DEVICE)
    f = torch.tensor(flag, device=DEVICE)
    OPS.copy_if(dst, None, f)  # both kernels compiled (GPU) before the check
    OPS.copy_if(dst, src, f)
    dst.zero_()
    with no_host_reads():
        OPS.copy_if(dst, src, f)
        OPS.copy_if(dst, None, f)
        OPS.copy_if(dst, src, f)
    assert torch.equal(dst, src if flag else torch.zeros_like(dst))


def test_copy_if_argument_checks() -> None:
    t = torch.tensor(True, device=DEVICE)
    z = torch.zeros(3, device=DEVICE)
    with pytest.raises(RuntimeError, match="copy_if: flag must be a one-element bool tensor"):
        OPS.copy_if(z, None, torch.tensor([True, False], device=DEVICE))
    with pytest.raises(RuntimeError, match="copy_if: flag must be a one-element bool tensor"):
        OPS.copy_if(z, None, torch.tensor(1, device=DEVICE))
    wrong = r"copy_if: src must be a contiguous Float tensor of shape \[3\], got Float of shape \[4\]"
    with pytest.raises(RuntimeError, match=wrong):
        OPS.copy_if(z, torch.zeros(4, device=DEVICE), t)
    with pytest.raises(RuntimeError, match="copy_if: src must be a contiguous"):
        OPS.copy_if(z, torch.zeros(3, dtype=torch.float64, device=DEVICE), t)
    with pytest.raises(RuntimeError, match="copy_if: src must be a contiguous"):
        OPS.copy_if(z, torch.zeros(6, device=DEVICE)[::2], t)
    with pytest.raises(RuntimeError, match="copy_if: dst must be a contiguous"):
        OPS.copy_if(torch.zeros(3, 4, device=DEVICE).T, None, t)
    if DEVICE.type == "cuda":
        with pytest.raises(RuntimeError, match="copy_if: flag must be on cuda"):
            OPS.copy_if(z, None, torch.tensor(True))
        with pytest.raises(RuntimeError, match="copy_if: src must be on cuda"):
            OPS.copy_if(z, torch.zeros(3), t)


# ---------------------------------------------------------------- schemas and fakes


def _opcheck_cases() -> list[tuple[str, Callable[[], tuple[Any, ...]]]]:
    def flag(value: bool) -> torch.Tensor:
        return torch.tensor(value, device=DEVICE)

    return [
        ("pack_bits", lambda: (u8(5, 13, seed=8), 2)),
        ("pack_bits", lambda: (u8(3, 9, seed=9), 1)),
        ("unpack_bits", lambda: (u8(5, 4, seed=10), 2, 13)),
        ("unpack_bits", lambda: (u8(2, 4, seed=11), 4, 7)),
        ("copy_if", lambda: (torch.randn(10, device=DEVICE), torch.randn(10, device=DEVICE), flag(True))),
        ("copy_if", lambda: (torch.randn(10, device=DEVICE), None, flag(False))),
        ("copy_if", lambda: (torch.arange(6, device=DEVICE), None, flag(True))),
        (
            "copy_if",
            lambda: (
                torch.zeros(4, dtype=torch.bool, device=DEVICE),
                torch.ones(4, dtype=torch.bool, device=DEVICE),
                flag(True),
            ),
        ),
    ]


@pytest.mark.parametrize("name,args", _opcheck_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name: str, args: Callable[[], tuple[Any, ...]]) -> None:
    """Schema (declared mutation of dst), fake implementation, autograd registration and AOT dispatch."""
    torch.library.opcheck(getattr(OPS, name), args())


def test_schemas_are_the_compiled_ops() -> None:
    want = {
        "pack_bits": "pack_bits(Tensor values, int bits) -> Tensor",
        "unpack_bits": "unpack_bits(Tensor packed, int bits, int cols) -> Tensor",
        "copy_if": "copy_if(Tensor(a!) dst, Tensor? src, Tensor flag) -> ()",
    }
    for name, schema in want.items():
        assert str(getattr(OPS, name).default._schema) == f"sylvie_comm_triton::{schema}"


def test_the_ops_compile_in_one_graph() -> None:
    values = u8(7, 19, seed=12)
    fn = torch.compile(lambda v: OPS.unpack_bits(OPS.pack_bits(v, 4), 4, 19), fullgraph=True, backend="aot_eager")
    assert_same(fn(values), values & 15)
