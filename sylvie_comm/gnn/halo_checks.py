"""Checks of the halo exchange: devices, matching partitions across ranks, checkpoint state and settings.

Where the exchanger and the pipeline are placed (:func:`as_device`; the trainer's
device, :func:`resolve_device`), whether a
transport's futures are CUDA-aware (:func:`uses_nccl`, :func:`cuda_aware`),
whether the ranks hold matching partitions (:func:`check_partitions`, a
collective call), and what a checkpoint must match before it loads
(:func:`partition_signature`, :func:`check_state`, :func:`check_settings`).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from sylvie_comm.collectives import ProcessGroupTransport, Transport
from sylvie_comm.config import differences
from sylvie_comm.gnn.partition import Partition


def as_device(value: Any, what: str = "halo") -> torch.device:
    """``value`` (a :class:`torch.device` or a string such as ``"cpu"``, ``"cuda:1"``, ``"meta"``) as a device.

    ``"cuda"`` without an index means the current CUDA device (when CUDA is available), so that devices
    compare equal to the ``tensor.device`` of the tensors made there.
    """
    if not isinstance(value, (str, torch.device)):
        raise ValueError(f"{what}: device must be a torch.device or a string such as 'cpu' or 'cuda:0', got {value!r}")
    try:
        device = torch.device(value)
    except RuntimeError as exc:
        raise ValueError(
            f"{what}: device must be a torch.device or a string such as 'cpu' or 'cuda:0', got {value!r} ({exc})"
        ) from exc
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # CUDA-only
    return device


def uses_nccl(backend: str | None) -> bool:
    """Whether a process group's backend (``"nccl"``, ``"gloo"``, ``"cpu:gloo,cuda:nccl"``) sends CUDA tensors
    over NCCL."""
    return backend is not None and any(b.rpartition(":")[2] == "nccl" for b in backend.split(","))


def local_rank() -> int:
    """This process's index on its machine: ``LOCAL_RANK`` from the environment (set by torchrun), else 0."""
    value = os.environ.get("LOCAL_RANK", "0")
    rank = int(value) if value.strip().isdigit() else -1
    if rank < 0:
        raise ValueError(f"gnn: LOCAL_RANK must be an integer >= 0 (this process's index on its machine), "
                         f"got {value!r}")  # fmt: skip
    return rank


def resolve_device(device: torch.device | str | None, backend: str | None = None) -> torch.device:
    """The device a :class:`~sylvie_comm.gnn.train.Trainer` trains on.

    Args:
        device: ``None`` (the default): ``cuda:LOCAL_RANK`` when CUDA is available and the ranks talk over
            NCCL (``backend``), else the CPU. Otherwise ``"cpu"``, ``"cuda"`` (the current CUDA device) or
            ``"cuda:i"`` (a string or a :class:`torch.device`).
        backend: the process group's backend (``dist.get_backend(group)``), ``None`` without one.

    Raises ValueError for another device type, a CUDA device that this process does not have, and the CPU
    on a group that is NCCL alone (NCCL carries CUDA tensors only).
    """
    if device is None:
        device = torch.device("cuda", local_rank()) if uses_nccl(backend) and torch.cuda.is_available() else "cpu"
    dev = as_device(device, "gnn")
    if dev.type == "cpu":
        if backend == "nccl":
            raise ValueError("gnn: device 'cpu' on a process group whose backend is 'nccl', which carries CUDA "
                             "tensors only; expected a CUDA device (the default, cuda:LOCAL_RANK, where CUDA is "
                             "available) or a gloo group")  # fmt: skip
        return dev
    if dev.type != "cuda":
        raise ValueError(f"gnn: device must be 'cpu', 'cuda' or 'cuda:<index>', got {str(device)!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"gnn: device {str(device)!r} asked for, but this process has no CUDA device "
                         f"(torch.cuda.is_available() is False); expected 'cpu' here")  # fmt: skip
    index = torch.cuda.current_device() if dev.index is None else dev.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"gnn: device {str(device)!r} asked for, but this process sees {count} CUDA "
                         f"device(s); expected an index in [0, {count})")  # fmt: skip
    return torch.device("cuda", index)


def cuda_aware(transport: Transport) -> bool:
    """Whether ``transport``'s futures for CUDA tensors are CUDA-aware: ``wait()`` makes the waiter's stream wait
    for the collective. So are NCCL's work futures, which the process-group transport chains; the in-process and
    Horovod transports complete plain futures once their copies are queued on the completing thread's stream."""
    return isinstance(transport, ProcessGroupTransport) and uses_nccl(str(dist.get_backend(transport.group)))


def check_partitions(part: Partition, transport: Any) -> None:
    """Fail on every rank unless the ranks hold matching partitions of one graph (a collective call).

    Rank ``r`` must send rank ``p`` exactly as many rows as ``p`` expects from
    ``r``; partitions from different runs (or a METIS labelling that differs
    between processes) would otherwise pair messages of different sizes.
    """
    mine = {"rank": part.rank, "num_parts": part.num_parts, "num_nodes": part.num_nodes,
            "send": part.send_counts, "halo": list(part.halo_counts)}  # fmt: skip
    everyone = transport.all_gather_object(mine)
    for r, info in enumerate(everyone):
        if info["rank"] != r or info["num_parts"] != len(everyone) or info["num_nodes"] != everyone[0]["num_nodes"]:
            raise ValueError(
                f"halo: rank {r} holds partition {info['rank']} of {info['num_parts']} of a {info['num_nodes']}-node "
                f"graph; expected partition {r} of {len(everyone)} of a {everyone[0]['num_nodes']}-node graph"
            )
    for r, a in enumerate(everyone):
        for p, b in enumerate(everyone):
            if a["send"][p] != b["halo"][r]:
                raise ValueError(
                    f"halo: partitions disagree: rank {r} would send {a['send'][p]} rows to rank {p}, which expects "
                    f"{b['halo'][r]}; make the partitions once (partition() then save_partitions()) and load them"
                )


def partition_signature(part: Partition) -> dict[str, Any]:
    """What identifies a partition in a checkpoint: its place, its sizes and checksums of its node ids."""

    def ids(t: torch.Tensor) -> str:
        data = t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
        return f"{t.numel()} ids, crc32 {zlib.crc32(data):08x}"

    return {"num_parts": part.num_parts, "num_nodes": part.num_nodes, "rank": part.rank, "inner": ids(part.inner),
            "halo": ids(part.halo), "send_counts": part.send_counts, "halo_counts": list(part.halo_counts)}  # fmt: skip


def check_state(what: str, state: Any, keys: set[str]) -> Mapping[str, Any]:
    """``state`` as a mapping with exactly ``keys``, or a ValueError naming what is missing or unexpected."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{what}: expected a state dict (a mapping), got {type(state).__name__}")
    missing, extra = sorted(keys - set(state)), sorted(set(state) - keys, key=str)
    if missing or extra:
        wrong = ([f"lacks {missing}"] if missing else []) + ([f"has unexpected {extra}"] if extra else [])
        raise ValueError(f"{what}: the state dict {' and '.join(wrong)}; expected the keys {sorted(keys)}")
    return state


def _field_order(mine: Mapping[str, Any], theirs: Mapping[str, Any], prefix: str = "") -> list[tuple[str, bool]]:
    """Dotted fields of two nested settings in the order of ``mine`` (its most telling first), each level
    followed by the fields only ``theirs`` has there; with each, whether only ``theirs`` has it."""
    out: list[tuple[str, bool]] = []
    for key, here in mine.items():
        out.append((f"{prefix}{key}", False))
        there = theirs.get(key)
        if isinstance(here, Mapping) and isinstance(there, Mapping):
            out += _field_order(here, there, f"{prefix}{key}.")
    return out + [(f"{prefix}{key}", True) for key in theirs if key not in mine]


def check_settings(what: str, mine: Mapping[str, Any], theirs: Any) -> None:
    """Fail, naming the first differing field, unless a checkpoint's settings equal this run's."""
    if not isinstance(theirs, Mapping):
        raise ValueError(f"{what}: the checkpoint's 'settings' must be a mapping, got {type(theirs).__name__}")
    # differences() sorts the fields by name and takes a field one side lacks for None; here the message names the
    # first differing field in this run's order, and a field only the checkpoint has always differs.
    found = {field: (here, there) for field, here, there in differences(mine, theirs)}
    for field, only_theirs in _field_order(mine, theirs):
        if field in found or only_theirs:
            here, there = found.get(field, (None, None))  # (None, None): only the checkpoint has it, as None
            raise ValueError(
                f"{what}: the checkpoint's '{field}' is {there!r} but this run's is {here!r}; resume with the "
                "configuration, world size and partition that wrote the checkpoint (each rank loads its own)"
            )
