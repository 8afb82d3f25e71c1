"""Distributed full-graph GNN training with low-bit halo exchange and bounded staleness.

Run on four processes (CPU, gloo)::

    torchrun --nproc_per_node 4 -m sylvie_comm.demo.gnn_full_graph                 # fp32, synchronous
    torchrun --nproc_per_node 4 -m sylvie_comm.demo.gnn_full_graph --bits-fwd 1 --bits-bwd 1 --staleness 1
    torchrun --nproc_per_node 4 -m sylvie_comm.demo.gnn_full_graph --dataset ogbn-arxiv --root /data/ogb
    horovodrun -np 4 python -m sylvie_comm.demo.gnn_full_graph --bits-fwd 1 --bits-bwd 1 --staleness 1

Under horovodrun every collective (halos, weight gradients, set-up) goes through
Horovod, with the same results as under torchrun.

Without torchrun it trains in a single process. Rank 0 partitions the graph
into a folder; every rank loads its own part. The default partitioner,
``bfs`` (greedy BFS region growing plus balanced refinement, plain torch,
seeded), needs nothing beyond the base install and gives the same parts on
every machine; ``--partition metis`` (pymetis: ``pip install
'sylvie-comm[dgl]'``) often cuts somewhat fewer edges, ``random`` far more.
The progress bar shows loss, accuracy, epoch time and the halo bytes rank 0
sent; rank 0 ends with test accuracy and bytes per epoch (and the
partitioner), and with ``--json-out`` writes them as JSON.
``examples/gnn_full_graph.py`` runs this module.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from sylvie_comm.demo.launch import rank_and_size, worker_entry
from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn.halo import parse_precision
from sylvie_comm.gnn.models import LAYERS
from sylvie_comm.gnn.partition import METHODS, shared_partition
from sylvie_comm.gnn.train import TrainConfig, Trainer, horovod_transport


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="csbm", help="csbm (generated), digits, or an OGB name (with --root)")
    p.add_argument("--root", default=None, help="OGB data root (the folder holding e.g. ogbn_arxiv/)")
    p.add_argument("--nodes", type=int, default=4000, help="csbm: number of nodes")
    p.add_argument("--features", type=int, default=64, help="csbm: feature width")
    p.add_argument("--model", default="sage", choices=sorted(LAYERS))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--bits-fwd", default="32", help="halo features: 32, 16 (bf16), fp16, 8, 4, 2 or 1")
    p.add_argument("--bits-bwd", default="32", help="halo gradients: same choices")
    p.add_argument("--meta-dtype", default="fp32", choices=["fp32", "bf16"], help="q-bit scale and minimum")
    p.add_argument("--error-feedback", action="store_true", help="range-bounded error feedback on q-bit halos")
    p.add_argument("--halo-smoothing", type=float, default=0.0,
                   help="m in [0, 1): training uses the running average a = m a + (1 - m) received of the halo "
                   "feature rows (0, the default: none)")  # fmt: skip
    p.add_argument("--eval-halos", default="fp32", type=eval_precision,
                   help="halo precision of the final evaluation: fp32 (default: exact rows, the model's own "
                   "accuracy) or 'train' (the training's forward precision)")  # fmt: skip
    p.add_argument("--staleness", type=int, default=0, help="0: synchronous; S: halos up to S epochs old")
    p.add_argument("--sync-every", type=int, default=0, help="every K-th epoch synchronous (0: only the first)")
    p.add_argument("--partition", default="bfs", choices=list(METHODS),
                   help="bfs (default: plain torch, seeded), metis (needs pymetis) or random")  # fmt: skip
    p.add_argument("--parts-dir", default=None,
                   help="where rank 0 writes the partitions (default: a private folder in this user's cache, "
                   "$XDG_CACHE_HOME or ~/.cache: sylvie_comm/gnn-parts/<key>)")  # fmt: skip
    p.add_argument("--backend", default="auto", choices=["auto", "dgl", "torch"])
    p.add_argument("--grad-hook", default=None, help="a sylvie_comm.ddp hook for the weight gradients")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (the halo exchanges stay eager)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="rank 0 writes its results here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def eval_precision(value: str) -> str:
    """A ``--eval-halos`` value: ``train``, or a halo precision (a name or a number of bits) as its name; a bad one
    is refused while the arguments are parsed, not after the training (the message lists the valid ones)."""
    if value == "train":
        return value
    try:
        return parse_precision(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or 'train' (the training's forward precision)") from exc


def precision(bits: str) -> str:
    """A ``--bits-*`` value as a halo precision: ``32`` -> ``fp32``, ``16`` -> ``bf16``, ``1`` -> ``q1``."""
    return {"32": "fp32", "16": "bf16", "fp16": "fp16"}.get(bits, f"q{bits}")


def _private_base() -> tuple[Path, Path]:
    """``(base, ours)``: this user's cache folder (``$XDG_CACHE_HOME``, else ``~/.cache``) and the demo's folder
    in it; without a home folder the temp folder and ``sylvie_comm-<uid>`` in it. Only ``ours`` and the folders
    below it are the demo's: :func:`private_folder` makes them private and refuses them when they are not."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # a relative one is invalid (XDG Base Directory): ignored
        return Path(xdg), Path(xdg) / "sylvie_comm"
    home = os.path.expanduser("~")
    if os.path.isabs(home):
        return Path(home) / ".cache", Path(home) / ".cache" / "sylvie_comm"
    tmp = Path(tempfile.gettempdir())
    return tmp, tmp / f"sylvie_comm-{os.geteuid()}"


def parts_folder(args: argparse.Namespace, world: int) -> str:
    """``--parts-dir``, or a folder in this user's cache named after everything that decides the partitions
    (``<cache>/sylvie_comm/gnn-parts/<key>``, see :func:`private_folder`), reused by a run with the same."""
    if args.parts_dir:
        return str(args.parts_dir)
    key = f"{args.dataset}/{args.nodes}/{args.features}/{args.seed}/{args.partition}/{world}"
    return str(_private_base()[1] / "gnn-parts" / hashlib.sha1(key.encode()).hexdigest()[:12])


def private_folder(folder: str | Path) -> Path:
    """The default partition folder ``folder``, made private (mode 0o700) where missing, else checked.

    Its name is predictable, so each folder from the demo's own (``<cache>/sylvie_comm``) down to ``folder``
    must be a folder (not a symbolic link) owned by this user that neither its group nor others may write to;
    else PermissionError names it and what is wrong, and nothing in it is read or written (another user could
    have planted parts there that pass every check, or made it unwritable).
    """
    folder = Path(folder)
    base, ours = _private_base()
    if folder != ours and ours not in folder.parents:
        raise ValueError(f"gnn_full_graph: {folder} is not in the demo's private folder {ours}")
    base.mkdir(mode=0o700, parents=True, exist_ok=True)  # the user's own cache folder: made as XDG says
    uid = os.geteuid()
    current = base
    for name in folder.relative_to(base).parts:
        current = current / name
        try:
            os.mkdir(current, 0o700)
            os.chmod(current, 0o700)  # whatever the umask
        except FileExistsError:
            pass
        st = os.lstat(current)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            problem = f"is a symbolic link (to {os.readlink(current)})"
        elif not stat.S_ISDIR(st.st_mode):
            problem = "is not a folder"
        elif st.st_uid != uid:
            problem = f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
        elif mode & 0o022:
            problem = f"is writable by its group or others (mode {mode:#o})"
        else:
            continue
        where = "the default partition folder" if current == folder else f"on the way to the partition folder {folder}"
        raise PermissionError(
            f"gnn_full_graph: {current} {problem}; it is {where} (no --parts-dir), so expected a folder of this "
            "user's that only this user may write to (mode 0o700, as the demo makes it): another user could "
            "have planted parts there. Remove it (or chown it and chmod 700 it), or give --parts-dir"
        )
    return folder


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Partition, then train on the initialized ranks (Horovod's under horovodrun, else the default process
    group); return this rank's results."""
    rank, world = rank_and_size()
    eval_halos = None if args.eval_halos == "train" else args.eval_halos
    transport = horovod_transport()  # None under torchrun: the trainer uses the process group

    folder = parts_folder(args, world)

    def make_graph() -> gdata.GraphData:
        if not args.parts_dir:  # rank 0, before shared_partition reads the folder: a refusal reaches every rank
            private_folder(folder)
        if args.dataset == "csbm":
            return gdata.csbm(num_nodes=args.nodes, feat_dim=args.features, seed=args.seed)
        return gdata.load_dataset(args.dataset, root=args.root)

    part = shared_partition(make_graph, rank, world, folder, args.partition, args.seed, transport)
    config = TrainConfig(
        model=args.model, hidden=args.hidden, layers=args.layers, dropout=args.dropout, lr=args.lr,
        forward=precision(args.bits_fwd), backward=precision(args.bits_bwd), meta_dtype=args.meta_dtype,
        error_feedback=args.error_feedback, halo_smoothing=args.halo_smoothing, staleness=args.staleness,
        sync_every=args.sync_every,
        backend=args.backend, grad_hook=args.grad_hook, seed=args.seed, compile=args.compile,
    )  # fmt: skip
    trainer = Trainer(part, config, transport=transport)
    try:
        label = f"{config.forward}/{config.backward} S={config.staleness}"
        bar = tqdm(range(args.epochs), disable=rank != 0 or args.no_progress, desc=label, unit="epoch")
        history = []
        for _ in bar:
            h = trainer.train_epoch()
            history.append(h)
            bar.set_postfix(loss=f"{h['loss']:.3f}", train=f"{h['train_acc']:.1f}", s=f"{h['seconds']:.2f}",
                            halo_kB=f"{h['halo_bytes'] / 1e3:.0f}", refresh=False)  # fmt: skip
        final = trainer.evaluate(eval_halos)
        # Beside it, the accuracy with halo rows at the training's forward precision (what the rounding adds).
        at_train = final if eval_halos in (None, config.forward) else trainer.evaluate(None)
        stats = trainer.stats()
    finally:
        trainer.close()
    epochs = len(history)
    return {
        "config": label,
        "eval_halos": eval_halos or config.forward,
        "dataset": args.dataset,
        "partition": args.partition,
        "world_size": world,
        "nodes": part.num_nodes,
        "epochs": epochs,
        # Epoch 0 is always synchronous: the mean starts at epoch 1.
        "epoch_seconds": sum(h["seconds"] for h in history[1:]) / max(epochs - 1, 1),
        "halo_bytes_per_epoch": sum(h["halo_bytes"] for h in history) / max(epochs, 1),
        # Every halo byte rank 0 sent, the final evaluation's exchanges included.
        "halo_bytes_total": sum(stats.get("bytes_sent", {}).values()),
        "grad_bytes_per_epoch": sum(h["grad_bytes"] for h in history) / max(epochs, 1),
        "peak_rss_mb": stats["peak_rss_mb"],
        "max_observed_staleness": stats.get("max_observed_staleness", 0),
        **{k: final[k] for k in ("train_acc", "val_acc", "test_acc")},
        "test_acc_train_halos": at_train["test_acc"],
    }


def report(result: dict[str, Any]) -> str:
    """Rank 0's closing line."""
    return (
        f"{result['config']}: test accuracy {result['test_acc']:.2f}% (val {result['val_acc']:.2f}%; evaluated "
        f"with {result['eval_halos']} halo rows) after "
        f"{result['epochs']} epochs on {result['world_size']} ranks ({result['partition']} partition); "
        f"{result['epoch_seconds']:.3f} s/epoch; rank 0 "
        f"sent {result['halo_bytes_per_epoch'] / 1e6:.3f} MB of halos and "
        f"{result['grad_bytes_per_epoch'] / 1e6:.3f} MB of weight gradients per epoch; "
        f"observed staleness <= {result['max_observed_staleness']}"
    )


main = worker_entry(parse_args, train, report)  # main(argv=None): parse, train; rank 0 reports


if __name__ == "__main__":
    main()
