"""Without the compiled extension the package still imports, warns once and gives the same bits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sylvie_comm import _ops, kernels

SCRIPT = textwrap.dedent(
    """
    import warnings, torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import sylvie_comm
        import sylvie_comm.kernels
        import sylvie_comm.codecs
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "compiled kernels unavailable" in msgs[0], msgs
    assert not sylvie_comm.HAS_EXTENSION
    torch.manual_seed(0)
    x = torch.randn(7, 33)
    q = sylvie_comm.get_codec("qbit", bits=2, seed=9)
    torch.save(q.encode(x).payload, "{out}")
    """
)


@pytest.mark.multiprocess
def test_fallback_without_extension(tmp_path):
    out = tmp_path / "payload.pt"
    env = dict(os.environ, SYLVIE_COMM_DISABLE_EXTENSION="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(out=out)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    fallback = torch.load(out)
    torch.manual_seed(0)
    x = torch.randn(7, 33)
    native = kernels.qbit_encode(x, 2, 9, 0)
    for a, b in zip(fallback, native, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not _ops.HAS_EXTENSION, reason="extension not built")
def test_extension_reports_its_build():
    assert _ops.cpu_isa() in _ops.available_cpu_isas()
