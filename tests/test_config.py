from __future__ import annotations

import pytest

from sylvie_comm import Config
from sylvie_comm.config import Rule, differences

YAML = """
codec: acpsgd
options: {rank: 4}
warmup_steps: 3
min_compression_rate: 1.5
seed: 7
rules:
  - match: "*.bias"
    codec: uncompressed
  - match: "head.*"
    options: {rank: 8}
"""


def test_from_yaml_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(YAML)
    cfg = Config.from_yaml(path)
    assert cfg.codec == "acpsgd" and cfg.options == {"rank": 4} and cfg.warmup_steps == 3 and cfg.seed == 7
    assert cfg.rule_for("layer.bias") == Rule("*.bias", "uncompressed")
    assert cfg.rule_for("head.weight").options == {"rank": 8}
    assert cfg.rule_for("layer.weight") is None
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert Config.from_dict(cfg.to_dict()).digest() == cfg.digest()


def test_digest_changes_with_any_field():
    base = Config(options={"rank": 4})
    assert base.digest() != Config(options={"rank": 8}).digest()
    assert base.digest() != Config(options={"rank": 4}, seed=1).digest()
    assert differences(base.to_dict(), Config(options={"rank": 8}).to_dict()) == [("options.rank", 4, 8)]


@pytest.mark.parametrize(
    "data,message",
    [
        ({"codec": "acpsgd", "rnak": 4}, "unknown field"),
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
        ({"min_compression_rate": "x"}, "min_compression_rate"),
        ({"rules": [{"codec": "uncompressed"}]}, r"rules\[0\] must be a mapping with a 'match'"),
        ({"rules": [{"match": "*", "codec": "fp16"}]}, "can only say 'uncompressed'"),
        ({"rules": [{"match": "*", "bits": 2}]}, "unknown field"),
        ({"options": [1, 2]}, "options must be a mapping"),
    ],
)
def test_invalid_configs(data, message):
    with pytest.raises(ValueError, match=message):
        Config.from_dict(data)


def test_yaml_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        Config.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("codec: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        Config.from_yaml(bad)


def test_shipped_example_configs_load():
    from pathlib import Path

    for path in sorted((Path(__file__).parents[1] / "examples" / "configs").glob("*.yaml")):
        Config.from_yaml(path)


def test_the_monitor_guide_lists_every_setting_with_its_default():
    """docs/guide/monitor.md's settings table is MONITOR_DEFAULTS: the same names, the same defaults."""
    import re
    from pathlib import Path

    from sylvie_comm.config import MONITOR_DEFAULTS

    text = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "monitor.md").read_text()
    table = text.split("## Settings", 1)[1]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", table, flags=re.M))
    assert set(rows) == set(MONITOR_DEFAULTS)
    for name, default in MONITOR_DEFAULTS.items():
        assert rows[name] == str(default).lower(), (name, rows[name], default)
