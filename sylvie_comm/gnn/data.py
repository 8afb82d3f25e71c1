"""Graphs for full-graph training: generated, shipped, and OGB from a local root.

* :func:`csbm`: a contextual stochastic block model generated on the fly: class
  means plus heavy feature noise, homophilous edges, so aggregating
  neighbours beats an MLP clearly. The embedded default.
* :func:`digits_knn`: a k-NN graph over scikit-learn's handwritten digits
  (the data ships inside scikit-learn), real labels.
* :func:`load_ogb`: OGB node-property data sets (``ogbn-arxiv``,
  ``ogbn-products``, ...) read with ``ogb``'s raw-file readers from a local
  root, without downloads, without running code from the data folder and
  without patching anything process-wide; cached as tensors.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import pickle
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from sylvie_comm import _deps

DATASETS = ("csbm", "digits", "ogbn-arxiv", "ogbn-products")


@dataclass
class GraphData:
    """Edges ``src -> dst`` and node data: ``feat``, ``label``, ``train_mask``, ``val_mask``, ``test_mask``."""

    name: str
    src: torch.Tensor
    dst: torch.Tensor
    num_nodes: int
    ndata: dict[str, torch.Tensor]
    num_classes: int

    @property
    def num_edges(self) -> int:
        return int(self.src.numel())


def _split_masks(n: int, gen: torch.Generator, train: float = 0.6, val: float = 0.2) -> dict[str, torch.Tensor]:
    perm = torch.randperm(n, generator=gen)
    a, b = int(train * n), int((train + val) * n)
    masks = {k: torch.zeros(n, dtype=torch.bool) for k in ("train_mask", "val_mask", "test_mask")}
    masks["train_mask"][perm[:a]] = True
    masks["val_mask"][perm[a:b]] = True
    masks["test_mask"][perm[b:]] = True
    return masks


def symmetrize(src: torch.Tensor, dst: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both directions of every edge, no self loops, no duplicates."""
    keep = src != dst
    s = torch.cat([src[keep], dst[keep]])
    d = torch.cat([dst[keep], src[keep]])
    key = torch.unique(s * n + d)
    return key // n, key % n


def csbm(
    num_nodes: int = 4000,
    num_classes: int = 8,
    feat_dim: int = 64,
    avg_degree: float = 20.0,
    homophily: float = 0.6,
    signal: float = 0.3,
    communities: int = 0,
    locality: float = 0.9,
    seed: int = 0,
) -> GraphData:
    """A contextual stochastic block model.

    Each node gets a class, features ``signal * mu_class + N(0, I)`` (the class
    means are random unit-variance vectors scaled so a single node is hard to
    classify), and about ``avg_degree`` undirected edges, each joining two nodes
    of the same class with probability ``homophily``. With ``communities > 0``
    the nodes also fall into that many equal blocks of consecutive ids and a
    fraction ``locality`` of the edges stays inside a block (whatever the
    classes), as in real graphs with community structure: METIS then finds
    small edge cuts, where on a pure block model every partition's halo is most
    of the graph.
    """
    if num_nodes < num_classes or num_classes < 2:
        raise ValueError(f"csbm: need num_classes >= 2 and num_nodes >= num_classes, got {num_nodes}, {num_classes}")
    if not 0.0 <= homophily <= 1.0:
        raise ValueError(f"csbm: homophily must be in [0, 1], got {homophily}")
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_nodes,), generator=gen)
    y[:num_classes] = torch.arange(num_classes)  # every class present
    means = torch.randn(num_classes, feat_dim, generator=gen) / feat_dim**0.25
    x = signal * means[y] + torch.randn(num_nodes, feat_dim, generator=gen)
    m = int(num_nodes * avg_degree / 2)
    src = torch.randint(0, num_nodes, (m,), generator=gen)
    same = torch.rand(m, generator=gen) < homophily
    # Nodes sorted by class: a same-class partner is a random position inside the class's range.
    by_class = torch.argsort(y)
    counts = torch.bincount(y, minlength=num_classes)
    starts = torch.cumsum(counts, 0) - counts
    cls = y[src]
    partner = by_class[starts[cls] + (torch.rand(m, generator=gen) * counts[cls]).long().clamp(max=counts[cls] - 1)]
    dst = torch.where(same, partner, torch.randint(0, num_nodes, (m,), generator=gen))
    if communities > 0:
        size = -(-num_nodes // communities)
        block_start = (src // size) * size
        local = block_start + (torch.rand(m, generator=gen) * size).long()
        inside = (torch.rand(m, generator=gen) < locality) & (local < num_nodes)
        dst = torch.where(inside, local, dst)
    src, dst = symmetrize(src, dst, num_nodes)
    ndata = {"feat": x.float(), "label": y, **_split_masks(num_nodes, gen)}
    return GraphData("csbm", src, dst, num_nodes, ndata, num_classes)


def digits_knn(k: int = 10, seed: int = 0) -> GraphData:
    """A symmetric k-nearest-neighbour graph over scikit-learn's 1797 handwritten digits (64 features)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    dist = torch.cdist(x, x)
    dist.fill_diagonal_(float("inf"))
    nbr = dist.topk(k, largest=False).indices
    src = nbr.reshape(-1)
    dst = torch.arange(len(x)).repeat_interleave(k)
    src, dst = symmetrize(src, dst, len(x))
    gen = torch.Generator().manual_seed(seed)
    return GraphData("digits", src, dst, len(x), {"feat": x, "label": y, **_split_masks(len(x), gen)}, 10)


OGB_CACHE = "sylvie_comm_graph.pt"  # in the data set's processed/ folder: our own copy, tensors only
_CACHE_FORMAT = 1
_OGB_SPLITS = (("train", "train_mask"), ("valid", "val_mask"), ("test", "test_mask"))


def _ogb_meta(name: str) -> dict[str, str]:
    """The data set's row of ogb's ``nodeproppred/master.csv`` (what OGB itself reads)."""
    spec = importlib.util.find_spec("ogb")
    assert spec is not None and spec.submodule_search_locations  # _deps.require("ogb") passed
    path = Path(next(iter(spec.submodule_search_locations))) / "nodeproppred" / "master.csv"
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    names = rows[0][1:]
    if name not in names:
        raise ValueError(f"load_ogb: unknown OGB node-property data set {name!r}; expected one of {names}")
    column = names.index(name) + 1
    return {row[0]: row[column] for row in rows[1:] if len(row) > column}


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"refused _codecs.encode with {encoding!r} (only latin1 bytes are read)")
    return text.encode("latin1")


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays, numpy scalars and plain Python data only: any other global, and any persistent
    id (a torch storage), is refused. Local to one load: no process-wide allowlist is touched."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        import numpy as np

        reconstruct = np.zeros(1).__reduce__()[0]
        scalar = np.float32(0).__reduce__()[0]
        self._allowed = {(m, "_reconstruct"): reconstruct for m in ("numpy.core.multiarray", "numpy._core.multiarray")}
        self._allowed.update({(m, "scalar"): scalar for m in ("numpy.core.multiarray", "numpy._core.multiarray")})
        self._allowed.update({("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype})
        self._allowed[("_codecs", "encode")] = _latin1  # how pickle protocol 2 stores bytes

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refused the global {module}.{name} (only numpy arrays are read)")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id (a torch storage; only numpy arrays are read)")


def _load_ogb_pickle(path: Path) -> Any:
    """A file OGB wrote with ``torch.save`` (``processed/data_processed``, ``split_dict.pt``: dicts of numpy
    arrays, pickle protocol 4), read without running code.

    torch's ``weights_only=True`` cannot read these (its unpickler does not support protocol 4's FRAME
    opcode, allowlist or not), so the pickle inside the archive is read by :class:`_NumpyOnlyUnpickler`.
    """
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise ValueError(f"expected one <name>/data.pkl in the archive, found {pickles[:3]}")
            with archive.open(pickles[0]) as f:
                return _NumpyOnlyUnpickler(f).load()
    except Exception as exc:
        raise ValueError(
            f"load_ogb: {path} could not be read as OGB's file of numpy arrays ({type(exc).__name__}: "
            f"{str(exc)[:300]}); it is never unpickled unrestricted. Delete it and keep OGB's raw/ and split/ "
            "CSV files (they are read instead)"
        ) from None


def _fingerprint(folder: Path, files: list[Path]) -> dict[str, list[int]]:
    """Size and modification time of each source file (relative to the data set's folder)."""
    out = {}
    for f in files:
        st = f.stat()
        out[f.relative_to(folder).as_posix()] = [st.st_size, st.st_mtime_ns]
    return out


def _ogb_sources(folder: Path, meta: dict[str, str]) -> tuple[str, list[Path], Path | None]:
    """Where the graph comes from (``raw``: OGB's raw files, read with ogb's readers; ``processed``: OGB's
    pickle), the files it reads (graph, then splits), and the split CSV folder (None: ``split_dict.pt``)."""
    raw, processed = folder / "raw", folder / "processed"
    binary = meta["binary"] == "True"
    graph_files = [raw / "data.npz", raw / "node-label.npz"] if binary else [
        raw / n for n in ("edge.csv.gz", "num-node-list.csv.gz", "num-edge-list.csv.gz", "node-feat.csv.gz",
                          "node-label.csv.gz")]  # fmt: skip
    split = folder / "split" / meta["split"]
    split_csv = [split / f"{k}.csv.gz" for k, _ in _OGB_SPLITS]
    split_files, split_dir = (
        (split_csv, split) if all(f.is_file() for f in split_csv) else ([split / "split_dict.pt"], None)
    )
    if graph_files[0].is_file():
        missing = [f for f in graph_files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"load_ogb: {folder} lacks {', '.join(str(m) for m in missing)}; expected OGB's "
                                    "complete raw/ folder (this loader never downloads)")  # fmt: skip
        kind, files = "raw", graph_files
    elif (processed / "data_processed").is_file():
        kind, files = "processed", [processed / "data_processed"]
    else:
        raise FileNotFoundError(
            f"load_ogb: no {meta.get('download_name', folder.name)} data under {folder} (expected "
            f"{graph_files[0].relative_to(folder)} or processed/data_processed); download and extract it there "
            "first (this loader never downloads)"
        )
    if not split_files[0].is_file():
        raise FileNotFoundError(f"load_ogb: {folder} has no split {meta['split']!r} (expected "
                                f"{', '.join(str(f) for f in split_csv)}, or {split_files[0]})")  # fmt: skip
    return kind, files + split_files, split_dir


def _read_ogb(folder: Path, meta: dict[str, str], kind: str, split_dir: Path | None) -> dict[str, Any]:
    """The graph, labels and split of an OGB data set, from OGB's files (never running code from them)."""
    import numpy as np
    import pandas as pd  # an ogb dependency: the CSV reader ogb uses

    def read_csv(path: Path) -> Any:
        return pd.read_csv(path, compression="gzip", header=None).values

    raw = folder / "raw"
    if kind == "raw":
        from ogb.io.read_graph_raw import read_binary_graph_raw, read_csv_graph_raw

        inverse = meta["add_inverse_edge"] == "True"
        if meta["binary"] == "True":
            graph = read_binary_graph_raw(str(raw), add_inverse_edge=inverse)[0]
            with np.load(raw / "node-label.npz") as z:  # allow_pickle=False: arrays only
                labels = z["node_label"]
        else:
            graph = read_csv_graph_raw(str(raw), add_inverse_edge=inverse)[0]
            labels = read_csv(raw / "node-label.csv.gz")
        where = str(raw)
    else:
        path = folder / "processed" / "data_processed"
        loaded = _load_ogb_pickle(path)
        if not isinstance(loaded, dict) or not isinstance(loaded.get("graph"), dict) or "labels" not in loaded:
            raise ValueError(f"load_ogb: {path} holds {type(loaded).__name__}; expected OGB's {{'graph', 'labels'}}")
        graph, labels, where = loaded["graph"], loaded["labels"], str(path)
    if split_dir is not None:
        split = {k: read_csv(split_dir / f"{k}.csv.gz").T[0] for k, _ in _OGB_SPLITS}
    else:
        path = folder / "split" / meta["split"] / "split_dict.pt"
        split = _load_ogb_pickle(path)
        if not isinstance(split, dict) or not all(k in split for k, _ in _OGB_SPLITS):
            raise ValueError(f"load_ogb: {path} holds no 'train', 'valid' and 'test' indices")
    if graph.get("node_feat") is None:
        raise ValueError(f"load_ogb: {where} has no node features; expected a data set with node features")

    def tensor(value: Any, what: str) -> torch.Tensor:
        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise ValueError(f"load_ogb: {where}: {what} has dtype {array.dtype}; expected numbers")
        array = np.ascontiguousarray(array)
        return torch.from_numpy(array if array.flags.writeable else array.copy())

    label = tensor(labels, "the labels")
    if label.dim() == 2 and label.shape[1] == 1:
        label = label[:, 0]
    if label.dim() != 1:
        raise ValueError(f"load_ogb: {where}: labels of shape {tuple(label.shape)}; expected one label per node "
                         f"(a single-task data set, not {meta['num tasks']} tasks)")  # fmt: skip
    if label.dtype.is_floating_point:  # ogbn-papers100M: NaN for unlabelled nodes
        label = torch.where(torch.isnan(label), -1.0, label)
    return {
        "num_nodes": int(graph["num_nodes"]),
        "edge_index": tensor(graph["edge_index"], "edge_index").long(),
        "node_feat": tensor(graph["node_feat"], "node_feat").float(),
        "label": label.long(),
        **{k: tensor(split[k], f"split {k!r}").long().reshape(-1) for k, _ in _OGB_SPLITS},
    }


def _check_ogb_arrays(arrays: Any, where: str) -> dict[str, Any]:
    """The cached (or freshly read) arrays, checked: dtypes, shapes, ids in range."""
    if not isinstance(arrays, dict):
        raise ValueError(f"load_ogb: {where} holds {type(arrays).__name__}; expected a dict")
    n = arrays.get("num_nodes")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"load_ogb: {where}: num_nodes is {n!r}; expected a positive integer")
    shapes = {"edge_index": (2, None), "node_feat": (n, None), "label": (n,), "train": (None,), "valid": (None,),
              "test": (None,)}  # fmt: skip
    dtypes = {"node_feat": torch.float32}
    for key, shape in shapes.items():
        t = arrays.get(key)
        dtype = dtypes.get(key, torch.int64)
        if (
            not isinstance(t, torch.Tensor)
            or t.layout != torch.strided
            or t.dtype != dtype
            or t.dim() != len(shape)
            or any(want is not None and got != want for got, want in zip(t.shape, shape, strict=True))
        ):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + (",)" if len(shape) == 1 else ")")
            raise ValueError(f"load_ogb: {where}: '{key}' must be a {dtype} tensor of shape {want}, got {got}")
    for key in ("edge_index", "train", "valid", "test"):
        t = arrays[key]
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
            raise ValueError(f"load_ogb: {where}: '{key}' holds node ids outside [0, {n}): "
                             f"[{int(t.min())}, {int(t.max())}]")  # fmt: skip
    return arrays


def _read_cache(path: Path, name: str, sources: dict[str, list[int]]) -> dict[str, Any] | None:
    """Our cached copy when it was made from exactly these source files (same sizes and times), else None."""
    if not path.is_file():
        return None
    try:
        cached = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"load_ogb: {path} is not a readable cache ({type(exc).__name__}: {str(exc)[:300]}); it is only "
            "ever loaded with weights_only=True. Delete it to rebuild it from OGB's files"
        ) from None
    if not isinstance(cached, dict) or cached.get("format") != _CACHE_FORMAT or cached.get("name") != name:
        return None
    if cached.get("sources") != sources:
        return None  # the data set's files changed since: read them again
    return _check_ogb_arrays(cached.get("arrays"), str(path))


def _write_cache(path: Path, name: str, sources: dict[str, list[int]], arrays: dict[str, Any]) -> None:
    """Save our copy next to OGB's files (atomically; a read-only data folder just goes without)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(exist_ok=True)
        torch.save({"format": _CACHE_FORMAT, "name": name, "sources": sources, "arrays": arrays}, tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        warnings.warn(f"load_ogb: could not cache {path} ({exc}); the next load reads OGB's files again",
                      RuntimeWarning, stacklevel=3)  # fmt: skip


def load_ogb(name: str, root: str | os.PathLike[str], to_undirected: bool = True) -> GraphData:
    """An OGB node-property data set from ``root`` (its extracted folder, e.g. ``root/ogbn_arxiv``).

    Nothing is downloaded: a missing folder is an error that says where the
    data must be. The graph is read from OGB's raw files with ogb's own readers
    (``read_csv_graph_raw``, or ``read_binary_graph_raw`` for binary data
    sets) and the split from ``split/<type>/*.csv.gz``; only without raw files
    is OGB's pickle ``processed/data_processed`` (or ``split_dict.pt``) read,
    by an unpickler that accepts numpy arrays and nothing else. No OGB class is
    instantiated, so ogb's update prompt never runs, and nothing process-wide
    (``torch.load``, ``builtins.input``, ``sys.stdout``) is patched; ogb's
    readers print their progress. The result is cached in
    ``processed/sylvie_comm_graph.pt`` (tensors only, loaded with
    ``weights_only=True``) together with the sizes and times of the files it
    came from; a cache of other files is rebuilt. Labels are flattened (NaN,
    for unlabelled nodes, becomes -1); splits become masks; with
    ``to_undirected`` (default) edges are symmetrized, as is usual for
    ogbn-arxiv. Single-task homogeneous data sets with node features only
    (``ogbn-arxiv``, ``ogbn-products``, ``ogbn-papers100M``).
    """
    _deps.require("ogb")
    meta = _ogb_meta(name)
    if meta["is hetero"] == "True":
        raise ValueError(f"load_ogb: {name} is heterogeneous; expected a homogeneous data set such as ogbn-arxiv")
    folder = Path(root) / name.replace("-", "_")
    kind, files, split_dir = _ogb_sources(folder, meta)
    sources = _fingerprint(folder, files)
    cache = folder / "processed" / OGB_CACHE
    arrays = _read_cache(cache, name, sources)
    if arrays is None:
        arrays = _check_ogb_arrays(_read_ogb(folder, meta, kind, split_dir), str(folder))
        _write_cache(cache, name, sources, arrays)
    n = arrays["num_nodes"]
    src, dst = arrays["edge_index"][0], arrays["edge_index"][1]
    if to_undirected:
        src, dst = symmetrize(src, dst, n)
    ndata: dict[str, torch.Tensor] = {"feat": arrays["node_feat"], "label": arrays["label"]}
    for key, mask in _OGB_SPLITS:
        m = torch.zeros(n, dtype=torch.bool)
        m[arrays[key]] = True
        ndata[mask] = m
    return GraphData(name, src.contiguous(), dst.contiguous(), n, ndata, int(meta["num classes"]))


def load_dataset(name: str, root: str | None = None, **options: Any) -> GraphData:
    """By name: ``csbm`` (options: see :func:`csbm`), ``digits``, or an OGB name with ``root``."""
    if name == "csbm":
        return csbm(**options)
    if name == "digits":
        return digits_knn(**options)
    if name.startswith("ogbn-"):
        if root is None:
            raise ValueError(f"load_dataset: {name} needs root= (the folder holding its extracted data)")
        return load_ogb(name, root, **options)
    raise ValueError(f"load_dataset: unknown data set {name!r}; expected one of {DATASETS} (or another ogbn-*)")
