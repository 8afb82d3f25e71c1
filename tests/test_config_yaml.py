"""Config.from_yaml refuses documents that would blow up once their aliases are expanded, and huge files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sylvie_comm import Config, config

EXAMPLES = Path(__file__).parents[1] / "examples" / "configs"


def _laughs(levels: int, width: int = 10) -> str:
    """A "billion laughs" config: option ``l<levels>`` expands to ``width ** levels`` leaves."""
    lines = ["codec: acpsgd", "options:", "  l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels + 1):
        lines.append(f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


@pytest.fixture(params=["libyaml", "pure"])
def parser(request, monkeypatch):
    """Both of PyYAML's parsers: libyaml's where it is built, and the pure-Python one it falls back to."""
    import yaml

    if request.param == "pure":
        monkeypatch.delattr(yaml, "CSafeLoader", raising=False)
    elif not hasattr(yaml, "CSafeLoader"):
        pytest.skip("PyYAML without libyaml")
    return request.param


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_billion_laughs_is_refused_at_once_naming_the_file_and_the_limit(tmp_path, parser):
    path = _write(tmp_path, _laughs(9))  # 10**9 leaves once expanded; a few hundred bytes of text
    assert path.stat().st_size < 1000
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        Config.from_yaml(path)
    # Counting an expanded size without expanding it is linear in the text: far below a second.
    assert time.monotonic() - t0 < 2.0
    message = str(info.value)
    assert str(path) in message and f"{config.YAML_MAX_NODES:,}" in message and "alias" in message, message


def test_the_node_limit_counts_every_alias_as_a_copy(tmp_path, monkeypatch):
    # root mapping, key "options", its mapping, key "a", [1, 2] (3 nodes), key "b", *x (a copy: 3 more): 11
    path = _write(tmp_path, "options: {a: &x [1, 2], b: *x}\n")
    monkeypatch.setattr(config, "YAML_MAX_NODES", 11, raising=False)
    assert Config.from_yaml(path).options == {"a": [1, 2], "b": [1, 2]}
    monkeypatch.setattr(config, "YAML_MAX_NODES", 10, raising=False)
    with pytest.raises(ValueError, match=r"more than 10 YAML nodes"):
        Config.from_yaml(path)


def test_nested_merge_keys_are_refused(tmp_path):
    # Merge keys (<<) flatten while the mapping is built: 6 levels of 10 merges are 10**6 key/value pairs.
    lines = ["options:", "  m0: &m0 {k: 1}"]
    for i in range(1, 7):
        lines.append(f"  m{i}: &m{i} {{<<: [" + ", ".join([f"*m{i - 1}"] * 10) + "]}")
    with pytest.raises(ValueError, match=r"more than [\d,]+ YAML nodes once its aliases are expanded"):
        Config.from_yaml(_write(tmp_path, "\n".join(lines) + "\n"))


def test_a_recursive_alias_is_refused(tmp_path, parser):
    path = _write(tmp_path, "options:\n  a: &a [1, *a]\n")
    with pytest.raises(ValueError, match=r"c\.yaml: an alias refers to a node that contains it"):
        Config.from_yaml(path)


def test_a_file_over_the_size_limit_is_refused_before_parsing(tmp_path):
    path = _write(tmp_path, "codec: acpsgd\n" + "#" * (4 << 20) + "\n")  # valid YAML: a field and a 4 MiB comment
    with pytest.raises(ValueError, match=rf"{path.name} is larger than [\d,]+ bytes") as info:
        Config.from_yaml(path)
    assert f"{config.YAML_MAX_BYTES:,} bytes" in str(info.value)
    assert 64 << 10 <= config.YAML_MAX_BYTES < 4 << 20  # room for the largest real configs (thousands of rules)


def test_deep_nesting_is_a_value_error_not_a_crash(tmp_path, parser):
    path = _write(tmp_path, "options:\n  a: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ValueError, match=r"c\.yaml"):
        Config.from_yaml(path)


def test_normal_configs_load_unchanged(tmp_path, parser):
    acpsgd = Config.from_yaml(EXAMPLES / "acpsgd.yaml")
    assert acpsgd.codec == "acpsgd" and acpsgd.options == {"rank": 4} and acpsgd.rule_for("4.weight") is not None
    assert Config.from_yaml(EXAMPLES / "onebit.yaml").options == {"chunk_size": 2048, "scale": "norm"}
    assert Config.from_yaml(_write(tmp_path, "")) == Config()  # an empty file: the defaults
    # Anchors and aliases used as people use them (one options block shared by rules) still work.
    shared = "options: &o {rank: 4}\nrules:\n" + "".join(f"  - {{match: 'l{i}.*', options: *o}}\n" for i in range(3))
    cfg = Config.from_yaml(_write(tmp_path, shared, "shared.yaml"))
    assert [r.options for r in cfg.rules] == [{"rank": 4}] * 3
    # A large but real config (2,000 per-layer rules) is well inside both limits.
    rules = "".join(f"  - match: 'layer{i}.*'\n    options: {{rank: 8}}\n" for i in range(2000))
    big = "codec: acpsgd\nrules:\n" + rules
    assert len(Config.from_yaml(_write(tmp_path, big, "big.yaml")).rules) == 2000


def test_invalid_yaml_and_missing_files_keep_their_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        Config.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match=r"bad\.yaml is not valid YAML"):
        Config.from_yaml(_write(tmp_path, "codec: [unclosed", "bad.yaml"))
