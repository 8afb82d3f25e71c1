"""A partition folder under concurrent writers and readers: a reader always sees one complete write.

The deterministic tests run a reader after every filesystem change a writer makes (os.replace, os.rename,
os.mkdir, os.unlink, os.rmdir, shutil.rmtree: wrapped for the duration of the test), and between the steps
of a read (through ``partition_store._step``); the last one races real processes, with a bounded number of writes.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
import torch

from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn import partition_store
from sylvie_comm.gnn.partition import load_partition, partition, recorded_inputs, save_partitions

N, PARTS = 200, 3


def write(seed):
    """Write number ``seed``: its parts and the inputs it records (every write's parts differ)."""
    g = gdata.csbm(num_nodes=N, num_classes=3, feat_dim=4, avg_degree=5, seed=0)
    return partition((g.src, g.dst), PARTS, "random", num_nodes=N, ndata=g.ndata, seed=seed), {"write": seed}


def save(folder, seed):
    parts, inputs = write(seed)
    save_partitions(parts, folder, inputs)


def same(a, b):
    return all(
        torch.equal(getattr(a, k), getattr(b, k)) for k in ("inner", "halo", "src", "dst", "in_degree", "out_degree")
    ) and all(torch.equal(x, y) for x, y in zip(a.send_idx, b.send_idx, strict=True))


def read_everything(folder, writes):
    """One reader's view: the recorded inputs and every rank's part, each from one complete write (which of
    ``writes``, by the meta.json of the version it was read from). Returns the writes seen."""
    inputs = recorded_inputs(folder)
    assert inputs in [w[1] for w in writes.values()], f"recorded_inputs saw {inputs!r}"
    seen = {inputs["write"]}
    for r in range(PARTS):
        if hasattr(partition_store, "_load"):  # the part and the meta.json of the version it came from
            part, meta = partition_store._load(Path(folder), r)
            which = meta["inputs"]["write"]
        else:  # (before versions existed: which write the part equals)
            part = load_partition(folder, r)
            which = next((s for s, w in writes.items() if same(part, w[0][r])), None)
        assert which is not None and same(part, writes[which][0][r]), f"rank {r}'s part is from no single write"
        seen.add(which)
    return seen


class EveryChange:
    """Wraps the os/shutil calls that change the filesystem so that ``after()`` runs after each of them."""

    NAMES = ((os, "replace"), (os, "rename"), (os, "mkdir"), (os, "unlink"), (os, "rmdir"), (shutil, "rmtree"))

    def __init__(self, monkeypatch, after):
        self.calls = []
        self.busy = False
        for module, name in self.NAMES:
            monkeypatch.setattr(module, name, self._wrap(getattr(module, name), name))
        self.after = after

    def _wrap(self, fn, name):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            if not self.busy:
                self.busy = True
                try:
                    self.calls.append(name)
                    self.after()
                finally:
                    self.busy = False
            return out

        return wrapped


@pytest.mark.parametrize("first_write", [True, False])
def test_a_reader_between_every_change_of_a_write_sees_one_complete_write(tmp_path, monkeypatch, first_write):
    folder = tmp_path / "parts"
    writes = {s: write(s) for s in (0, 1, 2)}
    if first_write:  # replacing a partition: every read sees the old or the new one
        save(folder, 0)
    seen = []

    def reader():
        if not (folder / "CURRENT").exists() and not first_write:
            # Before the first write is published there is no partition, and readers say so.
            with pytest.raises(FileNotFoundError, match=r"(holds no partition|does not exist)"):
                load_partition(folder, 0)
            assert recorded_inputs(folder) is None
            return
        seen.append(read_everything(folder, writes))

    changes = EveryChange(monkeypatch, reader)
    save_partitions(writes[1][0], folder, writes[1][1])
    save_partitions(writes[2][0], folder, writes[2][1])
    monkeypatch.undo()
    assert len(changes.calls) >= 8, changes.calls  # the reader ran many times in each write
    assert read_everything(folder, writes) == {2}
    views = [min(s) for s in seen]
    assert all(len(s) == 1 for s in seen), seen  # never parts of two writes in one read
    assert views == sorted(views) and views[-1] == 2  # old until the pointer moves, then the new one
    assert sorted(p.name for p in folder.iterdir())[:2] == [".lock", "CURRENT"]
    assert len([p for p in folder.iterdir() if p.name.startswith("v-")]) == 1  # old versions removed


def test_a_reader_whose_version_is_replaced_mid_read_reads_the_new_one(tmp_path, monkeypatch):
    """Between resolving the pointer and opening the files, two writes replace the version the reader resolved
    (and delete it): the reader notices and reads the newest complete write instead."""
    folder = tmp_path / "parts"
    writes = {s: write(s) for s in (0, 1, 2)}
    save_partitions(writes[0][0], folder, writes[0][1])
    steps = []

    def step(what):
        steps.append(what)
        if what.startswith("read: resolved") and len([s for s in steps if s.startswith("read: resolved")]) == 1:
            save_partitions(writes[1][0], folder, writes[1][1])
            save_partitions(writes[2][0], folder, writes[2][1])

    monkeypatch.setattr(partition_store, "_step", step)
    part, meta = partition_store._load(folder, 1)
    assert meta["inputs"] == {"write": 2} and same(part, writes[2][0][1])
    resolved = [s for s in steps if s.startswith("read: resolved")]
    assert len(resolved) == 2 and resolved[0] != resolved[1]
    assert recorded_inputs(folder) == {"write": 2}


def test_a_missing_file_in_the_current_version_is_an_error_not_a_retry(tmp_path):
    folder = tmp_path / "parts"
    save(folder, 0)
    version = folder / (folder / "CURRENT").read_text().strip()
    (version / "part2.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"part2\.pt is missing though .*CURRENT names its version"):
        load_partition(folder, 2)
    assert recorded_inputs(folder) is None


def test_a_crashed_first_write_leaves_no_partition_and_is_cleaned_up(tmp_path, monkeypatch):
    folder = tmp_path / "parts"

    def crash(what):
        if what == "write: wrote meta.json":
            raise KeyboardInterrupt

    monkeypatch.setattr(partition_store, "_step", crash)
    with pytest.raises(KeyboardInterrupt):
        save(folder, 0)
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]
    with pytest.raises(FileNotFoundError, match="holds no partition"):
        load_partition(folder, 0)
    # A writer killed mid-write leaves its staging folder; the next write removes it.
    (folder / f".writing-{'a' * 32}").mkdir()
    (folder / f".writing-{'a' * 32}" / "part0.pt").write_bytes(b"half")
    save(folder, 1)
    assert not (folder / f".writing-{'a' * 32}").exists() and recorded_inputs(folder) == {"write": 1}


@pytest.mark.parametrize("where", ["top", "version"])
def test_a_folder_named_like_a_part_file_is_refused(tmp_path, where):
    folder = tmp_path / "parts"
    save(folder, 0)
    parent = folder if where == "top" else folder / (folder / "CURRENT").read_text().strip()
    (parent / "part0.pt").unlink(missing_ok=True)
    (parent / "part0.pt").mkdir()
    (parent / "part0.pt" / "mine.txt").write_text("mine")
    prefix = "" if where == "top" else f"{parent.name}/"
    with pytest.raises(ValueError, match=rf"holds entries that are not a partition's \({prefix}part0\.pt \(not a "
                                         r"file\)\)"):  # fmt: skip
        save(folder, 1)
    assert (parent / "part0.pt" / "mine.txt").read_text() == "mine"


def test_a_folder_named_like_a_part_file_is_refused_in_an_older_layout(tmp_path):
    """The layout older versions wrote (meta.json and part files at the top): a folder part1.pt/ is refused."""
    folder = tmp_path / "parts"
    folder.mkdir()
    (folder / "meta.json").write_text("{}")
    (folder / "part1.pt").mkdir()
    (folder / "part1.pt" / "mine.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"\(part1\.pt \(not a file\)\)"):
        save(folder, 0)
    assert (folder / "part1.pt" / "mine.txt").read_text() == "mine"


# ---- a real race: two writer processes and a reader process on one folder


def _writer(folder, seed, count):
    parts, inputs = write(seed)
    for _ in range(count):
        save_partitions(parts, folder, inputs)


def _reader(folder, seeds, stop, reads):
    writes = {s: write(s) for s in seeds}
    done = 0
    while done < reads or not stop.is_set():
        read_everything(folder, writes)  # raises on a missing or torn partition
        done += 1
        if done >= 20 * reads:
            break
    return done


def _run_reader(folder, seeds, stop, reads, result):
    try:
        result.put(("ok", _reader(folder, seeds, stop, reads)))
    except BaseException as exc:  # report it to the parent
        result.put(("error", f"{type(exc).__name__}: {exc}"))


@pytest.mark.multiprocess
def test_two_writers_and_a_reader_race_on_one_folder(tmp_path):
    folder = str(tmp_path / "parts")
    save(folder, 0)
    ctx = multiprocessing.get_context("spawn")
    stop, result = ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_run_reader, args=(folder, (0, 1, 2), stop, 50, result))
    writers = [ctx.Process(target=_writer, args=(folder, s, 15)) for s in (1, 2)]
    reader.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=300)
        assert w.exitcode == 0
    stop.set()
    status, value = result.get(timeout=300)
    reader.join(timeout=60)
    assert status == "ok", value
    assert value >= 50
    assert recorded_inputs(folder) in ({"write": 1}, {"write": 2})
    assert len([p for p in Path(folder).iterdir() if p.name.startswith(("v-", ".writing-"))]) == 1


def test_a_writer_is_not_refused_while_another_deletes_an_old_version(tmp_path, monkeypatch):
    """Before it takes the lock, a writer checks the folder's names only: another writer may be deleting an old
    version at that moment, whose entries vanish between the listing and a look at them (as two writer processes
    once saw: 'v-... (not a folder)'). Under the lock, where no one deletes, the kinds are checked too."""
    folder = tmp_path / "parts"
    save(folder, 0)
    gone = folder / ("v-" + "0" * 32)  # listed, then deleted before it is looked at
    listing = Path.iterdir

    def stale(self):
        yield from listing(self)
        if self == folder:
            yield gone

    monkeypatch.setattr(Path, "iterdir", stale)
    partition_store._check_only_partition_files(folder, locked=False)  # a name of a partition: not refused
    with pytest.raises(ValueError, match=r"v-0{32} \(not a folder\)"):
        partition_store._check_only_partition_files(folder)
    monkeypatch.undo()
    save(folder, 1)  # and a write goes through
    assert recorded_inputs(folder) == {"write": 1}
