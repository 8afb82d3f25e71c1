"""A bad argument to a compiled op is a Python exception, raised by its Python checks before any C++ code runs.

A C++ exception thrown for a bad argument has to unwind through the extension into torch, which an extension built
by another compiler than torch's may not survive: on an H200 machine (the system's g++ 13.3 against a torch built by
gcc-toolset-13) every such throw was a segmentation fault (docs/internals/testing.md). This toolchain survives them,
so the guarantee is tested where it is made: every case of :mod:`tests.kernels.bad_arguments` is refused by
``sylvie_comm/kernels/checks.py`` (the innermost frame of its traceback), through ``torch.ops.sylvie_comm`` and the
entry points alike, and a recording stand-in for every C++ kernel sees none of them. And on any machine every case
also runs in a child process, where a crash is a failure that names the case instead of a dead test worker.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from sylvie_comm import _ops, kernels
from tests.kernels.bad_arguments import BAD_CALLS, EDGE_CALLS

pytestmark = pytest.mark.skipif(not _ops.HAS_EXTENSION, reason=f"extension not built: {_ops.LOAD_ERROR}")

ROOT = Path(__file__).resolve().parents[2]
CHECKS_FILE = os.path.join("sylvie_comm", "kernels", "checks.py")
U8 = torch.uint8


def _innermost_frame(exc: BaseException) -> str:
    """``file:line`` of the innermost Python frame of an exception's traceback (a C++ error's is the op call)."""
    tb = exc.__traceback__
    assert tb is not None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"


def _refused_in_python(call: Callable[[], object], message: str) -> None:
    with pytest.raises(RuntimeError, match=message) as error:
        call()
    where = _innermost_frame(error.value)
    assert where.rsplit(":", 1)[0].endswith(CHECKS_FILE), f"raised at {where}, not by the Python checks ({CHECKS_FILE})"


@pytest.mark.parametrize(("name", "call", "message"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments_are_refused_in_python(name: str, call: Callable[[Any], object], message: str) -> None:
    """Through ``torch.ops.sylvie_comm`` (a direct caller): the error comes from the op's Python check."""
    _refused_in_python(lambda: call(torch.ops.sylvie_comm), message)


# Entry points of sylvie_comm.kernels whose bad arguments reach the compiled kernels (others take the references).
ENTRY_CALLS: list[tuple[str, Callable[[], object], str]] = [
    ("pack_bits", lambda: kernels.pack_bits(torch.zeros(2, 3, dtype=U8), 3), "^pack_bits: bits must be one of"),
    ("unpack_bits", lambda: kernels.unpack_bits(torch.zeros(2, 3, dtype=U8), 2, 13), "need 4 bytes per row, got 3"),
    ("onebit_encode", lambda: kernels.onebit_encode(torch.zeros(8), 12, False), "chunk_size must be a positive"),
    ("onebit_decode", lambda: kernels.onebit_decode(torch.zeros(1, dtype=U8), torch.zeros(1), 9, 8, torch.float32),
     "expected 2 uint8 bytes for 9 values"),
    ("onebit_decode out", lambda: kernels.onebit_decode(torch.zeros(1, dtype=U8), torch.zeros(2), 8, 8, torch.float32,
                                                        out=torch.empty(8)), "expected 1 float32 scales, got 2"),
    ("qbit_encode", lambda: kernels.qbit_encode(torch.zeros(2, 2), 3, 0, 0), "^qbit_encode: bits must be one of"),
    ("qbit_decode", lambda: kernels.qbit_decode(torch.zeros(2, 1, dtype=U8), torch.zeros(3), torch.zeros(3), 8, 1,
                                                torch.float32), "per-row scale and minimum values"),
    ("onebit_feedback_encode", lambda: kernels.onebit_feedback_encode(torch.zeros(16), None, 12, False,
                                                                      torch.zeros(2, dtype=U8), torch.zeros(2)),
     "chunk_size must be a positive"),
    ("lowrank_project", lambda: kernels.lowrank_project(torch.zeros(6, 5), None, torch.zeros(4, 2), torch.zeros(6, 2),
                                                        True), "needs q of 5 rows and p of 6 rows"),
    ("lowrank_gram", lambda: kernels.lowrank_gram(torch.zeros(6, 5), None, torch.zeros(6, 2), torch.zeros(5, 3)),
     r"same number \(> 0\) of columns"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "message"), ENTRY_CALLS, ids=[c[0] for c in ENTRY_CALLS])
def test_entry_points_refuse_bad_arguments_in_python(name: str, call: Callable[[], object], message: str) -> None:
    if kernels.backend(torch.zeros(1)) != "compiled":
        pytest.skip("CPU tensors take the Triton kernels here")
    _refused_in_python(call, message)


def test_bad_arguments_never_enter_the_cpp_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every C++ kernel replaced by a recording stand-in: no bad argument reaches one, by the public ops, the
    checked kernels the entry points call, or the entry points; the right arguments of every op do."""
    compiled = importlib.import_module("sylvie_comm.kernels.compiled")
    defined = {s.name.split("::")[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("sylvie_comm::")}
    assert set(compiled.KERNELS) == defined
    entered: list[str] = []

    def recording(name: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            entered.append(name)
            return kernel(*args, **kwargs)

        return run

    for name, kernel in list(compiled.KERNELS.items()):
        monkeypatch.setitem(compiled.KERNELS, name, recording(name, kernel))
    for namespace in (torch.ops.sylvie_comm, compiled.OPS):
        for name, call, message in BAD_CALLS:
            with pytest.raises(RuntimeError, match=message):
                call(namespace)
            assert not entered, f"{name}: the C++ kernel {entered} was entered with a bad argument"
    if kernels.backend(torch.zeros(1)) == "compiled":
        for name, call, message in ENTRY_CALLS:
            with pytest.raises(RuntimeError, match=message):
                call()
            assert not entered, f"kernels.{name}: the C++ kernel {entered} was entered with a bad argument"
    good = importlib.import_module("tests.kernels.test_fakes").CASES
    for name, args in good.items():
        getattr(torch.ops.sylvie_comm, name)(*args())
        getattr(compiled.OPS, name)(*args())
    assert entered == [n for n in good for _ in range(2)]


@pytest.mark.parametrize(("name", "call", "check"), EDGE_CALLS, ids=[c[0] for c in EDGE_CALLS])
def test_sizes_the_checks_accept_run_in_cpp(name: str, call: Callable[[Any], object], check: Callable[[Any], bool]):
    """What the checks accept the C++ kernels run (their int64 arithmetic does not overflow), never throwing."""
    assert check(call(torch.ops.sylvie_comm))


def test_an_unknown_isa_is_a_value_error_without_a_cpp_exception() -> None:
    """The extension answers False (pybind11 carries no C++ exception); Python raises the ValueError."""
    before = _ops.cpu_isa()
    assert _ops._C is not None and _ops._C.set_cpu_isa("sse9") is False
    assert _ops.cpu_isa() == before
    with pytest.raises(ValueError, match=r"unknown or unsupported CPU instruction set 'sse9'; available: baseline"):
        _ops.set_cpu_isa("sse9")


# ---------------------------------------------------------------------------------------------------- in a child

CHILD = r"""
import importlib, re, sys
import torch
from sylvie_comm import _ops
from tests.kernels.bad_arguments import BAD_CALLS, EDGE_CALLS

def say(*words):
    print(*words, flush=True)

namespaces = {"torch.ops.sylvie_comm": torch.ops.sylvie_comm}
try:
    namespaces["compiled.OPS"] = importlib.import_module("sylvie_comm.kernels.compiled").OPS
except ImportError:
    pass
wrong = 0
for label, ns in namespaces.items():
    for name, call, message in BAD_CALLS:
        say("case", label, name)
        try:
            call(ns)
        except RuntimeError as exc:
            if re.search(message, str(exc)) is None:
                wrong += 1
                say("wrong", repr(str(exc).splitlines()[0]))
        else:
            wrong += 1
            say("wrong", "no error")
    for name, call, check in EDGE_CALLS:
        say("case", label, name)
        try:
            ok = check(call(ns))
        except RuntimeError as exc:
            ok = False
            say("wrong", repr(str(exc).splitlines()[0]))
        if not ok:
            wrong += 1
            say("wrong", "a wrong result")
say("case", "set_cpu_isa('sse9')")
try:
    _ops.set_cpu_isa("sse9")
except ValueError:
    pass
say("done")
sys.exit(1 if wrong else 0)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bad_arguments_do_not_crash_a_process() -> None:
    """Every case, through the public ops and the checked kernels, in a child process: a crash (the segmentation
    fault of a C++ exception the process did not survive) fails here naming its case, with the child's stack."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", CHILD], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    cases = re.findall(r"^case (.*)$", proc.stdout, flags=re.MULTILINE)
    last = cases[-1] if cases else "(before the first case)"
    if proc.returncode < 0:
        died = signal.Signals(-proc.returncode).name
        pytest.fail(f"the child process died of {died} in case {last!r} (a C++ exception the process did not "
                    f"survive?):\n{proc.stderr[-4000:]}")  # fmt: skip
    assert proc.returncode == 0, f"after case {last!r}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.stdout.rstrip().endswith("done")
    assert len(cases) == 2 * (len(BAD_CALLS) + len(EDGE_CALLS)) + 1
