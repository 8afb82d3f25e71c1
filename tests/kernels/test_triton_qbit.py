"""The Triton q-bit kernels (``sylvie_comm_triton::qbit_*``) against the pure-torch reference, bit for bit.

Every comparison is ``torch.equal`` on integer views (a NaN's bits included), against the reference run on the
same device: on a machine without a GPU the kernels run through Triton's interpreter on CPU tensors
(tests/conftest.py sets ``TRITON_INTERPRET=1``), on a GPU machine they compile for it.
"""

from __future__ import annotations

import pytest
import torch

from sylvie_comm import kernels
from sylvie_comm.kernels import reference as ref
from tests.kernels.fake_shapes import assert_fake_gives_real_shapes

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from sylvie_comm.kernels.triton import interpreted
from sylvie_comm.kernels.triton import qbit as tq  # registers the ops

OPS = torch.ops.sylvie_comm_triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
METAS = [torch.float32, torch.bfloat16]
BITS = [1, 2, 4, 8]
_INT_VIEW = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.uint8: torch.uint8,
}


@pytest.fixture(autouse=True)
def _kernels_can_run() -> None:
    if DEVICE == "cpu" and not interpreted():
        pytest.skip("no GPU, and TRITON_INTERPRET is not set for Triton's interpreter")


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.dtype])


def assert_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, shape and bits (NaN payloads included)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert torch.equal(bits_of(got), bits_of(want)), (got, want)


def encode_both(
    x: torch.Tensor, bits: int, seed: int, offset: int, meta: torch.dtype
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The op's and the reference's encodings of ``x`` (seed and offset any integers, taken modulo 2**64)."""
    got = OPS.qbit_encode(x, bits, kernels._as_int64(seed), kernels._as_int64(offset), meta)
    want = ref.qbit_encode(x, bits, seed, offset, meta)
    for g, w in zip(got, want, strict=True):
        assert_identical(g, w)
    return got, want


def check_decode(got: tuple[torch.Tensor, ...], bits: int, cols: int) -> None:
    """Both decode ops, every output dtype, against the reference decode of the same payload."""
    for dtype in DTYPES:
        want = ref.qbit_decode(*got, bits, cols, dtype)
        assert_identical(OPS.qbit_decode(*got, bits, cols, dtype), want)
        into = torch.full((got[0].shape[0], cols), 7.0, dtype=dtype, device=DEVICE)
        assert OPS.qbit_decode_into(*got, bits, into) is None
        assert_identical(into, want)


@pytest.fixture
def split_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small segments, so rows of a few hundred columns take the split-row kernels over many segments."""
    monkeypatch.setattr(tq, "_ROW_COLS", 16)
    monkeypatch.setattr(tq, "_SEG_COLS", 64)
    monkeypatch.setattr(tq, "_SEG_BLOCK", 32)
    monkeypatch.setattr(tq, "_META_SEGS", 2)


# Small shapes under every input dtype, bit width and metadata dtype; the wide ones ((3, 4096): whole rows of 8192
# elements per program (two of them); (1, 16384): the widest one-pass row, one program; (2, 16386): the split-row
# kernels, a whole segment and one of 2 columns per row) once per bit width (the interpreter runs them slowly, and
# the dtypes take the same kernel paths).
CASES = [
    (dtype, bits, meta, rows, cols)
    for dtype in DTYPES
    for bits in BITS
    for meta in METAS
    for rows, cols in [(0, 4), (3, 0), (1, 1), (5, 7), (37, 129)]
] + [
    (dtype, bits, meta, rows, cols)
    for bits in BITS
    for (dtype, meta, rows, cols) in [
        (torch.float32, torch.float32, 3, 4096),
        (torch.float16, torch.float32, 1, 16384),
        (torch.bfloat16, torch.bfloat16, 2, 16386),
    ]
]


@pytest.mark.parametrize("dtype,bits,meta,rows,cols", CASES)
def test_matches_reference(dtype, bits, meta, rows, cols):
    g = torch.Generator().manual_seed(rows * 10_000 + cols)
    x = (torch.randn(rows, cols, generator=g) * 3 + 1).to(dtype).to(DEVICE)
    got, _ = encode_both(x, bits, 1234, 99, meta)
    check_decode(got, bits, cols)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("meta", METAS)
def test_long_rows_split_over_segments(split_rows, bits, meta):
    # 4 segments of 2 steps per row (the last one partial), combined 2 at a time: each row's extremes sit in a
    # different segment, one row is not finite only in its last segment, one is constant, one holds subnormals.
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(6, 230, generator=g)
    x[0, 3], x[0, 229] = -40.0, 50.0
    x[1, 150], x[1, 64] = -9.0, 9.5
    x[2, 229] = float("nan")
    x[3] = 2.5
    x[4] = x[4].abs() * 1e-39  # one sign: fp16 flushes the row to zeros, all +0.0 (see test_signed_zero_minimum)
    x[5, 100] = float("-inf")
    for dtype in DTYPES if bits == 4 else (torch.float32,):  # the input dtypes once: the same kernel paths
        xd = x.to(dtype).to(DEVICE)
        got, _ = encode_both(xd, bits, 77, 2**32 - 5, meta)
        check_decode(got, bits, 230)


def test_long_rows_at_full_size():
    # The real segment size: 5 segments of 16384 columns per row.
    x = torch.randn(2, 70_000, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got, _ = encode_both(x, 2, 5, 2**40 + 1, torch.bfloat16)
    assert_identical(OPS.qbit_decode(*got, 2, 70_000, torch.float32), ref.qbit_decode(*got, 2, 70_000, torch.float32))


# Rows around the kernels' fast paths: packed rows that are whole 4-byte words, 2-byte halves or only bytes (the
# units the codes are stored in), rows of even length (two elements read as one word) and odd length (element by
# element, the first counters' parity changing from row to row), tiles filled exactly (no mask at all: (4, 32),
# (2, 64)) and not; a NaN row and an Inf row among them.
UNIT_SHAPES = [(4, 32), (2, 64), (3, 12), (2, 6), (5, 2), (3, 3), (1, 1)]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("offset", [0, 7])  # every row's first counter even, or odd
def test_units_tails_and_counter_parity(bits, offset):
    for rows, cols in UNIT_SHAPES:
        g = torch.Generator().manual_seed(rows * 100 + cols)
        x = torch.randn(rows, cols, generator=g) * 2 - 1
        if rows >= 3:
            x[1, cols - 1] = float("nan")
            x[2, 0] = float("-inf")
        for dtype in DTYPES:
            got, _ = encode_both(x.to(dtype).to(DEVICE), bits, 11, offset, torch.bfloat16 if dtype == torch.bfloat16
                                 else torch.float32)  # fmt: skip
        check_decode(got, bits, cols)


@pytest.mark.parametrize("bits", [4, 8])
def test_views_off_the_alignment(bits):
    # Views one element (or byte) into their buffers: a row of even length is read element by element, the packed
    # rows are read a byte or a half at a time (8-bit codes one per byte), the output is written element by element
    # (4 rows of 32: tiles filled exactly, so without masks).
    rows, cols = 4, 32
    pc = ref.packed_cols(cols, bits)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(bits))
    for dtype in DTYPES:
        xbuf = torch.full((1 + rows * cols,), float("nan"), dtype=dtype, device=DEVICE)
        xbuf[1:] = x.reshape(-1).to(dtype)
        got, want = encode_both(xbuf[1:].view(rows, cols), bits, 3, 4, torch.float32)
    for skew in (1, 2):
        pbuf = torch.full((skew + rows * pc + 1,), 0xA5, dtype=torch.uint8, device=DEVICE)
        pbuf[skew : skew + rows * pc] = got[0].view(-1)
        packed = pbuf[skew : skew + rows * pc].view(rows, pc)
        for dtype in DTYPES:
            obuf = torch.full((1 + rows * cols + 1,), 7.0, dtype=dtype, device=DEVICE)
            out = obuf[1 : 1 + rows * cols].view(rows, cols)
            OPS.qbit_decode_into(packed, got[1], got[2], bits, out)
            assert_identical(out, ref.qbit_decode(*want, bits, cols, dtype))
            assert obuf[0] == 7.0 and obuf[-1] == 7.0
            want_new = ref.qbit_decode(*want, bits, cols, dtype)
            assert_identical(OPS.qbit_decode(packed, *got[1:], bits, cols, dtype), want_new)


@pytest.mark.parametrize("bits", [1, 8])
def test_long_rows_whole_segments_and_odd_lengths(split_rows, bits):
    # Rows of whole segments (no mask in the split kernels), and rows of odd length split over segments (each row's
    # first counter of another parity), at even and odd offsets.
    for rows, cols in [(3, 128), (3, 131)]:
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)).to(DEVICE)
        x[1, cols - 1] = float("inf")
        for offset in (0, 3):
            got, _ = encode_both(x, bits, 21, offset, torch.float32)
        check_decode(got, bits, cols)


SEEDS_AND_OFFSETS = [
    (0, 0),
    (-1, 5),
    (2**64 - 1, 2**32 - 100),  # offsets in [2**31, 2**32) and seeds above 2**63
    (7, 2**40 + 3),
    (3, 2**33 - 100),  # counters straddling 2**33: the pair index's high word steps, from an even start
    (3, 2**33 - 101),  # ... and from an odd one
    (5, -300),  # counters straddling 2**64: the high word wraps from 0x7FFFFFFF to 0
    (2**63 + 12345, 2**63 - 50),  # counters straddling 2**63
    (-(2**63), 2**64 - 7),
    (2**32 + 1, 2**31),
]


@pytest.mark.parametrize("seed,offset", SEEDS_AND_OFFSETS)
@pytest.mark.parametrize("split", [False, True])
def test_noise_counter_edges(request, seed, offset, split):
    if split:
        request.getfixturevalue("split_rows")
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for bits in (1, 8):
        got, _ = encode_both(x, bits, seed, offset, torch.float32)
    check_decode(got, 8, 200)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_and_degenerate_rows(bits, dtype):
    x = torch.randn(11, 50, generator=torch.Generator().manual_seed(2))
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3, 49] = -float("inf")
    x[4] = 5.0  # constant: scale 0, decodes exactly
    x[5, :] = torch.tensor([3.0e38, -3.0e38] * 25)  # range beyond fp32
    x[6] = float("nan")
    x[7, :] = torch.tensor([-3.4028234663852886e38, 1.0] * 25)  # bf16 metadata: the minimum rounds to -inf
    x[8] = x[8].abs() * 1e-40  # subnormal values (a bf16 input keeps some; fp16 flushes them to +0.0)
    x[9] = torch.linspace(1e-44, 3e-44, 50)  # a subnormal range: an inverse scale that overflows
    x[10] = torch.linspace(1.0, 1.0 + 2**-20, 50)  # a range of a few ulps
    xd = x.to(dtype).to(DEVICE)
    for meta in METAS:
        got, _ = encode_both(xd, bits, 1, 0, meta)
        assert got[1][[1, 2, 3, 5, 6]].isnan().all()
        assert not got[0][[1, 2, 3, 5, 6]].any()
        check_decode(got, bits, 50)


def test_signed_zero_minimum():
    # Min and max are taken on order keys, -0.0 below +0.0 (torch's amin returns
    # whichever zero comes first, so the reference is compared only where it agrees).
    x = torch.tensor([[0.0, -0.0, 1.0], [-0.0, 0.0, 1.0], [-0.0, -0.0, -0.0], [0.0, 0.0, 0.0]], device=DEVICE)
    packed, scale, minimum = OPS.qbit_encode(x, 4, 3, 0, torch.float32)
    assert torch.equal(bits_of(minimum).cpu(), torch.tensor([-(2**31), -(2**31), -(2**31), 0], dtype=torch.int32))
    want = ref.qbit_encode(x, 4, 3, 0, torch.float32)
    assert_identical(packed, want[0])
    assert_identical(scale, want[1])


@pytest.mark.parametrize("bits", [2, 8])
def test_decode_rounding(bits):
    # Values that round to bf16 and fp16 on ties (to even), overflow to inf there, land on subnormals, and NaN
    # rows (a NaN scale or minimum): the casts of the reference, bit for bit.
    rows, cols = 7, 40
    q = torch.randint(0, 1 << bits, (rows, cols), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = ref.pack_bits(q, bits).to(DEVICE)
    scale = torch.tensor([1.0, 2.0**-7, 1.0e37, 3.0e-41, float("nan"), 0.5, 2.0**-13], device=DEVICE)
    minimum = torch.tensor([256.0, 1.0, 3.0e38, 1.0e-40, 0.0, float("nan"), 65504.0], device=DEVICE)
    check_decode((packed, scale, minimum), bits, cols)
    check_decode((packed, scale.bfloat16(), minimum.bfloat16()), bits, cols)


def test_bf16_nan_through_the_device_conversion(monkeypatch):
    # The GPU's branch of the bf16 narrowing (a NaN converted by the device's own instruction, as torch's CUDA
    # conversion is) runs here too: every other value keeps its bits, a NaN stays a NaN.
    monkeypatch.setattr(tq, "_nan_bf16", lambda device: -1)
    packed = ref.pack_bits(torch.randint(0, 16, (3, 20), dtype=torch.uint8), 4).to(DEVICE)
    scale = torch.tensor([0.25, float("nan"), 3.0], device=DEVICE)
    minimum = torch.tensor([-1.0, 0.0, float("nan")], device=DEVICE)
    got = OPS.qbit_decode(packed, scale, minimum, 4, 20, torch.bfloat16)
    want = ref.qbit_decode(packed, scale, minimum, 4, 20, torch.bfloat16)
    assert_identical(got[0], want[0])
    assert got[1:].isnan().all()


def test_inputs_and_outputs_in_guarded_buffers():
    # Views into buffers with NaN-filled guard regions: nothing outside the views is read or written.
    rows, cols, bits, guard = 5, 37, 4, 16
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(4))
    xbuf = torch.full((guard + rows * cols + guard,), float("nan"))
    xbuf[guard : guard + rows * cols] = x.view(-1)
    xbuf = xbuf.to(DEVICE)
    xv = xbuf[guard : guard + rows * cols].view(rows, cols)
    got, want = encode_both(xv, bits, 9, 11, torch.float32)
    pc = ref.packed_cols(cols, bits)
    pbuf = torch.full((guard + rows * pc + guard,), 0xA5, dtype=torch.uint8, device=DEVICE)
    pbuf[guard : guard + rows * pc] = got[0].view(-1)
    mbuf = torch.full((2, guard + rows + guard), float("nan"), device=DEVICE)
    mbuf[0, guard : guard + rows] = got[1]
    mbuf[1, guard : guard + rows] = got[2]
    views = (pbuf[guard : guard + rows * pc].view(rows, pc), mbuf[0, guard : guard + rows], mbuf[1, guard:-guard])
    obuf = torch.full((guard + rows * cols + guard,), float("nan"), device=DEVICE)
    out = obuf[guard : guard + rows * cols].view(rows, cols)
    OPS.qbit_decode_into(*views, bits, out)
    assert_identical(out, ref.qbit_decode(*want, bits, cols, torch.float32))
    assert obuf[:guard].isnan().all() and obuf[-guard:].isnan().all()


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_tiles_in_guarded_buffers(request, split, dtype):
    # Tiles that fill their rows exactly run without masks: aligned views into buffers whose guards hold NaN or 0
    # (and 0xA5 or 0 for bytes) come out with the same results and untouched guards, in one pass (4 rows of 32) and
    # split over whole segments (3 rows of 128).
    if split:
        request.getfixturevalue("split_rows")
    rows, cols, bits, guard = (3, 128, 4, 16) if split else (4, 32, 4, 16)
    pc = ref.packed_cols(cols, bits)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(6)).to(dtype)
    results = []
    for fill, byte in ((float("nan"), 0xA5), (0.0, 0)):
        xbuf = torch.full((guard + rows * cols + guard,), fill, dtype=dtype, device=DEVICE)
        xbuf[guard : guard + rows * cols] = x.reshape(-1).to(DEVICE)
        before = xbuf.clone()
        got, want = encode_both(xbuf[guard : guard + rows * cols].view(rows, cols), bits, 9, 2, torch.float32)
        assert torch.equal(bits_of(xbuf), bits_of(before))
        pbuf = torch.full((guard + rows * pc + guard,), byte, dtype=torch.uint8, device=DEVICE)
        pbuf[guard : guard + rows * pc] = got[0].view(-1)
        obuf = torch.full((guard + rows * cols + guard,), fill, dtype=dtype, device=DEVICE)
        out = obuf[guard : guard + rows * cols].view(rows, cols)
        OPS.qbit_decode_into(pbuf[guard : guard + rows * pc].view(rows, pc), got[1], got[2], bits, out)
        assert_identical(out, ref.qbit_decode(*want, bits, cols, dtype))
        for b in (obuf, pbuf):
            assert torch.equal(bits_of(b[:guard]), bits_of(torch.full_like(b[:guard], byte if b is pbuf else fill)))
            assert torch.equal(bits_of(b[-guard:]), bits_of(torch.full_like(b[-guard:], byte if b is pbuf else fill)))
        results.append(got)
    for a, b in zip(*results, strict=True):
        assert_identical(a, b)


def test_noncontiguous_input():
    x = torch.randn(40, 30, generator=torch.Generator().manual_seed(5)).to(DEVICE).t()
    got = OPS.qbit_encode(x, 2, 5, 0, torch.float32)
    for g, w in zip(got, ref.qbit_encode(x.contiguous(), 2, 5, 0, torch.float32), strict=True):
        assert_identical(g, w)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: OPS.qbit_encode(torch.randn(2, 2, device=DEVICE), 3, 0, 0, torch.float32), "bits must be one of"),
        (lambda: OPS.qbit_encode(torch.randn(4, device=DEVICE), 2, 0, 0, torch.float32), "2-D"),
        (lambda: OPS.qbit_encode(torch.randn(2, 2, device=DEVICE), 2, 0, 0, torch.float16), "meta_dtype"),
        (
            lambda: OPS.qbit_encode(torch.ones(2, 2, dtype=torch.int32, device=DEVICE), 2, 0, 0, torch.float32),
            "float32, float16",
        ),
        (
            lambda: OPS.qbit_decode(
                torch.zeros(2, 1, dtype=torch.uint8, device=DEVICE),
                torch.zeros(3, device=DEVICE),
                torch.zeros(3, device=DEVICE),
                8,
                1,
                torch.float32,
            ),
            "per-row scale",
        ),
        (
            lambda: OPS.qbit_decode(
                torch.zeros(2, 1, dtype=torch.uint8, device=DEVICE),
                torch.zeros(2, device=DEVICE),
                torch.zeros(2, device=DEVICE),
                8,
                2,
                torch.float32,
            ),
            r"need packed shape \[2, 2\]",
        ),
        (
            lambda: OPS.qbit_decode(
                torch.zeros(2, 1, dtype=torch.uint8, device=DEVICE),
                torch.zeros(2, dtype=torch.float16, device=DEVICE),
                torch.zeros(2, device=DEVICE),
                8,
                1,
                torch.float32,
            ),
            "float32 or bfloat16",
        ),
        (
            lambda: OPS.qbit_decode(
                torch.zeros(2, 1, dtype=torch.uint8, device=DEVICE),
                torch.zeros(2, device=DEVICE),
                torch.zeros(2, device=DEVICE),
                8,
                1,
                torch.int32,
            ),
            "dtype must be",
        ),
        (
            lambda: OPS.qbit_decode_into(
                torch.zeros(2, 1, dtype=torch.uint8, device=DEVICE),
                torch.zeros(2, device=DEVICE),
                torch.zeros(2, device=DEVICE),
                8,
                torch.empty(2, 2, device=DEVICE)[:, :1],
            ),
            "contiguous 2-D",
        ),
    ],
)
def test_checks_name_the_value(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        OPS.qbit_encode(torch.randn(2, 3), 2, 0, 0, torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        OPS.qbit_decode(torch.zeros(2, 1, dtype=torch.uint8), torch.zeros(2), torch.zeros(2), 2, 3, torch.float32)


def _cases() -> dict[str, tuple[object, ...]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 11, generator=g).to(DEVICE)
    u8 = torch.randint(0, 256, (6, 6), generator=g, dtype=torch.uint8).to(DEVICE)
    scale, minimum = torch.rand(6, generator=g).to(DEVICE), torch.randn(6, generator=g).to(DEVICE)
    return {
        "qbit_encode": (x, 4, 3, -2, torch.bfloat16),
        "qbit_decode": (u8, scale, minimum, 4, 11, torch.float16),
        "qbit_decode_into": (u8, scale, minimum, 4, torch.empty(6, 11, device=DEVICE)),
    }


@pytest.mark.parametrize("name", ["qbit_encode", "qbit_decode", "qbit_decode_into"])
def test_opcheck(name):
    torch.library.opcheck(getattr(OPS, name), _cases()[name])


@pytest.mark.parametrize("name", ["qbit_encode", "qbit_decode", "qbit_decode_into"])
def test_fake_tensor_mode_gives_the_real_shapes(name):
    assert_fake_gives_real_shapes(getattr(OPS, name), _cases()[name])
