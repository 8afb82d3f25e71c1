"""The benchmarks' command-line lists: names without repeats, and names with options."""

from __future__ import annotations

import pytest

from sylvie_comm.bench.choices import parse_spec, split_specs, unique_choices


def test_a_spec_is_a_name_and_typed_options() -> None:
    assert parse_spec("acpsgd") == ("acpsgd", {})
    assert parse_spec("qsgd:bits=2,stochastic=false,scale=1.5,name=x") == (
        "qsgd", {"bits": 2, "stochastic": False, "scale": 1.5, "name": "x"})  # fmt: skip
    assert parse_spec("acpsgd:monitor.period=0,monitor.adapt=true,rank=4") == (
        "acpsgd", {"monitor": {"period": 0, "adapt": True}, "rank": 4})  # fmt: skip
    for bad, message in [("acpsgd:rank", "option 'rank' is not key=value"), (":rank=4", "no name"),
                         ("acpsgd:=4", "option '=4' is not key=value"),
                         ("acpsgd:rank=4,rank.x=1", "'rank' is given a value and fields"),
                         ("acpsgd:rank.x=1,rank=4", "'rank' is given a value and fields")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_spec(bad)


def test_a_list_keeps_each_specs_options_together() -> None:
    assert split_specs("ddp, acpsgd:rank=2,monitor.period=0,qsgd,onebit:scale=mean") == [
        "ddp", "acpsgd:rank=2,monitor.period=0", "qsgd", "onebit:scale=mean"]  # fmt: skip
    assert split_specs("a,,b") == ["a", "b"]
    # An option with no spec before it stays an item of its own, for the caller to refuse by name.
    assert split_specs("rank=2,acpsgd") == ["rank=2", "acpsgd"]


def test_unique_choices_names_the_unknown_one() -> None:
    assert unique_choices(["b", "a", "b"], ["a", "b"], "codec") == ["b", "a"]
    with pytest.raises(ValueError, match=r"unknown codec 'c'; valid: a, b"):
        unique_choices(["c"], ["a", "b"], "codec")
    with pytest.raises(ValueError, match=r"no codec given; valid: a, b"):
        unique_choices([], ["a", "b"], "codec")
