"""``python -m sylvie_comm.gnn.halo_accuracy``: settings side by side over seeds, on in-process ranks."""

from __future__ import annotations

from typing import Any

import pytest

from sylvie_comm.gnn import halo_accuracy


def test_a_tiny_run_reports_every_setting_against_the_first() -> None:
    lines: list[str] = []
    rec = halo_accuracy.run(["fp32", "sylvie", "fp32"], [0, 1], epochs=2, nodes=200, world=2, echo=lines.append)
    assert list(rec["settings"]) == ["fp32", "sylvie"] and rec["seeds"] == [0, 1]
    assert len(lines) == 4 and all("test" in line for line in lines)
    first, low = rec["settings"]["fp32"], rec["settings"]["sylvie"]
    assert first["gap_vs_first"]["mean"] == 0.0 and first["bytes_ratio_vs_first"] == pytest.approx(1.0)
    assert low["bytes_ratio_vs_first"] > 8  # 1-bit rows and their scales against fp32's
    for s in rec["settings"].values():
        assert 0.0 <= s["test_acc"]["mean"] <= 100.0 and s["halo_bytes_per_epoch"] > 0
    table = halo_accuracy.table(rec)
    assert table.splitlines()[1].startswith("fp32") and table.splitlines()[2].startswith("sylvie")


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"settings": ["zip"]}, r"unknown halo_accuracy setting 'zip'; valid: .*sylvie"),
        ({"settings": []}, "no halo_accuracy setting given"),
        ({"seeds": []}, "at least one seed"),
        ({"layers": 1}, "layers must be an integer >= 2"),
        ({"launcher": "mpirun"}, "launcher must be 'local' or 'torchrun'"),
    ],
)
def test_bad_input_names_the_value(kw: dict[str, Any], message: str) -> None:
    args = {"settings": ["fp32"], "seeds": [0], **kw}
    with pytest.raises(ValueError, match=message):
        halo_accuracy.run(args.pop("settings"), args.pop("seeds"), epochs=1, nodes=100, world=2, **args)
