"""The unit tier's guard (tests/conftest.py): a unit test that starts a process fails, naming the marker it needs;
the tools Triton's compiler runs on a GPU (ldconfig, ptxas) are its compilation and are let through."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import conftest


def test_a_unit_test_that_starts_a_process_fails_naming_the_marker() -> None:
    with pytest.raises(RuntimeError, match=r"starts a process but is in the unit tier: mark it @pytest.mark.multiproc"):
        subprocess.Popen([sys.executable, "-c", "pass"])


@pytest.mark.skipif(conftest._TRITON_DIR is None, reason="Triton is not installed")
def test_a_process_that_tritons_compiler_starts_is_let_through() -> None:
    # A function whose code lives in Triton's package, as its driver's call of ldconfig does.
    where = os.path.join(str(conftest._TRITON_DIR), "backends", "compiler_tool.py")
    code = compile("def run(cmd):\n    return subprocess.run(cmd, capture_output=True, text=True)\n", where, "exec")
    space: dict[str, object] = {"subprocess": subprocess}
    exec(code, space)
    proc = space["run"]([sys.executable, "-c", "print('compiled')"])  # type: ignore[operator]
    assert proc.returncode == 0 and proc.stdout.strip() == "compiled"
