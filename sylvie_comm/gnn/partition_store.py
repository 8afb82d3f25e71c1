"""The partition folder on disk: immutable versions behind an atomic ``CURRENT`` pointer.

:func:`save_partitions` publishes every part of a partition as a new version
(under a writer lock, with the size and SHA-256 of every part file in
``meta.json``, format 2); :func:`load_partition` reads one rank's part from
the current version and checks it (digest, then every field: see
:mod:`sylvie_comm.gnn.partition_check`); :func:`recorded_inputs` says what a
complete folder's partition was made from. The layout and the protocol are
described below.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from sylvie_comm.gnn.part import Partition
from sylvie_comm.gnn.partition_check import _check_state, _describe, _is_int, check_partition

# ---------------------------------------------------------------------------------------------------------
# The partition folder: immutable versions and a pointer.
#
#   folder/CURRENT          the name of the current version (one line), replaced atomically (os.replace)
#   folder/v-<32 hex>/      one complete write: meta.json (sizes and a SHA-256 of every part file), part<r>.pt
#   folder/.lock            writers hold it (flock) for a whole write, so one writes at a time
#   folder/.writing-<hex>/  a write in progress (a leftover of a crashed writer is removed by the next one)
#
# A reader resolves CURRENT once and reads everything from that version; a version is never modified, and
# the only one a writer removes is one CURRENT no longer names, so a reader that finds its version gone
# knows it was replaced and reads the new one.

FORMAT = 2
_POINTER = "CURRENT"
_LOCK = ".lock"
_VERSION = re.compile(r"v-[0-9a-f]{32}")
_STAGING = re.compile(r"\.writing-[0-9a-f]{32}")
_POINTER_TMP = re.compile(r"\.CURRENT-[0-9a-f]{32}\.tmp")
_PART_FILE = re.compile(r"part\d+\.pt")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_READ_ATTEMPTS = 100  # a reader gives up after finding its version replaced this many times in a row


def _step(what: str) -> None:
    """Called between the steps of a write and of a read; does nothing (tests run readers and writers here)."""


class _Vanished(Exception):
    """A file of the version a reader resolved is gone (the version was replaced, or the folder is damaged)."""


def _is_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _is_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _check_only_partition_files(folder: Path, locked: bool = True) -> None:
    """Refuse a folder holding anything a partition writer did not put there (nothing else is ever deleted).

    Without the writer lock (``locked=False``, before taking it) only the names are checked: another writer
    may be deleting an old version right then, whose entries vanish under the check; with it, the kinds and
    the versions' contents too."""
    if not folder.exists() and not folder.is_symlink():
        return
    if not folder.is_dir():
        raise NotADirectoryError(f"partition: {folder} exists and is not a folder; expected a partition folder")
    foreign = []
    for entry in sorted(folder.iterdir()):
        name = entry.name
        if (
            name in (_POINTER, _LOCK)
            or _POINTER_TMP.fullmatch(name)
            or name == "meta.json"
            or _PART_FILE.fullmatch(name)
        ):
            if locked and not _is_file(entry):
                foreign.append(f"{name} (not a file)")
        elif _VERSION.fullmatch(name) or _STAGING.fullmatch(name):
            if not locked:
                continue
            if not _is_dir(entry):
                foreign.append(f"{name} (not a folder)")
                continue
            for inner in sorted(entry.iterdir()):
                if not (inner.name == "meta.json" or _PART_FILE.fullmatch(inner.name)):
                    foreign.append(f"{name}/{inner.name}")
                elif not _is_file(inner):
                    foreign.append(f"{name}/{inner.name} (not a file)")
        else:
            foreign.append(name)
    if foreign:
        raise ValueError(
            f"partition: {folder} holds entries that are not a partition's ({', '.join(foreign[:5])}); "
            "expected a new folder or one written by save_partitions (its old versions are deleted)"
        )


@contextlib.contextmanager
def _writer_lock(folder: Path) -> Iterator[None]:
    import fcntl

    with open(folder / _LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_pointer(folder: Path) -> str | None:
    """The version CURRENT names, None without CURRENT; ValueError when it names no version folder."""
    pointer = folder / _POINTER
    try:
        name = pointer.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        return None
    if not _VERSION.fullmatch(name):
        raise ValueError(f"partition: {pointer} names {name[:80]!r}; expected a version folder 'v-' + 32 hex digits")
    return name


def _sha256(f: io.BufferedReader) -> str:
    h = hashlib.sha256()
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    while n := f.readinto(buffer):
        h.update(view[:n])
    return h.hexdigest()


def _file_digest(path: Path) -> tuple[str, int]:
    with open(path, "rb") as f:
        return _sha256(f), os.fstat(f.fileno()).st_size


def save_partitions(parts: list[Partition], folder: str | Path, inputs: Mapping[str, Any] | None = None) -> Path:
    """Write every partition; each rank later loads only its own with :func:`load_partition`.

    Each call publishes a new immutable version of the folder: the parts are
    written into a staging folder inside ``folder``, renamed to ``v-<id>``, and
    the pointer file ``CURRENT`` is replaced (``os.replace``) to name it; then
    the previous version is deleted. A reader resolves ``CURRENT`` once and
    reads everything from that version, so it sees the previous complete
    partition or the new complete one, never a half-written mix, and never
    parts of two writes (also with several writers: they take turns on a lock
    file). ``meta.json`` records the SHA-256 and size of every part file and
    the sizes of every part, which :func:`load_partition` checks. ``folder`` may
    hold only a partition folder's entries (also those of older sylvie-comm
    versions: ``meta.json``, ``part<r>.pt`` files); anything else, a folder
    named like a part file included, is refused and nothing is deleted.

    Args:
        parts: every rank's partition, as :func:`partition` returns them (each is checked with
            :func:`check_partition` first).
        folder: where to write.
        inputs: what the parts were made from (see :func:`partition_inputs`),
            recorded in ``meta.json`` for :func:`shared_partition` to compare.
    """
    if not parts:
        raise ValueError("save_partitions: expected at least one partition, got none")
    for r, p in enumerate(parts):
        if p.rank != r or p.num_parts != len(parts) or p.num_nodes != parts[0].num_nodes:
            raise ValueError(f"save_partitions: parts[{r}] is part {p.rank} of {p.num_parts} of a {p.num_nodes}-node "
                             f"graph; expected part {r} of {len(parts)} of a {parts[0].num_nodes}-node graph "
                             "(the list partition() returns)")  # fmt: skip
        check_partition(p)
    folder = Path(folder)
    _check_only_partition_files(folder, locked=False)  # foreign names: refused before the lock file is made
    folder.mkdir(parents=True, exist_ok=True)
    with _writer_lock(folder):
        _check_only_partition_files(folder)
        ident = uuid.uuid4().hex
        staging, version = folder / f".writing-{ident}", folder / f"v-{ident}"
        staging.mkdir()
        try:
            records = []
            for p in parts:
                path = p.save(staging)
                digest, size = _file_digest(path)
                records.append({"file": path.name, "sha256": digest, "bytes": size, **p.record()})
                _step(f"write: wrote {path.name}")
            meta: dict[str, Any] = {"format": FORMAT, "num_parts": len(parts), "num_nodes": parts[0].num_nodes,
                                    "parts": records}  # fmt: skip
            if inputs is not None:
                meta["inputs"] = dict(inputs)
            (staging / "meta.json").write_text(json.dumps(meta))
            _step("write: wrote meta.json")
            os.rename(staging, version)
            _step(f"write: renamed to {version.name}")
            previous = _read_pointer_or_none(folder)
            tmp = folder / f".CURRENT-{ident}.tmp"
            tmp.write_text(version.name + "\n", encoding="ascii")
            _step("write: wrote the new pointer")
            os.replace(tmp, folder / _POINTER)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if _read_pointer_or_none(folder) != version.name:
                shutil.rmtree(version, ignore_errors=True)
            (folder / f".CURRENT-{ident}.tmp").unlink(missing_ok=True)
            raise
        _step(f"write: published {version.name}")
        # Writers hold the lock: anything but the new version is an old version or a crashed write's leftover.
        for entry in sorted(folder.iterdir()):
            if entry.name == version.name or entry.name in (_POINTER, _LOCK):
                continue
            if _is_dir(entry) and (_VERSION.fullmatch(entry.name) or _STAGING.fullmatch(entry.name)):
                shutil.rmtree(entry, ignore_errors=True)
            elif _is_file(entry) and (entry.name == "meta.json" or _PART_FILE.fullmatch(entry.name)
                                      or _POINTER_TMP.fullmatch(entry.name)):  # fmt: skip
                entry.unlink(missing_ok=True)
            else:
                continue
            _step(f"write: removed {entry.name}" + (" (the previous version)" if entry.name == previous else ""))
    return folder


def _read_pointer_or_none(folder: Path) -> str | None:
    try:
        return _read_pointer(folder)
    except (ValueError, OSError):
        return None


def _check_meta(meta: Any, path: Path) -> dict[str, Any]:
    """``meta.json``'s content, checked: its format, counts, and one consistent record per part."""
    if not isinstance(meta, dict):
        raise ValueError(f"partition: {path} must hold a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"partition: {path} is format {meta.get('format')!r}; expected format {FORMAT} (partitions with "
            "recorded digests): write it again with save_partitions() (shared_partition does so by itself)"
        )
    num_parts, num_nodes = meta.get("num_parts"), meta.get("num_nodes")
    if not (_is_int(num_parts) and _is_int(num_nodes) and 1 <= num_parts <= num_nodes):
        raise ValueError(f"partition: {path} records num_parts {num_parts!r} and num_nodes {num_nodes!r}; "
                         "expected integers with 1 <= num_parts <= num_nodes")  # fmt: skip
    records = meta.get("parts")
    if not isinstance(records, list) or len(records) != num_parts:
        raise ValueError(f"partition: {path}'s 'parts' must list {num_parts} part records, got {_describe(records)}")
    counts = ("halo_counts", "send_counts")
    for r, rec in enumerate(records):
        what = f"partition: {path}'s record of part {r}"
        if not isinstance(rec, dict) or rec.get("file") != f"part{r}.pt":
            raise ValueError(f"{what} must be an object with 'file': 'part{r}.pt', got {_describe(rec)}")
        if not isinstance(rec.get("sha256"), str) or not _SHA256.fullmatch(rec["sha256"]):
            raise ValueError(f"{what} must hold a 'sha256' of 64 hex digits, got {rec.get('sha256')!r}")
        for key in ("bytes", "n_inner", "n_halo", "n_edges"):
            if not _is_int(rec.get(key)) or rec[key] < 0:
                raise ValueError(f"{what} must hold an integer '{key}' >= 0, got {rec.get(key)!r}")
        for key in counts:
            c = rec.get(key)
            if not isinstance(c, list) or len(c) != num_parts or not all(_is_int(v) and v >= 0 for v in c):
                raise ValueError(f"{what} must hold '{key}': {num_parts} integers >= 0, got {_describe(c)}")
        if sum(rec["halo_counts"]) != rec["n_halo"]:
            raise ValueError(f"{what}: its 'halo_counts' sum to {sum(rec['halo_counts'])}, not its n_halo "
                             f"{rec['n_halo']}")  # fmt: skip
        if not isinstance(rec.get("ndata"), dict):
            raise ValueError(f"{what} must hold 'ndata' (an object), got {_describe(rec.get('ndata'))}")
    inner_total = sum(rec["n_inner"] for rec in records)
    if inner_total != num_nodes:
        raise ValueError(f"partition: {path}'s parts hold {inner_total} inner nodes; expected num_nodes {num_nodes}")
    for r, a in enumerate(records):
        for p, b in enumerate(records):
            if a["send_counts"][p] != b["halo_counts"][r]:
                raise ValueError(f"partition: {path} records that part {r} sends {a['send_counts'][p]} rows to part "
                                 f"{p}, which expects {b['halo_counts'][r]}")  # fmt: skip
    return meta


def _read_meta(version: Path) -> dict[str, Any]:
    path = version / "meta.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise _Vanished(path) from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"partition: {path} is not JSON ({exc}); expected the meta.json of save_partitions()"
        ) from None
    return _check_meta(meta, path)


def _read_part(version: Path, meta: Mapping[str, Any], rank: int) -> Partition:
    """One part file of ``version``: its size and SHA-256 against ``meta.json``, then its fields."""
    record = meta["parts"][rank]
    path = version / record["file"]
    try:
        f = open(path, "rb")  # noqa: SIM115 (an open file stays readable when its version is deleted afterwards)
    except FileNotFoundError:
        raise _Vanished(path) from None
    except IsADirectoryError:
        raise ValueError(f"partition: {path} is a folder; expected the part file save_partitions() wrote") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != record["bytes"]:
            raise ValueError(f"partition: {path} holds {size} bytes but meta.json records {record['bytes']} "
                             "(truncated or replaced); write the partition again with save_partitions()")  # fmt: skip
        digest = _sha256(f)
        if digest != record["sha256"]:
            raise ValueError(f"partition: {path} has SHA-256 {digest} but meta.json records {record['sha256']} "
                             "(damaged or altered); write the partition again with save_partitions()")  # fmt: skip
        f.seek(0)
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"partition: {path} is not a readable partition file ({type(exc).__name__}: "
                             f"{str(exc)[:300]}); expected one written by save_partitions()") from None  # fmt: skip
    return _check_state(state, f"partition: {path}", rank, meta["num_parts"], meta["num_nodes"],
                        {k: v for k, v in record.items() if k not in ("file", "sha256", "bytes")})  # fmt: skip


def _current(folder: Path) -> tuple[str, Path]:
    """The version CURRENT names, or FileNotFoundError / ValueError saying why there is none."""
    if not folder.is_dir():
        if folder.exists():
            raise NotADirectoryError(f"partition: {folder} is not a folder; expected one written by save_partitions()")
        raise FileNotFoundError(f"partition: {folder} does not exist; write a partition there with save_partitions()")
    name = _read_pointer(folder)
    if name is None:
        if (folder / "meta.json").is_file():
            raise ValueError(f"partition: {folder} holds a partition of format 1 (written by an older sylvie-comm: "
                             f"meta.json and part files at the top, no digests); expected format {FORMAT}: write it "
                             "again with save_partitions() (shared_partition does so by itself)")  # fmt: skip
        raise FileNotFoundError(f"partition: {folder} holds no partition (no {_POINTER} pointer, no meta.json); "
                                "write one with save_partitions()")  # fmt: skip
    return name, folder / name


def _read_current(folder: Path, read: Callable[[Path, dict[str, Any]], Any]) -> tuple[Any, dict[str, Any]]:
    """``read(version, meta)`` on the current version, again on the new one while the version it resolved
    is replaced under it; FileNotFoundError when a file of the version CURRENT still names is missing."""
    for _ in range(_READ_ATTEMPTS):
        name, version = _current(folder)
        _step(f"read: resolved {name}")
        try:
            meta = _read_meta(version)
            _step(f"read: read {name}/meta.json")
            return read(version, meta), meta
        except _Vanished as gone:
            if _read_pointer(folder) == name:
                raise FileNotFoundError(
                    f"partition: {gone} is missing though {folder / _POINTER} names its version; the folder is "
                    "damaged: write it again with save_partitions()"
                ) from None
    raise FileNotFoundError(f"partition: {folder} was replaced {_READ_ATTEMPTS} times while it was read; "
                            "expected writers to pause between writes")  # fmt: skip


def load_partition(folder: str | Path, rank: int) -> Partition:
    """Load one rank's partition from a folder written by :func:`save_partitions`.

    Reads the version ``CURRENT`` names (a complete write, see :func:`save_partitions`), checks the part
    file's size and SHA-256 against its ``meta.json``, loads it with ``weights_only=True`` and checks every
    field (types, shapes, ids in range, sizes against each other and against ``meta.json``): a ValueError
    names the file and the field.
    """
    return _load(Path(folder), rank)[0]


def _load(folder: Path, rank: int) -> tuple[Partition, dict[str, Any]]:
    def read(version: Path, meta: dict[str, Any]) -> Partition:
        if not _is_int(rank) or not 0 <= rank < meta["num_parts"]:
            raise ValueError(f"partition: rank {rank} is outside the {meta['num_parts']} partitions in {folder}")
        return _read_part(version, meta, rank)

    part, meta = _read_current(folder, read)
    return part, meta


def recorded_inputs(folder: str | Path) -> dict[str, Any] | None:
    """The inputs recorded in a complete partition folder, or None: no folder, no record, a format this
    version does not read, or a part file missing, of another size or with another SHA-256 than recorded."""
    folder = Path(folder)

    def verify(version: Path, meta: dict[str, Any]) -> bool:
        for rec in meta["parts"]:
            path = version / rec["file"]
            try:
                if _file_digest(path) != (rec["sha256"], rec["bytes"]):
                    return False
            except FileNotFoundError:
                raise _Vanished(path) from None
            except IsADirectoryError:
                return False
        return True

    try:
        complete, meta = _read_current(folder, verify)
    except (OSError, ValueError):
        return None
    inputs = meta.get("inputs")
    return inputs if complete and isinstance(inputs, dict) else None
