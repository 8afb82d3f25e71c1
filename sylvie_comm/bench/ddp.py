"""DDP hook cost on a 17.9M-parameter MLP: compute time and memory, against PyTorch's PowerSGD hook (and Horovod).

The model is 512 -> 2048, four 2048 x 2048 layers, -> 10 (17.9M parameters:
:func:`~sylvie_comm.bench.workloads.mlp_17m`), each rank on one fixed batch
(:func:`~sylvie_comm.bench.workloads.fixed_batch`).
Two measurements, each with every hook in the same invocation:

* ``world=2`` (gloo on loopback): backward time per step (it includes the
  wait for the hook's futures), our hooks' encode + decode seconds per step
  from ``state.stats()``, bytes sent per step, and the memory each hook keeps
  between steps.
* ``world=1``: the backward time of each hook minus that of the plain
  all-reduce at one rank, where collectives cost nothing: the hook's compute,
  measured the same way for PyTorch's hook (which reports no statistics).

PyTorch's ``powerSGD_hook`` runs with one bucket, the only way it runs on gloo
(with two or more buckets it launches its P and Q all-reduces from callbacks
on different threads, and ranks disagree on their order).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from sylvie_comm.algorithms import ALGORITHMS
from sylvie_comm.algorithms.delegating import takes_rank
from sylvie_comm.bench import horovod
from sylvie_comm.bench.kit import StepFigures
from sylvie_comm.bench.workloads import fixed_batch
from sylvie_comm.bench.workloads import mlp_17m as mlp_17m  # also read from here (its home is bench.workloads)

HOOKS = ("none", "acpsgd", "powersgd", "onebit", "torch-powersgd")


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _run_hook(name: str, rank: int, world: int, rank_r: int, steps: int, warmup: int) -> dict[str, Any]:
    import sylvie_comm.ddp

    model = mlp_17m()
    one_bucket = name == "torch-powersgd"
    ddp = DDP(model, bucket_cap_mb=1024 if one_bucket else 25)
    state = ps_state = None
    if name == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        ps_state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                                    start_powerSGD_iter=warmup, use_error_feedback=True, warm_start=True)  # fmt: skip
        ddp.register_comm_hook(ps_state, ps.powerSGD_hook)
    else:
        opts: dict[str, Any] = {"rank": rank_r} if takes_rank(ALGORITHMS[name]) else {}
        state = sylvie_comm.ddp.register(ddp, name, warmup_steps=warmup, **opts)
    x, y = fixed_batch(rank)
    figures = StepFigures()
    for step in range(warmup + steps):
        ddp.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        dist.barrier()
        t0 = time.perf_counter()
        loss.backward()  # type: ignore[no-untyped-call]
        dt = time.perf_counter() - t0
        if step >= warmup:
            figures.add(dt, state)
    if state is not None:
        memory = state.memory_bytes()
        state.close()
    else:
        assert ps_state is not None
        memory = _tensor_bytes([ps_state.error_dict, ps_state.p_memory_dict, ps_state.q_memory_dict])
    return {**figures.medians(), "memory_bytes": memory}


def _worker(rank: int, world: int, port: int, rank_r: int, steps: int, warmup: int, queue: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = {name: _run_hook(name, rank, world, rank_r, steps, warmup) for name in HOOKS}
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, rank_r: int, steps: int, warmup: int) -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, rank_r, steps, warmup, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in range(world))
    for p in procs:
        p.join()
    out: dict[str, Any] = results[0]
    return out


def run(rank: int = 4, steps: int = 5, warmup: int = 2) -> dict[str, Any]:
    params = sum(p.numel() for p in mlp_17m().parameters())
    two = _spawn(2, rank, steps, warmup)
    one = _spawn(1, rank, steps, warmup)
    base1 = one["none"]["backward_s"]
    for name in HOOKS:
        two[name]["compute_s_world1"] = one[name]["backward_s"] - base1
    return {"parameters": params, "rank": rank, "steps": steps, "hooks": two,
            "horovod": horovod.run(rank, steps, warmup)}  # fmt: skip


def format_table(res: dict[str, Any]) -> str:
    model_bytes = 4 * res["parameters"]
    hooks = res["hooks"]
    torch_compute = hooks["torch-powersgd"]["compute_s_world1"]
    lines = [
        f"17.9M-parameter MLP ({res['parameters']:,} parameters), rank {res['rank']}, median of {res['steps']} steps",
        "",
        f"{'hook':<16}{'backward s':>11}{'enc+dec s':>11}{'compute s':>11}{'x torch':>9}{'MB sent':>9}"
        f"{'hook MB':>9}{'x model':>9}",
    ]
    for name in HOOKS:
        h = hooks[name]
        ed = "-" if h["encode_decode_s"] is None else f"{h['encode_decode_s']:.4f}"
        sent = "-" if h["bytes_sent"] is None else f"{h['bytes_sent'] / 1e6:.2f}"
        ratio = h["compute_s_world1"] / torch_compute if torch_compute > 0 else float("nan")
        lines.append(
            f"{name:<16}{h['backward_s']:>11.4f}{ed:>11}{h['compute_s_world1']:>11.4f}{ratio:>9.2f}{sent:>9}"
            f"{h['memory_bytes'] / 1e6:>9.1f}{h['memory_bytes'] / model_bytes:>9.2f}"
        )
    if res.get("horovod") is not None:
        lines += ["", "under horovodrun (2 ranks, gloo): Horovod's optimizer, and ours (sylvie_comm.horovod)"]
        lines += horovod.format_rows(res["horovod"])
    else:
        lines += ["", "(Horovod is not installed: no Horovod rows; scripts/horovod.sh builds it)"]
    lines += [
        "",
        "backward s: loss.backward() at 2 ranks (includes waiting for the hook's collectives; under Horovod,",
        "backward + the optimizer's synchronize());",
        "enc+dec s: our hooks' encode + decode per step (state.stats()); compute s: backward at 1 rank minus",
        "the plain all-reduce's (same measure for every hook); hook MB: tensors kept between steps.",
    ]
    return "\n".join(lines)
