"""Per-row wire layout of the codecs: to_rows / from_rows / row_bytes."""

from __future__ import annotations

import pytest
import torch

import sylvie_comm
from sylvie_comm.codecs import Bf16Codec, Fp16Codec, IdentityCodec, QBitCodec

ROW_CODECS = [
    pytest.param(lambda: IdentityCodec(), id="none"),
    pytest.param(lambda: Fp16Codec(), id="fp16"),
    pytest.param(lambda: Bf16Codec(divide_by=4.0), id="bf16-divided"),
    *[pytest.param(lambda b=b, m=m: QBitCodec(bits=b, seed=3, meta_dtype=m), id=f"q{b}-{m}")
      for b in (1, 2, 4, 8) for m in ("fp32", "bf16")],
]  # fmt: skip


@pytest.mark.parametrize("make", ROW_CODECS)
def test_rows_decode_like_the_payload_and_one_by_one(make):
    codec = make()
    x = torch.randn(40, 37)
    enc = codec.encode(x)
    wire = codec.to_rows(enc)
    assert wire.dtype == torch.uint8 and wire.shape == (40, codec.row_bytes(37))
    assert wire.numel() == enc.nbytes == codec.payload_bytes(x.shape)
    full = codec.decode(enc)
    assert torch.equal(codec.decode(codec.from_rows(wire, 37)), full)
    # Rows are self-contained: any selection of rows decodes to the same rows.
    pick = torch.tensor([5, 0, 39, 5, 17])
    assert torch.equal(codec.decode(codec.from_rows(wire[pick], 37)), full[pick])


@pytest.mark.parametrize("make", ROW_CODECS)
def test_rows_into_a_preallocated_buffer_and_empty_rows(make):
    codec = make()
    x = torch.randn(9, 20)
    enc = codec.encode(x)
    buf = torch.full((9, codec.row_bytes(20)), 0xAB, dtype=torch.uint8)
    assert codec.to_rows(enc, out=buf) is buf
    assert torch.equal(buf, codec.to_rows(enc))
    empty = codec.to_rows(codec.encode(torch.zeros(0, 20)))
    assert empty.shape == (0, codec.row_bytes(20))
    assert codec.decode(codec.from_rows(empty, 20)).shape == (0, 20)


@pytest.mark.parametrize("meta,mb", [("fp32", 4), ("bf16", 2)])
def test_qbit_row_layout_is_scale_min_packed(meta, mb):
    codec = QBitCodec(bits=1, seed=1, meta_dtype=meta)
    x = torch.randn(6, 33)
    enc = codec.encode(x)
    packed, scale, minimum = enc.payload
    wire = codec.to_rows(enc)
    assert codec.row_bytes(33) == 2 * mb + 5
    assert torch.equal(wire[:, :mb], scale.view(torch.uint8).view(6, mb))
    assert torch.equal(wire[:, mb : 2 * mb], minimum.view(torch.uint8).view(6, mb))
    assert torch.equal(wire[:, 2 * mb :], packed)


def test_row_layout_errors():
    x = torch.randn(4, 8)
    onebit = sylvie_comm.get_codec("onebit", chunk_size=8)
    with pytest.raises(ValueError, match="onebit: this codec has no fixed per-row wire layout"):
        onebit.to_rows(onebit.encode(x))
    chunked = QBitCodec(row_size=4)
    with pytest.raises(ValueError, match="row_size=None, not 4"):
        chunked.to_rows(chunked.encode(x))
    codec = QBitCodec(bits=2)
    with pytest.raises(ValueError, match="expected rows of 10 bytes, got 9"):
        codec.from_rows(torch.zeros(4, 9, dtype=torch.uint8), 8)
    with pytest.raises(ValueError, match=r"expected a 2-D uint8 tensor of rows, got torch\.float32"):
        codec.from_rows(torch.zeros(4, 10), 8)
    with pytest.raises(ValueError, match="out has 3 rows, expected 4"):
        codec.to_rows(codec.encode(x), out=torch.zeros(3, 10, dtype=torch.uint8))
    fp16 = Fp16Codec()
    with pytest.raises(ValueError, match=r"expected an encoded 2-D \(rows, features\) tensor, got shape \(8,\)"):
        fp16.to_rows(fp16.encode(torch.randn(8)))
