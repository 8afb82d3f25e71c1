"""DDP on a shaped link: every gradient algorithm side by side, in one invocation.

``sylvie-comm bench ddp --link 1gbit --workers 4`` builds a :class:`~sylvie_comm.bench.lab.Lab`
(N worker network namespaces behind a bridge, the link shaped with ``tc tbf`` both ways,
or loopback where that cannot be built) and starts one process per worker, with one
``torchrun --nnodes N --node-rank i --nproc-per-node 1 --master-addr <worker 0>`` per worker
namespace (``Lab.run(..., launcher="torchrun")``, the command one runs on N machines). Each worker
joins one gloo process group and trains the 17.9M-parameter MLP of
:mod:`sylvie_comm.bench.workloads` (batch 32 per worker, SGD with momentum 0.9) under every
codec in turn, on the same seeds:

* ``ddp``: DDP's own all-reduce (S-SGD);
* ``torch-fp16``: PyTorch's ``fp16_compress_hook``;
* ``torch-powersgd``: PyTorch's ``powerSGD_hook`` (rank 4, error feedback, warm start) with one
  bucket, the only way it runs on gloo: with several buckets it launches its P and Q
  all-reduces from callbacks on different threads, ranks disagree on their order and gloo aborts;
* every sylvie algorithm (``sylvie_comm.ddp.register(model, name)``; rank 4 where a ``rank`` sets what it sends:
  the low-rank ones, and ``auto`` for its low-rank candidates);
* ``no-comm``: DDP with a hook that hands each bucket back as it is (nothing sent, nothing
  averaged, so its training is not data-parallel): DDP's own work (bucket copies, autograd
  hooks) with no hook work and no wire, the least any hook's step can take on this machine.

A step is ``zero_grad``, forward, backward (which waits for the hook's collectives) and
``optimizer.step()``, after a barrier (:func:`~sylvie_comm.bench.kit.measure_steps`); its time is the slowest
rank's (:func:`~sylvie_comm.bench.kit.merge_rounds`). The first
``warmup`` steps are not measured (the hooks' own warm-up sends plain gradients).
Per codec: median, min, max and quartiles of the step time, samples per second, the
bytes the hook reports per step (ours: ``state.stats()``), the bytes that actually left
each worker's ``eth0`` per step (headers and gloo's control included; lab only),
encode + decode seconds per step (ours), and the speedups, ratios of median step
times, over S-SGD and over PyTorch's PowerSGD hook. On a machine whose cores are
shared, ``--rounds 2`` runs the codecs twice, interleaved, and pools the steps.

Where Horovod is installed (``--no-horovod``: not), the same lab then runs the Horovod rows of
:mod:`sylvie_comm.bench.horovod` (Horovod's ``DistributedOptimizer`` in fp32, with
``Compression.fp16`` and with our ``Compression.acpsgd``; ``sylvie_comm.horovod.DistributedOptimizer``
with acpsgd and onebit) on the same workload, seeds and optimizer, started by one ``horovodrun -H
<addr0>:1,...  --network-interface eth0`` from worker 0; the table's ``launcher`` column tells them apart.

Example::

    sudo sylvie-comm bench ddp --link 1gbit --workers 4 --steps 8 --rounds 2
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from sylvie_comm.algorithms import ALGORITHMS
from sylvie_comm.algorithms.delegating import delegating, takes_rank
from sylvie_comm.bench import horovod as bh
from sylvie_comm.bench.choices import parse_spec, unique_choices
from sylvie_comm.bench.kit import (
    HOOK_WARMUP,
    LR,
    MOMENTUM,
    WARMUP,
    check_ints,
    check_timeout,
    fmt_mb,
    fmt_x,
    measure_steps,
    merge_rounds,
)

# Also read from here by the benchmarks that plot or record the machine as this one does (their home is bench.kit).
from sylvie_comm.bench.kit import NO_MATPLOTLIB as NO_MATPLOTLIB
from sylvie_comm.bench.kit import machine as machine
from sylvie_comm.bench.kit import pyplot as pyplot
from sylvie_comm.bench.kit import save_figure as save_figure
from sylvie_comm.bench.lab import Lab, LabError, ProgressBar, check_link, gather_ranks, serve_worker, worker_cli
from sylvie_comm.bench.workloads import WORKLOADS, check_workload

TORCH_CODECS: dict[str, str] = {
    "ddp": "DDP all-reduce (S-SGD)",
    "torch-fp16": "PyTorch fp16_compress_hook",
    "torch-powersgd": "PyTorch powerSGD_hook (1 bucket)",
    "no-comm": "DDP, a hook that sends nothing (bound)",
}


def all_codecs() -> list[str]:
    """Every codec the benchmark knows: DDP's and PyTorch's hooks, the no-comm bound, then every sylvie algorithm."""
    return [*TORCH_CODECS, *ALGORITHMS]


def check_codecs(codecs: Sequence[str]) -> list[str]:
    """``codecs`` without repeats; ValueError naming the bad one and listing the valid ones otherwise.

    A sylvie algorithm may carry options, ``name:key=value,...`` (``acpsgd:monitor.period=0``, ``qsgd:bits=2``),
    as ``bench quality``'s variants do; they run beside the plain name as a codec of their own."""
    known = all_codecs()

    def check(spec: str) -> None:
        name, options = parse_spec(spec)
        if name not in known:
            raise ValueError(f"unknown codec {name!r}; valid: {', '.join(known)}")
        if options and name in TORCH_CODECS:
            raise ValueError(f"codec {spec!r}: {name!r} takes no options (only the sylvie algorithms do)")

    return unique_choices(codecs, check, "codec")


def check_model(model: str) -> str:
    check_workload(model)
    return model


def label(spec: str, rank: int) -> str:
    """What a codec is, in words, for the table."""
    name, options = parse_spec(spec)
    if name in TORCH_CODECS:
        return TORCH_CODECS[name].replace("(1 bucket)", f"r{rank}, 1 bucket")
    if name in bh.LAB_ROWS:
        return bh.lab_label(name, rank)
    ranked = takes_rank(ALGORITHMS[name]) and "rank" not in options
    given = ", ".join(f"{k}={v}" for k, v in options.items())
    return f"sylvie {name}" + (f" r{rank}" if ranked else "") + (f" ({given})" if given else "")


# ---------------------------------------------------------------------- worker side


def _no_comm_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """Each rank's own gradient, at once: no collective (the ``no-comm`` bound)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP checks a hook's annotations at run time; this module's are strings (PEP 563).
_no_comm_hook.__annotations__ = {"state": Any, "bucket": torch.distributed.GradBucket,  # type: ignore[attr-defined]
                                 "return": torch.futures.Future[torch.Tensor]}  # fmt: skip


def _attach(name: str, ddp: Any, r: int, given: dict[str, Any], timeout: float) -> Any:
    """Codec ``name`` on ``ddp`` (``r``: the low-rank hooks' rank, ``given``: a sylvie algorithm's options); our
    session for a sylvie algorithm, None for DDP's and PyTorch's own."""
    import sylvie_comm.ddp

    if name == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        ps_state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=HOOK_WARMUP,
                                    use_error_feedback=True, warm_start=True)  # fmt: skip
        ddp.register_comm_hook(ps_state, ps.powerSGD_hook)
    elif name == "no-comm":
        ddp.register_comm_hook(None, _no_comm_hook)
    elif name != "ddp":
        opts: dict[str, Any] = {"rank": r} if takes_rank(ALGORITHMS[name]) else {}
        opts.update(given)
        return sylvie_comm.ddp.register(ddp, name, warmup_steps=HOOK_WARMUP, timeout=timeout, **opts)
    return None


def _ticks_after(skip: int, progress: Callable[[], None]) -> Callable[[], None]:
    """``progress`` that ignores its first ``skip`` calls (steps the driver's bar does not count)."""
    left = [skip]

    def tick() -> None:
        if left[0] > 0:
            left[0] -= 1
        else:
            progress()

    return tick


def _run_codec(spec: str, cfg: dict[str, Any], rank: int, world: int, progress: Callable[[], None]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    name, given = parse_spec(spec)
    work = WORKLOADS[cfg["model"]]
    model = work.model(0)  # same weights for every codec
    ddp = DDP(model, bucket_cap_mb=1024 if name == "torch-powersgd" else 25)
    state = _attach(name, ddp, int(cfg["rank"]), given, cfg["collective_timeout"])
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    gen = torch.Generator().manual_seed(1000 + rank)  # same data for every codec
    warmup, steps = int(cfg["warmup"]), int(cfg["steps"])
    chooser = delegating(state.algorithm) if state is not None else None
    settling = chooser.settles_after() if chooser is not None else 0
    # An algorithm that chooses while it runs (auto): the steps before its choice settles are warm-up too (not in
    # the driver's progress total): measure the choice it settles on, and report its choices.
    try:
        rec = measure_steps(ddp, opt, work, gen, warmup + settling, steps, dist.barrier, state,
                            _ticks_after(settling, progress))  # fmt: skip
        extra = {"auto": state.stats()["auto"]} if chooser is not None else {}
    finally:
        if state is not None:
            state.close()
    return {**extra, **rec}


def _merge(name: str, rounds: list[list[dict[str, Any]]], world: int, rank: int, batch: int) -> dict[str, Any]:
    """One codec's figures (:func:`merge_rounds`), with its label."""
    return merge_rounds(rounds, world, batch, label(name, rank))


def _run_codecs(cfg: dict[str, Any], rank: int, world: int, progress: Callable[[], None]) -> dict[str, Any]:
    """Every codec of ``cfg`` in turn on this rank, ``rounds`` times; the merged record (the same on every rank)."""
    # Rounds interleave the codecs (a b c a b c): a burst of load elsewhere on the machine
    # lands on several codecs rather than on all steps of one.
    rounds: dict[str, list[list[Any]]] = {name: [] for name in cfg["codecs"]}
    for _ in range(int(cfg["rounds"])):
        for name in cfg["codecs"]:
            rounds[name].append(gather_ranks(_run_codec(name, cfg, rank, world, progress)))
    batch = WORKLOADS[cfg["model"]].batch_size
    return {name: _merge(name, rounds[name], world, int(cfg["rank"]), batch) for name in cfg["codecs"]}


def worker_main(config_path: str) -> NoReturn:
    """One worker: every codec in turn on one process group; rank 0 writes the merged record."""
    serve_worker(config_path, _run_codecs)


# ---------------------------------------------------------------------- driver side


def _speedups(codecs: dict[str, Any]) -> dict[str, str | None]:
    """Add ``speedup_vs_ssgd`` and ``speedup_vs_torch_powersgd`` (ratios of medians); return the baselines."""
    ssgd = "ddp" if "ddp" in codecs else ("none" if "none" in codecs else None)
    tps = "torch-powersgd" if "torch-powersgd" in codecs else None
    for rec in codecs.values():
        rec["speedup_vs_ssgd"] = codecs[ssgd]["median_s"] / rec["median_s"] if ssgd else None
        rec["speedup_vs_torch_powersgd"] = codecs[tps]["median_s"] / rec["median_s"] if tps else None
    return {"s-sgd": ssgd, "torch-powersgd": tps}


def run(
    link: str,
    workers: int = 4,
    steps: int = 8,
    codecs: Sequence[str] | None = None,
    *,
    model: str = "mlp_17m",
    rank: int = 4,
    warmup: int = WARMUP,
    rounds: int = 1,
    timeout: float = 3600.0,
    shaped: bool | None = None,
    echo: Callable[[str], None] | None = print,
    progress: bool = True,
    horovod: bool | None = None,
    horovod_rows: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run every codec in one lab; return the full record (see the module's docstring).

    The DDP codecs' workers are started by torchrun, one node per worker namespace
    (``Lab.run(..., launcher="torchrun")``). ``horovod``: then run the Horovod rows
    (``horovod_rows``, default :data:`sylvie_comm.bench.horovod.DEFAULT_LAB_ROWS`) on the same lab,
    started by horovodrun from worker 0; None (default): when Horovod is installed (a failure of
    theirs is reported in ``horovod_error``, the DDP rows are kept), True: required, False: not run.

    ``rounds`` > 1 runs the codecs that many times, interleaved (a b c a b c), and pools their steps.
    ``timeout`` bounds the whole run: past it every worker is killed and
    :class:`~sylvie_comm.bench.lab.LabError` raised with the tail of their output.
    ``shaped`` as in :class:`~sylvie_comm.bench.lab.Lab` (None: the lab where possible).
    """
    check_link(link)
    names = check_codecs(list(codecs) if codecs is not None else all_codecs())
    check_model(model)
    check_ints("bench ddp --link", ("workers", workers, 1), ("steps", steps, 1), ("rank", rank, 1),
               ("warmup", warmup, 0), ("rounds", rounds, 1))  # fmt: skip
    check_timeout("bench ddp --link", timeout)
    _check_warmup(warmup, names)
    hvd_rows, hvd_skipped = _horovod_rows(horovod, horovod_rows, warmup)
    # A choosing algorithm's (auto's) steps before its choice settles are not in the total (see _run_codec).
    total = rounds * (len(names) + len(hvd_rows)) * (warmup + steps)
    with tempfile.TemporaryDirectory(prefix="sylvie-link-") as tmp, Lab(workers, link, shaped=shaped, echo=echo) as lab:
        cfg: dict[str, Any] = {"codecs": names, "steps": steps, "warmup": warmup, "rounds": rounds, "model": model,
               "rank": rank,
               "collective_timeout": max(60.0, min(timeout, 600.0)),
               "progress": str(Path(tmp) / "progress"), "result": str(Path(tmp) / "result.json")}  # fmt: skip
        t0 = time.perf_counter()
        with ProgressBar(cfg["progress"], total, f"ddp on {link}", "step", enabled=progress) as poll:
            results, launch = _run_ddp_rows(lab, cfg, Path(tmp), timeout, poll)
            hvd_error = None
            if hvd_rows:
                left = max(1.0, timeout - (time.perf_counter() - t0))
                hvd_error = _run_horovod_rows(lab, {**cfg, "horovod": hvd_rows}, Path(tmp), left, poll, results,
                                              launch, required=horovod is True)  # fmt: skip
        wall = time.perf_counter() - t0
        lab_info = {"shaped": lab.shaped, "fallback_reason": lab.fallback_reason, "banner": lab.banner,
                    "namespaces": lab.worker_namespaces if lab.shaped else None, "launch": launch}  # fmt: skip
    return {
        "benchmark": "ddp-link",
        "argv": list(sys.argv),
        "link": link,
        "workers": workers,
        "lab": lab_info,
        "model": model,
        "parameters": sum(p.numel() for p in WORKLOADS[model].model(0).parameters()),
        "batch_per_worker": WORKLOADS[model].batch_size,
        "workload": WORKLOADS[model].describe,
        "optimizer": f"SGD lr={LR} momentum={MOMENTUM}",
        "rank": rank,
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "wall_s": wall,
        "machine": machine(),
        "baselines": _speedups(results),
        "notes": NOTES,
        "codecs": results,
        "horovod_skipped": hvd_skipped,
        "horovod_error": hvd_error,
    }


NOTES = [
    "torch-powersgd runs with one bucket (bucket_cap_mb=1024): with several buckets powerSGD_hook "
    "aborts on gloo (its P and Q all-reduces start from callbacks on different threads)",
    "step time: barrier, then zero_grad + forward + backward (waits for the hook) + optimizer step; the slowest rank's",
]


def _check_warmup(warmup: int, names: Sequence[str]) -> None:
    """A ValueError where the warm-up would measure a hook's first, uncompressed steps."""
    if warmup < HOOK_WARMUP + 1 and any(n not in ("ddp", "torch-fp16") for n in names):
        raise ValueError(
            f"bench ddp --link: warmup must be >= {HOOK_WARMUP + 1} (got {warmup}): the hooks send plain "
            f"gradients for their first {HOOK_WARMUP} steps, which should not be measured"
        )


def _horovod_rows(horovod: bool | None, rows: Sequence[str] | None, warmup: int) -> tuple[list[str], str | None]:
    """The Horovod rows to run, and why none run (None when they do): ``horovod`` False, or Horovod missing (a
    ValueError where ``horovod`` is True); with too short a warm-up only the uncompressed rows."""
    hvd_rows = bh.check_rows(list(rows) if rows is not None else bh.DEFAULT_LAB_ROWS)
    hvd_skipped = "--no-horovod" if horovod is False else bh.available()
    if horovod is True and hvd_skipped is not None:
        raise ValueError(f"bench ddp --link --horovod: {hvd_skipped}")
    if hvd_skipped is not None:
        return [], hvd_skipped
    if warmup < HOOK_WARMUP + 1:  # as for the DDP hooks: the compressed rows' warm-up must not be measured
        hvd_rows = [n for n in hvd_rows if n in bh.UNCOMPRESSED_LAB_ROWS]
    return hvd_rows, None


def _run_ddp_rows(lab: Lab, cfg: dict[str, Any], tmp: Path, timeout: float,
                  poll: Callable[[], None]) -> tuple[dict[str, Any], dict[str, str]]:  # fmt: skip
    """Every DDP codec, started by torchrun (one node per worker namespace): their rows and the launch command."""
    cfg_path = tmp / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    argv = [sys.executable, "-m", "sylvie_comm.bench.link", "--worker", str(cfg_path)]
    launch = {"torchrun": " ".join(lab.command(0, argv, "torchrun"))}
    lab.run(argv, timeout=timeout, poll=poll, launcher="torchrun")
    results = json.loads(Path(cfg["result"]).read_text())
    for res in results.values():
        res["launcher"] = "torchrun"
    return results, launch


def _run_horovod_rows(lab: Lab, cfg: dict[str, Any], tmp: Path, timeout: float, poll: Callable[[], None],
                      results: dict[str, Any], launch: dict[str, str], *, required: bool) -> str | None:  # fmt: skip
    """The Horovod rows, started by horovodrun from worker 0, added to ``results`` (their command to ``launch``);
    their failure as text (a LabError where they are ``required``)."""
    hvd_cfg = {**cfg, "result": str(tmp / "result-hvd.json")}
    argv = [sys.executable, "-m", "sylvie_comm.bench.horovod", "--lab-worker", str(tmp / "hvd.json")]
    Path(argv[-1]).write_text(json.dumps(hvd_cfg))
    launch["horovodrun"] = " ".join(lab.command(0, argv, "horovodrun"))
    try:
        lab.run(argv, timeout=timeout, poll=poll, launcher="horovodrun")
    except LabError as exc:
        if required:
            raise
        return str(exc)
    for name, res in json.loads(Path(hvd_cfg["result"]).read_text()).items():
        results[name] = {**res, "launcher": "horovodrun"}
    return None


def format_table(rec: dict[str, Any]) -> str:
    """The record as a markdown table, with what each column means."""
    lab = rec["lab"]
    where = f"link {rec['link']}" if lab["shaped"] else f"LOOPBACK (not shaped: {lab['fallback_reason']})"
    m = rec["machine"]
    base = rec["baselines"]
    r = rec.get("rounds", 1)
    rounds = f", x {r} rounds (codecs interleaved)" if r > 1 else ""
    hvd = any(c.get("launcher") == "horovodrun" for c in rec["codecs"].values())
    lines = [
        f"{'DDP and Horovod' if hvd else 'DDP'} on {where}, {rec['workers']} workers, {rec['model']} "
        f"({rec['parameters']:,} parameters), "
        f"batch {rec['batch_per_worker']}/worker, {rec['optimizer']}, median of {rec['steps']} steps after "
        f"{rec['warmup']} warm-up{rounds}; {m['cpu_count']} CPUs ({m['cpu_model']}), torch {m['torch']}",
        "",
        f"| codec | launcher | step s (median) | min-max s | samples/s | hook MB/step | eth0 MB/step | enc+dec s "
        f"| x S-SGD ({base['s-sgd'] or '-'}) | x torch PowerSGD |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in rec["codecs"].values():
        ed = "-" if c["encode_decode_s"] is None else f"{c['encode_decode_s']:.4f}"
        lines.append(
            f"| {c['label']} | {c.get('launcher', '-')} | {c['median_s']:.3f} | {c['min_s']:.3f}-{c['max_s']:.3f} "
            f"| {c['samples_per_s']:.1f} "
            f"| {fmt_mb(c['hook_bytes_per_step'])} | {fmt_mb(c['eth0_tx_bytes_per_step'])} | {ed} "
            f"| {fmt_x(c['speedup_vs_ssgd'])} | {fmt_x(c['speedup_vs_torch_powersgd'])} |"
        )
    lines += [
        "",
        "step s: barrier, then zero_grad + forward + backward (waits for the hook's collectives) + SGD step, "
        "the slowest rank's; samples/s: workers x batch / median step.",
        "hook MB/step: what our hooks report sending per worker (state.stats()), mean over the measured steps; "
        "eth0 MB/step: bytes that left each worker's eth0 per step (TCP/IP headers and gloo's control included; "
        "lab only).",
        "enc+dec s: our hooks' encode + decode per step (median); x ...: ratio of median step times (higher is "
        "faster).",
        "PyTorch's powerSGD_hook runs with one bucket (bucket_cap_mb=1024): with several buckets it aborts on gloo.",
        "no-comm: DDP with a hook that sends nothing and averages nothing (not data-parallel training): the "
        "least any hook's step can take here; the other rows' distance to it is their hooks' work and wire time.",
        "auto: its probe steps (probe_steps x candidates, after the hooks' warm-up) are not measured; its choices "
        "are in the JSON.",
        "launcher: torchrun (one node per worker, static rendezvous at worker 0) or horovodrun (-H one slot per "
        "worker, gloo, from worker 0); the commands are in the JSON (lab.launch). Horovod rows: the same step, "
        "opt.step() waiting for the averaged gradients; hook MB/step is what our compressor or optimizer reports.",
    ]
    if rec.get("horovod_skipped"):
        lines.append(f"no Horovod rows: {rec['horovod_skipped']}")
    if rec.get("horovod_error"):
        lines.append(f"the Horovod rows FAILED: {_tail_line(rec['horovod_error'])}")
    return "\n".join(lines)


def _tail_line(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first + " (whole error in the JSON: horovod_error)"


def save(rec: dict[str, Any], out: str | Path) -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=2))
    return path


def plot(rec: dict[str, Any], out: str | Path) -> tuple[Path | None, str]:
    """A bar chart of the speedup over S-SGD per codec (PNG); ``(None, why)`` without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None, NO_MATPLOTLIB
    codecs = rec["codecs"]
    names = [c["label"] for c in codecs.values()]
    key = "speedup_vs_ssgd" if rec["baselines"]["s-sgd"] else None
    values = [c[key] if key else 1.0 / c["median_s"] for c in codecs.values()]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(names) + 2), 4))
    ax.bar(range(len(names)), values)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(f"speedup over S-SGD ({rec['baselines']['s-sgd']})" if key else "steps per second")
    ax.set_title(f"DDP, {rec['workers']} workers, link {rec['link'] if rec['lab']['shaped'] else 'loopback'}")
    return save_figure(plt, fig, out)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    worker_cli("sylvie_comm.bench.link", __doc__, worker_main, argv)


if __name__ == "__main__":
    main()
