"""Fixtures of every test, and the tiers.

Every test belongs to one tier, read from its markers (the first that applies):

* ``gpu``: needs a CUDA device and Triton (marker ``gpu``);
* ``lab``: needs root for the network lab's namespaces and shaped links (marker ``lab``);
* ``quality``: trains to an accuracy, or soaks a behaviour over many runs (marker ``quality``);
* ``integration``: starts processes: ranks over gloo, a launcher, a command, a build (marker ``multiprocess``);
* ``unit``: none of these: one process, no other process started (enforced: a unit test that starts one fails,
  naming the marker it needs).

``pytest`` alone runs the unit tier (the developer's loop, about a minute); ``--tier NAME`` (repeatable) picks
tiers, ``--tier all`` runs every one (``scripts/test.sh`` and CI do). Naming test files or ids, or a marker
expression (``-m``), on the command line runs every tier of what is named. Each tier has its own per-test time
limit (pytest-timeout), so a test that hangs fails with its stack instead of stopping the run;
``@pytest.mark.timeout(N)`` on a test, or ``--timeout N`` on the command line, overrides it.
"""

from __future__ import annotations

import importlib.util
import multiprocessing.process
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

# The Triton kernels run on CPU tensors through Triton's interpreter, which must be chosen before a kernel module
# is imported (``triton.jit`` reads it when it wraps a function); on a CUDA machine they compile for the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sylvie_comm import _ops

# Tier -> the marker that puts a test in it (None: the unit tier, no marker) and its per-test time limit, s.
TIERS: dict[str, tuple[str | None, float]] = {
    "gpu": ("gpu", 600),
    "lab": ("lab", 900),
    "quality": ("quality", 1200),
    "integration": ("multiprocess", 600),
    "unit": (None, 120),
}


# The standard library asks ``uname -p`` once per process, in a process of its own, for ``platform.platform()``
# (a benchmark record's machine): asked here, before any test, so no unit test is the one that starts it.
_PROCESSOR = platform.uname().processor


_ORDER = ("quality", "lab", "integration", "gpu", "unit")


def tier_of(item: pytest.Item) -> str:
    for tier, (marker, _) in TIERS.items():
        if marker is None or item.get_closest_marker(marker) is not None:
            return tier
    raise AssertionError("unreachable: the unit tier takes every test")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        action="append",
        choices=[*TIERS, "all"],
        help="run the tests of this tier (repeatable; 'all' for every tier). Default: 'unit', or every tier of "
        "the files or ids named on the command line.",
    )


def _chosen(config: pytest.Config) -> set[str]:
    chosen = config.getoption("--tier") or []
    if not chosen:  # files, ids or a marker expression named on the command line: every tier of those
        named = config.args_source == pytest.Config.ArgsSource.ARGS or bool(config.getoption("markexpr", ""))
        chosen = ["all"] if named else ["unit"]
    return set(TIERS) if "all" in chosen else set(chosen)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = _chosen(config)
    # pytest-timeout (scripts/setup.sh installs it); a --timeout on the command line is the caller's, for every test
    timeouts = config.pluginmanager.hasplugin("timeout") and config.getoption("timeout", None) is None
    kept, dropped = [], []
    for item in items:
        tier = tier_of(item)
        if tier in chosen:
            kept.append(item)
            if timeouts and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(TIERS[tier][1]))
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    # The long tiers first, each in collection order: pytest-xdist deals the list out in contiguous slices and a
    # worker that runs dry steals from the end of another's, so the runs end on short unit tests instead of one
    # worker finishing a long quality run alone.
    kept.sort(key=lambda item: _ORDER.index(tier_of(item)))
    items[:] = kept


def pytest_report_header(config: pytest.Config) -> str:
    return f"tiers: {', '.join(t for t in TIERS if t in _chosen(config))}"


def _refuse_processes(nodeid: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{nodeid} starts a process but is in the unit tier: mark it @pytest.mark.multiprocess (the integration "
            "tier), or test the behaviour in this process (sylvie_comm.collectives.local.run_local for ranks)"
        )

    return refuse


def _triton_dir() -> str | None:
    spec = importlib.util.find_spec("triton")
    return os.path.dirname(spec.origin) + os.sep if spec is not None and spec.origin else None


# On a GPU, Triton's compiler runs its own tools (ldconfig to find the driver, ptxas): a kernel's compilation, not a
# process the test starts (under the interpreter, as in CI, it runs none).
_TRITON_DIR = _triton_dir()
_POPEN_INIT = subprocess.Popen.__init__


def _from_triton() -> bool:
    if _TRITON_DIR is None:
        return False
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_TRITON_DIR):
            return True
        frame = frame.f_back
    return False


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A unit test may not start a process (a subprocess, a multiprocessing worker): the tiers rest on it. The
    tools Triton's compiler runs are allowed (:func:`_from_triton`)."""
    if tier_of(request.node) == "unit":
        refuse = _refuse_processes(request.node.nodeid)

        def popen(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
            if not _from_triton():
                refuse()
            _POPEN_INIT(self, *args, **kwargs)

        monkeypatch.setattr(subprocess.Popen, "__init__", popen)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield


@pytest.fixture(params=_ops.available_cpu_isas() or ["reference"])
def cpu_isa(request: pytest.FixtureRequest):
    """Run a test once per CPU instruction set of the compiled kernels (restored afterwards)."""
    if request.param == "reference":
        yield "reference"
        return
    before = _ops.cpu_isa()
    _ops.set_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        _ops.set_cpu_isa(before)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
