"""The multi-process runner the tests share: forked workers see what a spawned one would."""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

import pytest

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.multiprocess


def _seen(rank: int, world: int, marker: str) -> dict[str, Any]:
    return {"env": os.environ.get("SYLVIE_COMM_TEST_MARK"), "cwd": os.getcwd(), "marker_file": Path(marker).exists()}


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_workers_see_the_callers_environment_and_folder_of_now(
    start: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_distributed(_seen, 2, str(tmp_path / "x"), start=start)  # the fork server starts before the change
    monkeypatch.setenv("SYLVIE_COMM_TEST_MARK", f"mark-{start}")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x").write_text("")
    for res in run_distributed(_seen, 2, "x", start=start):
        assert res["env"] == f"mark-{start}"
        assert Path(res["cwd"]).resolve() == tmp_path.resolve()
        assert res["marker_file"]


_EXIT_FILE = "SYLVIE_COMM_TEST_EXIT_FILE"


def _registers_an_exit_handler(rank: int, world: int) -> int:
    path = Path(os.environ[_EXIT_FILE]) / f"rank{rank}"
    atexit.register(path.write_text, "ran")
    return rank


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_a_workers_atexit_handlers_run_as_at_a_spawned_exit(
    start: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_EXIT_FILE, str(tmp_path))
    assert run_distributed(_registers_an_exit_handler, 2, start=start) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    assert all(p.read_text() == "ran" for p in tmp_path.iterdir())


def test_an_unknown_start_is_refused() -> None:
    with pytest.raises(ValueError, match=r"start must be one of \('forkserver', 'spawn'\), got 'fork'"):
        run_distributed(_seen, 2, "x", start="fork")
