"""The DDP hook's configuration errors, raised where it is registered: on one in-process rank (the checks of the
configuration and of the hook need no process group; an error reaching every rank is tested across processes in
test_ddp.py)."""

from __future__ import annotations

from typing import Any

import sylvie_comm
from tests.integrations import workloads as wl


def _registration_error(codec: str | None, options: dict[str, Any]) -> str:
    """What registering a hook of ``codec`` with ``options`` raises, on one in-process rank: the checks of the
    configuration (``merge_config``) and of the hook (``HookState``) need no process group; carrying an error
    from one rank to the others is the adapter's, tested across processes above."""
    from sylvie_comm.algorithms.session import merge_config
    from sylvie_comm.collectives.local import LocalGroup
    from sylvie_comm.integrations.ddp import HookState

    config = options.pop("config", None)
    try:
        state = HookState(merge_config("ddp", codec, config, options), LocalGroup(1).transport(0),  # type: ignore[arg-type]
                          wl.mlp().named_parameters())  # fmt: skip
    except ValueError as exc:
        return str(exc)
    state.close()
    return "no error"


def test_invalid_options_raise_at_registration():
    def res(codec: str | None, **options: Any) -> str:
        return _registration_error(codec, options)

    assert "rank must be 'auto' or an integer >= 1, got 0" in res("acpsgd", rank=0)
    assert "ratio must be in (0, 1], got 0.0" in res("topk", ratio=0.0)
    assert "ratio must be in (0, 1]" in res("topk", ratio=1.5)
    warmup = res("powersgd", warmup_steps=1)
    assert "warmup_steps must be >= 2 with error feedback" in warmup and "rebuilds" in warmup
    codec = res("threebit")
    assert "unknown hook 'threebit'" in codec and "acpsgd" in codec
    assert "unknown option(s) ratio" in res("acpsgd", ratio=0.1)
    rule_rank0 = sylvie_comm.Config.from_dict({"codec": "acpsgd", "rules": [{"match": "0.*", "options": {"rank": 0}}]})
    assert "rules[0] (match '0.*'): acpsgd: rank must be 'auto' or an integer >= 1, got 0" in res(
        None, config=rule_rank0
    )
    rule_unknown = sylvie_comm.Config.from_dict({"codec": "topk", "rules": [{"match": "*", "options": {"rank": 2}}]})
    assert "rules[0] (match '*') sets unknown option(s) rank; per-name options: ratio" in res(None, config=rule_unknown)
    assert "bits must be 2, 4 or 8, got 4.0" in res("qsgd", bits=4.0)
    assert res("acpsgd", rank=4) == "no error"
