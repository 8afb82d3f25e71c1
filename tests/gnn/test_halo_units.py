from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sylvie_comm import _deps
from sylvie_comm.gnn.halo import RowFormat, parse_precision


@pytest.mark.parametrize("value,want", [(32, "fp32"), (16, "bf16"), ("16", "bf16"), (1, "q1"), ("q4", "q4"),
                                        ("fp16", "fp16"), (8, "q8"), ("none", "fp32")])  # fmt: skip
def test_parse_precision(value, want):
    assert parse_precision(value) == want


@pytest.mark.parametrize("value", [3, "q3", "int8", True])
def test_parse_precision_rejects(value):
    with pytest.raises(ValueError, match="unknown halo precision"):
        parse_precision(value)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "q1", "q2", "q4", "q8"])
@pytest.mark.parametrize("meta", ["fp32", "bf16"])
def test_row_format_round_trip(precision, meta):
    x = torch.randn(50, 33)
    fmt = RowFormat(precision, 33, meta)
    wire = fmt.encode(x)
    assert wire.dtype == torch.uint8 and wire.shape == (50, fmt.row_bytes)
    y = fmt.decode(wire)
    if precision == "fp32":
        assert torch.equal(y, x)
    elif precision in ("bf16", "fp16"):
        torch.testing.assert_close(y, x, rtol=1e-2, atol=1e-2)
    else:
        bits = int(precision[1:])
        step = (x.amax(1) - x.amin(1)) / ((1 << bits) - 1)
        assert ((y - x).abs() <= step[:, None] * 1.01 + 1e-6).all()
    # 1-bit rows: ceil(33 / 8) bytes plus scale and minimum.
    if precision == "q1":
        assert fmt.row_bytes == 5 + (8 if meta == "fp32" else 4)


@pytest.mark.multiprocess
def test_dgl_compat_import_warns_once_in_a_fresh_process():
    if not _deps.graphbolt_library_missing():
        pytest.skip("this DGL has graphbolt for the running torch, or DGL is absent")
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    from sylvie_comm import _deps\n"
        "    dgl = _deps.import_dgl(); _deps.import_dgl()\n"
        "msgs = [str(x.message) for x in w if 'graphbolt' in str(x.message)]\n"
        "assert len(msgs) == 1, msgs\n"
        "import torch\n"
        "g = dgl.graph((torch.tensor([0, 1]), torch.tensor([1, 2])))\n"
        "assert g.num_edges() == 2\n"
        "try:\n"
        "    dgl.graphbolt.ItemSet\n"
        "except ImportError as e:\n"
        "    assert 'graphbolt' in str(e)\n"
        "else:\n"
        "    raise AssertionError('stub did not raise')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("precision", ["q1", "q4"])
def test_row_format_feedback_is_the_codecs_bounded_feedback(precision):
    """Halo rows with error feedback are the codec's rows of ErrorFeedback.encode(bound_rows=True)."""
    from sylvie_comm.codecs import ErrorFeedback, QBitCodec

    x = torch.randn(30, 17)
    fmt = RowFormat(precision, 17, seed=9)
    codec = QBitCodec(bits=int(precision[1:]), seed=9)
    mine, ref = ErrorFeedback(), ErrorFeedback()
    for step in range(4):
        wire = fmt.encode(x + step, mine, "k")
        assert torch.equal(wire, codec.to_rows(ref.encode(codec, "k", x + step, bound_rows=True)))
        assert torch.equal(mine.residual("k"), ref.residual("k"))
    # Cast rows carry no residual.
    fp16 = RowFormat("fp16", 17)
    fp16.encode(x, mine, "cast")
    assert "cast" not in mine
