"""The reduce-scatter form (sharded data parallel): each rank ends with its shard of the average.

In one process through the in-process transport at 1, 2 and 4 ranks: plain averaging exact, the 16-bit
casts summed in fp32 (rounded once), the wire bytes exact against the fp32 reduce-scatter's, buffers on
the ``meta`` device, and the algorithms without a form refused with the reason.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import ALGORITHMS, make_algorithm
from sylvie_comm.collectives import Stats, wire_bytes
from sylvie_comm.collectives.local import run_local

WORLDS = [1, 2, 4]
SHARD = 37  # elements per rank: not a multiple of anything the codecs care about


def inputs(rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(world * SHARD, generator=g) * 3


def shards(name: str, world: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, Any]]:
    def body(tr: Any) -> tuple[torch.Tensor, Any]:
        alg, stats = make_algorithm(name, tr, {}), Stats()
        out = torch.empty(SHARD, dtype=dtype)
        alg.reduce_scatter(inputs(tr.rank, world).to(dtype), out, 0, stats.meter(0, world)).wait()
        alg.close()
        return out, stats.step(0)

    return run_local(world, body)


@pytest.mark.parametrize("world", WORLDS)
def test_plain_averaging_gives_each_rank_its_exact_shard_of_the_mean(world):
    for rank, (out, st) in enumerate(shards("none", world)):
        expected = inputs(0, world) / world
        for r in range(1, world):  # the in-process transport adds in rank order
            expected += inputs(r, world) / world
        assert torch.equal(out, expected[rank * SHARD : (rank + 1) * SHARD])
        assert st.bytes_sent == wire_bytes("reduce_scatter", 4 * world * SHARD, world) == st.bytes_uncompressed


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name,half", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_the_casts_send_16_bits_and_add_them_up_in_fp32_once(world, name, half):
    for rank, (out, st) in enumerate(shards(name, world)):
        # What each rank sent, x / w in 16 bits, added up in fp32 in rank order: rounded once, at the end.
        expected = torch.zeros(SHARD)
        for r in range(world):
            expected += (inputs(r, world) / world).to(half)[rank * SHARD : (rank + 1) * SHARD].float()
        assert torch.equal(out, expected)
        exact = sum(inputs(r, world).double() for r in range(world))[rank * SHARD : (rank + 1) * SHARD] / world
        tol = 1e-3 if half == torch.float16 else 1e-2
        torch.testing.assert_close(out.double(), exact, rtol=tol, atol=tol)
        assert st.bytes_sent == wire_bytes("all_to_all", 2 * world * SHARD, world)  # a 16-bit reduce-scatter's
        assert st.bytes_uncompressed == wire_bytes("reduce_scatter", 4 * world * SHARD, world)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_a_bf16_shard_takes_the_average_too(name):
    """FSDP's ``reduce_dtype`` may be bf16: input and output in bf16, the result that of fp32 rounded."""
    got = shards(name, 2, torch.bfloat16)
    exact = (inputs(0, 2).bfloat16().double() + inputs(1, 2).bfloat16().double()) / 2
    for rank, (out, _) in enumerate(got):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), exact[rank * SHARD : (rank + 1) * SHARD], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_the_shard_stays_on_the_inputs_device(name):
    def body(tr: Any) -> torch.Tensor:
        alg = make_algorithm(name, tr, {})
        out = torch.empty(SHARD, device="meta")
        alg.reduce_scatter(torch.empty(2 * SHARD, device="meta"), out, 0).wait()
        alg.close()
        return out

    assert all(out.device.type == "meta" for out in run_local(2, body))


def test_algorithms_without_a_form_are_refused_with_the_reason():
    having = [n for n, cls in ALGORITHMS.items() if cls.shards]
    assert having == ["none", "fp16", "bf16"]

    def body(tr: Any) -> dict[str, str]:
        said = {}
        for name in ALGORITHMS:
            alg = make_algorithm(name, tr, {})
            try:
                alg.reduce_scatter(torch.zeros(2 * SHARD), torch.empty(SHARD), 0)
            except ValueError as exc:
                said[name] = str(exc)
            finally:
                alg.close()
        return said

    said = run_local(2, body)[0]
    assert set(said) == set(ALGORITHMS) - set(having)
    for name in ("acpsgd", "powersgd"):
        assert said[name].startswith(f"{name}: no reduce-scatter form (it factors whole matrices")
        assert "HSDP" in said[name] and said[name].endswith("algorithms with one: none, fp16, bf16")
    assert "its encoding has no reduce-scatter form yet" in said["onebit"]


def test_buffers_that_do_not_fit_are_refused():
    def body(tr: Any) -> list[str]:
        alg, said = make_algorithm("fp16", tr, {}), []
        for flat, out in ((torch.zeros(5), torch.empty(2)), (torch.zeros(4, dtype=torch.int32), torch.empty(2))):
            with pytest.raises(ValueError) as exc:
                alg.reduce_scatter(flat, out, 0)
            said.append(str(exc.value))
        alg.close()
        return said

    first, second = run_local(2, body)[0]
    assert "input has 5 elements, expected world_size * out.numel() = 2 * 2 = 4" in first
    assert "floating-point input and output on one device, got torch.int32 on cpu" in second
