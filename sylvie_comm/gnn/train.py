"""Distributed full-graph training on one partition per rank.

:class:`Trainer` wires the pieces, a builder each: the halo transport (a process group of its
own), the exchanger (precision per direction, error feedback), the
bounded-staleness pipeline, the model on the local block, the weight
gradient average and the optimizer. The last two are the caller's to give
(:mod:`sylvie_comm.gnn.update`); by default :func:`default_averaging` (DDP,
optionally with a sylvie_comm gradient hook, or the gradient average over
another transport) and :func:`default_optimizer` (Adam) build them. The
loss is the global mean over training nodes, so with staleness 0 and fp32
exchange the gradients equal single-process full-graph training's.
``Trainer.state_dict()`` / ``load_state_dict()`` checkpoint all of it, so a
restarted run continues exactly where it stopped.

The trainer runs on one device (:func:`~sylvie_comm.gnn.halo_checks.resolve_device`: ``cuda:LOCAL_RANK``
on NCCL when CUDA is available, else the CPU): model, features, labels, masks, the local
graph and the halo buffers live there, and an epoch reads the device back once,
for the metrics it reports. :mod:`sylvie_comm.gnn.gpu_check` (``python -m sylvie_comm.gnn.gpu_check
--gpu-check OUTDIR``) compares training on a GPU with training on the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sylvie_comm.collectives import ProcessGroupTransport, Transport, agree, wire_bytes
from sylvie_comm.collectives.local import LocalTransport
from sylvie_comm.gnn.checkpoint import check_checkpoint
from sylvie_comm.gnn.halo import HaloExchanger, HaloPipeline, parse_precision, partition_signature
from sylvie_comm.gnn.halo_checks import resolve_device
from sylvie_comm.gnn.labels import check_node_data, check_width, label_ranges
from sylvie_comm.gnn.models import FullGraphGNN, LocalGraph
from sylvie_comm.gnn.partition import Partition
from sylvie_comm.gnn.update import (
    AveragerFactory,
    AverageState,
    GradientAverager,
    OptimizerFactory,
    build_optimizer,
)
from sylvie_comm.integrations.average import GradientAverage

# DDP bucket size (MB) of the plain weight-gradient all-reduce. DDP's default (25 MB) puts a GNN's weights
# (0.8 MB for 3 SAGE layers of 256) in one bucket, all-reduced only once the whole backward pass is done: on a
# 100 Mbit/s link that is 0.1 s per epoch nothing hides. With 0.25 MB buckets it overlaps the first layers'
# backward (4 workers, 50,000 nodes: Sylvie's epoch at 100 Mbit/s 0.81 s instead of 0.86-0.98 s, unshaped
# unchanged). The same buckets on every run: deterministic; with 2 ranks every sum is bit-identical to any
# other layout's, with more a sum can differ from the one-bucket layout's in the last bits.
GRAD_BUCKET_MB = 0.25


# torch's default generator is one per process: in-process ranks (threads) seed it and draw their initial weights
# one at a time, or one rank's draws would continue from another's seed and the ranks would start apart.
_SEEDED_INIT = threading.Lock()


@dataclass(frozen=True)
class TrainConfig:
    """Everything every rank must agree on."""

    model: str = "sage"  # "sage" (mean), "gcn" or "gat" (sylvie_comm.gnn.models.LAYERS)
    hidden: int = 64
    layers: int = 2
    dropout: float = 0.0
    lr: float = 0.01
    weight_decay: float = 0.0
    forward: str = "fp32"  # halo features: fp32 | bf16 | fp16 | q1 | q2 | q4 | q8
    backward: str = "fp32"  # halo gradients, same choices
    meta_dtype: str = "fp32"  # scale/min of q-bit rows: fp32 | bf16
    error_feedback: bool = False
    # the running average a = m a + (1 - m) received of the halo feature rows training uses (HaloExchanger's
    # smoothing, on the receiver: no bytes); 0: none. Off by default: on the demo's 2-layer model it narrows the
    # 1-bit gap a little, on a 3-layer one it widens it (docs/gnn/layers.md, "Accuracy of low-bit halos")
    halo_smoothing: float = 0.0
    staleness: int = 0  # 0: synchronous
    sync_every: int = 0  # every K-th epoch synchronous (0: only epoch 0)
    backend: str = "auto"  # layers: auto | dgl | torch
    grad_hook: str | None = None  # a sylvie_comm.ddp hook for the weight gradients (None: fp32 all-reduce)
    precompute_first: bool = True  # aggregate the fixed input features once (fp32): no first-layer exchange
    # (GAT: its attention depends on the weights, so it keeps the input's halo rows, exchanged once)
    seed: int = 0
    compile: bool = False  # torch.compile the model (its dense parts; halo exchanges stay eager): same losses

    def validated(self) -> TrainConfig:
        """The configuration with its precisions by name (and ``halo_smoothing`` checked)."""
        m = self.halo_smoothing
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m < 1.0:
            raise ValueError(f"gnn: halo_smoothing must be a number in [0, 1) (0: none), got {m!r}")
        return dataclasses.replace(self, forward=parse_precision(self.forward), backward=parse_precision(self.backward),
                                   halo_smoothing=float(m))  # fmt: skip


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _backend_of(transport: Transport | None) -> str | None:
    """The backend of a process-group transport's group (other transports have none)."""
    if isinstance(transport, ProcessGroupTransport):
        return str(dist.get_backend(transport.group))
    return None


def _ranks(process_group: dist.ProcessGroup | None, transport: Transport | None) -> Transport | None:
    """The trainer's transport: ``transport``; else, where torch.distributed is initialized, ``process_group``'s
    (None: the default group's); else None: one process trains alone. Never Horovod's by itself: under
    ``horovodrun`` the caller passes ``transport=horovod_transport()``."""
    distributed = dist.is_available() and dist.is_initialized()
    if transport is not None and process_group is not None:
        raise ValueError("gnn: give the Trainer a process_group or a transport, not both")
    if distributed and process_group is not None and dist.get_rank(process_group) < 0:
        raise ValueError(
            f"gnn: this process (global rank {dist.get_rank()}) is not a member of the process_group it "
            "was given; only the group's ranks build a Trainer on it"
        )
    if transport is None and distributed:
        return ProcessGroupTransport(process_group)
    return transport


class Averaging(NamedTuple):
    """How a trainer's weight gradients reach their mean over the ranks."""

    net: torch.nn.Module  # what the forward runs: the model, or DDP around it (which averages during backward)
    averager: GradientAverager | None  # run after backward (None: DDP averaged them, or one rank trains)
    state: AverageState | None  # checkpointed, its bytes counted, closed with the trainer (None: a plain all-reduce)


def default_averaging(
    model: torch.nn.Module,
    transport: Transport,
    config: TrainConfig,
    device: torch.device,
    process_group: dist.ProcessGroup | None = None,
) -> Averaging:
    """The weight-gradient average of a :class:`Trainer` given no ``averager`` (more than one rank).

    On a process group, DDP around ``model`` (on ``process_group``, None: the default group): a plain fp32
    all-reduce in buckets of :data:`GRAD_BUCKET_MB`, or ``config.grad_hook``'s sylvie_comm hook in DDP's default
    buckets. On any other transport (Horovod's, the in-process one), the algorithm ``config.grad_hook`` (default
    ``"none"``: fp32) averages the gradients after backward
    (:class:`~sylvie_comm.integrations.average.GradientAverage` on a fork of ``transport``).
    """
    if not isinstance(transport, ProcessGroupTransport):
        average = GradientAverage(model, transport.fork(), config.grad_hook or "none")
        return Averaging(model, average, average)
    # Plain fp32 all-reduce: buckets of GRAD_BUCKET_MB, so the last layers' gradients are summed while the first
    # layers' are still computed (a hook keeps DDP's default buckets, which it was written for); under compile,
    # DDPOptimizer splits the graph at buckets no smaller than DDP's first (1 MiB): DDP's default too.
    bucket_mb = GRAD_BUCKET_MB if config.grad_hook is None and not config.compile else None
    device_ids = [device] if device.type == "cuda" else None  # CUDA: the model's one device
    net = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, process_group=process_group, bucket_cap_mb=bucket_mb
    )
    if config.grad_hook is None:
        return Averaging(net, None, None)
    from sylvie_comm.integrations.ddp import register

    return Averaging(net, None, register(net, config.grad_hook, process_group=process_group))


def default_optimizer(config: TrainConfig) -> OptimizerFactory:
    """Adam with ``config.lr`` and ``config.weight_decay``: the optimizer of a :class:`Trainer` given none."""

    def adam(params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)

    return adam


class Trainer:
    """Full-graph training of one rank's partition (a collective constructor: every rank builds one).

    Args:
        part: this rank's partition (partition ``r`` on the rank ``r`` of ``process_group``).
        config: the training configuration; every rank must pass the same.
        process_group: the ranks that train together (default: the default group, when torch.distributed
            is initialized; otherwise one process trains alone unless ``transport`` says otherwise). Every
            collective of the trainer (halo exchange, gradient all-reduce, loss and accuracy sums) stays in it.
        transport: instead of a process group, any :class:`~sylvie_comm.collectives.Transport`, e.g.
            :class:`~sylvie_comm.collectives.horovod.HorovodTransport` (under ``horovodrun``:
            ``transport=horovod_transport()``), or the in-process
            :class:`~sylvie_comm.collectives.local.LocalTransport` (ranks as threads of one process, on the CPU).
        device: where to train (see :func:`~sylvie_comm.gnn.halo_checks.resolve_device`); default
            ``cuda:LOCAL_RANK`` when CUDA is available and the group's backend is NCCL, else the CPU. On CUDA
            the trainer makes it the current device. Every rank must train on the same kind of device.
        model: instead of the configuration's layers, a PyG model (a ``torch.nn.Module`` whose
            ``forward(x, edge_index)`` calls ``SAGEConv``/``GCNConv``/``GATConv``) or a zero-argument factory
            building one (called under the seeded lock, as our layers are made): see
            :mod:`sylvie_comm.integrations.pyg`. ``config.model``, ``hidden``, ``layers``, ``dropout`` and
            ``backend`` then do not apply; ``precompute_first`` exchanges the input's halo rows once.
        averager: how the weight gradients are averaged over the ranks: a factory ``(model, transport) ->``
            :class:`~sylvie_comm.gnn.update.GradientAverager` (e.g. ``lambda model, transport:
            GradientAverage(model, transport, "qsgd", bits=4)``), called with the trainer's model and a fork of
            its transport when more than one rank trains; its ``average()`` runs after each backward pass (no
            DDP then, on a process group too). Default (:func:`default_averaging`): DDP on a process group
            (``config.grad_hook``'s sylvie_comm hook on it, if any), else
            :class:`~sylvie_comm.integrations.average.GradientAverage` of ``config.grad_hook`` (``"none"``:
            fp32). Give ``config.grad_hook`` or an averager, not both; every rank gives one or none.
        optimizer: a factory ``params -> torch.optim.Optimizer`` (e.g. ``lambda params: torch.optim.SGD(params,
            lr=0.1, momentum=0.9)``); default (:func:`default_optimizer`): Adam with ``config.lr`` and
            ``config.weight_decay``, which then do not apply to another optimizer.

    Every training label must be a class index of the model: node data ``label`` of an integer dtype, each
    training node's in ``[0, classes)``, where ``classes`` is 1 + the largest label of any node for our layers
    (checked when the trainer is built) and a PyG model's logits' width (checked at its first forward, in
    :meth:`train_epoch` or :meth:`evaluate`, against the label ranges the ranks exchanged when it was built).
    Otherwise every rank raises the same ValueError, naming the label, its node and its partition. Labels of
    nodes outside the training mask are not checked (unlabelled nodes may hold -1).
    """

    def __init__(
        self,
        part: Partition,
        config: TrainConfig,
        process_group: dist.ProcessGroup | None = None,
        transport: Transport | None = None,
        device: torch.device | str | None = None,
        model: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
        *,
        averager: AveragerFactory | None = None,
        optimizer: OptimizerFactory | None = None,
    ) -> None:
        self.part = part
        self.process_group = process_group
        self.transport: Transport | None = _ranks(process_group, transport)
        self.world = self.transport.world_size if self.transport is not None else 1
        # Before the first collective: NCCL's object gathers run on the current CUDA device.
        self.device = self._place(device)
        self.config = self._agreed(config, averager is not None)
        # Every rank learns every rank's training-label range (the one collective of the label check): a label the
        # model cannot take fails on every rank, not as an IndexError in one rank's loss while the others wait.
        self.train_labels = label_ranges(part, self.transport if self.world > 1 else None)
        # Our layers: one output per class up to the largest label of any node. A PyG model's width is its
        # logits', checked at its first forward (_check_width) against the ranges agreed on here.
        num_classes = max(r["classes"] for r in self.train_labels)
        self.classes: int | None = None
        if model is None:
            self._check_width(num_classes)
        self.pipeline, self.halo_transport = self._halo_pipeline()
        self.graph = LocalGraph(part, self.pipeline, self.device)
        self.x = part.ndata["feat"].to(self.device).float()
        self.y = part.ndata["label"].to(self.device)
        self.first_aggregate = self._first_aggregate(pyg=model is not None)
        self.model = self._model(model, num_classes).to(self.device)
        self.net, self.averager, self.hook_state = self._averaging(averager)
        if self.config.compile:
            # Around DDP, as DDPOptimizer expects: the graph splits at DDP's buckets, the C++ reducer stays.
            self.net = cast(torch.nn.Module, torch.compile(self.net))
        self.opt = build_optimizer(optimizer or default_optimizer(self.config), self.model)
        host_masks = {k: part.ndata[k] for k in ("train_mask", "val_mask", "test_mask") if k in part.ndata}
        self.masks: dict[str, torch.Tensor] = {k: m.to(self.device) for k, m in host_masks.items()}
        # The training rows as indices, found once on the host: a boolean mask would read its count back
        # from the device on every use.
        self.train_idx = torch.nonzero(host_masks["train_mask"]).view(-1).to(self.device)
        count = torch.tensor([float(host_masks["train_mask"].sum())], device=self.device)
        self.train_count = self._all_reduce_sum(count)[0].item()
        self.epoch = -1
        self.params = sum(p.numel() for p in self.model.parameters())

    def _place(self, device: torch.device | str | None) -> torch.device:
        """The device this rank trains on (:func:`~sylvie_comm.gnn.halo_checks.resolve_device`), made the current
        one on CUDA."""
        placed = resolve_device(device, _backend_of(self.transport))
        if placed.type == "cuda" and isinstance(self.transport, LocalTransport) and self.world > 1:
            raise ValueError(
                f"gnn: device {str(placed)!r} with the in-process transport ({self.world} ranks as threads): their "
                "CUDA backward passes share the device's one autograd thread, so one rank's halo exchange in "
                "backward would wait forever for the other's; expected device='cpu' for in-process ranks, or one "
                "process per GPU over NCCL"
            )
        if placed.type == "cuda":
            torch.cuda.set_device(placed)  # CUDA-only
        return placed

    def _agreed(self, config: TrainConfig, own_averager: bool) -> TrainConfig:
        """``config`` validated and checked against the partition, the same on every rank (else every rank
        raises)."""
        part, feat = self.part, self.part.ndata.get("feat")

        def build() -> TrainConfig:
            check_node_data(part, self.world)
            if own_averager and config.grad_hook is not None:
                raise ValueError(f"gnn: config.grad_hook={config.grad_hook!r} and an averager given: the averager "
                                 "averages the gradients, so expected grad_hook=None with it")  # fmt: skip
            return config.validated()

        def describe(cfg: TrainConfig) -> dict[str, Any]:
            return {**dataclasses.asdict(cfg), "num_parts": part.num_parts, "num_nodes": part.num_nodes,
                    "features": int(feat.shape[1]) if feat is not None else None,
                    "device_type": self.device.type, "averager": "given" if own_averager else "default"}  # fmt: skip

        if self.transport is not None:
            return agree(self.transport, build, describe, "sylvie_comm.gnn")
        return build()

    def _halo_pipeline(self) -> tuple[HaloPipeline | None, Transport | None]:
        """The halo exchange's pipeline and its transport (None, None for one rank)."""
        if self.transport is None or self.world == 1:
            return None, None
        cfg = self.config
        # The halo exchange runs on a thread of its own under staleness: a transport of its own too.
        halo_transport = self.transport.fork()
        exchanger = HaloExchanger(self.part, halo_transport, cfg.forward, cfg.backward, cfg.meta_dtype,
                                  cfg.error_feedback, cfg.seed, self.device, smoothing=cfg.halo_smoothing)  # fmt: skip
        return HaloPipeline(exchanger, cfg.staleness, cfg.sync_every), halo_transport

    def _first_aggregate(self, pyg: bool) -> torch.Tensor | None:
        """With ``precompute_first``: the input never changes, so its halo rows are exchanged once, exactly, and
        aggregated once (a PyG model's convs take ``[inner; halo]`` rows themselves)."""
        if not self.config.precompute_first:
            return None
        halo_x = self.pipeline.exchange_once(self.x) if self.pipeline is not None else self.x[:0]
        x_full = torch.cat([self.x, halo_x])
        return x_full if pyg else self.graph.first_aggregate(self.config.model, x_full)

    def _model(self, model: torch.nn.Module | Callable[[], torch.nn.Module] | None, classes: int) -> torch.nn.Module:
        """The caller's PyG model, bound to the partition (built under the lock, checked and agreed on there), or
        the configuration's layers."""
        cfg = self.config
        if model is not None:
            from sylvie_comm.integrations.pyg import bind

            bound: torch.nn.Module = bind(model, self.graph, self.transport, seed=cfg.seed, lock=_SEEDED_INIT)
            return bound
        with _SEEDED_INIT:  # identical initial weights on every rank (made on the CPU, on any device)
            torch.manual_seed(cfg.seed)
            return FullGraphGNN(cfg.model, self.x.shape[1], cfg.hidden, classes, cfg.layers, cfg.dropout, cfg.backend)

    def _averaging(self, averager: AveragerFactory | None) -> Averaging:
        """The module the forward runs, the averager that runs after backward and the average's state."""
        if self.transport is None or self.world == 1:
            return Averaging(self.model, None, None)
        if averager is not None:
            made = averager(self.model, self.transport.fork())
            return Averaging(self.model, made, made)
        return default_averaging(self.model, self.transport, self.config, self.device, self.process_group)

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.transport is not None and self.world > 1:
            self.transport.all_reduce(t).wait()
        return t

    def _check_width(self, classes: int) -> None:
        """ValueError unless every rank's training labels are in ``[0, classes)`` (:func:`check_width`); once:
        ``self.classes`` records it."""
        check_width(self.train_labels, classes)
        self.classes = classes

    def _checked(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits``, once their width is known to fit every rank's training labels (a PyG model's first
        forward: the same on every rank, whose models the ranks agreed on)."""
        if self.classes is None and logits.dim() == 2:
            self._check_width(int(logits.shape[1]))
        return logits

    def forward(self) -> torch.Tensor:
        """Logits of this rank's inner nodes."""
        return self.net(self.graph, self.x, self.first_aggregate)  # type: ignore[no-any-return]

    def loss(self, logits: torch.Tensor) -> torch.Tensor:
        """Sum of cross-entropy over local training nodes / global training count (times the world size,
        because DDP averages gradients over ranks)."""
        m = self.train_idx
        local = F.cross_entropy(self._checked(logits)[m], self.y[m], reduction="sum") / self.train_count
        return local * self.world

    def train_epoch(self) -> dict[str, Any]:
        """Train one epoch; return its metrics (global loss and accuracies, seconds and their split, bytes).

        ``peak_memory_mb``: on CUDA, the most memory the device's caching allocator held during the epoch
        (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``), in MiB; on the CPU ``None``:
        the process's peak RSS only ever grows, so it says nothing about one epoch (it is ``peak_rss_mb`` of
        :meth:`stats`). On CUDA the epoch ends with one ``torch.cuda.synchronize``, so ``seconds`` counts its
        kernels; the halo timings count the host threads' time.
        """
        self.epoch += 1
        if self.pipeline is not None:
            self.pipeline.begin_epoch(self.epoch)
        halo_before = self._halo_bytes()
        times_before = self.pipeline.timings() if self.pipeline is not None else None
        hook_before = self.hook_state.stats()["bytes_sent"] if self.hook_state is not None else 0
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)  # CUDA-only
        t0 = time.perf_counter()
        self.model.train()
        self.opt.zero_grad()
        logits = self.forward()
        loss = self.loss(logits)
        loss.backward()  # type: ignore[no-untyped-call]
        if self.averager is not None:
            self.averager.average()
        self.opt.step()
        if cuda:
            torch.cuda.synchronize(self.device)  # CUDA-only: the epoch's seconds include its kernels
        seconds = time.perf_counter() - t0
        metrics = self._accuracies(logits.detach(), loss.detach() / self.world)
        # CUDA-only: the device's peak this epoch (the caching allocator's, shared by in-process ranks on it).
        peak = torch.cuda.max_memory_allocated(self.device) / 2**20 if cuda else None
        if self.hook_state is not None:
            grad_bytes = self.hook_state.stats()["bytes_sent"] - hook_before
        else:
            grad_bytes = wire_bytes("all_reduce", 4 * self.params, self.world)
        breakdown = {"compute_s": seconds, "halo_wait_s": 0.0, "halo_exchange_s": 0.0, "halo_hidden_s": 0.0}
        if self.pipeline is not None and times_before is not None:
            now = self.pipeline.timings()
            wait, exchange = now["wait_s"] - times_before["wait_s"], now["exchange_s"] - times_before["exchange_s"]
            # Exchanges still running at the epoch's end count in the epoch that finishes them.
            breakdown = {"compute_s": max(seconds - wait, 0.0), "halo_wait_s": wait, "halo_exchange_s": exchange,
                         "halo_hidden_s": max(exchange - wait, 0.0)}  # fmt: skip
        return {
            "epoch": self.epoch,
            "seconds": seconds,
            **breakdown,
            "halo_bytes": self._halo_bytes() - halo_before,
            "grad_bytes": grad_bytes,
            "peak_memory_mb": peak,
            **metrics,
        }

    def _halo_bytes(self) -> int:
        if self.pipeline is None:
            return 0
        return sum(self.pipeline.exchanger.bytes_sent.values())

    def _accuracies(self, logits: torch.Tensor, loss: torch.Tensor) -> dict[str, float]:
        """Global loss and accuracies: counted on the device, summed over the ranks, read back once."""
        correct = logits.argmax(1) == self.y
        names = ["train", "val", "test"]
        vals = [loss.reshape(1).double()]
        for k in names:
            m = self.masks.get(f"{k}_mask")
            if m is None:
                vals.append(torch.zeros(2, dtype=torch.float64, device=self.device))
            else:
                vals.append(torch.stack([(correct & m).sum(), m.sum()]).double())
        t = self._all_reduce_sum(torch.cat(vals)).tolist()  # the epoch's one read of the device
        out = {"loss": t[0]}
        for i, k in enumerate(names):
            out[f"{k}_acc"] = t[1 + 2 * i] / t[2 + 2 * i] * 100 if t[2 + 2 * i] > 0 else float("nan")
        return out

    @contextlib.contextmanager
    def _synchronous(self, precision: str | None = None) -> Iterator[None]:
        if self.pipeline is None:
            yield
            return
        with self.pipeline.evaluating(precision):
            yield

    def evaluate(self, halo_precision: str | None = "fp32") -> dict[str, float]:
        """Accuracies with fresh (synchronous, uncompensated) halo data and dropout off.

        ``halo_precision``: the precision of the evaluation's halo rows. ``fp32`` (the default): exact rows, so
        the accuracy is the trained model's own, what it computes on the whole graph in one process (as Sylvie
        and PipeGCN judge it: rank 0 evaluates on the full graph), whatever the training's halo precision; the
        one exchange per layer is counted in the halo bytes like any other. None: the training's forward
        precision (1-bit rows add their rounding noise to the predictions: on the demo's graph about half a
        point of test accuracy, see "Accuracy of low-bit halos" in docs/gnn/layers.md).
        """
        self.model.eval()
        with torch.no_grad(), self._synchronous(halo_precision):
            logits = self.model(self.graph, self.x, self.first_aggregate)
            m = self.train_idx
            loss = F.cross_entropy(self._checked(logits)[m], self.y[m], reduction="sum") / self.train_count
            return self._accuracies(logits, loss)

    def settings(self) -> dict[str, Any]:
        """What a checkpoint of this trainer is only valid for: configuration, world size, partition."""
        config = dataclasses.asdict(self.config)
        if not config["halo_smoothing"]:  # a field added later: at its default, checkpoints written before it load
            del config["halo_smoothing"]
        return {"world_size": self.world, "config": config, "partition": partition_signature(self.part)}

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of everything this rank needs to continue training exactly (call it between epochs).

        Holds the epoch counter, the model and optimizer state, the CPU random generator (dropout on the
        CPU) and, on CUDA, the training device's generator (``cuda_rng``, else None), the halo pipeline's
        state (the stale halo rows and gradients still queued for later epochs, error-feedback residuals,
        q-bit noise offsets; see :meth:`HaloPipeline.state_dict`) and the gradient hook's state. Local (no
        collectives): every rank saves its own, and it loads with ``torch.load(path)`` (``weights_only``).
        Training on does not change it.

        With 2 ranks the resumed run is bit-identical to an uninterrupted one. With more, the first
        resumed step's gradient sum can differ in the last bits: a fresh DDP all-reduces its first step
        in its initial bucket layout and only then rebuilds the buckets in gradient order, and a sum of
        three or more terms depends on where each element sits.

        Example::

            torch.save(trainer.state_dict(), f"ckpt/rank{rank}.pt")
            ...  # after a restart, on every rank:
            trainer = Trainer(part, config)
            trainer.load_state_dict(torch.load(f"ckpt/rank{rank}.pt"))
        """
        return {
            "settings": self.settings(),
            "epoch": self.epoch,
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.opt.state_dict()),
            "rng": torch.get_rng_state(),
            # CUDA-only: dropout on the device draws from the device's generator.
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            "halo": self.pipeline.state_dict() if self.pipeline is not None else None,
            "grad_hook": self.hook_state.state_dict() if self.hook_state is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into a freshly built trainer, before its first epoch.

        A collective call: every rank loads the checkpoint it wrote. A checkpoint written with another
        configuration, world size or partition raises ValueError naming the field (``'config.hidden'``,
        ``'world_size'``, ``'partition.rank'``, ...); so do ranks that load checkpoints of different
        epochs and a trainer that has trained already. Whatever fails on one rank fails on every rank.
        """
        what = "gnn: Trainer.load_state_dict"

        def load() -> dict[str, Any]:
            if self.epoch != -1:
                raise ValueError(f"{what}: load a checkpoint into a freshly built trainer, before its first "
                                 f"epoch (this one is at epoch {self.epoch})")  # fmt: skip
            st = check_checkpoint(what, state, self.settings(), halo=self.pipeline is not None,
                                  grad_hook=self.hook_state is not None, optimizer=self.opt)  # fmt: skip
            epoch, cuda_rng = st["epoch"], st["cuda_rng"]
            if self.pipeline is not None:
                self.pipeline.load_state_dict(st["halo"])
            try:
                if self.hook_state is not None:
                    self.hook_state.load_state_dict(st["grad_hook"], agreed=False)  # agreed here, below
                self.model.load_state_dict(st["model"])
                self.opt.load_state_dict(st["optimizer"])
            except (RuntimeError, KeyError) as exc:  # as ValueError, so that every rank learns of it
                raise ValueError(f"{what}: the checkpoint's gradient hook, model or optimizer state does not "
                                 f"fit this trainer: {exc!r}") from exc  # fmt: skip
            torch.set_rng_state(st["rng"])
            if cuda_rng is not None and self.device.type == "cuda":
                # CUDA-only. A checkpoint written on the CPU carries none: the device's generator stays as
                # seeded (dropout then draws other masks than the CPU run would have).
                torch.cuda.set_rng_state(cuda_rng.cpu(), self.device)
            self.epoch = epoch
            return {"epoch": epoch}

        if self.transport is None:
            load()
        else:
            agree(self.transport, load, lambda info: info, what)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"peak_rss_mb": peak_rss_mb()}
        if self.pipeline is not None:
            out.update(self.pipeline.stats())
        return out

    def close(self) -> None:
        """Stop the halo thread, release the hook's and the halo exchange's own process groups."""
        if self.pipeline is not None:
            self.pipeline.close()
        if self.hook_state is not None:
            self.hook_state.close()
        for transport in (self.halo_transport, self.transport):
            close = getattr(transport, "close", None)
            if close is not None:
                close()


def horovod_transport() -> Transport | None:
    """A :class:`~sylvie_comm.collectives.horovod.HorovodTransport` when this process runs Horovod
    (``horovod.torch`` imported and initialized, as under ``horovodrun``), else None. Never imports Horovod.

    For a caller that runs under ``horovodrun`` or ``torchrun`` alike: ``Trainer(part, config,
    transport=horovod_transport())`` trains over Horovod under the one and over the default process group under
    the other (the trainer itself never looks for Horovod)."""
    hvd = sys.modules.get("horovod.torch")
    if hvd is None or not hvd.is_initialized():
        return None
    from sylvie_comm.collectives.horovod import HorovodTransport

    return HorovodTransport()
