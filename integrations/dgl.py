"""DGL adapter: message passing on DGL blocks, and partitions made by ``dgl.distributed.partition_graph``.

**Layers.** :class:`DGLEdges` is the ``"dgl"`` backend of the GNN layers
(:mod:`sylvie_comm.gnn.graphops`): the layers own their parameters and DGL only
moves the messages, with its fused kernels on a block whose sources are the
rows ``[inner; halo]`` and whose destinations are the inner nodes
(``copy_u_sum``; ``u_add_v``, ``edge_softmax`` and ``u_mul_e_sum`` for
attention). It computes what :class:`~sylvie_comm.gnn.graphops.TorchEdges`
computes, up to float rounding (tested).

**Partitions.** DGL users who already partitioned their graph (METIS, random,
or their own assignment) keep that partition: :func:`load_dgl_partitions` reads
the JSON config and every part's graph and node features, and returns one
:class:`~sylvie_comm.gnn.partition.Partition` per part with exactly DGL's node
assignment.

Node ids are DGL's partitioned ids (the ones in the config's ``node_map``, which
``DistGraph`` also uses): part ``r`` owns the contiguous range ``node_map[r]``.
``partition_graph(..., return_mapping=True)`` returns ``orig_nids``, where
``orig_nids[i]`` is the original id of node ``i``. DGL assigns every edge to the
part of its destination (its "inner" edges), so the union of the parts' inner
edges is the whole graph; the halos, send lists and degrees are then derived as
:func:`~sylvie_comm.gnn.partition.partition` derives them for an explicit
assignment. Only homogeneous graphs (one node type and one edge type) are
supported; each part's file is read once, on every rank.

DGL is imported on first use (with :mod:`sylvie_comm._deps`' ``graphbolt`` stub
where this torch needs it), never by ``import sylvie_comm``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sylvie_comm import _deps
from sylvie_comm.gnn.partition import Partition, partition


class DGLEdges:
    """:class:`~sylvie_comm.gnn.graphops.EdgeOps` on a DGL block (built on first use, moved to the data's device)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, n_src: int, n_dst: int) -> None:
        self.dgl = _deps.import_dgl()
        self.src, self.dst, self.n_src, self.n_dst = src, dst, n_src, n_dst
        self._block: Any = None

    def block(self, device: torch.device | None = None) -> Any:
        """The edges as a DGL block (sources ``n_src`` rows, destinations ``n_dst``)."""
        if self._block is None:
            self._block = self.dgl.create_block((self.src, self.dst), num_src_nodes=self.n_src,
                                                num_dst_nodes=self.n_dst)  # fmt: skip
        if device is not None and self._block.device != device:
            self._block = self._block.to(device)
        return self._block

    def sum(self, h_src: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dgl.ops.copy_u_sum(self.block(h_src.device), h_src)
        return out

    def attend(self, el: torch.Tensor, er: torch.Tensor, z: torch.Tensor, slope: float) -> torch.Tensor:
        ops, block = self.dgl.ops, self.block(z.device)
        alpha = ops.edge_softmax(block, F.leaky_relu(ops.u_add_v(block, el, er), slope))
        out: torch.Tensor = ops.u_mul_e_sum(block, z, alpha.unsqueeze(-1))
        return out


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"dgl partitions: {str(path)!r} is not a file; expected the JSON config that "
                         "dgl.distributed.partition_graph wrote (<out_path>/<graph_name>.json)")  # fmt: skip
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"dgl partitions: {str(path)!r} is not JSON ({exc})") from exc
    missing = [k for k in ("num_nodes", "num_parts", "node_map") if not isinstance(config, dict) or k not in config]
    if missing:
        raise ValueError(f"dgl partitions: {str(path)!r} lacks {missing}; expected a partition_graph config")
    out: dict[str, Any] = config
    return out


def _node_ranges(config: dict[str, Any], where: str) -> list[tuple[int, int]]:
    """``node_map`` as one ``(start, end)`` range per part, checked to tile ``[0, num_nodes)``."""
    node_map, num_parts, num_nodes = config["node_map"], config["num_parts"], config["num_nodes"]
    if not isinstance(node_map, dict) or len(node_map) != 1:
        types = sorted(node_map) if isinstance(node_map, dict) else type(node_map).__name__
        raise ValueError(f"dgl partitions: {where} has node types {types}; expected a homogeneous graph "
                         "(one node type and one edge type)")  # fmt: skip
    etypes = config.get("etypes", {})
    if isinstance(etypes, dict) and len(etypes) > 1:
        raise ValueError(f"dgl partitions: {where} has edge types {sorted(etypes)}; expected a homogeneous graph "
                         "(one node type and one edge type)")  # fmt: skip
    (ranges,) = node_map.values()
    if not isinstance(ranges, list) or len(ranges) != num_parts:
        raise ValueError(f"dgl partitions: {where}'s node_map must list one [start, end] range per part "
                         f"({num_parts}), got {ranges!r}")  # fmt: skip
    out, at = [], 0
    for r, rng in enumerate(ranges):
        if not (isinstance(rng, list) and len(rng) == 2 and rng[0] == at and rng[1] >= rng[0]):
            raise ValueError(f"dgl partitions: {where}'s node_map range {r} is {rng!r}; expected [{at}, end] "
                             "(ranges tile the node ids in order)")  # fmt: skip
        out.append((int(rng[0]), int(rng[1])))
        at = rng[1]
    if at != num_nodes:
        raise ValueError(f"dgl partitions: {where}'s node_map covers {at} nodes, expected num_nodes={num_nodes}")
    return out


def load_dgl_partitions(part_config: str | Path, ndata: list[str] | None = None) -> list[Partition]:
    """Every part of a ``dgl.distributed.partition_graph`` output as a :class:`Partition` (index = rank).

    Args:
        part_config: the JSON config (``<out_path>/<graph_name>.json``).
        ndata: node-data names to carry (default: every feature DGL saved, e.g. ``feat``, ``label``,
            ``train_mask``); the trainer needs ``feat``, ``label`` and ``train_mask``.

    Example::

        dgl.distributed.partition_graph(g, "arxiv", 4, "parts/", part_method="metis")
        part = load_dgl_partitions("parts/arxiv.json")[rank]
        trainer = Trainer(part, TrainConfig(forward="q1", backward="q1"))
    """
    dgl = _deps.import_dgl()
    path = Path(part_config)
    config = _read_config(path)
    ranges = _node_ranges(config, repr(str(path)))
    num_nodes, num_parts = int(config["num_nodes"]), int(config["num_parts"])
    assign = torch.empty(num_nodes, dtype=torch.int64)
    eids, srcs, dsts = [], [], []
    data: dict[str, list[torch.Tensor]] = {}
    for r, (start, end) in enumerate(ranges):
        assign[start:end] = r
        graph, node_feats = dgl.distributed.load_partition(str(path), r)[:2]
        gid = graph.ndata[dgl.NID]
        inner = graph.ndata["inner_node"].bool()
        if not torch.equal(gid[inner], torch.arange(start, end)):
            raise ValueError(f"dgl partitions: part {r}'s inner nodes are not the node_map range [{start}, {end}); "
                             "expected a partition written by dgl.distributed.partition_graph")  # fmt: skip
        mine = graph.edata["inner_edge"].bool()
        s, d = graph.edges()
        srcs.append(gid[s[mine]])
        dsts.append(gid[d[mine]])
        eids.append(graph.edata[dgl.EID][mine])
        for key, value in node_feats.items():
            name = key.split("/", 1)[1] if "/" in key else key
            if ndata is not None and name not in ndata:
                continue
            if value.shape[0] != end - start:
                raise ValueError(f"dgl partitions: part {r}'s node data '{name}' has {value.shape[0]} rows, "
                                 f"expected one per inner node ({end - start})")  # fmt: skip
            data.setdefault(name, []).append(value)
    missing = sorted(set(ndata or []) - set(data))
    if missing:
        raise ValueError(f"dgl partitions: node data {missing} is not in the partitions; they hold {sorted(data)}")
    incomplete = sorted(k for k, v in data.items() if len(v) != num_parts)
    if incomplete:
        raise ValueError(f"dgl partitions: node data {incomplete} is missing from some parts")
    # Edges in DGL's edge-id order: the block's edge order does not depend on the order the parts were read.
    order = torch.argsort(torch.cat(eids))
    src, dst = torch.cat(srcs)[order], torch.cat(dsts)[order]
    return partition((src, dst), num_parts, assign, num_nodes=num_nodes,
                     ndata={k: torch.cat(v) for k, v in data.items()})  # fmt: skip
