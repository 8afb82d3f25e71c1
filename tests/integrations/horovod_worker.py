"""Checks of the Horovod integration, run on every rank under ``horovodrun``.

    horovodrun -np 2 --gloo python -m tests.integrations.horovod_worker OUT_DIR CHECK [CHECK ...]

Each check's result (or its traceback) goes to ``OUT_DIR/<check>-rank<r>.pt``;
``tests/integrations/test_horovod.py`` launches this once for many checks and
asserts on the files. :func:`equal_run` is also run under DDP (gloo) by the test.
"""

from __future__ import annotations

import io
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.integrations import workloads as wl

FULL_RANK = {"rank": 16, "min_compression_rate": 0}
# (codec, options, tolerance on the largest gradient error relative to the largest gradient; None: lossy)
OPTIMIZER_CASES: list[tuple[str, dict[str, Any], float | None]] = [
    ("none", {}, 1e-6),
    ("fp16", {}, 2e-3),
    ("bf16", {}, 1.6e-2),
    ("acpsgd", FULL_RANK, 1e-5),
    ("powersgd", FULL_RANK, 1e-5),
    ("acpsgd", {"rank": 2}, None),
    ("powersgd", {"rank": 2}, None),
    ("onebit", {"chunk_size": 8}, None),
    ("topk", {"ratio": 0.1}, None),
    ("sign", {}, None),
    ("qsgd", {}, None),
]
RESUME_CODECS = ["acpsgd", "powersgd", "onebit", "topk", "sign", "qsgd", "fp16", "bf16", "none"]
TINY_BUCKET_MB = 0.0005  # one parameter per fusion group or so: several groups


def _hvd() -> Any:
    import horovod.torch as hvd

    return hvd


def _sh() -> Any:
    import sylvie_comm.horovod as sh

    return sh


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _backward(model: nn.Module, rank: int, step: int) -> None:
    x, y = wl.batch(rank, step)
    F.cross_entropy(model(x), y).backward()


# ---------------------------------------------------------------- stock hvd.DistributedOptimizer + our Compression


def compare_compression(
    rank: int, make: Callable[[nn.Module], Any], steps: int = 6, *, op: str = "average", passes: int = 1,
    groups: int | None = None,
) -> list[float]:  # fmt: skip
    """Gradients through hvd.DistributedOptimizer with a compressor against Compression.none, per step."""
    hvd = _hvd()
    hop = hvd.Sum if op == "sum" else hvd.Average
    base, test = wl.square_mlp(), wl.square_mlp()
    lr = 0.05
    opt_b = hvd.DistributedOptimizer(torch.optim.SGD(base.parameters(), lr=lr), named_parameters=[
        (f"base.{n}", p) for n, p in base.named_parameters()], op=hop, backward_passes_per_step=passes)  # fmt: skip
    opt_t = hvd.DistributedOptimizer(
        torch.optim.SGD(test.parameters(), lr=lr),
        named_parameters=[(f"test.{n}", p) for n, p in test.named_parameters()],
        compression=make(test),
        op=hop,
        backward_passes_per_step=passes,
        groups=groups,
    )
    errors = []
    for step in range(steps):
        for model, opt in ((base, opt_b), (test, opt_t)):
            opt.zero_grad()  # Horovod's: set_to_none=True, torch's default
            for micro in range(passes):
                _backward(model, rank, step * passes + micro)
            opt.synchronize()
        errors.append(wl.relative_error(_grads(test), _grads(base)))
        with opt_b.skip_synchronize():
            opt_b.step()
        with torch.no_grad():
            for pt, pb in zip(test.parameters(), base.parameters(), strict=True):
                pt.copy_(pb)
    return errors


def check_compression(rank: int) -> dict[str, Any]:
    sh = _sh()
    out: dict[str, Any] = {}
    out["none"] = compare_compression(rank, lambda m: sh.Compression.none)
    out["fp16"] = compare_compression(rank, lambda m: sh.Compression.fp16)
    try:
        out["bf16"] = compare_compression(rank, lambda m: sh.Compression.bf16)
    except Exception as exc:  # Horovod 0.28.1 has no bf16 all-reduce for PyTorch: the compressor says so
        out["bf16"] = f"{type(exc).__name__}: {exc}"

    def acp(**kw: Any) -> Callable[[nn.Module], Any]:
        return lambda m: sh.Compression.acpsgd(m.named_parameters(), **kw)

    out["acpsgd_full"] = compare_compression(rank, acp(rank=16, min_compression_rate=0))
    out["acpsgd_full_sum"] = compare_compression(rank, acp(rank=16, min_compression_rate=0), op="sum")
    out["acpsgd_full_passes2"] = compare_compression(rank, acp(rank=16, min_compression_rate=0), passes=2)
    out["acpsgd_full_groups2"] = compare_compression(rank, acp(rank=16, min_compression_rate=0), groups=2)
    out["acpsgd_rank2"] = compare_compression(rank, acp(rank=2))
    # A compressor's stats and a checkpoint of its state.
    model = wl.square_mlp()
    comp = sh.Compression.acpsgd(model.named_parameters(), rank=2, warmup_steps=1)
    opt = _hvd().DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                      named_parameters=model.named_parameters(), compression=comp)  # fmt: skip
    for step in range(3):
        opt.zero_grad()
        _backward(model, rank, step)
        opt.step()
    out["acpsgd_stats"] = comp.stats()
    state = comp.state_dict()
    out["acpsgd_state_keys"] = sorted(state["params"])
    out["acpsgd_steps"] = state["step"]
    # A gradient that belongs to no named parameter: a clear error.
    try:
        comp.compress(torch.zeros(3, 3))
        out["foreign"] = "no error"
    except ValueError as exc:
        out["foreign"] = str(exc)
    try:
        comp.compress(next(model.parameters()))
        out["adasum"] = "no error"
    except ValueError as exc:
        out["adasum"] = str(exc)
    return out


# ---------------------------------------------------------------- our DistributedOptimizer


def compare_optimizer(rank: int, codec: str, options: dict[str, Any], steps: int = 6, passes: int = 1) -> dict:
    """Gradients averaged by our optimizer against Horovod's plain average, at the same parameters each step."""
    hvd, sh = _hvd(), _sh()
    base, test = wl.square_mlp(), wl.square_mlp()
    opt_b = hvd.DistributedOptimizer(torch.optim.SGD(base.parameters(), lr=0.05), named_parameters=[
        (f"base.{n}", p) for n, p in base.named_parameters()], backward_passes_per_step=passes)  # fmt: skip
    opt_t = sh.DistributedOptimizer(
        torch.optim.SGD(test.parameters(), lr=0.05),
        test.named_parameters(),
        codec,
        bucket_cap_mb=TINY_BUCKET_MB,
        backward_passes_per_step=passes,
        **options,
    )
    errors = []
    for step in range(steps):
        for model, opt in ((base, opt_b), (test, opt_t)):
            opt.zero_grad()
            for micro in range(passes):
                _backward(model, rank, step * passes + micro)
            opt.synchronize()
        if step >= opt_t.config.warmup_steps:
            errors.append(wl.relative_error(_grads(test), _grads(base)))
        with opt_b.skip_synchronize():
            opt_b.step()
        with torch.no_grad():
            for pt, pb in zip(test.parameters(), base.parameters(), strict=True):
                pt.copy_(pb)
    out = {"errors": errors, "stats": opt_t.stats(), "groups": len(opt_t._groups)}
    opt_t.close()
    return out


def check_optimizer(rank: int) -> dict[str, Any]:
    out = {f"{codec}/{i}": compare_optimizer(rank, codec, opts) for i, (codec, opts, _) in enumerate(OPTIMIZER_CASES)}
    out["acpsgd_full_passes2"] = compare_optimizer(rank, "acpsgd", FULL_RANK, passes=2)
    out["onebit_passes2"] = compare_optimizer(rank, "onebit", {"chunk_size": 8}, passes=2)
    return out


def _train(opt: Any, model: nn.Module, rank: int, steps: range) -> None:
    for step in steps:
        x, y = wl.batch(rank, step)
        opt.zero_grad()
        F.cross_entropy(model(x)[:, :8], y % 8).backward()
        opt.step()


def resume_codec(rank: int, codec: str, options: dict[str, Any] | None = None, k: int = 8) -> dict[str, Any]:
    """k steps, checkpoint, k more; then a fresh model and optimizer load the checkpoint and run the last k.

    The compression monitor runs in both (at ``MONITOR_DEFAULTS`` unless ``options`` set ``monitor``): at k = 8 its
    first check (compressed step 10, step 12) falls in the resumed half, its figures (taken on steps 7-12) across the
    checkpoint. Besides the parameters, the monitor's checks (at the checkpoint and at the end), decisions and
    per-tensor figures of both runs."""
    sh = _sh()
    extra = options or {}
    model = wl.mlp()
    opt = sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  model.named_parameters(), codec, bucket_cap_mb=TINY_BUCKET_MB, **extra)  # fmt: skip
    _train(opt, model, rank, range(k))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(opt, model, rank, range(k, 2 * k))
    first = [p.detach().clone() for p in model.parameters()]
    straight = opt.stats().get("monitor")
    opt.close()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model = wl.mlp(seed=1)  # other initial values: everything must come from the checkpoint
    model.load_state_dict(ckpt["model"])
    opt = sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),  # other groups:
                                  model.named_parameters(), codec, bucket_cap_mb=1.0, **extra)  # fmt: skip
    opt.load_state_dict(ckpt["opt"])
    _train(opt, model, rank, range(k, 2 * k))
    second = [p.detach().clone() for p in model.parameters()]
    resumed = opt.stats().get("monitor")
    opt.close()
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(first, second, strict=True)),
        "max_diff": max((a - b).abs().max().item() for a, b in zip(first, second, strict=True)),
        "state_names": sorted(ckpt["opt"]["sylvie_comm"]["params"]),
        "monitor": None if straight is None else (ckpt["opt"]["sylvie_comm"]["monitor"], _unsampled(straight),
                                                  _unsampled(resumed)),
    }  # fmt: skip


def _unsampled(report: dict[str, Any]) -> dict[str, Any]:
    """A monitor report less the exact check's figures: which tensors a check samples follows the groups (the
    resumed run's are others)."""
    tensors = {n: {k: v for k, v in t.items() if not k.startswith("exact")} for n, t in report["tensors"].items()}
    return {**report, "tensors": tensors}


# Adaptation across the checkpoint, k = 6: checks every 3 compressed steps (steps 5, 8 and 11), a bound every
# compressed tensor's lag exceeds and patience 1, so each check changes settings (a low-rank matrix's rank 1 -> 2,
# then raw; top-k's ratio, qsgd's bits; raw for one-bit, which has no safer level). The checkpoint after step 5 is
# taken right after a check: its decisions apply at the next step, the resumed run's first (the low-rank factors
# grow a column there), and the check at step 8 falls in the resumed half.
ADAPT_MONITOR = {"first": 3, "period": 3, "adapt": True, "max_lag": 0.05, "patience": 1}
ADAPT_CASES: dict[str, dict[str, Any]] = {"acpsgd": {"rank": 1}, "powersgd": {"rank": 1}, "onebit": {}, "topk": {},
                                          "qsgd": {}}  # fmt: skip


def check_resume(rank: int) -> dict[str, Any]:
    out = {codec: resume_codec(rank, codec) for codec in RESUME_CODECS}
    for codec, options in ADAPT_CASES.items():
        out[f"{codec}/adapt"] = resume_codec(rank, codec, {**options, "monitor": ADAPT_MONITOR}, k=6)
    return out


AMP_CODECS = ["acpsgd", "auto", "bf16", "fp16", "none", "onebit", "powersgd", "qsgd", "sign", "topk"]


def check_amp(rank: int) -> dict[str, Any]:
    """GradScaler with one NaN on rank 0 (see workloads.amp_run): our optimizer with every codec, and
    hvd.DistributedOptimizer with our ACP-SGD compressor, as Horovod documents AMP (synchronize, unscale_,
    step without synchronizing again)."""
    hvd, sh = _hvd(), _sh()
    out: dict[str, Any] = {}
    for codec in AMP_CODECS:

        def ours(model: nn.Module, opt: torch.optim.Optimizer, codec: str = codec) -> Any:
            dist_opt = sh.DistributedOptimizer(opt, model.named_parameters(), codec, bucket_cap_mb=TINY_BUCKET_MB)

            def step(scaler: Any, loss: torch.Tensor) -> None:
                scaler.scale(loss).backward()
                dist_opt.synchronize()
                scaler.unscale_(dist_opt)
                scaler.step(dist_opt, skip_synchronize=True)
                scaler.update()

            return model, step, dist_opt.close, dist_opt.stats, lambda: dist_opt.state_dict()["sylvie_comm"]["params"]

        out[codec] = wl.amp_run(rank, ours)

    def stock(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        comp = sh.Compression.acpsgd(model.named_parameters(), rank=2)
        dist_opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)

        def step(scaler: Any, loss: torch.Tensor) -> None:
            scaler.scale(loss).backward()
            dist_opt.synchronize()
            scaler.unscale_(dist_opt)
            with dist_opt.skip_synchronize():
                scaler.step(dist_opt)
            scaler.update()

        return model, step, lambda: None, comp.stats, lambda: comp.state_dict()["params"]

    out["hvd+acpsgd"] = wl.amp_run(rank, stock)
    return out


def check_errors(rank: int) -> dict[str, Any]:
    """Configurations that must fail on every rank, with a message, without a hang."""
    sh = _sh()
    out: dict[str, Any] = {}
    cases: dict[str, Callable[[], Any]] = {
        "disagree": lambda: sh.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), "acpsgd", rank=4 + 4 * rank),
        "bad_option_one_rank": lambda: sh.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), "topk", ratio=0.1 if rank == 0 else 2.0),
        "unknown_codec": lambda: sh.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), "zip"),
        "horovod_op": lambda: sh.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), "acpsgd", op="sum"),
        "unnamed": lambda: sh.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), list(m.named_parameters())[:2], "acpsgd"),
        "passes": lambda: sh.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), "acpsgd", backward_passes_per_step=0),
    }  # fmt: skip
    m = wl.mlp()
    for name, make in cases.items():
        try:
            make().close()
            out[name] = "no error"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    # Too many backward passes before step(): a clear error from the gradient hook.
    opt = sh.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), "none")
    try:
        for _ in range(2):
            F.cross_entropy(m(torch.randn(4, 16))[:, :8], torch.zeros(4, dtype=torch.long)).backward()
        out["extra_pass"] = "no error"
    except RuntimeError as exc:
        out["extra_pass"] = str(exc)
    opt.synchronize()
    opt.close()
    # Checkpoints that do not fit: rank 0's on every rank, and of two steps, refused on every rank.
    hvd = _hvd()
    for key, codec in (("optimizer", "onebit"), ("compressor", "acpsgd")):
        model = wl.mlp()
        if key == "optimizer":
            o = sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(), codec,
                                        bucket_cap_mb=TINY_BUCKET_MB)  # fmt: skip
            holder, close = o, o.close
        else:
            comp = sh.Compression.acpsgd(model.named_parameters(), rank=2)
            o = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters(), compression=comp)  # fmt: skip
            holder, close = comp, lambda: None
        _train(o, model, rank, range(4))
        early = holder.state_dict()
        _train(o, model, rank, range(4, 6))
        late = holder.state_dict()
        everyone = hvd.allgather_object(late)
        for case, ckpt in (("rank0", everyone[0]), ("steps", early if rank == 0 else late)):
            try:
                holder.load_state_dict(ckpt)
                out[f"ckpt_{key}_{case}"] = "loaded"
            except ValueError as exc:
                out[f"ckpt_{key}_{case}"] = str(exc)
        holder.load_state_dict(late)
        out[f"ckpt_{key}_own"] = "loaded"
        close()
    return out


# ---------------------------------------------------------------- DDP equality


def equal_run(rank: int, world: int, backend: str, codec: str, steps: int = 8) -> list[torch.Tensor]:
    """The same training under DDP with our hook (``backend="ddp"``) or under Horovod with our optimizer."""
    import sylvie_comm

    model = wl.mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if backend == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=wl.TINY_BUCKET_MB)
        state = sylvie_comm.ddp.register(ddp, codec)
        _train(inner, ddp, rank, range(steps))
        state.close()
    elif backend == "horovod":
        opt = _sh().DistributedOptimizer(inner, model.named_parameters(), codec)
        _train(opt, model, rank, range(steps))
        opt.close()
    else:
        raise ValueError(f"backend must be 'ddp' or 'horovod', got {backend!r}")
    return [p.detach().clone() for p in model.parameters()]


# Every algorithm but auto, whose choice after its probes follows the timings it measured on the link.
EQUAL_CODECS = ["acpsgd", "bf16", "fp16", "none", "onebit", "powersgd", "qsgd", "sign", "topk"]


def check_equal(rank: int) -> dict[str, Any]:
    world = _hvd().size()
    return {codec: equal_run(rank, world, "horovod", codec) for codec in EQUAL_CODECS}


def check_transport(rank: int) -> dict[str, Any]:
    """Every collective of the HorovodTransport against what the Transport protocol promises (2 ranks)."""
    from sylvie_comm.collectives.horovod import HorovodTransport

    t = HorovodTransport()
    out: dict[str, Any] = {"rank": t.rank, "world_size": t.world_size}
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32):
        x = (torch.arange(6) + 10 * rank).to(dtype)
        t.all_reduce(x).wait()
        out[f"all_reduce/{dtype}"] = x.tolist()
    gathered = torch.empty(2, 3, dtype=torch.uint8)
    t.all_gather(gathered, torch.arange(3, dtype=torch.uint8) + 10 * rank).wait()
    out["all_gather"] = gathered.tolist()
    received = torch.empty(4, dtype=torch.int32)
    t.all_to_all(received, torch.arange(4, dtype=torch.int32) + 10 * rank).wait()
    out["all_to_all"] = received.tolist()
    # rank r sends r + 1 rows to each peer: every rank receives 1 row from rank 0 and 2 from rank 1.
    send = torch.full((2 * (rank + 1), 2), float(rank))
    recv = torch.empty(3, 2)
    t.all_to_all_v(recv, send, [1, 2], [rank + 1, rank + 1]).wait()
    out["all_to_all_v"] = recv[:, 0].tolist()
    for dtype in (torch.float32, torch.float16):  # rank r's shard of the sum of every rank's (6,) input
        shard = torch.empty(3, dtype=dtype)
        t.reduce_scatter(shard, (torch.arange(6) + 10 * rank).to(dtype)).wait()
        out[f"reduce_scatter/{dtype}"] = shard.tolist()
    try:
        t.reduce_scatter(torch.empty(2), torch.zeros(6))
        out["bad_shard"] = "no error"
    except ValueError as exc:
        out["bad_shard"] = str(exc)
    out["all_gather_object"] = t.all_gather_object({"rank": rank})
    try:
        t.all_to_all_v(recv, send, [1, 2], [5, 5])
        out["bad_splits"] = "no error"
    except ValueError as exc:
        out["bad_splits"] = str(exc)
    t.close()
    return out


CHECKS: dict[str, Callable[[int], Any]] = {
    "transport": check_transport,
    "compression": check_compression,
    "optimizer": check_optimizer,
    "resume": check_resume,
    "errors": check_errors,
    "amp": check_amp,
    "equal": check_equal,
}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any(c not in CHECKS for c in argv[1:]):
        print(f"usage: horovod_worker OUT_DIR CHECK...; checks: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    hvd = _hvd()
    hvd.init()
    rank, folder = hvd.rank(), argv[0]
    for check in argv[1:]:
        try:
            torch.manual_seed(0)
            result: Any = {"ok": CHECKS[check](rank)}
        except Exception:
            result = {"error": traceback.format_exc()}
        torch.save(result, os.path.join(folder, f"{check}-rank{rank}.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
