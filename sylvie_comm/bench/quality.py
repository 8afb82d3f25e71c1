"""Model quality on real data: each hook trained next to plain DDP, same seeds, same data order.

Two workloads on the data sets of :mod:`sylvie_comm.bench.datasets` (``scripts/data.sh`` installs them):

* ``cnn``: a small CNN (conv 32 3x3, max-pool, conv 64 3x3, max-pool, linear 1600-128, linear 128-10;
  225k parameters) on Fashion-MNIST (or MNIST), batch 64 per rank; test accuracy on the 10,000 test images.
  Optimizers: SGD lr 0.05 momentum 0.9, and AdamW lr 1e-3 weight decay 0.01.
* ``resnet``: a small BatchNorm ResNet (:class:`~sylvie_comm.bench.models.SmallResNet`: a 3x3 stem and three basic
  blocks of widths 8, 16, 32; 29 tensors, 20k parameters) on Fashion-MNIST, batch 64 per rank, SGD lr 0.05
  Nesterov momentum 0.9, 500 steps; test accuracy (BatchNorm in eval mode) on the 10,000 test images. Held out
  from the monitor's first calibration (the bound of ``docs/guide/monitor.md`` was chosen on ``cnn``).
* ``lm``: a byte-level transformer language model (4 pre-LayerNorm blocks, width 128, 4 heads, context 128,
  tied embeddings; 842k parameters) on the Python documentation's sources, batch 16 x 128 bytes per rank,
  AdamW(lr 1e-3, betas (0.9, 0.95), weight decay 0.1), 20 warm-up steps then cosine decay, gradient clipping
  at 1.0; validation loss in nats per byte on 256 fixed windows of the held-out files.

Every run uses 2 gloo ranks (one thread each) and the hook's default options unless a variant says otherwise;
``sylvie-comm bench quality --workload cnn`` prints a table (accuracy or loss, its gap to plain
DDP, bytes against fp32 over the whole run and over its second half) and writes JSON and a plot with ``--out``;
``--diagnose`` adds what compression does per kind of layer (:mod:`sylvie_comm.bench.quality_diagnosis`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import queue as queue_mod
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sylvie_comm.bench import datasets
from sylvie_comm.bench.choices import parse_spec
from sylvie_comm.bench.models import SmallResNet
from sylvie_comm.bench.quality_diagnosis import KINDS, Diagnosis

PLAIN = "plain"  # plain DDP: no hook registered
COMPRESSED_ADAMW = "cadamw"  # sylvie_comm.optim.CompressedAdamW (AdamW workloads): DDP's all-reduce off
COMPRESSED_SGD = "csgd"  # sylvie_comm.optim.CompressedSGD (SGD workloads): DDP's all-reduce off


@dataclass(frozen=True)
class Variant:
    """One run: a hook name (or ``plain``) with options, under a label."""

    label: str
    hook: str
    options: dict[str, Any] = field(default_factory=dict)


def variants(names: Sequence[str]) -> list[Variant]:
    """Variants from ``hook`` or ``hook:key=value,key=value`` strings (``acpsgd:rank=8``); a dotted key sets a
    field of a mapping option (``acpsgd:monitor.adapt=true``). See :func:`~sylvie_comm.bench.choices.parse_spec`."""
    out = []
    for spec in names:
        try:
            hook, options = parse_spec(spec)
        except ValueError as exc:
            raise ValueError(f"variant {exc}") from None
        out.append(Variant(spec, hook, options))
    return out


# ---------------------------------------------------------------------------------------------- models


class SmallCNN(nn.Module):
    """conv 32 3x3, max-pool 2, conv 64 3x3, max-pool 2, linear 1600-128, linear 128-10 (ReLU between)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(1600, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))  # type: ignore[no-any-return]


class ByteLM(nn.Module):
    """A byte-level decoder: byte + position embeddings, pre-LayerNorm causal blocks, the byte embedding tied
    to the output projection."""

    def __init__(self, width: int = 128, layers: int = 4, heads: int = 4, context: int = 128) -> None:
        super().__init__()
        self.bytes = nn.Embedding(256, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.context = context
        nn.init.normal_(self.bytes.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        if n > self.context:
            raise ValueError(f"ByteLM: sequence length {n} is over the context {self.context}")
        h = self.bytes(tokens) + self.positions(torch.arange(n, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.norm(h) @ self.bytes.weight.t()  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    """What a run needs: the model, its optimizer and schedule, the batches and the evaluation."""

    name: str
    steps: int
    make_model: Callable[[], nn.Module]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module], float]  # the metric: accuracy % (higher is better) or loss (lower)
    metric: str
    higher_is_better: bool
    schedule: Callable[[int], float] = lambda step: 1.0  # lr multiplier at ``step``
    clip: float | None = None
    eval_every: int = 100
    adamw: dict[str, Any] | None = None  # the AdamW hyperparameters, for the compressed AdamW variant
    sgd: dict[str, Any] | None = None  # the SGD hyperparameters (lr, momentum), for a compressed SGD


SGD: dict[str, Any] = {"lr": 0.05, "momentum": 0.9}
NESTEROV: dict[str, Any] = {**SGD, "nesterov": True}  # the resnet workload's
OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), **SGD),
    "nesterov": lambda m: torch.optim.SGD(m.parameters(), **NESTEROV),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01),
}


def cnn_workload(rank: int, world: int, optimizer: str = "sgd", steps: int = 600, images: str = "fashion-mnist",
                 batch: int = 64, eval_size: int | None = None, model: str = "cnn") -> Workload:  # fmt: skip
    """The CNN workload for ``rank`` (``model`` ``resnet``: :class:`~sylvie_comm.bench.models.SmallResNet`'s):
    each rank draws its own batches from the whole training set.

    ``eval_size``: test on that many test images, evenly spaced over the test set (which is sorted by class);
    default: all of them."""
    if model not in IMAGE_MODELS:
        raise ValueError(f"cnn: model must be one of {', '.join(IMAGE_MODELS)}, got {model!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"cnn: optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    train, test = datasets.load_images(images, "train"), datasets.load_images(images, "test")
    mean, std = train.images.float().div(255).mean(), train.images.float().div(255).std()
    xtr = (train.images.float().div(255).unsqueeze(1) - mean) / std
    xte = (test.images.float().div(255).unsqueeze(1) - mean) / std
    ytr, yte = train.labels, test.labels
    if eval_size is not None:
        if isinstance(eval_size, bool) or not isinstance(eval_size, int) or not 1 <= eval_size <= len(yte):
            raise ValueError(f"cnn: eval_size must be an integer in [1, {len(yte)}], got {eval_size!r}")
        keep = torch.linspace(0, len(yte) - 1, eval_size).long()
        xte, yte = xte[keep], yte[keep]

    def draw(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(ytr), (batch,), generator=gen)
        return xtr[idx], ytr[idx]

    def evaluate(net: nn.Module) -> float:
        training = net.training
        net.eval()  # BatchNorm's running statistics (a model without it computes the same either way)
        with torch.no_grad():
            hits = sum(
                int((net(xte[i : i + 1000]).argmax(1) == yte[i : i + 1000]).sum()) for i in range(0, len(yte), 1000)
            )
        net.train(training)
        return 100.0 * hits / len(yte)

    adamw = {"lr": 1e-3, "weight_decay": 0.01} if optimizer == "adamw" else None
    sgd = {"sgd": SGD, "nesterov": NESTEROV}.get(optimizer)
    return Workload(f"{model}/{images}/{optimizer}", steps, IMAGE_MODELS[model], OPTIMIZERS[optimizer], draw,
                    F.cross_entropy, evaluate, "test accuracy %", True, adamw=adamw,
                    sgd=None if sgd is None else dict(sgd))  # fmt: skip


RESNET_WIDTH = 8  # SmallResNet's first stage: 8, 16, 32 channels (20k parameters; a step costs ~0.1 s on one core)
IMAGE_MODELS: dict[str, Callable[[], nn.Module]] = {"cnn": SmallCNN, "resnet": lambda: SmallResNet(RESNET_WIDTH)}
LM_CONTEXT = 128
LM_VAL_WINDOWS = 256


def lm_workload(rank: int, world: int, steps: int = 300, batch: int = 16, warmup: int = 20) -> Workload:
    """The byte LM workload: random windows of the training bytes; validation on fixed held-out windows."""
    text = datasets.load_text("pydocs")
    train, val = text.train, text.val
    starts = torch.linspace(0, val.numel() - LM_CONTEXT - 2, LM_VAL_WINDOWS).long()
    windows = torch.stack([val[s : s + LM_CONTEXT + 1] for s in starts.tolist()]).long()

    def draw(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.randint(0, train.numel() - LM_CONTEXT - 1, (batch,), generator=gen)
        w = torch.stack([train[i : i + LM_CONTEXT + 1] for i in s.tolist()]).long()
        return w[:, :-1], w[:, 1:]

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    def evaluate(model: nn.Module) -> float:
        with torch.no_grad():
            total = sum(
                float(loss(model(windows[i : i + 32, :-1]), windows[i : i + 32, 1:]))
                for i in range(0, LM_VAL_WINDOWS, 32)
            )
        return total / (LM_VAL_WINDOWS // 32)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    def optimizer(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    return Workload("lm/pydocs/adamw", steps, ByteLM, optimizer, draw, loss, evaluate, "val loss (nats/byte)", False,
                    schedule=schedule, clip=1.0, eval_every=50,
                    adamw={"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1})  # fmt: skip


def make_workload(name: str, rank: int, world: int, **kw: Any) -> Workload:
    if name == "cnn":
        return cnn_workload(rank, world, **kw)
    if name == "resnet":  # the test set (10,000 images) at the middle and the end only: it costs ~100 steps
        wl = cnn_workload(rank, world, **{"optimizer": "nesterov", "steps": 500, **kw, "model": "resnet"})
        return dataclasses.replace(wl, eval_every=max(1, wl.steps // 2))
    if name == "lm":
        return lm_workload(rank, world, **kw)
    raise ValueError(f"unknown workload {name!r}; expected cnn, resnet or lm")


# ---------------------------------------------------------------------------------------------- one run


def train_step(
    wl: Workload, model: nn.Module, opt: torch.optim.Optimizer, base_lr: Sequence[float], step: int,
    x: torch.Tensor, y: torch.Tensor, after_backward: Callable[[], None] | None = None,
) -> torch.Tensor:  # fmt: skip
    """One training step of ``wl`` at ``step`` on the batch ``(x, y)``: the schedule's learning rate (of
    ``base_lr``, one per parameter group), forward and backward through ``model`` (the DDP model: its
    collectives), ``after_backward()``, gradient clipping, the optimizer's step; returns the loss."""
    for g, lr in zip(opt.param_groups, base_lr, strict=True):
        g["lr"] = lr * wl.schedule(step)
    opt.zero_grad(set_to_none=True)
    loss = wl.loss(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    if after_backward is not None:
        after_backward()
    if wl.clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), wl.clip)
    opt.step()
    return loss


def _attach(wl: Workload, variant: Variant, ddp: nn.Module) -> tuple[Any, Any]:
    """``variant`` on ``ddp``: the hook's state (None for plain DDP and the compressed optimizers) and the compressed
    optimizer (None but for ``cadamw`` and ``csgd``)."""
    import sylvie_comm.ddp

    if variant.hook == COMPRESSED_ADAMW:
        if wl.adamw is None:
            raise ValueError(f"quality: {variant.label} needs an AdamW workload, {wl.name} trains with SGD")
        return None, sylvie_comm.ddp.compressed_adamw(ddp, **wl.adamw, total_steps=wl.steps, **variant.options)
    if variant.hook == COMPRESSED_SGD:
        if wl.sgd is None:
            raise ValueError(f"quality: {variant.label} needs an SGD workload, {wl.name} trains with AdamW")
        return None, sylvie_comm.ddp.compressed_sgd(ddp, **wl.sgd, total_steps=wl.steps, **variant.options)
    if variant.hook == PLAIN:
        return None, None
    options = dict(variant.options)
    raw = options.pop("raw", None)  # raw=conv*+fc1.*: those parameters travel uncompressed
    if raw is None:
        return sylvie_comm.ddp.register(ddp, variant.hook, **options), None
    from sylvie_comm.config import FIELDS, UNCOMPRESSED, Config, Rule

    fields = {k: options.pop(k) for k in FIELDS if k != "codec" and k in options}
    rules = tuple(Rule(p, UNCOMPRESSED) for p in str(raw).split("+"))
    return sylvie_comm.ddp.register(ddp, config=Config(variant.hook, options, rules=rules, **fields)), None


class Checks:
    """The monitor's figures at each of its checks (``taken``: ``[step, {tensor: {lag, error, exact_error,
    exact_cos, over}}]``), read a step after the check, when the run's own next step has judged it (reading them
    earlier would judge it sooner than the run does)."""

    FIGURES = ("lag", "error", "exact_error", "exact_cos", "over")

    def __init__(self, holder: Any) -> None:
        policy = getattr(holder, "policy", None)
        self.monitor = None if policy is None else policy.monitor
        self.seen = 0
        self.due: int | None = None
        self.taken: list[list[Any]] = []

    def after_step(self, step: int) -> None:
        mon = self.monitor
        if mon is None:
            return
        if self.due is not None:
            tensors = mon.report()["tensors"]
            self.taken.append([self.due, {n: {k: t.get(k) for k in self.FIGURES} for n, t in tensors.items()}])
            self.due = None
        if mon.checks != self.seen:
            self.seen, self.due = mon.checks, step


def train(
    wl: Workload, variant: Variant, rank: int, world: int, seed: int = 0, diagnose: bool = False
) -> dict[str, Any]:
    """Train ``wl`` under ``variant`` on this rank (the default group is up); metrics, curve and bytes.

    With ``diagnose``, every step also measures what compression does per kind of layer (:class:`Diagnosis`).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    model = wl.make_model()
    ddp = DDP(model)
    state, copt = _attach(wl, variant, ddp)
    opt = copt if copt is not None else wl.make_optimizer(model)
    checks = Checks(state or copt)
    diag = Diagnosis(model, variant.hook, variant.options, opt) if diagnose else None
    betas = opt.param_groups[0].get("betas")
    beta2 = betas[1] if betas is not None else None
    base_lr = [g["lr"] for g in opt.param_groups]
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    curve: list[tuple[int, float, float]] = []  # (step, training loss, metric)
    losses: list[float] = []
    t0 = time.perf_counter()
    half: dict[str, Any] | None = None  # the hook's or optimizer's stats at the run's middle
    try:
        for step in range(wl.steps):
            x, y = wl.batch(gen)
            observe = None
            if diag is not None:
                opt.zero_grad(set_to_none=True)
                with ddp.no_sync():
                    wl.loss(ddp(x), y).backward()  # type: ignore[no-untyped-call]
                observe = functools.partial(diag.observe, diag.true_gradients(), beta2)
            loss = train_step(wl, ddp, opt, base_lr, step, x, y, observe)
            checks.after_step(step)
            if step + 1 == wl.steps // 2 and (state is not None or copt is not None):
                half = (state or copt).stats()  # the second half: past any warm-up
            losses.append(loss.item())
            if (step + 1) % wl.eval_every == 0 or step + 1 == wl.steps:
                window = losses[-wl.eval_every :]
                curve.append((step + 1, sum(window) / len(window), wl.evaluate(model)))
        out: dict[str, Any] = {"metric": curve[-1][2], "curve": curve, "seconds": time.perf_counter() - t0}
        if diag is not None:
            out["diagnosis"] = diag.report()
        if state is not None or copt is not None:
            stats = (state or copt).stats()
            out["compression_ratio"] = stats["compression_ratio"]
            out["monitor_checks"] = checks.taken
            for key in ("monitor", "auto"):  # the monitor's figures and decisions, auto's choices and probe times
                if key in stats:
                    out[key] = stats[key]
            sent = stats["bytes_sent"] - (half["bytes_sent"] if half else 0)
            plain = stats["bytes_uncompressed"] - (half["bytes_uncompressed"] if half else 0)
            out["compression_ratio_last"] = plain / sent if sent else float("nan")  # the run's second half
            out["skipped_nonfinite"] = stats.get("skipped_nonfinite", 0)
        else:
            out["compression_ratio"] = out["compression_ratio_last"] = 1.0
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        out["replicas_equal"] = all(torch.equal(gathered[0], g) for g in gathered)
        return out
    finally:
        if state is not None:
            state.close()
        if copt is not None:
            copt.close()


def _worker(rank: int, world: int, port: int, workload: str, kw: dict[str, Any], specs: list[Variant],
            seeds: list[int], diagnose: bool, queue: Any) -> None:  # fmt: skip
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        wl = make_workload(workload, rank, world, **kw)
        for variant in specs:
            for seed in seeds:
                res = train(wl, variant, rank, world, seed, diagnose)
                if rank == 0:
                    queue.put((variant.label, seed, res))
    except BaseException as exc:
        queue.put(("error", rank, repr(exc)))
        raise
    finally:
        dist.destroy_process_group()
        queue.put(("done", rank, None))


def run(
    workload: str, specs: list[Variant], seeds: Sequence[int] = (0,), world: int = 2,
    progress: Callable[[str], None] | None = None, diagnose: bool = False, **kw: Any,
) -> dict[str, Any]:  # fmt: skip
    """Every variant on ``world`` spawned gloo ranks; results by label, then seed."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, workload, kw, specs, list(seeds), diagnose, queue))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    results: dict[str, dict[int, Any]] = {}
    done = 0
    limit = 3600.0 * max(1, len(specs) * len(seeds))  # an hour per run of a variant and a seed
    deadline = time.monotonic() + limit
    try:
        while done < world:
            try:
                label, seed, res = queue.get(timeout=1.0)
            except queue_mod.Empty:
                # A rank that died without a word (killed, or it could not start) fails the run, not a long wait.
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"quality {workload}: rank(s) died without reporting (rank, exit code): "
                                       f"{dead}") from None  # fmt: skip
                if time.monotonic() > deadline:
                    raise RuntimeError(f"quality {workload}: the ranks did not finish within {limit:.0f} s") from None
                continue
            if label == "error":
                raise RuntimeError(f"quality {workload}: rank {seed} failed: {res}")
            if label == "done":
                done += 1
                continue
            results.setdefault(label, {})[seed] = res
            if progress is not None:
                progress(f"{workload} {label} seed {seed}: {res['metric']:.4f} ({res['seconds']:.0f} s)")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return {"workload": workload, "options": kw, "seeds": list(seeds), "results": results}


def summary(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per label: the metric's mean over seeds, its gap to plain DDP (points, or % of the loss), bytes ratios."""
    rows: dict[str, dict[str, float]] = {}
    for label, by_seed in res["results"].items():
        runs = list(by_seed.values())
        rows[label] = {
            "metric": sum(r["metric"] for r in runs) / len(runs),
            "compression_ratio": sum(r["compression_ratio"] for r in runs) / len(runs),
            "compression_ratio_last": sum(r["compression_ratio_last"] for r in runs) / len(runs),
        }
    if PLAIN in rows:
        accuracy = res["workload"] != "lm"
        base = rows[PLAIN]["metric"]
        for row in rows.values():
            diff = row["metric"] - base
            row["gap"] = diff if accuracy else 100.0 * diff / base  # points, or % of the loss
    return rows


def format_table(res: dict[str, Any]) -> str:
    rows = summary(res)
    cnn = res["workload"] != "lm"  # accuracy, in points
    head = (
        "| variant | "
        + ("test accuracy %" if cnn else "val loss")
        + " | vs plain | x fewer bytes (run) | (second half) |"
    )
    lines = [head, "|---|---|---|---|---|"]
    for label, row in rows.items():
        gap = row.get("gap")
        gap_text = "" if gap is None or label == PLAIN else (f"{gap:+.2f}" if cnn else f"{gap:+.1f}%")
        metric = f"{row['metric']:.2f}" if cnn else f"{row['metric']:.4f}"
        lines.append(f"| {label} | {metric} | {gap_text} | {row['compression_ratio']:.1f} | "
                     f"{row['compression_ratio_last']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def format_diagnosis(res: dict[str, Any]) -> str:
    """Per variant and kind of layer: the measures of :class:`Diagnosis` (first seed)."""
    keys = ("cosine", "relative_error", "relative_residual", "one_shot_removed", "adam_v_ratio")
    lines = ["| variant | layer kind | parameters | " + " | ".join(keys) + " |", "|---|---|---|" + "---|" * len(keys)]
    for label, by_seed in res["results"].items():
        diag = by_seed[min(by_seed)].get("diagnosis")
        if not diag:
            continue
        for kind in KINDS:
            if kind in diag:
                row = diag[kind]
                cells = [f"{row[k]:.3f}" if k in row else "" for k in keys]
                lines.append(f"| {label} | {kind} | {int(row['parameters'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for label, by_seed in res["results"].items():
        curve = by_seed[min(by_seed)]["curve"]
        steps = [c[0] for c in curve]
        ax[0].plot(steps, [c[1] for c in curve], label=label)
        ax[1].plot(steps, [c[2] for c in curve], label=label)
    ax[0].set_title("training loss")
    ax[1].set_title(res["workload"] + ": " + ("validation loss" if res["workload"] == "lm" else "test accuracy %"))
    for a in ax:
        a.set_xlabel("step")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DEFAULT_VARIANTS = {
    "cnn": [PLAIN, "acpsgd", "powersgd", "onebit", "topk", "sign", "qsgd"],
    "resnet": [PLAIN, "acpsgd", "onebit", "topk", "sign", "qsgd", COMPRESSED_SGD],
    "lm": [PLAIN, "fp16", "qsgd", "powersgd", "sign", "acpsgd", "onebit", "topk", "acpsgd:rank=8", "powersgd:rank=8"],
}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="sylvie-comm bench quality")
    ap.add_argument("--workload", choices=("cnn", "resnet", "lm"), default="cnn")
    ap.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=None,
                    help="cnn (default sgd) and resnet (default nesterov) only")  # fmt: skip
    ap.add_argument("--images", choices=datasets.IMAGE_SETS, default="fashion-mnist", help="cnn and resnet only")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument(
        "--variants", nargs="+", default=None,
        help="hook or hook:key=value,... ('plain': no hook; 'cadamw': sylvie_comm.optim.CompressedAdamW, 'csgd': "
        "sylvie_comm.optim.CompressedSGD)",
    )  # fmt: skip
    ap.add_argument("--diagnose", action="store_true", help="measure what compression does per kind of layer")
    ap.add_argument("--out", default=None, help="write OUT.json, OUT.md and OUT.png")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be an integer >= 1, got {args.steps}")
    kw: dict[str, Any] = {}
    if args.workload != "lm":
        kw.update(optimizer=args.optimizer or {"cnn": "sgd", "resnet": "nesterov"}[args.workload], images=args.images)
    if args.steps is not None:
        kw["steps"] = args.steps
    specs = variants(args.variants or DEFAULT_VARIANTS[args.workload])
    res = run(args.workload, specs, args.seeds, progress=lambda m: print(m, flush=True), diagnose=args.diagnose, **kw)
    table = format_table(res)
    if args.diagnose:
        table += "\n\n" + format_diagnosis(res)
    print(table)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(table + "\n")
        plot(res, args.out + ".png")


if __name__ == "__main__":
    main()
