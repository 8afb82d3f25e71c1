"""Check a partition's fields against every invariant its consumers rely on.

:func:`check_partition` checks a :class:`~sylvie_comm.gnn.part.Partition`;
``_check_state`` checks the fields read back from a part file (and the sizes
``meta.json`` records for it) before they become one, so a damaged or tampered
file is a ValueError naming the file and the field, never out-of-range indices
in the message passing. Every field, cheaply: a few vectorized passes over the
edges, no Python loop over them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

import torch

from sylvie_comm.gnn.part import Partition

_TENSOR_FIELDS = ("inner", "halo", "src", "dst", "in_degree", "out_degree")
_NDATA_KINDS = {"feat": "floating", "label": "integer", "train_mask": "bool", "val_mask": "bool", "test_mask": "bool"}


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} ({value.layout})"
    return f"{type(value).__name__} {value!r}"[:120]


def _ids(where: str, name: str, t: Any, lo: int, hi: int, length: int | None = None) -> torch.Tensor:
    """``t`` as a 1-D dense int64 tensor of ids in ``[lo, hi)`` (and of ``length`` elements), else ValueError."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dtype != torch.int64 or t.dim() != 1:
        raise ValueError(f"{where}: field '{name}' must be a 1-D int64 tensor, got {_describe(t)}")
    if length is not None and t.numel() != length:
        raise ValueError(f"{where}: field '{name}' must hold {length} ids, got {t.numel()}")
    if t.numel():
        low, high = (int(v) for v in torch.aminmax(t))
        if low < lo or high >= hi:
            raise ValueError(f"{where}: field '{name}' must hold ids in [{lo}, {hi}), got ids in [{low}, {high}]")
    return t


def _check_state(
    state: Any, where: str, rank: int, num_parts: int, num_nodes: int, record: Mapping[str, Any] | None = None
) -> Partition:
    """The :class:`Partition` of the fields ``state``, checked against every invariant its consumers rely on.

    ``where`` names the file (or the part) in the ValueError. ``record`` is the part's entry in ``meta.json``.
    """
    _check_fields(state, where, rank, num_parts, num_nodes)
    inner = _check_inner(where, state["inner"], num_nodes)
    halo = _check_halo(where, state["halo"], state["halo_counts"], rank, num_parts, num_nodes, inner)
    n_inner = int(inner.numel())
    _check_send_idx(where, state["send_idx"], rank, num_parts, n_inner)
    _check_block(where, state, n_inner, n_inner + int(halo.numel()))
    _check_ndata(where, state["ndata"], n_inner)
    part = Partition(**state)
    if record is not None:
        for key, value in part.record().items():
            if record.get(key) != value:
                raise ValueError(f"{where}: its {key} is {value!r} but meta.json records {record.get(key)!r}")
    return part


def _check_fields(state: Any, where: str, rank: int, num_parts: int, num_nodes: int) -> None:
    """``state`` holds exactly the Partition's fields, with this part's rank, part count and node count."""
    if not isinstance(state, dict):
        raise ValueError(f"{where}: expected a dict of Partition fields, got {type(state).__name__}")
    fields = set(Partition.__dataclass_fields__)
    missing, extra = sorted(fields - set(state)), sorted(set(state) - fields, key=str)
    if missing or extra:
        wrong = ([f"lacks the fields {missing}"] if missing else []) + (
            [f"has unexpected fields {extra}"] if extra else []
        )
        raise ValueError(f"{where}: {' and '.join(wrong)}; expected exactly {sorted(fields)}")
    for name, expected in (("rank", rank), ("num_parts", num_parts), ("num_nodes", num_nodes)):
        if not _is_int(state[name]) or state[name] != expected:
            raise ValueError(f"{where}: field '{name}' must be the integer {expected}, got {_describe(state[name])}")


def _check_inner(where: str, value: Any, num_nodes: int) -> torch.Tensor:
    """The inner nodes: at least one, strictly ascending ids of the graph."""
    inner = _ids(where, "inner", value, 0, num_nodes)
    if inner.numel() == 0:
        raise ValueError(f"{where}: field 'inner' is empty; expected at least one inner node")
    if inner.numel() > 1 and not bool((inner[1:] > inner[:-1]).all()):
        raise ValueError(f"{where}: field 'inner' must be strictly ascending")
    return inner


def _check_halo(
    where: str, value: Any, halo_counts: Any, rank: int, num_parts: int, num_nodes: int, inner: torch.Tensor
) -> torch.Tensor:
    """The halo nodes: ``halo_counts`` per owner (none of this part's own), ascending within each owner's
    group, none of them inner."""
    if (not isinstance(halo_counts, list) or len(halo_counts) != num_parts
            or not all(_is_int(c) and c >= 0 for c in halo_counts)):  # fmt: skip
        raise ValueError(f"{where}: field 'halo_counts' must be a list of {num_parts} counts >= 0, "
                         f"got {_describe(halo_counts)}")  # fmt: skip
    if halo_counts[rank] != 0:
        raise ValueError(f"{where}: field 'halo_counts' must be 0 for the part's own rank {rank}, "
                         f"got {halo_counts[rank]}")  # fmt: skip
    halo = _ids(where, "halo", value, 0, num_nodes, length=sum(halo_counts))
    n_halo, n_inner = int(halo.numel()), int(inner.numel())
    if n_halo > 1:
        rising = halo[1:] > halo[:-1]
        starts = torch.tensor(halo_counts, dtype=torch.int64).cumsum(0)[:-1]
        rising[starts[(starts > 0) & (starts < n_halo)] - 1] = True  # a new owner's group may start lower
        if not bool(rising.all()):
            raise ValueError(f"{where}: field 'halo' must be ascending within each owner's group "
                             "(groups sized by 'halo_counts')")  # fmt: skip
    if n_halo:
        at = torch.searchsorted(inner, halo).clamp(max=n_inner - 1)
        if bool((inner[at] == halo).any()):
            raise ValueError(f"{where}: field 'halo' holds ids that are also in 'inner'; expected remote nodes only")
    return halo


def _check_send_idx(where: str, send_idx: Any, rank: int, num_parts: int, n_inner: int) -> None:
    """What the part sends each peer: inner rows, nothing to itself."""
    if not isinstance(send_idx, list) or len(send_idx) != num_parts:
        raise ValueError(f"{where}: field 'send_idx' must be a list of {num_parts} tensors, got {_describe(send_idx)}")
    for p, t in enumerate(send_idx):
        _ids(where, f"send_idx[{p}]", t, 0, n_inner)
    if send_idx[rank].numel():
        raise ValueError(f"{where}: field 'send_idx[{rank}]' must be empty (a part sends nothing to itself)")


def _check_block(where: str, state: Mapping[str, Any], n_inner: int, n_src: int) -> None:
    """The block's edges (sources among inner and halo rows, destinations inner) and the degrees they imply."""
    src = _ids(where, "src", state["src"], 0, n_src)
    dst = _ids(where, "dst", state["dst"], 0, n_inner, length=int(src.numel()))
    in_degree = _ids(where, "in_degree", state["in_degree"], 0, 2**62, length=n_inner)
    if not torch.equal(in_degree, torch.bincount(dst, minlength=n_inner)):
        raise ValueError(f"{where}: field 'in_degree' must count the block's in-edges of each inner node "
                         "(the block holds all of them)")  # fmt: skip
    out_degree = _ids(where, "out_degree", state["out_degree"], 0, 2**62, length=n_src)
    if bool((out_degree < torch.bincount(src, minlength=n_src)).any()):
        raise ValueError(f"{where}: field 'out_degree' must be at least each source's out-edges in the block")


def _check_ndata(where: str, ndata: Any, n_inner: int) -> None:
    """Node data: a dense tensor of one row per inner node each, of its kind (:data:`_NDATA_KINDS`)."""
    if not isinstance(ndata, dict):
        raise ValueError(f"{where}: field 'ndata' must be a dict of tensors, got {_describe(ndata)}")
    for k, v in ndata.items():
        name = f"ndata[{k!r}]"
        if not isinstance(k, str):
            raise ValueError(f"{where}: field 'ndata' must have string keys, got {k!r}")
        if not isinstance(v, torch.Tensor) or v.layout != torch.strided or v.dim() < 1 or v.shape[0] != n_inner:
            raise ValueError(f"{where}: field '{name}' must be a dense tensor of {n_inner} rows (one per inner "
                             f"node), got {_describe(v)}")  # fmt: skip
        kind = _NDATA_KINDS.get(k)
        ok = {"floating": v.dtype.is_floating_point and v.dim() == 2,
              "integer": not v.dtype.is_floating_point and not v.dtype.is_complex and v.dtype != torch.bool
              and v.dim() == 1, "bool": v.dtype == torch.bool and v.dim() == 1, None: True}[kind]  # fmt: skip
        if not ok:
            shape = "(n_inner, F)" if kind == "floating" else "(n_inner,)"
            raise ValueError(f"{where}: field '{name}' must be a {kind} tensor of shape {shape}, got {_describe(v)}")


def check_partition(part: Partition) -> Partition:
    """``part`` if all its fields hold together (ids in range, sizes consistent), else a ValueError naming the
    field. :func:`load_partition` applies it to every part it reads, :func:`save_partitions` to every part."""
    where = f"partition: part {part.rank}"
    _check_state(part.state(), where, part.rank, part.num_parts, part.num_nodes)
    return part
