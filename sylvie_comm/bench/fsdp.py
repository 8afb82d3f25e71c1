"""FSDP2 on a shaped link: FSDP's own reduce-scatter, its bf16 reduce and ours, side by side in one lab.

``sylvie-comm bench fsdp --link 1gbit`` builds one :class:`~sylvie_comm.bench.lab.Lab` (2 worker network
namespaces behind a bridge, the link shaped with ``tc tbf`` both ways, or loopback where that cannot be
built) and runs each row in fresh worker processes, one ``torchrun --nnodes N --node-rank i`` per worker
namespace (gloo, one thread per rank), so that a row's peak memory is its own. Every row trains the same
workload of :mod:`sylvie_comm.bench.workloads` (default: the DDP link benchmark's 17.9M-parameter MLP, batch 32
per worker) from the same weights on the same batches, with ``fully_shard`` on each ``nn.Linear`` and on the
root (FSDP2's defaults otherwise) and SGD with momentum 0.9:

* ``fsdp2``: plain FSDP2, its fp32 reduce-scatter (the baseline of the speedups);
* ``fsdp2-bf16``: FSDP2 with PyTorch's bf16 reduce, ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``
  (parameters stay fp32);
* ``none``, ``fp16``, ``bf16``, ``qsgd``, ``onebit``: ours, ``sylvie_comm.fsdp.register(model, codec)``: every
  algorithm with a reduce-scatter form (``shards``), from the most wire bytes per element to the fewest; a codec
  whose ``register`` raises is reported as skipped with the error, not run;
* ``no-comm``: a bound, not a codec: FSDP2 with an all-gather and a reduce-scatter that send nothing (each a
  local copy; every rank's block of a gathered parameter is its own shard, so this is not the model's
  training): FSDP2's own work with no wire, the least any row's step can take on this machine.

A step is ``zero_grad``, forward (FSDP's all-gathers), backward (its reduce-scatters) and ``optimizer.step()``
after a barrier (:func:`~sylvie_comm.bench.kit.measure_steps`); its time is the slowest rank's. Per row:
median and spread of the step time, samples per second, the speedup over ``fsdp2``, the reduce-scatter's
wire bytes per step and rank (ours: ``state.stats()``; FSDP's rows: :func:`reduce_scatter_bytes`, the
convention of ``sylvie_comm.collectives.wire_bytes``) and how many times fewer than the fp32
reduce-scatter's, the bytes that left each worker's ``eth0`` (all-gathers and headers included; lab only),
the codec state each rank keeps (``state.memory_bytes()``), each rank's peak RSS (``ru_maxrss``) and the
bytes of its gradients, optimizer state and codec state, counted from the tensors.

Example::

    sudo sylvie-comm bench fsdp --link 1gbit
"""

from __future__ import annotations

import json
import math
import resource
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from sylvie_comm.algorithms import ALGORITHMS
from sylvie_comm.bench.choices import unique_choices
from sylvie_comm.bench.kit import (
    HOOK_WARMUP,
    LR,
    MOMENTUM,
    WARMUP,
    check_ints,
    check_timeout,
    fmt_mb,
    fmt_x,
    machine,
    measure_steps,
    merge_rounds,
)
from sylvie_comm.bench.lab import Lab, ProgressBar, check_link, gather_ranks, serve_worker, worker_cli
from sylvie_comm.bench.workloads import WORKLOADS
from sylvie_comm.collectives import wire_bytes

FSDP_ROWS: dict[str, str] = {
    "fsdp2": "FSDP2 fully_shard, fp32 reduce-scatter",
    "fsdp2-bf16": "FSDP2, MixedPrecisionPolicy(reduce_dtype=bf16)",
}


def shard_algorithms() -> tuple[str, ...]:
    """The algorithms with a reduce-scatter form, from the most wire bytes per element to the fewest (the
    registry's order among equals), so a table reads from the least compressed to the most."""
    return tuple(
        sorted(
            (n for n, cls in ALGORITHMS.items() if cls.record.shards),
            key=lambda n: -ALGORITHMS[n].record.payload_per_element({}),
        )
    )


OURS = shard_algorithms()  # our rows
BOUND = "no-comm"
ROWS = (*FSDP_ROWS, *OURS, BOUND)
BASELINE = "fsdp2"
MODELS = ("mlp_17m", "small")  # every parameter in an nn.Linear or the root (lm's attention calls no out_proj)
STEPS = 10
WORKERS = 2


def check_rows(rows: Sequence[str]) -> list[str]:
    """``rows`` without repeats; ValueError naming the bad one and listing the valid ones otherwise."""
    return unique_choices(rows, ROWS, "row")


def check_model(model: str) -> str:
    if model not in MODELS:
        raise ValueError(
            f"bench fsdp: model {model!r} is not one of {', '.join(MODELS)} (fully_shard goes on each nn.Linear, "
            "whose forward must run; lm's attention uses its out_proj weight without calling it)"
        )
    return model


def label(name: str) -> str:
    """What a row is, in words, for the table."""
    if name in FSDP_ROWS:
        return FSDP_ROWS[name]
    if name == BOUND:
        return "FSDP2, comms that send nothing (bound)"
    return f"sylvie_comm.fsdp {name}"


# ---------------------------------------------------------------------- the units and their bytes


def shard_units(model: nn.Module) -> list[tuple[str, list[tuple[int, ...]]]]:
    """The FSDP units :func:`shard` makes of ``model``, found before it does: each ``nn.Linear`` with its
    parameters' shapes, then the root with the rest (possibly none)."""
    units: list[tuple[str, list[tuple[int, ...]]]] = []
    taken: set[int] = set()
    for fqn, m in model.named_modules():
        if fqn and isinstance(m, nn.Linear):
            params = list(m.parameters())
            units.append((fqn, [tuple(p.shape) for p in params]))
            taken.update(id(p) for p in params)
    units.append(("", [tuple(p.shape) for p in model.parameters() if id(p) not in taken]))
    return units


def shard(model: nn.Module, reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` on each ``nn.Linear`` of ``model``, then on the root (the units of :func:`shard_units`);
    ``reduce_dtype``: FSDP's ``MixedPrecisionPolicy(reduce_dtype=...)`` on every unit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {} if reduce_dtype is None else {"mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype)}
    for fqn, m in model.named_modules():
        if fqn and isinstance(m, nn.Linear):
            fully_shard(m, **kw)
    fully_shard(model, **kw)
    return model


def padded_numel(shape: Sequence[int], world: int) -> int:
    """Elements of one gradient in FSDP2's reduce-scatter input: dim 0 padded to a multiple of ``world``."""
    size = tuple(shape) or (1,)
    return -(-size[0] // world) * world * math.prod(size[1:])


Units = Sequence[tuple[str, Sequence[Sequence[int]]]]


def reduce_scatter_bytes(units: Units, world: int, element_size: int = 4) -> int:
    """Bytes one rank sends per step in FSDP2's own reduce-scatters of ``units`` (:func:`shard_units`): one per
    unit with parameters, on its flat buffer of every gradient padded on dim 0 (``element_size`` bytes each: 4
    for fp32, 2 for a bf16 ``reduce_dtype``), counted as ``wire_bytes("reduce_scatter", ...)`` counts ours."""
    return sum(
        wire_bytes("reduce_scatter", element_size * sum(padded_numel(s, world) for s in shapes), world)
        for _, shapes in units
        if shapes
    )


# ---------------------------------------------------------------------- worker side


class _LocalAllGather:
    """An all-gather that sends nothing: every rank's block of the output is this rank's own shard."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:  # fmt: skip
        src = input_tensor.view(-1)
        for block in output_tensor.view(-1, src.numel()):
            if block.data_ptr() != src.data_ptr():  # FSDP's input is usually this rank's block of the output
                block.copy_(src)


class _LocalReduceScatter:
    """A reduce-scatter that sends nothing: this rank's shard of its own gradient."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:  # fmt: skip
        output_tensor.view(-1).copy_(input_tensor.view(group.size(), -1)[group.rank()])


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank
    return int(local.numel() * local.element_size())


def memory(model: nn.Module, opt: torch.optim.Optimizer, state: Any) -> dict[str, Any]:
    """This rank's peak RSS (MiB) and the bytes of its shards of the parameters, gradients and optimizer state,
    and of the codec's state (``state.memory_bytes()``, 0 without a state)."""
    params = list(model.parameters())
    grads = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    optim = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    codec = state.memory_bytes() if state is not None else 0
    return {"peak_rss_mib": _rss_mib(), "param_bytes": sum(_local_bytes(p) for p in params), "grad_bytes": grads,
            "optimizer_bytes": optim, "codec_bytes": codec, "grad_opt_codec_bytes": grads + optim + codec}  # fmt: skip


def _run_row(name: str, cfg: dict[str, Any], rank: int, progress: Callable[[], None]) -> dict[str, Any]:
    import torch.distributed as dist

    import sylvie_comm.fsdp

    work = WORKLOADS[cfg["model"]]
    warmup, steps = int(cfg["warmup"]), int(cfg["steps"])
    model = shard(work.model(0), torch.bfloat16 if name == "fsdp2-bf16" else None)  # same weights for every row
    if name == BOUND:
        for _, unit in sylvie_comm.fsdp.units_of(model):
            unit.set_custom_all_gather(_LocalAllGather())
            unit.set_custom_reduce_scatter(_LocalReduceScatter())
    state = None
    if name in OURS:
        try:
            state = sylvie_comm.fsdp.register(model, name, warmup_steps=HOOK_WARMUP, timeout=cfg["collective_timeout"])
        except ValueError as exc:
            for _ in range(warmup + steps):
                progress()
            return {"skipped": f"{type(exc).__name__}: {exc}"}
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    gen = torch.Generator().manual_seed(1000 + rank)  # same data for every row
    try:
        rec = measure_steps(model, opt, work, gen, warmup, steps, dist.barrier, state, progress)
        if state is not None:
            rec["fp32_reduce_scatter_bytes"] = state.stats()["last_step"]["bytes_uncompressed"]
        rec.update(memory(model, opt, state))
    finally:
        if state is not None:
            state.close()
    return rec


def _run_row_here(cfg: dict[str, Any], rank: int, world: int, progress: Callable[[], None]) -> list[Any]:
    """This worker's row, with its RSS at the start; every rank's figures."""
    start = _rss_mib()
    return gather_ranks({**_run_row(cfg["row"], cfg, rank, progress), "rss_start_mib": start})


def worker_main(config_path: str) -> NoReturn:
    """One worker of one row (fresh processes per row); rank 0 writes every rank's figures."""
    serve_worker(config_path, _run_row_here)


# ---------------------------------------------------------------------- driver side


FSDP_REDUCE_BYTES = {"fsdp2": 4, "fsdp2-bf16": 2}  # bytes per element of FSDP's own rows' reduce-scatter


def merge_row(name: str, rounds: list[list[dict[str, Any]]], world: int, batch: int, units: Units) -> dict[str, Any]:
    """One row's record from every round's figures of every rank (``units``: :func:`shard_units` of the model)."""
    fp32 = reduce_scatter_bytes(units, world)
    skipped = next((p["skipped"] for per_rank in rounds for p in per_rank if "skipped" in p), None)
    if skipped is not None:
        return {"label": label(name), "skipped": skipped}
    rec = merge_rounds(rounds, world, batch, label(name))
    if name in OURS:
        wire, source = rec["hook_bytes_per_step"], "state.stats()"
    elif name == BOUND:
        wire, source = 0, "nothing sent"
    else:
        wire, source = reduce_scatter_bytes(units, world, FSDP_REDUCE_BYTES[name]), "reduce_scatter_bytes()"
    last = rounds[-1]
    per_rank = {key: [p[key] for p in last] for key in ("param_bytes", "grad_bytes", "optimizer_bytes",
                                                          "codec_bytes", "grad_opt_codec_bytes")}  # fmt: skip
    return {
        **rec,
        "wire_bytes_per_step": wire,
        "wire_bytes_from": source,
        "wire_ratio_vs_fp32": fp32 / wire if wire else None,
        "fp32_reduce_scatter_bytes": last[0].get("fp32_reduce_scatter_bytes"),  # ours: what their stats count
        "peak_rss_mib": [max(r[i]["peak_rss_mib"] for r in rounds) for i in range(world)],
        "rss_start_mib": [max(r[i]["rss_start_mib"] for r in rounds) for i in range(world)],
        **per_rank,
    }


def speedups(rows: dict[str, Any]) -> str | None:
    """Add ``speedup_vs_fsdp2`` (ratio of median step times) to each measured row; the baseline, if measured."""
    base = rows.get(BASELINE)
    ok = base is not None and "skipped" not in base
    for rec in rows.values():
        if "skipped" not in rec:
            rec["speedup_vs_fsdp2"] = base["median_s"] / rec["median_s"] if ok else None  # type: ignore[index]
    return BASELINE if ok else None


def run(
    link: str,
    steps: int = STEPS,
    rows: Sequence[str] | None = None,
    *,
    workers: int = WORKERS,
    model: str = "mlp_17m",
    warmup: int = WARMUP,
    rounds: int = 1,
    timeout: float = 1800.0,
    shaped: bool | None = None,
    echo: Callable[[str], None] | None = print,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every row in one lab, each in fresh worker processes; return the full record (see the module).

    ``rounds`` > 1 runs the rows that many times, interleaved, and pools their steps. ``timeout`` bounds the
    whole run (:class:`~sylvie_comm.bench.lab.LabError` past it). ``shaped`` as in
    :class:`~sylvie_comm.bench.lab.Lab` (False: plain processes on 127.0.0.1, no lab).
    """
    check_link(link)
    names = check_rows(list(rows) if rows is not None else ROWS)
    check_model(model)
    check_ints("bench fsdp", ("workers", workers, 2), ("steps", steps, 1), ("warmup", warmup, 0), ("rounds", rounds, 1))
    check_timeout("bench fsdp", timeout)
    if warmup < HOOK_WARMUP + 1 and any(n in OURS for n in names):
        raise ValueError(f"bench fsdp: warmup must be >= {HOOK_WARMUP + 1} (got {warmup}): our rows send plain "
                         f"gradients for their first {HOOK_WARMUP} steps, which should not be measured")  # fmt: skip
    units = shard_units(WORKLOADS[model].model(0))
    total = rounds * len(names) * (warmup + steps)
    raw: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="sylvie-fsdp-") as tmp, Lab(workers, link, shaped=shaped, echo=echo) as lab:
        base: dict[str, Any] = {"model": model, "steps": steps, "warmup": warmup,
                                "progress": str(Path(tmp) / "progress"),
                                "collective_timeout": max(60.0, min(timeout, 600.0))}  # fmt: skip
        t0 = time.perf_counter()
        launch = None
        with ProgressBar(base["progress"], total, f"fsdp on {link}", "step", enabled=progress) as poll:
            for r in range(rounds):
                for name in names:  # interleaved rounds: a burst of load elsewhere lands on several rows
                    cfg = {**base, "row": name, "result": str(Path(tmp) / f"result-{name}-{r}.json")}
                    cfg_path = Path(tmp) / f"config-{name}-{r}.json"
                    cfg_path.write_text(json.dumps(cfg))
                    argv = [sys.executable, "-m", "sylvie_comm.bench.fsdp", "--worker", str(cfg_path)]
                    launch = launch or " ".join(lab.command(0, argv, "torchrun"))
                    left = max(1.0, timeout - (time.perf_counter() - t0))
                    lab.run(argv, timeout=left, poll=poll, launcher="torchrun")
                    raw[name].append(json.loads(Path(cfg["result"]).read_text()))
        wall = time.perf_counter() - t0
        lab_info = {"shaped": lab.shaped, "fallback_reason": lab.fallback_reason, "banner": lab.banner,
                    "namespaces": lab.worker_namespaces if lab.shaped else None,
                    "launch": {"torchrun": launch, "per_row": "fresh workers per row and round"}}  # fmt: skip
    return record(raw, units, link=link, workers=workers, model=model, steps=steps, warmup=warmup, rounds=rounds,
                  lab_info=lab_info, wall=wall)  # fmt: skip


def record(raw: dict[str, list[list[dict[str, Any]]]], units: Units, *, link: str, workers: int, model: str,
           steps: int, warmup: int, rounds: int, lab_info: dict[str, Any], wall: float) -> dict[str, Any]:  # fmt: skip
    """The run's record from each row's figures (``raw``: per row, per round, every rank's), ``units`` of the
    model (:func:`shard_units`) and the lab's description."""
    work = WORKLOADS[model]
    out = {name: merge_row(name, rounds_of, workers, work.batch_size, units) for name, rounds_of in raw.items()}
    for rec in out.values():
        if not lab_info["shaped"] and "skipped" not in rec:
            rec["eth0_tx_bytes_per_step"] = None  # loopback: the host's eth0 carries none of it
    baseline = speedups(out)
    options = {n: {**ALGORITHMS[n].record.option_defaults, "warmup_steps": HOOK_WARMUP} for n in raw if n in ALGORITHMS}
    return {
        "benchmark": "fsdp-link",
        "command": shlex.join(sys.argv),
        "argv": list(sys.argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "link": link,
        "workers": workers,
        "lab": lab_info,
        "model": model,
        "parameters": sum(math.prod(s) for _, shapes in units for s in shapes),
        "fsdp_units": [fqn or "<root>" for fqn, shapes in units if shapes],
        "batch_per_worker": work.batch_size,
        "workload": work.describe,
        "optimizer": f"SGD lr={LR} momentum={MOMENTUM}",
        "codec_options": options,
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "wall_s": wall,
        "machine": machine(),
        "baseline": baseline,
        "fp32_reduce_scatter_bytes_per_step": reduce_scatter_bytes(units, workers),
        "notes": NOTES,
        "rows": out,
    }


NOTES = [
    "step s: barrier, then zero_grad + forward (FSDP's all-gathers) + backward (its reduce-scatters) + SGD step, "
    "the slowest rank's; samples/s: workers x batch / median step; x FSDP2: ratio of median step times (higher "
    "is faster).",
    "RS MB/step: the gradient reduce-scatter's bytes sent per rank and step (ours: state.stats(), mean over the "
    "measured steps; FSDP's rows: the padded flat buffer of each unit, counted as "
    "sylvie_comm.collectives.wire_bytes('reduce_scatter', ...) counts ours); x fewer: the fp32 reduce-scatter's "
    "bytes over the row's.",
    "eth0 MB/step: bytes that left each worker's eth0 per step (lab only): the parameter all-gathers too (fp32 in "
    "every row, in forward and again in backward, fully_shard resharding after forward), TCP/IP headers and "
    "gloo's control included.",
    "gloo's reduce_scatter_tensor sends what an all-reduce of its input sends (at 2 ranks the whole buffer, twice "
    "the convention of RS MB/step): FSDP's rows and our none call it, as their eth0 shows; our fp16, bf16, qsgd "
    "and onebit deal their blocks out with an all-to-all, which sends what the convention counts.",
    "codec MB: state.memory_bytes() per rank (0 for FSDP's rows); grad+opt+codec MB: this rank's shards of the "
    "gradients and of SGD's momentum plus the codec state, counted from the tensors (largest rank); peak RSS: "
    "each rank's ru_maxrss in MiB, each row in fresh processes.",
    "no-comm: FSDP2 with an all-gather and a reduce-scatter that send nothing (local copies; not the model's "
    "training): FSDP2's own work with no wire, the least any row's step can take here.",
]


def format_table(rec: dict[str, Any]) -> str:
    """The record as a markdown table, with what each column means."""
    lab = rec["lab"]
    where = f"link {rec['link']}" if lab["shaped"] else f"LOOPBACK (not shaped: {lab['fallback_reason']})"
    m = rec["machine"]
    r = rec.get("rounds", 1)
    rounds = f", x {r} rounds (rows interleaved)" if r > 1 else ""
    lines = [
        f"FSDP2 on {where}, {rec['workers']} workers, {rec['model']} ({rec['parameters']:,} parameters, "
        f"{len(rec['fsdp_units'])} FSDP units), batch {rec['batch_per_worker']}/worker, {rec['optimizer']}, median "
        f"of {rec['steps']} steps after {rec['warmup']} warm-up{rounds}, each row in fresh processes; "
        f"{m['cpu_count']} CPUs ({m['cpu_model']}), torch {rec['torch']}",
        f"fp32 reduce-scatter: {fmt_mb(rec['fp32_reduce_scatter_bytes_per_step'])} MB per rank and step",
        "",
        "| row | step s (median) | min-max s | samples/s | x FSDP2 | RS MB/step | x fewer than fp32 RS "
        "| eth0 MB/step | enc+dec s | codec MB | grad+opt+codec MB | peak RSS MiB per rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    skipped = []
    for name, c in rec["rows"].items():
        if "skipped" in c:
            skipped.append(f"skipped {name}: {c['skipped']}")
            lines.append(f"| {c['label']} | skipped (below) |" + " - |" * 10)
            continue
        ed = "-" if c["encode_decode_s"] is None else f"{c['encode_decode_s']:.4f}"
        rss = "/".join(f"{v:.0f}" for v in c["peak_rss_mib"])
        lines.append(
            f"| {c['label']} | {c['median_s']:.3f} | {c['min_s']:.3f}-{c['max_s']:.3f} | {c['samples_per_s']:.1f} "
            f"| {fmt_x(c['speedup_vs_fsdp2'])} | {fmt_mb(c['wire_bytes_per_step'])} "
            f"| {fmt_x(c['wire_ratio_vs_fp32'])} | {fmt_mb(c['eth0_tx_bytes_per_step'])} | {ed} "
            f"| {fmt_mb(max(c['codec_bytes']))} | {fmt_mb(max(c['grad_opt_codec_bytes']))} | {rss} |"
        )
    return "\n".join([*lines, "", *rec["notes"], *skipped])


def main(argv: Sequence[str] | None = None) -> NoReturn:
    worker_cli("sylvie_comm.bench.fsdp", __doc__, worker_main, argv)


if __name__ == "__main__":
    main()
