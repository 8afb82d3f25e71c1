"""Without ``--parts-dir`` the GNN demo keeps its partitions in a private folder of this user's.

The default folder's name is predictable (it is named after the run's inputs, so that a rerun reuses it). It
used to be in the shared temp folder, where another local user could create it first, with poisoned parts that
pass the checks or unwritable. Now it is in the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``), made with
mode 0o700, and a folder on the way that is not this user's, or that others may write to, is refused.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from sylvie_comm.demo import gnn_full_graph as demo

ARGS = ["--nodes", "60", "--features", "4", "--hidden", "4", "--epochs", "1", "--backend", "torch",
        "--no-progress"]  # fmt: skip
NOBODY = 65534


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own cache and temp folders (nothing is written to the real ones)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path / "cache"


def default_folder() -> Path:
    return Path(demo.parts_folder(demo.parse_args(ARGS), 1))


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_fresh_run_makes_a_private_folder_in_the_users_cache_and_reuses_it(cache):
    folder = default_folder()
    assert folder.is_relative_to(cache / "sylvie_comm"), folder
    demo.main(ARGS)
    assert (folder / "CURRENT").is_file()
    for made in (cache / "sylvie_comm", *[p for p in folder.parents if p.is_relative_to(cache / "sylvie_comm")]):
        assert mode(made) == 0o700, (made, oct(mode(made)))
    assert mode(folder) == 0o700
    version = (folder / "CURRENT").read_text()
    demo.main(ARGS)
    assert (folder / "CURRENT").read_text() == version  # the same inputs: reused, not partitioned again


def test_a_folder_others_may_write_to_is_refused(cache):
    folder = default_folder()
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match=rf"{folder} is writable by its group or others \(mode 0o777\)"):
        demo.main(ARGS)
    assert not (folder / "CURRENT").exists()


def test_a_folder_of_another_user_is_refused(cache):
    folder = default_folder()
    folder.mkdir(parents=True, mode=0o700)
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=rf"{folder} is owned by uid {NOBODY}, not by this user"):
        demo.main(ARGS)
    assert not (folder / "CURRENT").exists()


def test_a_parent_folder_of_another_user_is_refused(cache):
    folder = default_folder()
    folder.parent.mkdir(parents=True, mode=0o700)
    os.chown(folder.parent, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=rf"{folder.parent} is owned by uid {NOBODY}"):
        demo.main(ARGS)
    assert not folder.exists()


def test_a_planted_symbolic_link_is_refused(cache, tmp_path):
    folder = default_folder()
    folder.parent.mkdir(parents=True, mode=0o700)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    folder.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match=rf"{folder} is a symbolic link"):
        demo.main(ARGS)
    assert not (tmp_path / "elsewhere" / "CURRENT").exists()


def test_without_a_home_the_default_is_a_private_temp_folder(cache, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)  # no home folder to be found
    folder = default_folder()
    assert folder.is_relative_to(Path(tempfile.gettempdir()) / f"sylvie_comm-{os.geteuid()}"), folder


def test_an_explicit_parts_dir_is_used_as_given(cache, tmp_path):
    given = tmp_path / "mine"
    assert demo.parts_folder(demo.parse_args([*ARGS, "--parts-dir", str(given)]), 1) == str(given)
