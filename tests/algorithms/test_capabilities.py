"""What an algorithm can do is declared in its class's record, and every list of algorithms elsewhere is read from
the registry.

The records declare their bytes per element (their codec's), whether they average a momentum, whether they send
low-rank factors, their reduce-scatter form or why they have none; these tests pin the figures the integrations and
benchmarks read, and check that what reads them follows the records.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import ALGORITHMS, Algorithm, make_algorithm
from sylvie_comm.algorithms.delegating import takes_rank
from sylvie_comm.algorithms.record import Record
from sylvie_comm.codecs import get_codec
from sylvie_comm.collectives.local import run_local
from sylvie_comm.optim.momentum import MOMENTUM_CODECS, check_codec


def test_the_base_class_reads_the_registry_as_it_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dict(Algorithm.registered) == ALGORITHMS
    monkeypatch.setitem(ALGORITHMS, "extra", ALGORITHMS["none"])
    assert Algorithm.registered["extra"] is ALGORITHMS["none"]  # a view of the one list, not a copy
    with pytest.raises(TypeError):
        Algorithm.registered["other"] = ALGORITHMS["none"]  # type: ignore[index]  # read-only from below


def _refusal(name: str) -> str:
    def body(tr: Any) -> str:
        alg = make_algorithm(name, tr, {})
        try:
            alg.reduce_scatter(torch.zeros(2), torch.empty(1), 0)
        except ValueError as exc:
            return str(exc)
        finally:
            alg.close()
        return "no error"

    return run_local(2, body)[0]


def test_the_reduce_scatter_refusal_is_the_class_reason_and_names_the_registered_forms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, cls in ALGORITHMS.items():
        assert cls.record.shards or str(cls.record.no_shards_reason).strip(), name
    assert ALGORITHMS["acpsgd"].record.no_shards_reason == ALGORITHMS["powersgd"].record.no_shards_reason
    assert "replica all-reduce of HSDP" in str(ALGORITHMS["acpsgd"].record.no_shards_reason)
    declare(monkeypatch, "sign", no_shards_reason="a reason of its own")
    declare(monkeypatch, "topk", no_shards_reason=None)  # another form: the list follows the records
    said = _refusal("sign")
    assert said == "sign: no reduce-scatter form (a reason of its own); algorithms with one: " + ", ".join(
        ["none", "fp16", "bf16", "topk", "onebit", "qsgd"]
    )


def declare(monkeypatch: pytest.MonkeyPatch, name: str, **fields: Any) -> None:
    """Algorithm ``name`` declares ``fields`` otherwise, for one test."""
    cls = ALGORITHMS[name]
    monkeypatch.setattr(cls, "record", replace(cls.record, **fields))


# The bytes per element the Horovod optimizer sizes its fusion groups with, by algorithm, at each one's defaults
# (sign's int8 votes: 1 byte, not the bit it was once sized as).
PAYLOAD = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "sign": 1.0, "onebit": 1 / 8, "topk": 0.8, "qsgd": 0.5,
           "auto": 4.0}  # fmt: skip


def test_the_bytes_per_element_are_the_codecs_declaration() -> None:
    for name, figure in PAYLOAD.items():
        record = ALGORITHMS[name].record
        assert record.payload_per_element({}) == figure, name
        assert record.payload_per_element(record.option_defaults) == figure, name
        if record.codec_name is not None:  # one place: the codec's declaration, with the options it takes
            assert figure == get_codec(record.codec_name).payload_per_element() or name in ("topk", "qsgd"), name
    assert ALGORITHMS["topk"].record.payload_per_element({"ratio": 0.25}) == 2.0  # an fp32 value and an int32 index
    assert ALGORITHMS["qsgd"].record.payload_per_element({"bits": 2}) == 0.25
    assert ALGORITHMS["qsgd"].record.payload_per_element({"bits": 8, "block": 64, "error_feedback": False}) == 1.0
    assert ALGORITHMS["sign"].record.payload_per_element({"scale": "mean"}) == 1.0  # no option changes its size
    assert ALGORITHMS["topk"].record.sent_bytes(1000, 4) == 3 * 800  # an all-gather: to each of 3 peers
    assert ALGORITHMS["fp16"].record.sent_bytes(1000, 4) == 2 * 3 * 2000 // 4  # a ring all-reduce
    assert ALGORITHMS["fp16"].record.sent_bytes(1000, 1) == 0


def test_a_record_declares_its_bytes_from_one_place() -> None:
    with pytest.raises(ValueError, match=r"from a codec \(codec_name\) or a format of its own \(payload\), not both"):
        Record(codec_name="fp16", payload=2.0)
    with pytest.raises(ValueError, match="not neither"):
        Record()
    with pytest.raises(ValueError, match="codec_name 'fp8' is not a registered codec; valid: bf16, "):
        Record(codec_name="fp8")
    with pytest.raises(ValueError, match="collective must be one of all_reduce, all_gather, got 'all_to_all'"):
        Record(payload=1.0, collective="all_to_all")
    with pytest.raises(ValueError, match=r"per-name option\(s\) bits are not options \(ratio\)"):
        Record(payload=1.0, option_defaults={"ratio": 0.1}, per_name_options=frozenset({"bits"}))
    record = Record(payload=1.0, option_defaults={"ratio": 0.1})
    with pytest.raises(TypeError):
        record.option_defaults["ratio"] = 0.5  # type: ignore[index]  # read-only: the record is the one copy


def test_the_monitor_budget_reads_the_same_figures() -> None:
    """Per tensor: the compression rate's where the shape sets it, the class's bytes per element otherwise (auto:
    its cheapest candidate's)."""

    def body(tr: Any) -> dict[str, tuple[float, float]]:
        out = {}
        for name in ALGORITHMS:
            alg = make_algorithm(name, tr, {"ratio": 0.5} if name == "topk" else {})
            try:
                for shape, options in (((64, 32), {}), ((64, 32), {"bits": 8} if name == "qsgd" else {})):
                    rate = alg.compression_rate(shape, options)
                    if alg.record.delegates:
                        cands = getattr(alg, "candidates", {})
                        want = min(c.bytes_per_element(shape, options) for c in cands.values())
                    elif math.isfinite(rate):
                        want = 4.0 / min(rate, 32.0)
                    else:
                        want = alg.record.payload_per_element({**alg.options, **options})
                    out[f"{name}{options}"] = (alg.bytes_per_element(shape, options), want)
            finally:
                alg.close()
        return out

    got = run_local(1, body)[0]
    for key, (figure, want) in got.items():
        assert figure == want, key
    assert got["topk{}"][0] == 4.0 and got["qsgd{'bits': 8}"][0] == 1.0 and got["none{}"][0] == 4.0
    assert got["onebit{}"][0] == 1 / 8 and got["auto{}"][0] == 1 / 8  # auto: its cheapest candidate, onebit
    assert got["sign{}"][0] == 1.0


def test_the_horovod_optimizer_sizes_groups_from_the_classes() -> None:
    from sylvie_comm.integrations.horovod import DistributedOptimizer

    def body(tr: Any) -> dict[str, float]:
        out = {}
        for name in ("none", "fp16", "topk", "qsgd", "acpsgd", "auto"):
            opt = object.__new__(DistributedOptimizer)  # its groups' sizing alone: no Horovod here
            alg = make_algorithm(name, tr, {"rank": 4} if name == "acpsgd" else {})
            opt.session = SimpleNamespace(algorithm=alg)  # type: ignore[assignment]  # what the sizing reads
            try:
                out[name] = opt._wire_bytes(torch.Size((64, 32)), True, {**opt.algorithm.options, "ratio": 0.25,
                                                                          "bits": 2})  # fmt: skip
                out[f"{name} raw"] = opt._wire_bytes(torch.Size((64, 32)), False, opt.algorithm.options)
                if name == "acpsgd":
                    out["acpsgd rate"] = opt.algorithm.compression_rate((64, 32), opt.algorithm.options)
            finally:
                opt.algorithm.close()
        return out

    got = run_local(1, body)[0]
    numel = 64 * 32
    assert got["none"] == 4.0 * numel and got["fp16"] == 2.0 * numel and got["auto"] == 4.0 * numel
    assert got["topk"] == 2.0 * numel and got["qsgd"] == 0.25 * numel
    assert got["acpsgd"] == pytest.approx(4.0 * numel / got["acpsgd rate"]) and got["acpsgd rate"] > 1
    assert all(got[f"{n} raw"] == 4.0 * numel for n in ("none", "fp16", "topk", "qsgd", "acpsgd", "auto"))


def test_the_momentum_codecs_are_the_algorithms_that_average_a_momentum() -> None:
    assert tuple(sorted(n for n, cls in ALGORITHMS.items() if cls.record.averages_momentum)) == MOMENTUM_CODECS
    assert MOMENTUM_CODECS == ("bf16", "fp16", "none", "onebit", "qsgd", "sign", "topk")
    for name in ("acpsgd", "powersgd", "auto"):
        with pytest.raises(ValueError, match=rf"codec '{name}' cannot average the momentum; valid: bf16, .*; the low"):
            check_codec("opt", name)
    for bad in ("zstd", ["onebit"], None):
        with pytest.raises(ValueError, match=r"cannot average the momentum; valid: bf16, fp16, none, onebit, qsgd, "
                                             r"sign, topk$"):  # fmt: skip
            check_codec("opt", bad)
    assert check_codec("opt", "qsgd") == "qsgd"


def test_low_rank_is_declared_and_auto_takes_its_candidates_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {n for n, cls in ALGORITHMS.items() if cls.record.low_rank} == {"acpsgd", "powersgd"}
    assert {n for n, cls in ALGORITHMS.items() if takes_rank(cls)} == {"acpsgd", "powersgd", "auto"}
    auto = ALGORITHMS["auto"]
    declare(
        monkeypatch, "auto", option_defaults={**auto.record.option_defaults, "candidates": ("none", "fp16", "onebit")}
    )
    assert not takes_rank(auto)  # no low-rank candidate: its rank sets nothing


def test_delegates_and_variants_are_declared() -> None:
    assert {n for n, cls in ALGORITHMS.items() if cls.record.delegates} == {"auto"}
    variants = {n: cls.record.variant_of for n, cls in ALGORITHMS.items() if cls.record.variant_of is not None}
    assert variants == {"bf16": "fp16"}
    for name, of in variants.items():  # the same code: a subclass of the same implementation, another setting
        assert ALGORITHMS[name].__mro__[1] is ALGORITHMS[of].__mro__[1], (name, of)


def test_the_benchmarks_read_the_classes() -> None:
    from sylvie_comm.bench import fsdp, horovod, link

    sharded = [n for n, cls in ALGORITHMS.items() if cls.record.shards]
    assert sorted(fsdp.OURS) == sorted(sharded)
    assert fsdp.OURS == ("none", "fp16", "bf16", "qsgd", "onebit")  # most wire bytes first: the table's order
    assert link.label("auto", 4) == "sylvie auto r4" and link.label("acpsgd", 4) == "sylvie acpsgd r4"
    assert link.label("onebit", 4) == "sylvie onebit" and link.label("powersgd:rank=8", 4) == "sylvie powersgd (rank=8)"
    ranked = {row for row in horovod.LAB_ROWS if horovod.lab_label(row, 4).endswith(" r4")}
    assert ranked == {"hvd-acpsgd", "hvd-sylvie-acpsgd", "hvd-sylvie-powersgd"}


def test_the_policy_reads_what_needs_a_warmup_and_a_monitor_from_the_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``warmup: auto`` waits only for algorithms that lose more than a float format's rounding; the monitor
    watches only algorithms that do not send the gradient as it is; both read the class."""
    from sylvie_comm.algorithms import Policy
    from sylvie_comm.config import Config

    assert [n for n, c in ALGORITHMS.items() if c.record.rounds_only] == ["none", "fp16", "bf16"]
    assert [n for n, c in ALGORITHMS.items() if c.record.sends_raw] == ["none"]

    def body(tr: Any) -> tuple[bool, bool]:
        policy = Policy(make_algorithm("fp16", tr, {}), Config(codec="fp16", warmup="auto", monitor={"period": 10}))
        out = (policy.warmup is None, policy.monitor is not None)
        policy.close()
        policy.algorithm.close()
        return out

    assert run_local(1, body)[0] == (True, True)
    declare(monkeypatch, "fp16", rounds_only=False, sends_raw=True)

    def flipped(tr: Any) -> tuple[bool, bool]:
        policy = Policy(make_algorithm("fp16", tr, {}), Config(codec="fp16", warmup="auto", monitor={"period": 10}))
        out = (policy.warmup is not None, policy.monitor is None)
        policy.close()
        policy.algorithm.close()
        return out

    assert run_local(1, flipped)[0] == (True, True)


def test_a_refused_dtype_names_the_algorithms_that_take_every_dtype() -> None:
    from sylvie_comm.algorithms import Policy
    from sylvie_comm.config import Config

    def body(tr: Any) -> str:
        policy = Policy(make_algorithm("qsgd", tr, {}), Config(codec="qsgd"))
        try:
            policy.check_parameters([("w", torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64)))], "ddp")
        except ValueError as exc:
            return str(exc)
        finally:
            policy.close()
            policy.algorithm.close()
        return "no error"

    message = run_local(1, body)[0]
    assert message.endswith("or use none, acpsgd or powersgd"), message
