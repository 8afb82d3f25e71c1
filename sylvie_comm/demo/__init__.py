"""The demo: data-parallel training under three gradient hooks (and Horovod), then full-graph GNN training.

Both workloads are modules of this package, each a command line that runs
under torchrun or horovodrun (and in a single process without either)::

    torchrun --nproc_per_node 2 -m sylvie_comm.demo.ddp_train --codec acpsgd --rank 4
    horovodrun -np 2 python -m sylvie_comm.demo.ddp_train --codec acpsgd --rank 4
    torchrun --nproc_per_node 4 -m sylvie_comm.demo.gnn_full_graph --bits-fwd 1 --bits-bwd 1 --staleness 1

``examples/ddp_train.py`` and ``examples/gnn_full_graph.py`` are the same two
commands as scripts. :func:`run` (``sylvie-comm demo``) launches them one
configuration at a time and compares what rank 0 reports.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from sylvie_comm.demo.launch import horovodrun, torchrun

DDP_MODULE = "sylvie_comm.demo.ddp_train"
GNN_MODULE = "sylvie_comm.demo.gnn_full_graph"
# (hook, extra arguments): the same model, data and seed under each.
DDP_RUNS: tuple[tuple[str, tuple[str, ...]], ...] = (("none", ()), ("acpsgd", ("--rank", "4")), ("onebit", ()))
# Under horovodrun (when Horovod is installed): the same training, Horovod's collectives, our optimizer.
HOROVOD_RUN: tuple[str, tuple[str, ...]] = ("acpsgd", ("--rank", "4"))
GNN_NODES = 4000  # the generated CSBM graph
# (label, extra arguments): halo precision and staleness.
GNN_RUNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fp32, synchronous", ()),
    ("1-bit, staleness 1", ("--bits-fwd", "1", "--bits-bwd", "1", "--staleness", "1")),
)


def ddp_table(rows: list[dict[str, Any]]) -> str:
    """Accuracy, wire bytes (and the ratio to the first row), wall time and hook compute of DDP runs."""
    base = rows[0]["bytes_sent"]
    lines = [f"   {'hook':<16}{'accuracy':>10}{'MB sent':>10}{'vs plain':>10}{'wall s':>9}{'encode+decode s':>17}"]
    for r in rows:
        name = f"{r['codec']} (Horovod)" if r.get("launcher") == "horovodrun" else r["codec"]
        lines.append(
            f"   {name:<16}{r['accuracy']:>9.2f}%{r['bytes_sent'] / 1e6:>10.2f}"
            f"{base / r['bytes_sent']:>9.1f}x{r['seconds']:>9.1f}"
            f"{r['encode_seconds'] + r['decode_seconds']:>17.2f}"
        )
    return "\n".join(lines)


def gnn_table(rows: list[dict[str, Any]]) -> str:
    """Test accuracy, epoch time and halo bytes per epoch (and the ratio to the first row) of GNN runs."""
    base = rows[0]["halo_bytes_per_epoch"]
    lines = [f"   {'halo exchange':<24}{'test acc':>9}{'s/epoch':>9}{'halo MB/epoch':>15}{'vs fp32':>9}"]
    for r in rows:
        ratio = base / r["halo_bytes_per_epoch"] if r["halo_bytes_per_epoch"] else 0.0
        lines.append(
            f"   {r['label']:<24}{r['test_acc']:>8.2f}%{r['epoch_seconds']:>9.3f}"
            f"{r['halo_bytes_per_epoch'] / 1e6:>15.3f}{ratio:>8.1f}x"
        )
    return "\n".join(lines)


def run(
    steps: int = 1000,
    nproc: int = 2,
    epochs: int = 100,
    gnn_nproc: int = 4,
    echo: Callable[[str], None] = print,
) -> dict[str, list[dict[str, Any]]]:
    """Run every configuration of both workloads; ``echo`` each section and table as it completes.

    Args:
        steps: DDP training steps per hook (default 1000).
        nproc: DDP processes (default 2).
        epochs: GNN epochs per configuration (default 100).
        gnn_nproc: GNN processes, one graph partition each (default 4).
        echo: receives the report, a few lines at a time.

    Returns:
        ``{"ddp": [...], "gnn": [...]}``: rank 0's results of each run, in order.
    """
    results: dict[str, list[dict[str, Any]]] = {"ddp": [], "gnn": []}
    echo(f"1) data-parallel training: {nproc} processes (gloo), scikit-learn digits, {steps} steps, "
         "the same model and data under three gradient hooks")  # fmt: skip
    for codec, extra in DDP_RUNS:
        echo(f"   running {codec} ...")
        results["ddp"].append(torchrun(DDP_MODULE, nproc, ["--codec", codec, *extra, "--steps", str(steps)]))
    codec, extra = HOROVOD_RUN
    if shutil.which("horovodrun") is not None:
        echo(f"   running {codec} under horovodrun (Horovod's collectives, sylvie_comm.horovod's optimizer) ...")
        results["ddp"].append(horovodrun(DDP_MODULE, nproc, ["--codec", codec, *extra, "--steps", str(steps)]))
    else:
        echo("   (Horovod is not installed, so no horovodrun run: scripts/horovod.sh builds and installs it)")
    echo("\n" + ddp_table(results["ddp"]))

    echo(f"\n2) full-graph GNN: {gnn_nproc} processes, generated CSBM graph ({GNN_NODES} nodes), GraphSAGE, "
         f"{epochs} epochs; halo exchange fp32 synchronous vs 1-bit with staleness 1")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sylvie-comm-parts-") as parts:
        for label, extra in GNN_RUNS:
            echo(f"   running {label} ...")
            cmd = [*extra, "--nodes", str(GNN_NODES), "--epochs", str(epochs), "--parts-dir", parts]
            r = torchrun(GNN_MODULE, gnn_nproc, cmd)
            results["gnn"].append({"label": label, **r})
    echo("\n" + gnn_table(results["gnn"]))
    echo("\nMB: bytes rank 0 put on the wire (ring all-reduce/all-gather/all-to-all volumes).")
    return results
