"""The host time of one GNN halo layer, each precision next to the same layer without an exchange, and an
epoch of our layers next to PyG's same model, all in one process.

Two kinds of rows, measured in one run:

* ``halo``: one GraphSAGE layer on a rank's ``[inner; halo]`` rows, forward and backward, at every halo
  precision (fp32, q1, q2, q4, q8) with staleness 0, on a graph of 4,000 nodes and 64 features and on one of
  200 nodes and 16 features (where the arithmetic is next to nothing and the host's time is what is left),
  and that one again on one rank (no halo rows: the exchange's host time alone, no peer's thread beside it):
  the ReLU written into the layer's buffer, the halo rows exchanged (both ranks of a world of 2, threads of
  this process on the in-process transport, :func:`sylvie_comm.collectives.local.run_local`), the layer,
  and its backward with the halo gradients sent back. Beside each, the baseline of the same step: the ReLU
  and the same layer on ``[inner; halo]`` rows of the same size that need no exchange, timed in the same
  loop (one step of each in turn). Reported: the medians over both ranks' steps, their difference (what the
  exchange costs) and their ratio; and ``host_us``, the exchanging step less the seconds the rank waited in
  the all-to-all (the copies between the ranks and the wait for the peer: the wire, in process), with its
  ratio to the baseline. The ranks' threads run with the interpreter's switch interval at 0.1 ms (see
  ``SWITCH_S``).
* ``epoch``: a training epoch (forward, cross-entropy on the training nodes, backward, Adam) of our
  GraphSAGE and GCN (:class:`~sylvie_comm.gnn.models.FullGraphGNN`, ``backend="torch"``) on the whole graph
  as one partition, next to PyG's model of the same layers and widths on the same graph
  (``SAGEConv``: mean aggregation with a root weight, as ours; ``GCNConv(add_self_loops=False, cached=True)``:
  ours has no self-loops and uses global degrees, equal to PyG's normalization on this symmetric graph; the
  normalization cached, as PyG advises for full-graph training). Ours runs every layer (``ours``) and with
  the first layer's aggregate precomputed, as the trainer does by default (``ours, first precomputed``).
  The epochs alternate between the models; the ratio is to PyG's median.

Host time: wall-clock seconds of the step on this machine's CPU, ``torch.set_num_threads(1)``. Run
``python -m sylvie_comm.bench.hooks_halo`` (``--steps``, ``--out FILE.json``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sylvie_comm.bench.timing import cpu_model

PRECISIONS = ("fp32", "q1", "q2", "q4", "q8")
WARMUP = 2  # steps not timed: the first builds the plans and buffers
TINY = (200, 16)  # nodes and features of the halo rows where the arithmetic is next to nothing: the host's time
# The interpreter's switch interval while the ranks' threads run: two threads of one interpreter take turns
# holding the GIL, and at the default 5 ms a rank whose peer has completed the collective can wait that long
# for the lock alone (processes of a real run do not share one).
SWITCH_S = 1e-4


def _graph(nodes: int, features: int, seed: int = 0) -> Any:
    """The generated graph of both kinds of rows: a CSBM graph with one community per 500 nodes."""
    from sylvie_comm.gnn import data as gdata

    return gdata.csbm(num_nodes=nodes, num_classes=8, feat_dim=features, avg_degree=10.0, signal=0.5,
                      communities=max(nodes // 500, 1), locality=0.8, seed=seed)  # fmt: skip


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


class _Waited:
    """A future whose ``wait()`` adds the seconds it blocks to its transport's count."""

    def __init__(self, future: Any, owner: _TimedTransport) -> None:
        self._future, self._owner = future, owner

    def wait(self) -> Any:
        t0 = time.perf_counter()
        try:
            return self._future.wait()
        finally:
            self._owner.waited += time.perf_counter() - t0


class _TimedTransport:
    """A rank's transport that counts the seconds this rank spends in its all-to-alls: the collective itself
    (in process, the copies between the ranks, made by the rank that arrives last) and the wait for the peer."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self.waited = 0.0

    def all_to_all_v(self, *args: Any) -> _Waited:
        t0 = time.perf_counter()
        try:  # the last rank to arrive runs the collective (every rank's copies) inside this call
            return _Waited(self._transport.all_to_all_v(*args), self)
        finally:
            self.waited += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _halo_rank(transport: Any, parts: list[Any], features: int, steps: int) -> dict[str, Any]:
    """One rank's steps: for each precision, the exchanging layer and the baseline in turn."""
    from sylvie_comm.gnn.halo import HaloExchanger, HaloPipeline
    from sylvie_comm.gnn.models import LocalGraph, SAGELayer

    part = parts[transport.rank]
    n, h = part.n_inner, part.n_halo
    gen = torch.Generator().manual_seed(transport.rank)
    pre = torch.randn(n, features, generator=gen).requires_grad_()  # the previous layer's output, pre-ReLU
    rows_full = torch.randn(n + h, features, generator=gen).requires_grad_()  # baseline rows, no exchange
    out: dict[str, Any] = {"inner_rows": n, "halo_rows": h}
    for precision in PRECISIONS:
        timed = _TimedTransport(transport.fork())
        exchanger = HaloExchanger(part, timed, precision, precision)  # type: ignore[arg-type]
        pipeline = HaloPipeline(exchanger, staleness=0)
        graph = LocalGraph(part, pipeline)
        torch.manual_seed(0)
        layer = SAGELayer(features, features, "torch")
        grad_out = torch.randn(n, features, generator=gen)
        exchanging: list[float] = []
        plain: list[float] = []
        waited: list[float] = []
        try:
            for step in range(WARMUP + steps):
                pre.grad = rows_full.grad = None  # each step's backward writes its own, as a training step's
                layer.zero_grad()
                t0 = time.perf_counter()
                layer(graph, F.relu(rows_full)).backward(grad_out)
                t1 = time.perf_counter()
                pipeline.begin_epoch(step)
                timed.waited = 0.0
                layer(graph, graph.exchange(1, pre, relu=True)).backward(grad_out)
                t2 = time.perf_counter()
                if step >= WARMUP:
                    plain.append(t1 - t0)
                    exchanging.append(t2 - t1)
                    waited.append(timed.waited)
        finally:
            pipeline.close()
        out[precision] = {"exchanging": exchanging, "plain": plain, "waited": waited,
                          "bytes_sent": pipeline.exchanger.bytes_sent}  # fmt: skip
    return out


def halo_layer_rows(steps: int, nodes: int = 4000, features: int = 64, world: int = 2) -> list[dict[str, Any]]:
    """The ``halo`` rows: every precision's exchanging layer next to the same layer without an exchange, on
    ``world`` in-process ranks (one: no halo rows, what the exchange costs the host alone)."""
    from sylvie_comm.collectives.local import run_local
    from sylvie_comm.gnn.partition import partition

    g = _graph(nodes, features)
    parts = partition((g.src, g.dst), world, "bfs", num_nodes=g.num_nodes, ndata=g.ndata, seed=0)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    try:
        ranks = run_local(world, lambda tr: _halo_rank(tr, parts, features, steps), timeout=600.0)
    finally:
        sys.setswitchinterval(switch)
    rows = []
    for precision in PRECISIONS:
        exchanging = [t for r in ranks for t in r[precision]["exchanging"]]
        plain = [t for r in ranks for t in r[precision]["plain"]]
        own = [t - w for r in ranks for t, w in zip(r[precision]["exchanging"], r[precision]["waited"], strict=True)]
        us, base, host = _median_us(exchanging), _median_us(plain), _median_us(own)
        rows.append({
            "kind": "halo", "name": f"SAGE {nodes}x{features}, {world} rank{'s' if world > 1 else ''}, {precision}",
            "precision": precision,
            "world": world,
            "nodes": nodes, "features": features, "inner_rows": [r["inner_rows"] for r in ranks],
            "halo_rows": [r["halo_rows"] for r in ranks], "steps": steps, "us": us, "baseline_us": base,
            "exchange_us": us - base, "x_baseline": us / base, "host_us": host, "host_x_baseline": host / base,
            "halo_bytes_per_rank_step": sum(sum(r[precision]["bytes_sent"].values()) for r in ranks)
                                        / (world * (WARMUP + steps)),
        })  # fmt: skip
    return rows


class _PyGNet(nn.Module):
    """PyG's model of our layers: convs with ReLU between them."""

    def __init__(self, conv: Callable[[int, int], nn.Module], dims: list[int]) -> None:
        super().__init__()
        self.convs = nn.ModuleList(conv(a, b) for a, b in itertools.pairwise(dims))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i + 1 < len(self.convs):
                x = F.relu(x)
        return x


def _epoch(net: nn.Module, forward: Callable[[], torch.Tensor], train: torch.Tensor,
           y: torch.Tensor) -> Callable[[], None]:  # fmt: skip
    """One training epoch of ``net``: Adam on the cross-entropy of the training nodes."""
    opt = torch.optim.Adam(net.parameters(), lr=0.01)

    def epoch() -> None:
        opt.zero_grad()
        F.cross_entropy(forward()[train], y[train]).backward()  # type: ignore[no-untyped-call]
        opt.step()

    return epoch


def epoch_rows(
    steps: int, nodes: int = 10000, features: int = 128, hidden: int = 128, layers: int = 3
) -> list[dict[str, Any]]:
    """The ``epoch`` rows: our GraphSAGE and GCN against PyG's on the same graph, one partition."""
    from torch_geometric.nn import GCNConv, SAGEConv

    from sylvie_comm.gnn.models import LAYERS, FullGraphGNN, LocalGraph
    from sylvie_comm.gnn.partition import partition

    g = _graph(nodes, features)
    (part,) = partition((g.src, g.dst), 1, "bfs", num_nodes=g.num_nodes, ndata=g.ndata, seed=0)
    graph = LocalGraph(part)
    x, y = part.ndata["feat"].float(), part.ndata["label"]
    train = torch.nonzero(part.ndata["train_mask"]).view(-1)
    classes = int(y.max()) + 1
    dims = [features] + [hidden] * (layers - 1) + [classes]
    edge_index = torch.stack([graph.src, graph.dst])
    pyg_convs: dict[str, Callable[[int, int], nn.Module]] = {
        "sage": lambda a, b: SAGEConv(a, b),
        "gcn": lambda a, b: GCNConv(a, b, add_self_loops=False, cached=True),
    }
    rows = []
    for model in ("sage", "gcn"):
        torch.manual_seed(0)
        ours = FullGraphGNN(model, features, hidden, classes, layers, backend="torch")
        torch.manual_seed(0)
        ours_first = FullGraphGNN(model, features, hidden, classes, layers, backend="torch")
        torch.manual_seed(0)
        pyg = _PyGNet(pyg_convs[model], dims)
        first = LAYERS[model].first_aggregate(graph, x)

        epochs = {
            "pyg": _epoch(pyg, functools.partial(pyg, x, edge_index), train, y),
            "ours": _epoch(ours, functools.partial(ours, graph, x), train, y),
            "ours, first precomputed": _epoch(ours_first, functools.partial(ours_first, graph, x, first), train, y),
        }
        times: dict[str, list[float]] = {k: [] for k in epochs}
        for step in range(WARMUP + steps):
            for name, epoch in epochs.items():
                t0 = time.perf_counter()
                epoch()
                if step >= WARMUP:
                    times[name].append(time.perf_counter() - t0)
        pyg_us = _median_us(times["pyg"])
        for name, samples in times.items():
            us = _median_us(samples)
            rows.append({
                "kind": "epoch", "name": f"{model} {name}", "model": model, "impl": name, "nodes": nodes,
                "edges": int(graph.src.numel()), "features": features, "hidden": hidden, "layers": layers,
                "steps": steps, "us": us, "baseline_us": pyg_us, "x_baseline": us / pyg_us,
            })  # fmt: skip
    return rows


def halo_rows(steps: int) -> list[dict[str, Any]]:
    """Every row, measured in this process: the ``halo`` layer rows, then the ``epoch`` rows.

    Each row has ``kind``, ``name``, ``us`` (the median host time of its step, µs), ``baseline_us`` (its
    baseline's median in the same run: the layer without an exchange, or PyG's model) and ``x_baseline``
    (``us / baseline_us``); ``halo`` rows also ``exchange_us`` (``us - baseline_us``), ``host_us`` (the step
    less its wait in the all-to-all) and ``host_x_baseline``, and the bytes a rank sent per step.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"hooks_halo: steps must be an integer >= 1, got {steps!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        halo = halo_layer_rows(steps) + halo_layer_rows(steps, *TINY) + halo_layer_rows(steps, *TINY, world=1)
        return halo + epoch_rows(steps)
    finally:
        torch.set_num_threads(threads)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a plain-text table: medians (µs) and the ratio to each row's baseline."""
    lines = [f"{'row':40s} {'µs':>11s} {'baseline µs':>12s} {'x baseline':>11s} {'exchange µs':>12s} "
             f"{'host µs':>10s} {'host x baseline':>16s}"]  # fmt: skip
    for r in rows:
        extra = f"{'':12s} {'':10s} {'':16s}"
        if r["kind"] == "halo":
            extra = f"{r['exchange_us']:12.0f} {r['host_us']:10.0f} {r['host_x_baseline']:16.2f}"
        lines.append(f"{r['name']:40s} {r['us']:11.0f} {r['baseline_us']:12.0f} {r['x_baseline']:11.2f} {extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sylvie_comm.bench.hooks_halo",
                                     description=(__doc__ or "").split("\n")[0])  # fmt: skip
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row, after 2 untimed (default 10)")
    parser.add_argument("--out", help="also write the rows and the machine as JSON here")
    args = parser.parse_args(argv)
    rows = halo_rows(args.steps)
    print(f"host time per step, median of {args.steps} steps, one process, 1 thread, torch {torch.__version__}")
    print(table(rows))
    if args.out:
        record = {"benchmark": "hooks_halo", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "machine": {"cpu": cpu_model() or "", "torch": torch.__version__}, "steps": args.steps,
                  "rows": rows}  # fmt: skip
        Path(args.out).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
