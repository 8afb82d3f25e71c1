"""Configuration of a gradient-compression hook: YAML in, validated, comparable across ranks.

Example ``acpsgd.yaml``::

    codec: acpsgd            # hook algorithm (see sylvie_comm.ddp.HOOKS)
    options:                 # options of that algorithm
      rank: 4
    warmup_steps: 2          # plain all-reduce for the first steps
    min_compression_rate: 2  # low-rank hooks: send a matrix raw below this rate
    seed: 0                  # initial low-rank factors, agreed by every rank
    rules:                   # per-parameter-name rules, first match wins
      - match: "*.bias"
        codec: uncompressed
      - match: "head.*"
        options: {rank: 8}
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UNCOMPRESSED = "uncompressed"


@dataclass(frozen=True)
class Rule:
    """Per-parameter rule: parameters whose name matches ``match`` (a glob) are
    sent raw (``codec: uncompressed``) or use ``options`` on top of the hook's."""

    match: str
    codec: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"match": self.match}
        if self.codec is not None:
            out["codec"] = self.codec
        if self.options:
            out["options"] = dict(self.options)
        return out


@dataclass(frozen=True)
class Config:
    """Everything that defines a hook; ranks must agree on all of it."""

    codec: str = "acpsgd"
    options: Mapping[str, Any] = field(default_factory=dict)
    warmup_steps: int = 2
    min_compression_rate: float = 2.0
    seed: int = 0
    rules: tuple[Rule, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.codec, str):
            raise ValueError(f"config: codec must be a string, got {self.codec!r}")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"config: options must be a mapping, got {type(self.options).__name__}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"config: warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        rate = self.min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 0:
            raise ValueError(f"config: min_compression_rate must be a finite number >= 0, got {rate!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"config: seed must be an integer, got {self.seed!r}")
        for rule in self.rules:
            if not isinstance(rule, Rule):
                raise ValueError(f"config: rules must be Rule objects, got {rule!r}")
            if rule.codec not in (None, UNCOMPRESSED):
                raise ValueError(
                    f"config: rule for {rule.match!r} has codec {rule.codec!r}; a rule can only say "
                    f"'{UNCOMPRESSED}' (one codec per hook keeps one collective per bucket) or set options"
                )

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        if not isinstance(data, Mapping):
            raise ValueError(f"config: expected a mapping at the top level, got {type(data).__name__}")
        known = {"codec", "options", "warmup_steps", "min_compression_rate", "seed", "rules"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        rules = []
        for i, r in enumerate(data.get("rules") or ()):
            if not isinstance(r, Mapping) or "match" not in r:
                raise ValueError(f"config: rules[{i}] must be a mapping with a 'match' glob, got {r!r}")
            extra = sorted(set(r) - {"match", "codec", "options"})
            if extra:
                raise ValueError(f"config: rules[{i}] has unknown field(s) {', '.join(extra)}")
            rules.append(Rule(str(r["match"]), r.get("codec"), dict(r.get("options") or {})))
        kwargs = {k: data[k] for k in ("codec", "warmup_steps", "min_compression_rate", "seed") if k in data}
        options = data.get("options") or {}
        if not isinstance(options, Mapping):
            raise ValueError(f"config: options must be a mapping, got {type(options).__name__}")
        return cls(options=dict(options), rules=tuple(rules), **kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Config:
        """Read a YAML file (see the module docstring for the fields)."""
        import yaml

        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"config: no such file {str(p)!r}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"config: {p} is not valid YAML: {exc}") from None
        return cls.from_dict(data or {})

    def with_options(self, **options: Any) -> Config:
        """A copy with ``options`` merged over this config's."""
        return Config(self.codec, {**self.options, **options}, self.warmup_steps, self.min_compression_rate,
                      self.seed, self.rules)  # fmt: skip

    # ------------------------------------------------------------------ use

    def rule_for(self, name: str) -> Rule | None:
        """The first rule whose glob matches a parameter name."""
        for rule in self.rules:
            if fnmatch.fnmatchcase(name, rule.match):
                return rule
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "options": dict(sorted(self.options.items())),
            "warmup_steps": self.warmup_steps,
            "min_compression_rate": float(self.min_compression_rate),
            "seed": self.seed,
            "rules": [r.to_dict() for r in self.rules],
        }

    def digest(self) -> str:
        """A short hash of the canonical form; equal configs have equal digests."""
        text = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def differences(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Fields (dotted paths) where two ``to_dict()`` forms differ, with both values."""
    out: list[tuple[str, Any, Any]] = []
    for key in sorted(set(a) | set(b), key=str):
        path = f"{prefix}{key}"
        va, vb = a.get(key), b.get(key)
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            out += differences(va, vb, path + ".")
        elif va != vb:
            out.append((path, va, vb))
    return out
