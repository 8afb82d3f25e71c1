"""One namespace of names: a name means one thing in every role, and a wrong name lists the valid ones."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sylvie_comm import registry
from sylvie_comm.algorithms import ALGORITHMS, algorithm_class
from sylvie_comm.codecs import CODECS, get_codec
from sylvie_comm.gnn.halo import RowFormat, parse_precision


def test_the_namespace_is_consistent():
    registry.check()


def test_a_name_shared_by_roles_is_one_codec():
    for name, roles in registry.table():
        if "codec" in roles and "algorithm" in roles:
            assert ALGORITHMS[name].record.codec_name == name
        if "halo" in roles and "codec" in roles:
            assert type(RowFormat(parse_precision(name), 8).codec) is CODECS[name]


def test_check_catches_an_algorithm_that_reuses_a_codec_name_for_another_codec(monkeypatch):
    sign = ALGORITHMS["sign"]
    monkeypatch.setattr(sign, "record", replace(sign.record, codec_name="topk"))
    with pytest.raises(AssertionError, match="'sign' is a codec and an algorithm that encodes with 'topk'"):
        registry.check()


def test_check_catches_an_algorithm_that_declares_no_record_of_its_own(monkeypatch):
    class Bare(ALGORITHMS["fp16"]):  # a subclass that would read fp16's record as its own
        name = "bare"

    monkeypatch.setitem(ALGORITHMS, "bare", Bare)
    with pytest.raises(AssertionError, match="algorithm 'bare' declares no record of its own"):
        registry.check()


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: algorithm_class("qbit"), r"unknown algorithm 'qbit'; valid: acpsgd, .* \('qbit' is a codec"),
        (lambda: algorithm_class("q4", "hook"), r"unknown hook 'q4'; valid: .*\('q4' is a halo precision"),
        (lambda: get_codec("acpsgd"), r"unknown codec 'acpsgd'; valid: bf16, .*\('acpsgd' is a gradient algorithm"),
        (lambda: parse_precision("qsgd"), r"unknown halo precision 'qsgd'; valid: .*q8.*\('qsgd' is a gradient"),
        (lambda: get_codec("twobit"), r"unknown codec 'twobit'; valid: [a-z0-9, ]+$"),
    ],
)
def test_a_wrong_name_lists_the_valid_ones_and_what_it_is_elsewhere(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_info_prints_every_name(capsys):
    from sylvie_comm.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name, _ in registry.table():
        assert f"  {name} " in out


def test_info_says_which_gpu_kernels_there_are(capsys, monkeypatch):
    from sylvie_comm.cli import main
    from sylvie_comm.kernels import triton as kt

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert ("Triton GPU kernels: yes (triton " in out) == (kt.unavailable_reason() is None)
    monkeypatch.setattr(kt, "unavailable_reason", lambda: "triton is not installed (pip install triton)")
    assert main(["info"]) == 0
    assert "Triton GPU kernels: no (triton is not installed (pip install triton))" in capsys.readouterr().out
