"""The checked-in tables of codecs and algorithms are what the code declares (:mod:`sylvie_comm.catalog`), and a
newly registered codec or algorithm shows in every one of them, and in ``sylvie-comm info``, with nothing else
edited."""

from __future__ import annotations

import math
import shutil
from typing import ClassVar

import pytest
import torch

from sylvie_comm import catalog
from sylvie_comm.algorithms.base import Algorithm
from sylvie_comm.algorithms.record import Record
from sylvie_comm.algorithms.registry import ALGORITHMS
from sylvie_comm.codecs import CODECS
from sylvie_comm.codecs.base import Codec, Encoded, meta_of


def test_every_checked_in_table_is_what_the_code_declares():
    stale = catalog.stale()
    assert not stale, "tables that differ from the code (run python -m sylvie_comm.catalog --write):\n" + "\n".join(
        stale
    )


def test_a_changed_table_is_named_with_its_file(tmp_path):
    for rel in catalog.PLACES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(catalog.ROOT / rel, tmp_path / rel)
    guide = tmp_path / "docs/guide/codecs.md"
    guide.write_text(guide.read_text().replace("| `qsgd` |", "| `qsgd2` |", 1))
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("<!-- /catalog:common-options -->", ""))
    assert catalog.stale(tmp_path) == ["README.md: common-options (its markers are missing)",
                                       "docs/guide/codecs.md: algorithms"]  # fmt: skip
    catalog.write(tmp_path)
    assert catalog.stale(tmp_path) == ["README.md: common-options (its markers are missing)"]


def test_a_marker_that_names_no_table_is_refused():
    with pytest.raises(ValueError, match="unknown table 'codex'"):
        catalog.render("<!-- catalog:codex --><!-- /catalog:codex -->")


def test_the_readme_table_holds_every_option_and_the_session_options():
    readme = (catalog.ROOT / "README.md").read_text()
    for name, cls in ALGORITHMS.items():
        for option in cls.record.option_defaults:
            assert f"`{option}` (`" in readme, (name, option)
    assert "`block` (`1`)" in readme  # qsgd's
    assert "`monitor` (on:" in readme  # on by default: the session's option


# ---------------------------------------------------------------------------------------------------- a toy codec


class ToyCodec(Codec):
    """Send every other value of the tensor, as fp32."""

    name: ClassVar[str] = "toycodec"

    def __init__(self, *, stride: int = 2) -> None:
        self.stride = stride

    def _encode(self, tensor: torch.Tensor) -> Encoded:
        return Encoded((tensor.reshape(-1)[:: self.stride].float(),), meta_of(tensor))

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError("a toy for the tables")

    def payload_bytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        return 4 * math.ceil(math.prod(shape) / self.stride)


def toy_algorithm() -> type[Algorithm]:
    """An algorithm of the toy codec, declared once the codec is registered (its record checks the name)."""

    class ToyAlgorithm(Algorithm):
        """Average every other value through the toy codec."""

        name = "toyalgo"
        record = Record(
            codec_name="toycodec",
            option_defaults={"stride": 2},
            per_name_options=frozenset({"stride"}),
            no_shards_reason="a toy has no shards",
            averages_momentum=True,
        )  # its bytes per element are its codec's: 2, measured

    return ToyAlgorithm


@pytest.fixture
def toys(monkeypatch):
    monkeypatch.setitem(CODECS, ToyCodec.name, ToyCodec)
    monkeypatch.setitem(ALGORITHMS, "toyalgo", toy_algorithm())
    # monkeypatch puts both registries back after the test


def test_a_registered_codec_and_algorithm_show_everywhere_with_nothing_else_edited(toys):
    for rel, names in catalog.PLACES.items():
        text = catalog.render((catalog.ROOT / rel).read_text())
        for name in names:
            assert name in catalog.markers(text), (rel, name)
        if {"algorithms", "capabilities", "algorithm-names"} & set(names):
            assert "`toyalgo`" in text, rel
        if {"codecs", "codec-names"} & set(names):
            assert "`toycodec`" in text, rel
    capabilities = catalog.capabilities_table().splitlines()
    (row,) = [line for line in capabilities if line.startswith("| `toyalgo` |")]
    assert row.split(" | ")[1:5] == ["`toycodec`", "2", "no: a toy has no shards", "yes"]
    (row,) = [line for line in catalog.codecs_table().splitlines() if line.startswith("| `toycodec` |")]
    assert "Send every other value of the tensor, as fp32." in row and "`stride` (`2`)" in row
    assert row.split(" | ")[3:6] == ["2", "", "`toyalgo`"]  # 4 bytes for every other value; not summable
    info = "\n".join(catalog.info_lines())
    assert "  toyalgo    codec, algorithm" not in info  # toyalgo is an algorithm only
    assert "  toyalgo    algorithm" in info and "  toycodec   codec" in info
    assert "  toyalgo    toycodec; 2; stride=2" in info and "  toycodec   stride=2; 2" in info


def test_and_the_checked_in_tables_do_not_name_them():
    assert "toyalgo" not in ALGORITHMS and "toycodec" not in CODECS
    assert not catalog.stale()


def test_info_lines_name_every_algorithm_and_codec_with_its_options():
    lines = catalog.info_lines()
    at = next(i for i, line in enumerate(lines) if line.startswith("algorithms ("))
    codecs_at = next(i for i, line in enumerate(lines) if line.startswith("codecs ("))
    for name, cls in ALGORITHMS.items():
        (line,) = [line for line in lines[at:codecs_at] if line.startswith(f"  {name:10s} ")]
        for option in cls.record.option_defaults:
            assert f"{option}=" in line, (name, option)
    for name in CODECS:
        assert any(line.startswith(f"  {name:10s} ") for line in lines[codecs_at:]), name
    assert any(line.startswith("  every one also takes: warmup_steps=2") and "monitor (period=50)" in line
               for line in lines)  # fmt: skip


def test_every_read_of_a_declaration_goes_through_one_accessor():
    source = (catalog.ROOT / "sylvie_comm/catalog.py").read_text()
    body = source.split("def _declared", 1)[1].split("\ndef ", 1)[1]  # everything after the accessor
    for field in ("codec_name", "shards", "no_shards_reason", "needs_monitor", "averages_momentum", "low_rank",
                  "delegates", "variant_of", "error_feedback", "per_name_options", "gradient_dtypes",
                  "option_defaults", "payload_per_element", "allreduce_compatible"):  # fmt: skip
        assert f'_declared(cls, "{field}")' in body, field
        assert f".{field}" not in body, field
