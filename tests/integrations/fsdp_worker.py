"""What the FSDP2 tests run on each rank: digits under ``fully_shard``, with and without our reduce-scatter."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import sylvie_comm
from tests.integrations import workloads as wl

STEPS = 300


def sharded_mlp(seed: int = 0, mesh: Any = None, reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """The digits MLP 64-256-256-10, ``fully_shard`` on each Linear and on the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    kw: dict[str, Any] = {"mesh": mesh} if mesh is not None else {}
    if reduce_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, **kw)
    fully_shard(model, **kw)
    return model


def _step(model: nn.Module, opt: Any, xtr: torch.Tensor, ytr: torch.Tensor, g: torch.Generator) -> None:
    idx = torch.randint(0, len(xtr), (64,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
    opt.step()


def train(
    rank: int, world: int, codec: str | None, options: dict[str, Any], optimizer: str = "sgd_momentum",
    steps: int = STEPS, hsdp: bool = False, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Digits with plain FSDP2 (``codec`` None) or ours; with ``hsdp`` 2 replicas of 2 shards (4 ranks):
    FSDP's own HSDP for None, else ``fully_shard`` on the shard dimension and our replica all-reduce."""
    mesh, replicas = None, None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        full = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        mesh = full if codec is None else full["shard"]
        replicas = full["replicate"].get_group()
    # Every rank trains on its own slice of the data, as under DDP (HSDP included).
    xtr, ytr, xte, yte = wl.digits_split(rank, world)
    model = sharded_mlp(seed, mesh)
    state = None
    if codec is not None:
        kw = {"replicas": replicas} if hsdp else {}
        state = sylvie_comm.fsdp.register(model, codec, **kw, **options)
    opt = wl.OPTIMIZERS[optimizer](model.parameters())
    g = torch.Generator().manual_seed(rank + 100 * seed)
    for _ in range(steps):
        _step(model, opt, xtr, ytr, g)
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
    out: dict[str, Any] = {"accuracy": acc}
    if state is not None:
        out["stats"] = state.stats()
        out["memory_bytes"] = state.memory_bytes()
        state.close()
    return out


def _save(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}  # type: ignore[operator]


def _hsdp_mesh(world: int) -> tuple[Any, Any]:
    """The shard dimension's mesh and the replicas' group of 2 replicas of ``world // 2`` shards."""
    from torch.distributed.device_mesh import init_device_mesh

    full = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return full["shard"], full["replicate"].get_group()


def resume(
    rank: int, world: int, codec: str, options: dict[str, Any], optimizer: str, k: int = 5, hsdp: bool = False
) -> dict[str, Any]:
    """2k steps straight against k steps, a checkpoint (model, optimizer, codec state), a fresh model and k more."""
    xtr, ytr, _, _ = wl.digits_split(rank, world)
    mesh, replicas = _hsdp_mesh(world) if hsdp else (None, None)

    def fresh() -> tuple[nn.Module, Any, Any]:
        model = sharded_mlp(0, mesh)
        kw = {"replicas": replicas} if hsdp else {}
        state = sylvie_comm.fsdp.register(model, codec, **kw, **options)
        return model, wl.OPTIMIZERS[optimizer](model.parameters()), state

    model, opt, state = fresh()
    g = torch.Generator().manual_seed(rank)
    for _ in range(2 * k):
        _step(model, opt, xtr, ytr, g)
    straight = _params(model)
    state.close()

    model, opt, state = fresh()
    g = torch.Generator().manual_seed(rank)
    for _ in range(k):
        _step(model, opt, xtr, ytr, g)
    ckpt = _save({"model": model.state_dict(), "opt": opt.state_dict(), "codec": state.state_dict(),
                  "rng": g.get_state()})  # fmt: skip
    state.close()
    model, opt, state = fresh()
    saved = _load(ckpt)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["codec"])
    g = torch.Generator()
    g.set_state(saved["rng"])
    for _ in range(k):
        _step(model, opt, xtr, ytr, g)
    resumed = _params(model)
    monitor = state.stats().get("monitor", {})
    state.close()
    diff = max((straight[n] - resumed[n]).abs().max().item() for n in straight)
    return {"bitwise": all(torch.equal(straight[n], resumed[n]) for n in straight), "max_diff": diff,
            "state_names": sorted(saved["codec"]["params"]), "step": saved["codec"]["step"],
            "checks": monitor.get("checks", 0)}  # fmt: skip


def errors(rank: int, world: int) -> dict[str, str]:
    """What register says to bad input, on every rank."""
    out: dict[str, str] = {}

    def attempt(key: str, fn: Any) -> None:
        try:
            state = fn()
            state.close()
            out[key] = "no error"
        except (ValueError, TypeError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    attempt("disagree", lambda: sylvie_comm.fsdp.register(sharded_mlp(), "fp16", warmup_steps=2 + rank))
    attempt("lowrank", lambda: sylvie_comm.fsdp.register(sharded_mlp(), "acpsgd"))
    attempt("unknown", lambda: sylvie_comm.fsdp.register(sharded_mlp(), "zip"))
    attempt("auto_warmup", lambda: sylvie_comm.fsdp.register(sharded_mlp(), "qsgd", warmup="auto"))
    return out


def equal_to_fsdp(rank: int, world: int, hsdp: bool, force_sum: bool = False) -> dict[str, Any]:
    """Plain FSDP2 (or its HSDP) against ours with codec ``none``, a few steps: the parameters, bit for bit
    (``force_sum``: FSDP asks for SUM reduce-scatters around its own pre- and post-division)."""
    res = {}
    for codec in (None, "none"):
        mesh, kw = None, {}
        if hsdp:
            from torch.distributed.device_mesh import init_device_mesh

            full = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            mesh = full if codec is None else full["shard"]
            kw = {"replicas": full["replicate"].get_group()}
        xtr, ytr, _, _ = wl.digits_split(rank, world)
        model = sharded_mlp(0, mesh)
        if force_sum:
            model.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        state = sylvie_comm.fsdp.register(model, codec, **kw) if codec else None
        opt = wl.OPTIMIZERS["sgd_momentum"](model.parameters())
        g = torch.Generator().manual_seed(rank)
        for _ in range(4):
            _step(model, opt, xtr, ytr, g)
        res[codec or "fsdp"] = _params(model)
        if state is not None:
            res["stats"] = state.stats()
            state.close()
    same = all(torch.equal(res["fsdp"][n], res["none"][n]) for n in res["fsdp"])
    return {"bitwise": same, "stats": res["stats"]}


def rules(rank: int, world: int) -> dict[str, Any]:
    """A YAML-style configuration with per-name rules under FSDP2: the first weight raw, the last at 8 bits."""
    cfg = sylvie_comm.Config.from_dict({"codec": "qsgd", "options": {"bits": 2}, "rules": [
        {"match": "0.weight", "codec": "uncompressed"}, {"match": "4.*", "options": {"bits": 8}}]})  # fmt: skip
    xtr, ytr, _, _ = wl.digits_split(rank, world)
    model = sharded_mlp(0)
    state = sylvie_comm.fsdp.register(model, config=cfg)
    opt = wl.OPTIMIZERS["sgd_momentum"](model.parameters())
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        _step(model, opt, xtr, ytr, g)
    layouts = {s.name: (s.compress, s.options.get("bits"), s.row) for u in state.units for s in u.layout.segments}
    out = {"layouts": layouts, "names": sorted(state.state_dict()["params"]), "stats": state.stats()}
    state.close()
    return out


def tiny_mlp(mesh: Any = None, seed: int = 0) -> nn.Module:
    """8-16-4, ``fully_shard`` on each Linear and on the root: for the tests of register's checks."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    kw: dict[str, Any] = {"mesh": mesh} if mesh is not None else {}
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, **kw)
    fully_shard(model, **kw)
    return model


def _tiny_steps(model: nn.Module, rank: int, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 8, generator=g)).square().mean().backward()
        opt.step()


def _attempt(fn: Any) -> str:
    """The error of ``fn()`` as ``Type: message``, or ``no error`` (a state it returned is closed)."""
    try:
        state = fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    state.close()
    return "no error"


def register_twice(rank: int, world: int) -> dict[str, Any]:
    """A model registered twice: refused while the first state is open; after its close() a new one serves."""
    model = tiny_mlp()
    first = sylvie_comm.fsdp.register(model, "qsgd")
    out: dict[str, Any] = {
        "again": _attempt(lambda: sylvie_comm.fsdp.register(model, "fp16")),
        "unit": _attempt(lambda: sylvie_comm.fsdp.register(model[0], "fp16")),  # one of its units
    }
    _tiny_steps(model, rank, 2)
    out["first_bytes"] = first.stats()["bytes_sent"]
    first.close()
    second = sylvie_comm.fsdp.register(model, "fp16")
    first.close()  # idempotent: a closed state leaves the units of a later one alone
    _tiny_steps(model, rank, 2)
    out["second_bytes"] = second.stats()["bytes_sent"]
    out["first_bytes_after"] = first.stats()["bytes_sent"]
    second.close()
    return out


def replica_groups(rank: int, world: int) -> dict[str, Any]:
    """HSDP (4 ranks, 2 replicas of 2 shards): ``replicas`` groups that are not the replica dimension of the
    model's mesh, refused at register; the right one trains and refuses a second register; a replica group of
    another size than the shard group (a 1x4 mesh) lays the shards out by the shard group's size."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    full = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    shard, good = full["shard"], full["replicate"].get_group()
    reg = sylvie_comm.fsdp.register
    out: dict[str, Any] = {
        "world": _attempt(lambda: reg(tiny_mlp(shard), "acpsgd", replicas=dist.group.WORLD)),
        "shard_group": _attempt(lambda: reg(tiny_mlp(shard), "acpsgd", replicas=shard.get_group())),
        "native_hsdp": _attempt(lambda: reg(tiny_mlp(full), "acpsgd", replicas=good)),
        "one_d": _attempt(lambda: reg(tiny_mlp(), "acpsgd", replicas=dist.group.WORLD)),  # default 1-D mesh
    }
    model = tiny_mlp(shard)
    state = reg(model, "acpsgd", replicas=good)
    out["twice"] = _attempt(lambda: reg(model, "acpsgd", replicas=good))
    _tiny_steps(model, rank, 2)
    out["good_bytes"] = state.stats()["bytes_sent"]
    state.close()
    # One replica of four shards: the replica group has 1 rank, the shard group 4.
    wide = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    params = {}
    for codec in (None, "none"):
        model = tiny_mlp(wide["shard"])
        state = reg(model, codec, replicas=wide["replicate"].get_group()) if codec else None
        try:
            _tiny_steps(model, rank, 2)
        except ValueError as exc:
            out["wide"] = f"ValueError: {exc}"
            return out
        finally:
            if state is not None:
                state.close()
        params[codec or "fsdp"] = _params(model)
    same = all(torch.equal(params["fsdp"][n], params["none"][n]) for n in params["fsdp"])
    out["wide"] = "bitwise" if same else "differs"
    return out
