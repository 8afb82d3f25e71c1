"""The installed package works on its own: a wheel built from the sources, installed outside the checkout.

One fixture builds an sdist from a copy of the sources (so MANIFEST.in must
carry the C++ sources), builds a wheel from that sdist against the installed
torch (``--no-build-isolation``, as the README says) and installs it with
``--no-deps`` into a fresh virtual environment. That environment sees the
project environment's site-packages for torch and the other dependencies, but
not the checkout or its editable install. The commands then run from a
temporary directory.

A second environment is a base install (``pip install .``, no extras): it sees
the project environment's site-packages through folders of links that leave out
the packages the extras install (DGL, pymetis, OGB, Horovod), and its ``PATH``
has no ``horovodrun``; ``sylvie-comm demo`` must run there too.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sylvie_comm.demo import (
    DDP_RUNS,
    GNN_PARTITION,
    GNN_RUNS,
    HOROVOD_RUN,
    LAB_CODECS,
    ddp_table,
    gnn_table,
    lab_table,
)

pytestmark = pytest.mark.multiprocess  # builds the extension (about a minute), then trains on several processes

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "csrc", "sylvie_comm", "integrations")


def _run(cmd: list[str], cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    full_env.update(OMP_NUM_THREADS="1", **env)
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    tail = f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{tail}"
    return proc


def _extension_key() -> str:
    """A digest of everything the compiled extension depends on: its sources, the build files, torch, Python."""
    import torch

    h = hashlib.sha256(f"{torch.__version__} {sys.version} {sys.platform}".encode())
    files = [ROOT / "setup.py", ROOT / "pyproject.toml", *(p for p in (ROOT / "csrc").rglob("*") if p.is_file())]
    for path in sorted(files):
        h.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _unpack_sdist(sdist: Path, dest: Path) -> Path:
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python without extraction filters; the archive is the one built above
            tar.extractall(dest)
    (tree,) = dest.iterdir()
    return tree


def _build_inputs(root: Path) -> dict[str, bytes]:
    """What compiling the extension reads: setup.py, pyproject.toml and every file under csrc/, by path."""
    files = [root / "setup.py", root / "pyproject.toml", *(p for p in (root / "csrc").rglob("*") if p.is_file())]
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in files}


def _assert_carries_the_build_inputs(tree: Path) -> None:
    """The sdist (unpacked at ``tree``) holds every file the extension's build reads, with the checkout's bytes."""
    ours, theirs = _build_inputs(ROOT), _build_inputs(tree)
    missing = sorted(set(ours) - set(theirs))
    assert not missing, f"the sdist lacks {missing} (MANIFEST.in)"
    assert all(theirs[k] == v for k, v in ours.items()), [k for k, v in ours.items() if theirs[k] != v]


def _checkout_extension() -> Path | None:
    """The checkout's compiled extension if it is newer than setup.py and every file under csrc/ (what
    scripts/setup.sh rebuilds it for), else None: the wheel's build then compiles the extension itself."""
    built = sorted((ROOT / "sylvie_comm").glob("_C.*.so"))
    if len(built) != 1:
        return None
    newest_input = max((ROOT / name).stat().st_mtime for name in _build_inputs(ROOT) if name != "pyproject.toml")
    return built[0] if built[0].stat().st_mtime > newest_input else None


@pytest.fixture(scope="module")
def wheel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built by pip from an sdist of a copy of the sources.

    The sdist is new every time, and must carry every file the extension's
    build reads (checked byte for byte). Compiling the extension takes minutes
    on a small machine and ``scripts/setup.sh`` has compiled it from the same
    bytes already: where the checkout's extension is newer than every build
    input, the wheel packs it (setuptools finds it up to date). Otherwise the
    build compiles, in a tree kept in pytest's cache under a digest of the
    extension's inputs (C++ sources and headers, setup.py, pyproject.toml,
    torch and Python versions), where ninja finds the objects of an earlier run
    up to date; any change to those inputs starts a new tree.
    """
    tmp = tmp_path_factory.mktemp("build")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, src / name)
    build_sdist = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    _run([sys.executable, "-c", build_sdist, str(tmp / "sdist")], cwd=src, timeout=300)
    (sdist,) = (tmp / "sdist").glob("*.tar.gz")

    pytest_cache = getattr(request.config, "cache", None)  # absent with -p no:cacheprovider
    cache = pytest_cache.mkdir("sylvie-comm-wheel") if pytest_cache else tmp / "cache"
    cache.mkdir(exist_ok=True)
    key = _extension_key()
    with _locked(cache / "lock"):
        for old in cache.iterdir():
            if old.is_dir() and old.name != key:
                shutil.rmtree(old)
        # The tree keeps its path: ninja's build log records the absolute paths of the sources.
        tree = cache / key / "tree"
        tree.mkdir(parents=True, exist_ok=True)
        for entry in tree.iterdir():
            if entry.is_dir() and entry.name != "build":
                shutil.rmtree(entry)
            elif entry.is_file():
                entry.unlink()
        # Keep the compiled objects; drop every packaged file so that only the fresh sources get packed.
        for f in tree.glob("build/lib.*/**/*"):
            if f.is_file() and f.suffix != ".so":
                f.unlink()
        for bdist in tree.glob("build/bdist.*"):
            shutil.rmtree(bdist)
        unpacked = _unpack_sdist(sdist, tmp / "unpacked")
        for entry in unpacked.iterdir():
            shutil.move(entry, tree / entry.name)
        _assert_carries_the_build_inputs(tree)
        built = _checkout_extension()
        env = {"MAX_JOBS": os.environ.get("MAX_JOBS", "2")}
        if built is not None:
            # The extension scripts/setup.sh compiled from these very sources (the same bytes, checked above):
            # setuptools finds it newer than its sources and packs it without compiling them again. (torch's
            # BuildExtension forces a rebuild where it builds with ninja, which then decides what is up to date;
            # without ninja on PATH it keeps setuptools' own check.)
            lib = tree / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / "sylvie_comm"
            lib.mkdir(parents=True, exist_ok=True)
            shutil.copy(built, lib / built.name)
            path = os.environ.get("PATH", "").split(os.pathsep)
            env["PATH"] = os.pathsep.join(d for d in path if d and not (Path(d) / "ninja").exists())
        pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index"]
        _run([*pip_wheel, "-w", str(tmp / "dist"), str(tree)], cwd=tmp, timeout=900, **env)
    (whl,) = (tmp / "dist").glob("*.whl")
    return whl


def _venv_with(wheel: Path, root: Path, dependencies: list[Path] | list[str]) -> Path:
    """A fresh virtual environment at ``root`` holding the wheel, whose dependencies come from the folders
    ``dependencies`` (named in a .pth file)."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root.parent, timeout=120)
    python = root / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root,
                   timeout=60).stdout.strip()  # fmt: skip
    # A path line in a .pth file only extends sys.path: the .pth files over there (the editable install's
    # finder among them) are not run, so `sylvie_comm` can come only from this environment's own copy.
    (Path(purelib) / "project-dependencies.pth").write_text("".join(f"{p}\n" for p in dependencies))
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
         cwd=root, timeout=300)  # fmt: skip
    return root


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding the wheel; dependencies come from this environment's site-packages."""
    root = tmp_path_factory.mktemp("venv") / "env"
    return _venv_with(wheel, root, [p for p in site.getsitepackages() if Path(p).is_dir()])


# The top-level packages the optional extras install (sylvie-comm[dgl], [ogb], [horovod]) and the base install does not.
EXTRA_PACKAGES = ("dgl", "pymetis", "ogb", "horovod")


def _from_an_extra(name: str) -> bool:
    """Whether a site-packages entry (package, module, ``.dist-info``, ``.libs``) belongs to an extra's package."""
    return re.split(r"[-.]", name, maxsplit=1)[0].lower() in EXTRA_PACKAGES


def _base_install_view(dest: Path) -> list[Path]:
    """This environment's site-packages as folders of links to every entry but the extras' packages (and the
    checkout's editable install): the dependencies a base install has."""
    views = []
    for i, packages in enumerate(p for p in site.getsitepackages() if Path(p).is_dir()):
        view = dest / f"site-packages-{i}"
        view.mkdir(parents=True)
        for entry in Path(packages).iterdir():
            skip = entry.suffix == ".pth" or entry.name.startswith(("__editable__", "sylvie_comm"))
            if not skip and not _from_an_extra(entry.name):
                (view / entry.name).symlink_to(entry)
        views.append(view)
    return views


@pytest.fixture(scope="module")
def base_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding the wheel and seeing only the base install's dependencies."""
    root = tmp_path_factory.mktemp("base-venv") / "env"
    return _venv_with(wheel, root, _base_install_view(root.parent / "deps"))


def _path_without_horovodrun(venv: Path) -> str:
    """``PATH`` with the venv's bin first and no folder holding a ``horovodrun`` (the base install has none)."""
    kept = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "horovodrun").exists()]
    return os.pathsep.join([str(venv / "bin"), *kept])


@pytest.fixture()
def outside(tmp_path: Path) -> Path:
    """A working directory outside the checkout."""
    assert not tmp_path.resolve().is_relative_to(ROOT)
    return tmp_path


def test_wheel_carries_the_demo_and_the_extension(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "cli",
        "demo/__init__",
        "demo/launch",
        "demo/ddp_train",
        "demo/gnn_full_graph",
        "bench/kernels",
        "integrations/__init__",
        "integrations/ddp",
        "integrations/dgl",
        "integrations/horovod",
        # the GPU kernels: Triton sources, compiled on the GPU at run time (this wheel was built without nvcc)
        "kernels/triton/__init__",
        "kernels/triton/bits",
        "kernels/triton/onebit",
        "kernels/triton/qbit",
        "kernels/triton/lowrank",
        "kernels/ordered",
    ):
        assert f"sylvie_comm/{module}.py" in names  # integrations/ at the top of the sources installs here
    assert any(n.startswith("sylvie_comm/_C.") and n.endswith(".so") for n in names), sorted(names)
    assert not any(n.startswith(("examples/", "tests/")) for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "sylvie-comm = sylvie_comm.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_package_imports_its_own_copy(venv: Path, outside: Path) -> None:
    code = (
        "import sylvie_comm, sylvie_comm.demo, sylvie_comm.integrations.ddp as d; print(sylvie_comm.__file__); "
        "print(d.__file__); print(sylvie_comm.HAS_EXTENSION)"
    )
    run = _run([str(venv / "bin" / "python"), "-c", code], cwd=outside, timeout=120)
    where, adapter, has_extension = run.stdout.split()
    assert Path(where).resolve().is_relative_to(venv.resolve())
    assert Path(adapter).resolve().is_relative_to(venv.resolve())
    assert has_extension == "True"


def test_demo_runs_from_the_installed_package(venv: Path, outside: Path) -> None:
    cmd = [str(venv / "bin" / "sylvie-comm"), "demo", "--steps", "20", "--epochs", "3", "--gnn-nproc", "2",
           "--lab-workers", "2", "--lab-steps", "2", "--lab-model", "small", "--out", "demo.json"]  # fmt: skip
    proc = _run(cmd, cwd=outside, timeout=900)
    res = json.loads((outside / "demo.json").read_text())

    with_horovod = shutil.which("horovodrun") is not None  # the demo adds a horovodrun run where it can
    expected = [codec for codec, _ in DDP_RUNS] + ([HOROVOD_RUN[0]] if with_horovod else [])
    assert [r["codec"] for r in res["ddp"]] == expected
    assert all(r["world_size"] == 2 and r["steps"] == 20 for r in res["ddp"])
    if with_horovod:  # one function, one answer: the same run under horovodrun and under torchrun
        hvd, tr = res["ddp"][-1], next(r for r in res["ddp"] if r["codec"] == HOROVOD_RUN[0])
        assert hvd["launcher"] == "horovodrun" and tr["launcher"] == "torchrun"
        assert hvd["accuracy"] == tr["accuracy"] and hvd["bytes_sent"] == tr["bytes_sent"]
    plain = res["ddp"][0]["bytes_sent"]
    assert all(0 < r["bytes_sent"] < plain for r in res["ddp"][1:])  # the hooks compress
    assert [r["label"] for r in res["gnn"]] == [label for label, _ in GNN_RUNS]
    assert all(r["world_size"] == 2 and r["epochs"] == 3 for r in res["gnn"])
    assert 0 < res["gnn"][1]["halo_bytes_per_epoch"] < res["gnn"][0]["halo_bytes_per_epoch"]  # 1-bit halos

    # The lab part: S-SGD and three of ours on one link, in namespaces as root and on loopback
    # otherwise, saying which in its first line; a plot next to the JSON where matplotlib is installed.
    lab = res["lab"]
    assert list(lab["codecs"]) == list(LAB_CODECS) and lab["workers"] == 2 and lab["link"] == "1gbit"
    assert all(len(c["step_s"]) == 2 and c["median_s"] > 0 for c in lab["codecs"].values())
    assert lab["codecs"]["acpsgd"]["hook_bytes_per_step"] < lab["codecs"]["onebit"]["hook_bytes_per_step"]
    from sylvie_comm.algorithms.registry import ALGORITHMS

    candidates = ALGORITHMS["auto"].record.option_defaults["candidates"]
    assert set(lab["codecs"]["auto"]["auto_choices"].values()) <= set(candidates)
    banner = "lab: 2 workers in network namespaces" if lab["lab"]["shaped"] else "lab: LOOPBACK FALLBACK"
    assert f"   {banner}" in proc.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert lab["plot"] and (outside / lab["plot"]).stat().st_size > 0

    # The tables it printed are those of the results it wrote.
    assert ddp_table(res["ddp"]) in proc.stdout
    assert gnn_table(res["gnn"]) in proc.stdout
    assert lab_table(lab) in proc.stdout
    assert proc.stdout.startswith("1) data-parallel training: 2 processes")
    assert proc.stdout.rstrip().endswith("wrote demo.json")


def test_demo_runs_on_the_base_install(base_venv: Path, outside: Path) -> None:
    """No extras: no pymetis, DGL, OGB or Horovod importable (checked), yet ``sylvie-comm demo`` runs its DDP part
    and its GNN part, whose partitioner (plain torch) it names."""
    python = str(base_venv / "bin" / "python")
    probe = "import importlib.util as u, sys; print(sorted(m for m in sys.argv[1:] if u.find_spec(m)))"
    found = _run([python, "-c", probe, *EXTRA_PACKAGES], cwd=outside, timeout=120).stdout.strip()
    assert found == "[]", f"the base install sees {found}"
    path = _path_without_horovodrun(base_venv)
    assert shutil.which("horovodrun", path=path) is None
    cmd = [str(base_venv / "bin" / "sylvie-comm"), "demo", "--steps", "5", "--epochs", "2", "--gnn-nproc", "2",
           "--no-lab", "--out", "demo.json"]  # fmt: skip
    proc = _run(cmd, cwd=outside, timeout=900, PATH=path)
    res = json.loads((outside / "demo.json").read_text())
    assert [r["codec"] for r in res["ddp"]] == [codec for codec, _ in DDP_RUNS]
    assert "Horovod is not installed" in proc.stdout
    assert [r["label"] for r in res["gnn"]] == [label for label, _ in GNN_RUNS]
    assert all(r["partition"] == GNN_PARTITION and r["world_size"] == 2 and r["epochs"] == 2 for r in res["gnn"])
    assert f"   partitioner: {GNN_PARTITION} (" in proc.stdout
    assert gnn_table(res["gnn"]) in proc.stdout and res["lab"] is None
