"""The ops' calls at the benchmark's shapes: the target, the shapes and the rules' constants, one row of
:data:`OP_CALLS` per declared op, and the GPU's host choices made during the capture."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from sylvie_comm.kernels.triton import NAMESPACE, load

Json = Any  # what json.loads returns
Shape = tuple[int, int]

# ---------------------------------------------------------------- the target, the shapes, the rules' constants

TARGET = ("cuda", 90, 32)  # GPUTarget: an H100 or H200 (sm_90), warps of 32 threads
SMS = 132  # streaming multiprocessors of an H100 SXM and of an H200
BIG = "8192x8192"
SHAPES: dict[str, Shape] = {BIG: (8192, 8192), "64K": (256, 256)}  # 1-D ops take them flattened
MIN_PROGRAMS = 2 * SMS
MIN_ACCESS_BYTES = 4
F64_OUTSIDE_LOOPS = 64

# The benchmark's choices.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CHUNK_SIZE = 2048  # one-bit chunk, with the norm scale
NORM_SCALE = True
QBIT_CASES = ((4, "fp32"), (4, "fp16"), (4, "bf16"), (2, "fp32"), (8, "fp32"))  # (bits, dtype)
RANK = 4
WORLD = 4  # one-bit rows averaged by onebit_mean_feedback_encode

# Kernels that move too few bytes for the bulk rules, by "family.kernel" name, with why.
TAIL_KERNELS: dict[str, str] = {
    "qbit._encode_meta_kernel": "combines each row's per-segment min/max keys into its scale: one key per segment",
    "lowrank._reduce_kernel": "adds gram's per-slab subtrees of q by the rest of the tree (k x rank values a slab)",
}

# Bulk kernels excused from one rule, each with the reason (shown in the report; a name no op launches fails the test).
EXCUSED: dict[str, dict[str, str]] = {
    "qbit._encode_quantize_kernel": {
        "no-barrier-in-loops": "the long-row path only (rows over 16,384 columns): one shared-memory round trip per "
        "4,096-column step to lay the packed words out for their stores, about an eighth of the input's bytes",
    },
}


# ---------------------------------------------------------------- the ops' calls at the benchmark's shapes


class Pool:
    """CPU tensors by role, shape and dtype, made once (``torch.empty``: never written, so no memory is touched)."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def get(self, role: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        key = (role, shape, dtype)
        if key not in self._made:
            self._made[key] = torch.empty(shape, dtype=dtype)
        return self._made[key]


Calls = list[tuple[str, tuple[Any, ...]]]  # (label, the op's arguments)


def _onebit_coded(pool: Pool, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    packed = pool.get("packed", ((n + 7) // 8,), torch.uint8)
    return packed, pool.get("scales", (-(-n // CHUNK_SIZE),))


def _onebit_encode(pool: Pool, shape: Shape) -> Calls:
    return [(d, (pool.get("x", shape, t).view(-1), CHUNK_SIZE, NORM_SCALE)) for d, t in DTYPES.items()]


def _onebit_decode(pool: Pool, shape: Shape) -> Calls:
    n = shape[0] * shape[1]
    return [(d, (*_onebit_coded(pool, n), n, CHUNK_SIZE, t)) for d, t in DTYPES.items()]


def _onebit_decode_into(pool: Pool, shape: Shape) -> Calls:
    coded = _onebit_coded(pool, shape[0] * shape[1])
    return [(d, (*coded, CHUNK_SIZE, pool.get("out", shape, t).view(-1))) for d, t in DTYPES.items()]


def _onebit_feedback_encode(pool: Pool, shape: Shape) -> Calls:
    residual = pool.get("residual", shape).view(-1)
    coded = _onebit_coded(pool, residual.numel())
    return [(f"{d} grad", (residual, pool.get("grad", shape, t).view(-1), CHUNK_SIZE, NORM_SCALE, *coded))
            for d, t in DTYPES.items()]  # fmt: skip


def _onebit_mean_feedback_encode(pool: Pool, shape: Shape) -> Calls:
    residual = pool.get("residual", shape).view(-1)
    n = residual.numel()
    parts = pool.get("parts", (WORLD, (n + 7) // 8), torch.uint8), pool.get("part_scales", (WORLD, -(-n // CHUNK_SIZE)))
    coded = _onebit_coded(pool, n)
    return [(f"fp32, {WORLD} rows", (residual, *parts, CHUNK_SIZE, NORM_SCALE, *coded))]


def _qbit_coded(pool: Pool, shape: Shape, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packed = pool.get(f"q{bits}", (shape[0], -(-shape[1] * bits // 8)), torch.uint8)
    return packed, pool.get("scale", (shape[0],)), pool.get("minimum", (shape[0],))


def _qbit_encode(pool: Pool, shape: Shape) -> Calls:
    calls: Calls = [(f"{d}, {b} bits", (pool.get("x", shape, DTYPES[d]), b, 1, 0, torch.float32))
                    for b, d in QBIT_CASES]  # fmt: skip
    # the same tensor as one row (a flattened bias, a whole bucket): the long-row path, split over programs
    calls.append(("fp32, 4 bits, one row", (pool.get("x", shape).view(1, -1), 4, 1, 0, torch.float32)))
    return calls


def _qbit_decode(pool: Pool, shape: Shape) -> Calls:
    return [(f"{d}, {b} bits", (*_qbit_coded(pool, shape, b), b, shape[1], DTYPES[d])) for b, d in QBIT_CASES]


def _qbit_decode_into(pool: Pool, shape: Shape) -> Calls:
    return [
        (f"{d}, {b} bits", (*_qbit_coded(pool, shape, b), b, pool.get("out", shape, DTYPES[d]))) for b, d in QBIT_CASES
    ]


def _pack_bits(pool: Pool, shape: Shape) -> Calls:
    return [(f"{b} bits", (pool.get("values", shape, torch.uint8), b)) for b in (4, 2, 8)]


def _unpack_bits(pool: Pool, shape: Shape) -> Calls:
    return [(f"{b} bits", (_qbit_coded(pool, shape, b)[0], b, shape[1])) for b in (4, 2, 8)]


def _copy_if(pool: Pool, shape: Shape) -> Calls:
    flag = pool.get("flag", (1,), torch.bool)
    return [("fp32", (pool.get("out", shape), pool.get("x", shape), flag))]


def _factors(pool: Pool, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    return pool.get("p", (shape[0], RANK)), pool.get("q", (shape[1], RANK))


def _lowrank_project(pool: Pool, shape: Shape) -> Calls:
    p, q = _factors(pool, shape)
    return [(f"fp32, rank {RANK}, grad, subtract", (pool.get("residual", shape), pool.get("grad", shape), q, p, True))]


def _lowrank_gram(pool: Pool, shape: Shape) -> Calls:
    p, q = _factors(pool, shape)
    return [(f"fp32, rank {RANK}", (pool.get("residual", shape), None, p, q))]


def _lowrank_outer_into(pool: Pool, shape: Shape) -> Calls:
    p, q = _factors(pool, shape)
    return [(f"fp32, rank {RANK}", (pool.get("out", shape), p, q, 1.0, False))]


# op -> its calls at one shape. Every op of the namespace must have an entry (the test checks both ways).
OP_CALLS: dict[str, Callable[[Pool, Shape], Calls]] = {
    "onebit_encode": _onebit_encode,
    "onebit_decode": _onebit_decode,
    "onebit_decode_into": _onebit_decode_into,
    "onebit_feedback_encode": _onebit_feedback_encode,
    "onebit_mean_feedback_encode": _onebit_mean_feedback_encode,
    "qbit_encode": _qbit_encode,
    "qbit_decode": _qbit_decode,
    "qbit_decode_into": _qbit_decode_into,
    "pack_bits": _pack_bits,
    "unpack_bits": _unpack_bits,
    "copy_if": _copy_if,
    "lowrank_project": _lowrank_project,
    "lowrank_gram": _lowrank_gram,
    "lowrank_outer_into": _lowrank_outer_into,
}


def registered_ops() -> list[str]:
    """The ops of ``torch.ops.sylvie_comm_triton`` (the families loaded first)."""
    load()
    prefix = f"{NAMESPACE}::"
    names = {s.name[len(prefix) :] for s in torch._C._jit_get_all_schemas() if s.name.startswith(prefix)}
    return sorted(names)


# ---------------------------------------------------------------- the GPU's host choices, made during the capture


@dataclasses.dataclass(frozen=True)
class CudaChoice:
    """A host function whose answer differs on a GPU, replaced during the capture by the GPU's answer."""

    module: str
    attribute: str
    make: Callable[[ModuleType], Callable[..., Any]]  # the module -> the replacement
    reason: str


CUDA_CHOICES = (
    CudaChoice(
        "sylvie_comm.kernels.triton.lowrank",
        "_target_programs",
        lambda m: lambda device: SMS * m.PROGRAMS_PER_SM,
        "the low-rank ops split a sum over more programs when too few would fill the GPU (SMs x PROGRAMS_PER_SM); "
        "for CPU tensors they never do",
    ),
    CudaChoice(
        "sylvie_comm.kernels.triton.qbit",
        "_nan_bf16",
        lambda m: lambda device: -1,
        "the q-bit decode's NAN_BF16 is -1 on a GPU (the GPU's own conversion), torch's CPU NaN bits on CPU tensors",
    ),
)


@contextlib.contextmanager
def cuda_choices(notes: list[str]) -> Iterator[None]:
    undo: list[tuple[ModuleType, str, Any]] = []
    try:
        for choice in CUDA_CHOICES:
            module = sys.modules.get(choice.module)
            if module is None or not hasattr(module, choice.attribute):
                notes.append(f"GPU choice not applied ({choice.module}.{choice.attribute} is gone): {choice.reason}")
                continue
            undo.append((module, choice.attribute, getattr(module, choice.attribute)))
            setattr(module, choice.attribute, choice.make(module))
            notes.append(f"GPU choice applied ({choice.module}.{choice.attribute}): {choice.reason}")
        yield
    finally:
        for module, name, value in reversed(undo):
            setattr(module, name, value)
