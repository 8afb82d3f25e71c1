"""Each algorithm's declared bytes per element (its record's, read from its codec) against what its collectives send.

The Horovod optimizer sizes its fusion groups, and the FSDP benchmark orders its rows, by the declared figure; here
every algorithm averages one large matrix for two steps at 1, 2 and 4 ranks, and a :class:`Meter` that also keeps
each collective's input measures what this rank handed its collectives per element, and what it sent in the one
byte convention. They agree within the per-tensor overhead (each row's scales, a row's padding): 2 %.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import ALGORITHMS, make_algorithm
from sylvie_comm.algorithms.base import Group, Member
from sylvie_comm.collectives import Meter, Stats
from sylvie_comm.collectives.local import run_local

SHAPE = (128, 4096)  # rows of 4096: one or two scales a row
STEPS = 2  # acpsgd sends P, then Q: its rate is their mean
OVERHEAD = 1.02
MEASURED = [n for n, cls in ALGORITHMS.items() if not cls.record.delegates]


class Recording(Meter):
    """A meter that also keeps each collective's kind and input bytes."""

    def __init__(self, world_size: int, stats: Stats, step: int, inputs: list[tuple[str, int]]) -> None:
        super().__init__(world_size, stats, step)
        self.inputs = inputs

    def collective(self, kind: str, t: torch.Tensor) -> None:
        super().collective(kind, t)
        self.inputs.append((kind, t.numel() * t.element_size()))


def payload(inputs: list[tuple[str, int]]) -> int:
    """The bytes this rank handed its collectives as its own payload: all of them, but for the all-gather of the
    reduced shard that follows an all-to-all (the second phase of an all-reduce in two phases: onebit's)."""
    two_phase = any(kind == "all_to_all" for kind, _ in inputs)
    return sum(n for kind, n in inputs if not (two_phase and kind == "all_gather"))


def measure(name: str, world: int) -> list[dict[str, Any]]:
    def body(tr: Any) -> dict[str, Any]:
        alg = make_algorithm(name, tr, {})
        stats, inputs = Stats(), []
        try:
            for step in range(STEPS):
                x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7 * step + tr.rank))
                alg(Group(0, [Member("w", x)]), step, Recording(tr.world_size, stats, step, inputs)).wait()
            rate = alg.compression_rate(SHAPE, alg.options)
        finally:
            alg.close()
        sent = sum(stats.step(s).bytes_sent for s in range(STEPS))
        return {"payload": payload(inputs), "sent": sent, "rate": rate}

    return run_local(world, body)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", MEASURED)
def test_the_declared_bytes_per_element_are_what_the_collectives_send(name: str, world: int) -> None:
    record = ALGORITHMS[name].record
    numel = math.prod(SHAPE)
    for got in measure(name, world):
        # the low-rank factors' size follows the matrix's shape: their compression rate says it
        declared = 4.0 / got["rate"] if record.low_rank else record.payload_per_element({})
        per_element = got["payload"] / (STEPS * numel)
        assert declared <= per_element <= declared * OVERHEAD, (name, world, declared, per_element)
        traffic = STEPS * record.sent_bytes(numel, world) if not record.low_rank else None
        if traffic is not None:  # what it sent on the wire, as the Meter counts: its payload through its collective
            assert traffic <= got["sent"] <= traffic * OVERHEAD, (name, world, traffic, got["sent"])


def test_auto_declares_fp32_and_its_candidates_are_measured() -> None:
    """``auto`` averages each group through one of its candidates, chosen while it runs: before it runs its bytes
    are fp32's (sizing stays safe), after they are its candidate's, each measured above."""
    record = ALGORITHMS["auto"].record
    assert record.delegates and record.payload_per_element({}) == 4.0
    assert set(record.option_defaults["candidates"]) <= set(MEASURED)


def test_sign_is_sized_by_its_int8_votes() -> None:
    """sign all-reduces an int8 vote per element (votes add up on the wire): 1 byte, not the bit it was once
    declared as, which made the Horovod optimizer put 8 times too many of its tensors in a group."""
    assert ALGORITHMS["sign"].record.payload_per_element({}) == 1.0
    got = measure("sign", 2)[0]
    assert got["payload"] >= STEPS * math.prod(SHAPE)  # at least a byte per element
