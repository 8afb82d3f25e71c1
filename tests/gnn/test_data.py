from __future__ import annotations

import gzip
import subprocess
import sys
import textwrap

import pytest
import torch

from sylvie_comm import _deps
from sylvie_comm.gnn import data as gdata


def test_csbm_is_deterministic_homophilous_and_symmetric():
    a, b = gdata.csbm(num_nodes=1000, seed=5), gdata.csbm(num_nodes=1000, seed=5)
    assert torch.equal(a.src, b.src) and torch.equal(a.ndata["feat"], b.ndata["feat"])
    y = a.ndata["label"]
    same = (y[a.src] == y[a.dst]).float().mean().item()
    assert same > 0.6  # homophily 0.7 plus chance
    edges = set(zip(a.src.tolist(), a.dst.tolist(), strict=True))
    assert all((d, s) in edges for s, d in list(edges)[:500])
    masks = a.ndata["train_mask"].int() + a.ndata["val_mask"].int() + a.ndata["test_mask"].int()
    assert (masks == 1).all()


def test_digits_knn():
    g = gdata.digits_knn(k=5)
    assert g.num_nodes == 1797 and g.ndata["feat"].shape == (1797, 64) and g.num_classes == 10
    y = g.ndata["label"]
    assert (y[g.src] == y[g.dst]).float().mean() > 0.9  # neighbours in pixel space share digits


def write_tiny_arxiv(root, n=60, f=8, seed=0):
    """A tiny data set in ogbn-arxiv's on-disk layout (no RELEASE_v1.txt, no processed/)."""
    gen = torch.Generator().manual_seed(seed)
    folder = root / "ogbn_arxiv"
    (folder / "raw").mkdir(parents=True)
    (folder / "split" / "time").mkdir(parents=True)
    src = torch.randint(0, n, (200,), generator=gen)
    dst = torch.randint(0, n, (200,), generator=gen)

    def csv(path, rows):
        with gzip.open(path, "wt") as fh:
            for r in rows:
                fh.write(",".join(str(v) for v in (r if isinstance(r, (list, tuple)) else [r])) + "\n")

    csv(folder / "raw" / "edge.csv.gz", list(zip(src.tolist(), dst.tolist(), strict=True)))
    csv(folder / "raw" / "num-node-list.csv.gz", [n])
    csv(folder / "raw" / "num-edge-list.csv.gz", [200])
    csv(folder / "raw" / "node-feat.csv.gz", torch.randn(n, f, generator=gen).tolist())
    csv(folder / "raw" / "node-label.csv.gz", torch.randint(0, 40, (n,), generator=gen).tolist())
    csv(folder / "raw" / "node_year.csv.gz", [2020] * n)
    csv(folder / "split" / "time" / "train.csv.gz", list(range(0, 40)))
    csv(folder / "split" / "time" / "valid.csv.gz", list(range(40, 50)))
    csv(folder / "split" / "time" / "test.csv.gz", list(range(50, n)))
    return src, dst


@pytest.mark.skipif(not _deps.WITH_OGB, reason="ogb not installed")
def test_ogb_loader_handles_ogb_traps(tmp_path):
    src, dst = write_tiny_arxiv(tmp_path)
    # Run in a child whose stdin is closed: ogb's update prompt would raise EOFError there.
    code = textwrap.dedent(
        f"""
        import torch
        from sylvie_comm.gnn.data import load_ogb
        first = load_ogb("ogbn-arxiv", r"{tmp_path}")
        second = load_ogb("ogbn-arxiv", r"{tmp_path}")   # reloads processed/data_processed
        assert torch.equal(first.src, second.src) and torch.equal(first.ndata["feat"], second.ndata["feat"])
        torch.save({{"src": first.src, "dst": first.dst, "feat": first.ndata["feat"], "label": first.ndata["label"],
                    "train": first.ndata["train_mask"], "classes": first.num_classes}}, r"{tmp_path}/out.pt")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert (tmp_path / "ogbn_arxiv" / "processed" / "data_processed").exists()
    assert out["feat"].shape == (60, 8) and out["classes"] == 40 and out["train"].sum() == 40
    sym = gdata.symmetrize(src, dst, 60)
    assert torch.equal(out["src"], sym[0]) and torch.equal(out["dst"], sym[1])


@pytest.mark.skipif(not _deps.WITH_OGB, reason="ogb not installed")
def test_ogb_loader_never_downloads(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        gdata.load_ogb("ogbn-products", tmp_path)


def test_load_dataset_names():
    assert gdata.load_dataset("csbm", num_nodes=100, num_classes=4).num_nodes == 100
    with pytest.raises(ValueError, match="unknown data set"):
        gdata.load_dataset("cora")
    with pytest.raises(ValueError, match="needs root"):
        gdata.load_dataset("ogbn-arxiv")
