"""Configuration of a gradient-compression hook: YAML in, validated, comparable across ranks.

Example ``acpsgd.yaml``::

    codec: acpsgd            # hook algorithm (see sylvie_comm.ddp.HOOKS)
    options:                 # options of that algorithm
      rank: 4
    warmup_steps: 2          # plain all-reduce for the first steps
    warmup: fixed            # or auto: then each tensor compresses once its gradient has settled
    total_steps: null        # the run's length, if known: no tensor waits past a tenth of it
    min_compression_rate: 2  # low-rank hooks: send a matrix raw below this rate
    seed: 0                  # initial low-rank factors, agreed by every rank
    monitor:                 # the compression's measured error (see sylvie_comm.algorithms.monitor)
      period: 50             # an exact check every 50 compressed steps; 0 turns the monitor off
      adapt: false           # true: ranks, bits and raw fallback follow the measured error
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
# Config fields a user may set as keywords (the hooks' **options) or in YAML, besides codec, options and rules.
FIELDS = ("codec", "warmup_steps", "min_compression_rate", "seed", "warmup", "total_steps", "monitor")
# The compression-error monitor's settings (sylvie_comm.algorithms.monitor): an exact check every ``period``
# compressed steps (0: no monitor) on ``sample`` tensors per group, the per-step figures over the ``window`` steps
# before each check; a tensor is over its bound where the
# residual exceeds ``max_lag`` times what was averaged (error feedback; None: the bound of :data:`LAG_BOUNDS` for
# what the integration averages) or, without error feedback, the exact relative error exceeds ``max_error``, at
# ``patience`` checks in a row; ``adapt`` lets that change its settings within ``budget`` times the starting
# bytes, or send it raw.
MONITOR_DEFAULTS: dict[str, Any] = {
    "period": 50,
    "first": 10,
    "window": 5,
    "sample": 1,
    "max_lag": None,
    "max_error": 1.0,
    "patience": 2,
    "adapt": False,
    "budget": 2.0,
    "share": 0.02,
    "target_ratio": None,  # a byte budget: this many times fewer bytes than fp32 (budget.py); None: no budget
    "target_bytes": None,  # or: bytes per compressed step (payload, all tensors); None: no budget
}

# The monitor's default bound on ``lag`` (``max_lag`` null), by what the integration averages, calibrated against the
# accuracy each path lost to plain DDP (docs/guide/monitor.md, "Why the bounds are what they are";
# benchmarks/monitor-calibration-2026-12-07.md):
# * ``gradient`` (the DDP hooks, Horovod, FSDP2, the GNN trainer's average): the residual in steps' worth of gradient;
# * ``momentum`` (CompressedSGD and CompressedAdamW): the residual against the momentum. A momentum changes little
#   from step to step, so what a codec drops is sent at the next steps: its residual stays near the codec's own
#   relative error (0.7-1.1 under one-bit, on models it did not hurt), where a gradient's residual near that size
#   is owed gradients that momentum turns late; a momentum residual that grows past 1.5 is one that piles up.
LAG_BOUNDS: dict[str, float] = {"gradient": 0.5, "momentum": 1.5}

# Bounds on a YAML config (Config.from_yaml). A real one is a few hundred bytes and a few dozen nodes;
# thousands of per-layer rules fit in both. Aliases count as copies: a "billion laughs" document of a
# few hundred bytes names 10**9 nodes, which every consumer of the data (digest, to_dict, the ranks'
# agreement) would walk one by one.
YAML_MAX_BYTES = 1 << 20
YAML_MAX_NODES = 100_000


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


def check_monitor(monitor: Any) -> dict[str, Any]:
    """The monitor's settings with the defaults filled in; a ValueError naming the first bad one."""
    if not isinstance(monitor, Mapping):
        raise ValueError(f"config: monitor must be a mapping of settings, got {type(monitor).__name__}")
    unknown = sorted(set(monitor) - set(MONITOR_DEFAULTS))
    if unknown:
        raise ValueError(f"config: monitor has unknown setting(s) {', '.join(map(str, unknown))}; known: "
                         f"{', '.join(MONITOR_DEFAULTS)}")  # fmt: skip
    out = {**MONITOR_DEFAULTS, **monitor}
    for key, low in (("period", 0), ("first", 1), ("window", 1), ("sample", 1), ("patience", 1)):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"config: monitor {key} must be an integer >= {low}, got {v!r}")
    for key, rule in (("max_lag", "> 0"), ("max_error", "> 0"), ("budget", ">= 1"), ("share", "> 0")):
        v = out[key]
        if key == "max_lag" and v is None:  # the bound of what is averaged (LAG_BOUNDS)
            continue
        number = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        if not number or not (v >= 1 if key == "budget" else v > 0):
            also = " (or null: the bound of what the integration averages)" if key == "max_lag" else ""
            raise ValueError(f"config: monitor {key} must be a finite number {rule}{also}, got {v!r}")
        out[key] = float(v)
    if not isinstance(out["adapt"], bool):
        raise ValueError(f"config: monitor adapt must be true or false, got {out['adapt']!r}")
    for key, floor in (("target_ratio", 1.0), ("target_bytes", 0.0)):
        v = out[key]
        number = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        if v is not None and (not number or v <= floor):
            raise ValueError(f"config: monitor {key} must be a finite number > {floor:g} or null, got {v!r}")
        out[key] = None if v is None else float(v)
    if out["target_ratio"] is not None and out["target_bytes"] is not None:
        raise ValueError("config: monitor takes target_ratio or target_bytes, not both (got "
                         f"{out['target_ratio']!r} and {out['target_bytes']!r})")  # fmt: skip
    return out


@dataclass(frozen=True)
class Config:
    """Everything that defines a hook; ranks must agree on all of it."""

    codec: str = "acpsgd"
    options: Mapping[str, Any] = field(default_factory=dict)
    warmup_steps: int = 2  # every tensor travels as a plain fp32 average for the first steps
    min_compression_rate: float = 2.0  # a tensor compressing less than this travels raw
    seed: int = 0  # initial low-rank factors, agreed by every rank
    rules: tuple[Rule, ...] = ()  # per-name rules, first match wins
    warmup: str = "fixed"  # fixed: everything compresses from warmup_steps; auto: each tensor once its gradient settled
    total_steps: int | None = None  # the run's length, if known: bounds the auto warm-up at a tenth of it
    monitor: Mapping[str, Any] = field(default_factory=dict)  # MONITOR_DEFAULTS' keys; the defaults fill the rest

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
        if self.warmup not in ("auto", "fixed"):
            raise ValueError(f"config: warmup must be 'auto' or 'fixed', got {self.warmup!r}")
        total = self.total_steps
        if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
            raise ValueError(f"config: total_steps must be an integer >= 1 or None, got {total!r}")
        object.__setattr__(self, "monitor", check_monitor(self.monitor))
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
        known = {"codec", "options", "rules", *FIELDS}
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
        kwargs = {k: data[k] for k in FIELDS if k in data}
        options = data.get("options") or {}
        if not isinstance(options, Mapping):
            raise ValueError(f"config: options must be a mapping, got {type(options).__name__}")
        return cls(options=dict(options), rules=tuple(rules), **kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Config:
        """Read a YAML file (see the module docstring for the fields).

        The file may hold at most :data:`YAML_MAX_BYTES` bytes and :data:`YAML_MAX_NODES` YAML nodes
        with every alias counted as a copy of what it names; larger files, recursive aliases and
        nesting the parser cannot follow are a ValueError naming the file.
        """
        return cls.from_dict(load_yaml(path) or {})

    def with_options(self, **options: Any) -> Config:
        """A copy with ``options`` merged over this config's."""
        return Config(self.codec, {**self.options, **options}, self.warmup_steps, self.min_compression_rate,
                      self.seed, self.rules, self.warmup, self.total_steps, self.monitor)  # fmt: skip

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
            "warmup": self.warmup,
            "total_steps": self.total_steps,
            "monitor": dict(sorted(self.monitor.items())),
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


def load_yaml(path: str | Path) -> Any:
    """The data in the YAML file ``path`` (standard tags only: ``yaml.safe_load``'s), within bounds.

    A ValueError naming the file where it holds more than :data:`YAML_MAX_BYTES` bytes, more than
    :data:`YAML_MAX_NODES` nodes with every alias counted as a copy of what it names (counted on the
    parsed document, before anything is built from it), an alias inside what it names, nesting the
    parser cannot follow, or anything that is not YAML. FileNotFoundError where there is no file.
    """
    import yaml

    p = Path(path)
    limit = YAML_MAX_BYTES
    try:
        with p.open("rb") as f:
            raw = f.read(limit + 1)
    except FileNotFoundError:
        raise FileNotFoundError(f"config: no such file {str(p)!r}") from None
    if len(raw) > limit:
        raise ValueError(
            f"config: {p} is larger than {limit:,} bytes (sylvie_comm.config.YAML_MAX_BYTES); "
            "a config file is a few hundred"
        )
    # libyaml's parser where PyYAML has it: it also stops at 1000 levels of nesting.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(raw)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node, p)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ValueError(f"config: {p} is not valid YAML: {exc}") from None
    except RecursionError:
        raise ValueError(f"config: {p} nests its lists and mappings too deeply to be read") from None
    finally:
        loader.dispose()


def _yaml_children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expanded_size(root: Any, path: Path) -> int:
    """The number of nodes under ``root`` (itself included) with every alias expanded, or a ValueError
    beyond :data:`YAML_MAX_NODES` or for an alias inside what it names.

    An alias is the node it names, shared: each node's expanded size is counted once, from its
    children's, so the work is linear in the parsed document however far it would expand.
    """
    limit = YAML_MAX_NODES
    sizes: dict[int, int] = {}
    started: set[int] = set()  # the nodes on the path from the root to the one being visited
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            started.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in _yaml_children(node))
            if sizes[key] > limit:
                raise ValueError(
                    f"config: {path} holds more than {limit:,} YAML nodes once its aliases are expanded "
                    "(an alias counts as a copy of what it names; the limit is sylvie_comm.config.YAML_MAX_NODES)"
                )
        elif key in started:
            raise ValueError(
                f"config: {path}: an alias refers to a node that contains it (the node at line "
                f"{node.start_mark.line + 1}); a config must be a tree"
            )
        elif key not in sizes:
            started.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in _yaml_children(node))
    return sizes[id(root)]
