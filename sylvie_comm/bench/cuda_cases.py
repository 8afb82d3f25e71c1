"""The cases of :mod:`sylvie_comm.bench.cuda`: what each op must move at the least (its floor in bytes, :data:`OPS`),
the goals (:data:`GOALS`), and one case per op, variant, dtype and size (:func:`variants`, :func:`build`): the call
through the public entry point, the sizes its floor is written in, and its ``torch`` equivalent where it has one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sylvie_comm import kernels
from sylvie_comm.algorithms.qsgd import BLOCK, merged_rows

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "uint8": torch.uint8}
FLOATS = ("fp32", "bf16")

# ---------------------------------------------------------------- what each op must move, and the goals
# The sizes a floor is written in, for one call: ``n`` elements of the op's tensor, ``s`` bytes per element of its
# dtype; ``m`` x ``k`` its matrix; ``r`` the low rank; ``packed`` the bytes of the packed code (one-bit: ceil(n / 8);
# q-bit: ``groups`` rows of ceil(k * bits / 8)); ``chunks`` the one-bit scales (one fp32 each); ``groups`` the q-bit
# rows (a scale and a minimum, fp32, each); ``w`` the one-bit rows averaged by the server's error-fed encode.
# Residuals, factors and scales are fp32 (4 bytes); the q-bit codes and sign bits pack whole.


@dataclass(frozen=True)
class Op:
    """One op of the bench: the least it must move (bytes, over the sizes above), its goal, its input dtypes."""

    floor: str  # bytes, an expression over the sizes above
    what: str  # the floor in words
    goal: str | None = None  # a key of GOALS
    dtypes: tuple[str, ...] = FLOATS


OPS: dict[str, Op] = {
    "onebit_encode": Op("s*n + packed + 4*chunks", "read x; write the sign bits and the scales", "onebit"),
    "onebit_decode": Op("packed + 4*chunks + s*n", "read the bits and scales; write x", "onebit"),
    "onebit_feedback_encode": Op(
        "4*n + s*n + 4*n + packed + 4*chunks",
        "read the residual and the gradient; write the residual, the bits and the scales",
        "onebit",
    ),
    "onebit_mean_feedback_encode": Op(
        "4*n + w*(packed + 4*chunks) + 4*n + packed + 4*chunks",
        "read the residual and w one-bit rows; write the residual, the bits and the scales",
        "onebit",
        ("fp32",),
    ),
    "qbit_encode": Op("s*n + packed + 8*groups", "read x; write the codes and a scale and minimum per row", "qbit"),
    "qbit_decode": Op("packed + 8*groups + s*n", "read the codes, scales and minimums; write x", "qbit"),
    "pack_bits": Op("n + packed", "read one byte per value; write the packed codes", None, ("uint8",)),
    "unpack_bits": Op("packed + n", "read the packed codes; write one byte per value", None, ("uint8",)),
    "copy_if": Op("2*s*n", "the flag set: read src; write dst"),
    "lowrank_project": Op(
        "4*n + s*n + 4*n + 4*r*(m + k)", "read the residual and the gradient; write the residual; read q, write p",
        "lowrank",
    ),
    "lowrank_gram": Op("4*n + 4*r*(m + k)", "read the residual; read p, write q", "lowrank", ("fp32",)),
    "lowrank_gram_grad": Op(
        "4*n + s*n + 4*n + 4*r*(m + k)", "read the residual and the gradient; write the residual; read p, write q",
        "lowrank",
    ),
    "lowrank_outer_into": Op("4*n + 4*r*(m + k)", "write out; read p and q", "lowrank", ("fp32",)),
    "lowrank_outer_into_accumulate": Op("8*n + 4*r*(m + k)", "read and write out; read p and q", "lowrank", ("fp32",)),
}  # fmt: skip


@dataclass(frozen=True)
class Goal:
    text: str
    of_copy_rate: float | None = None  # at least this fraction of the copy rate
    within: float | None = None  # at most this many times min(floor's time, torch.matmul's time)


GOALS = {
    "onebit": Goal("one-bit encode (plain and error-fed) and decode >= 0.6 of the copy rate", of_copy_rate=0.6),
    "qbit": Goal("q-bit encode and decode >= 0.6 of the copy rate", of_copy_rate=0.6),
    "lowrank": Goal("low-rank steps <= 1.5x their floor's time, or torch.matmul's where that is faster", within=1.5),
}


def floor_bytes(op: str, sizes: dict[str, float]) -> float:
    """The bytes ``op`` must move at the least for one call of these sizes (:data:`OPS`)."""
    return float(eval(OPS[op].floor, {"__builtins__": {}}, sizes))


# ---------------------------------------------------------------- the cases: one op, its variant, one size


@dataclass(frozen=True)
class Variant:
    """A row of the record: an op of :data:`OPS` with its arguments (q-bit width and layout, bits packed)."""

    name: str
    op: str
    bits: int = 0
    block: bool = False  # q-bit: a scale per BLOCK values (qsgd's reduce-scatter form), not per matrix row
    into: bool = False  # decode: into a given tensor (what the integrations call), not a new one
    subtract: bool = False  # lowrank_project: residual -= p q^T too (acpsgd's step; powersgd's has none)


def variants() -> list[Variant]:
    """Every row: each op of :data:`OPS` once, the q-bit ops at 2, 4 and 8 bits in both layouts, bit packing at 1
    and 4 bits, ``onebit_decode`` and ``qbit_decode`` into a given tensor (what the integrations call) and
    allocating their result (once)."""
    out = [
        Variant("onebit_encode", "onebit_encode"),
        Variant("onebit_decode", "onebit_decode", into=True),
        Variant("onebit_decode_alloc", "onebit_decode"),
        Variant("onebit_feedback_encode", "onebit_feedback_encode"),
        Variant("onebit_mean_feedback_encode", "onebit_mean_feedback_encode"),
    ]
    for bits in (2, 4, 8):
        for block, layout in ((False, "row"), (True, "block")):
            out.append(Variant(f"qbit{bits}_encode_{layout}", "qbit_encode", bits, block))
            out.append(Variant(f"qbit{bits}_decode_{layout}", "qbit_decode", bits, block, into=True))
    out.append(Variant("qbit4_decode_alloc_row", "qbit_decode", 4))
    out += [Variant(f"pack_bits{b}", "pack_bits", b) for b in (1, 4)]
    out += [Variant(f"unpack_bits{b}", "unpack_bits", b) for b in (1, 4)]
    out.append(Variant("copy_if", "copy_if"))
    out += [
        Variant("lowrank_project", "lowrank_project"),
        Variant("lowrank_project_subtract", "lowrank_project", subtract=True),
        Variant("lowrank_gram", "lowrank_gram"),
        Variant("lowrank_gram_grad", "lowrank_gram_grad"),
        Variant("lowrank_outer_into", "lowrank_outer_into"),
        Variant("lowrank_outer_into_accumulate", "lowrank_outer_into_accumulate"),
    ]
    return out


@dataclass
class Case:
    """One variant at one size and dtype, its tensors made: the call, its torch.matmul equivalent, its sizes."""

    call: Callable[[], Any]
    shape: tuple[int, ...]
    sizes: dict[str, float]
    matmul: Callable[[], Any] | None = None


@dataclass(frozen=True)
class Setting:
    """What every case of a run shares."""

    device: torch.device
    rank: int
    chunk: int  # one-bit values per scale (the one-bit algorithm's default)
    norm_scale: bool  # one-bit scale: RMS (the algorithm's default) or mean |x|
    parts: int  # w, the rows of the one-bit server's mean


def _randn(shape: tuple[int, ...], setting: Setting, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=setting.device).mul_(scale)


def build(v: Variant, dtype: str, rows: int, cols: int, setting: Setting, gen: torch.Generator) -> Case:
    """The tensors and the call of ``v`` on a ``rows x cols`` input of ``dtype`` (flat or re-laid as the op takes
    it), on the setting's device; called through :mod:`sylvie_comm.kernels` only."""
    dt = DTYPES[dtype]
    n = rows * cols
    s = torch.empty((), dtype=dt).element_size()
    sizes: dict[str, float] = {"n": n, "s": s, "m": rows, "k": cols, "r": setting.rank, "w": setting.parts}
    sizes["chunks"] = -(-n // setting.chunk)
    if v.op.startswith("onebit"):
        sizes["packed"] = -(-n // 8)
        return _onebit(v, dt, n, sizes, setting, gen)
    if v.op.startswith("qbit"):
        m, k = merged_rows(n, 1, BLOCK) if v.block else (rows, cols)
        sizes.update(m=m, k=k, groups=m, packed=m * -(-k * v.bits // 8))
        x = _randn((m, k), setting, gen).to(dt)
        if v.op == "qbit_encode":
            return Case(lambda: kernels.qbit_encode(x, v.bits, 1, 0), (m, k), sizes)
        packed, scale, minimum = kernels.qbit_encode(x, v.bits, 1, 0)
        out = torch.empty_like(x) if v.into else None
        return Case(lambda: kernels.qbit_decode(packed, scale, minimum, v.bits, k, dt, out=out), (m, k), sizes)
    if v.op in ("pack_bits", "unpack_bits"):
        sizes["packed"] = rows * -(-cols * v.bits // 8)
        values = torch.randint(0, 1 << v.bits, (rows, cols), generator=gen, device=setting.device, dtype=torch.uint8)
        if v.op == "pack_bits":
            return Case(lambda: kernels.pack_bits(values, v.bits), (rows, cols), sizes)
        packed = kernels.pack_bits(values, v.bits)
        return Case(lambda: kernels.unpack_bits(packed, v.bits, cols), (rows, cols), sizes)
    if v.op == "copy_if":
        dst, src = torch.empty(n, dtype=dt, device=setting.device), _randn((n,), setting, gen).to(dt)
        flag = torch.ones(1, dtype=torch.bool, device=setting.device)
        return Case(lambda: kernels.copy_if(dst, src, flag), (n,), sizes)
    return _lowrank(v, dt, rows, cols, sizes, setting, gen)


def _onebit(v: Variant, dt: torch.dtype, n: int, sizes: dict[str, float], setting: Setting,
            gen: torch.Generator) -> Case:  # fmt: skip
    chunk, norm = setting.chunk, setting.norm_scale
    dev = setting.device
    if v.op == "onebit_encode":
        x = _randn((n,), setting, gen).to(dt)
        return Case(lambda: kernels.onebit_encode(x, chunk, norm), (n,), sizes)
    if v.op == "onebit_decode":
        packed, scales = kernels.onebit_encode(_randn((n,), setting, gen), chunk, norm)
        out = torch.empty(n, dtype=dt, device=dev) if v.into else None
        return Case(lambda: kernels.onebit_decode(packed, scales, n, chunk, dt, out=out), (n,), sizes)
    residual = _randn((n,), setting, gen, 0.01)
    bits = torch.empty(int(sizes["packed"]), dtype=torch.uint8, device=dev)
    scales = torch.empty(int(sizes["chunks"]), device=dev)
    if v.op == "onebit_feedback_encode":
        grad = _randn((n,), setting, gen, 0.01).to(dt)
        return Case(lambda: kernels.onebit_feedback_encode(residual, grad, chunk, norm, bits, scales), (n,), sizes)
    w = setting.parts
    parts = torch.randint(0, 256, (w, int(sizes["packed"])), generator=gen, device=dev, dtype=torch.uint8)
    parts_scales = torch.rand((w, int(sizes["chunks"])), generator=gen, device=dev).mul_(0.01)
    return Case(
        lambda: kernels.onebit_mean_feedback_encode(residual, parts, parts_scales, chunk, norm, bits, scales),
        (n,), sizes,
    )  # fmt: skip


def _lowrank(v: Variant, dt: torch.dtype, m: int, k: int, sizes: dict[str, float], setting: Setting,
             gen: torch.Generator) -> Case:  # fmt: skip
    """A low-rank step and its torch.matmul equivalent (:mod:`sylvie_comm.kernels.reference`'s arithmetic, one
    torch op at a time), each on its own tensors of the same shapes."""
    r = setting.rank

    def tensors() -> tuple[torch.Tensor, ...]:
        e = _randn((m, k), setting, gen, 0.01)
        g = _randn((m, k), setting, gen, 0.01).to(dt)
        # q's columns near orthonormal (as the algorithms' are): residual -= (residual q) q^T, repeated, stays bounded
        q, p = _randn((k, r), setting, gen, k**-0.5), _randn((m, r), setting, gen, 0.01)
        return e, g, q, p

    e, g, q, p = tensors()
    e2, g2, q2, p2 = tensors()
    shape = (m, k)
    if v.op == "lowrank_project":
        subtract = v.subtract

        def project() -> None:
            e2.add_(g2)
            torch.mm(e2, q2, out=p2)
            if subtract:
                e2.addmm_(p2, q2.T, alpha=-1)

        return Case(lambda: kernels.lowrank_project(e, g, q, p, subtract), shape, sizes, project)
    if v.op in ("lowrank_gram", "lowrank_gram_grad"):
        grad, grad2 = (g, g2) if v.op == "lowrank_gram_grad" else (None, None)

        def gram() -> None:
            if grad2 is not None:
                e2.add_(grad2)
            torch.mm(e2.T, p2, out=q2)

        return Case(lambda: kernels.lowrank_gram(e, grad, p, q), shape, sizes, gram)
    if v.op == "lowrank_outer_into":
        return Case(lambda: kernels.lowrank_outer_into(e, p, q, 1.0, False), shape, sizes,
                    lambda: torch.mm(p2, q2.T, out=e2))  # fmt: skip
    return Case(lambda: kernels.lowrank_outer_into(e, p, q, -1.0, True), shape, sizes,
                lambda: e2.addmm_(p2, q2.T, alpha=-1))  # fmt: skip
