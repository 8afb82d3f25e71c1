"""The Lightning strategies check their codec, options and configuration in the constructor, in the process that
builds them, before Lightning starts the other processes: what the DDP hook (``sylvie_comm.ddp.register``) and the
FSDP2 reduce-scatter (``sylvie_comm.fsdp.register``) would refuse once every process had joined. No process group.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytest.importorskip("lightning")

import sylvie_comm
import sylvie_comm.lightning as sl


def _error(build: Any) -> str:
    try:
        build()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_the_ddp_strategy_refuses_what_the_hook_would_refuse() -> None:
    ddp = sl.CompressedDDPStrategy
    # Error feedback needs a warm-up past DDP's bucket rebuild: the hook's own rule, said in the constructor.
    msg = _error(lambda: ddp("onebit", options={"warmup_steps": 1}))
    assert msg.startswith("ValueError: sylvie_comm.lightning.CompressedDDPStrategy: ddp[onebit]: warmup_steps must "
                          "be >= 2 with error feedback (got 1)"), msg  # fmt: skip
    msg = _error(lambda: ddp(config=sylvie_comm.Config(codec="acpsgd", warmup_steps=0)))
    assert "ddp[acpsgd]: warmup_steps must be >= 2 with error feedback (got 0)" in msg, msg
    assert "unknown hook 'zip'" in _error(lambda: ddp("zip")), _error(lambda: ddp("zip"))
    msg = _error(lambda: ddp("qsgd", options={"ratio": 0.1}))
    assert "qsgd: unknown option(s) ratio; valid: bits, block, error_feedback" in msg, msg
    # A per-name rule the algorithm cannot honour (checked by the hook's policy).
    cfg = sylvie_comm.Config.from_dict({"codec": "qsgd", "rules": [{"match": "fc.*", "options": {"rank": 2}}]})
    msg = _error(lambda: ddp(config=cfg))
    assert "qsgd: rules[0] (match 'fc.*') sets unknown option(s) rank" in msg, msg


def test_the_model_parallel_strategy_refuses_what_the_reduce_scatter_would_refuse() -> None:
    mp = sl.CompressedModelParallelStrategy
    msg = _error(lambda: mp("acpsgd"))
    assert "acpsgd: no reduce-scatter form" in msg and "replica all-reduce of HSDP" in msg, msg
    msg = _error(lambda: mp("qsgd", options={"warmup": "auto"}))
    assert "warmup 'auto' watches whole averaged gradients" in msg, msg
    assert "unknown codec 'zip'" in _error(lambda: mp("zip")), _error(lambda: mp("zip"))
    msg = _error(lambda: mp("onebit", options={"bits": 4}))
    assert "onebit: unknown option(s) bits" in msg, msg


def test_what_the_hooks_accept_is_accepted_and_the_check_leaves_nothing_running() -> None:
    before = threading.active_count()
    strategies = [
        sl.CompressedDDPStrategy("onebit", options={"warmup_steps": 2}),
        sl.CompressedDDPStrategy("acpsgd", options={"rank": 4}),
        sl.CompressedDDPStrategy("auto"),  # candidates on forked transports, a thread each where serial
        sl.CompressedDDPStrategy("qsgd", options={"bits": 2, "warmup": "auto"}),
        sl.CompressedDDPStrategy("fp16", options={"warmup_steps": 0}),  # no error feedback: no warm-up needed
        # No bucket rebuild under FSDP2: the reduce-scatter takes error feedback from the first step.
        sl.CompressedModelParallelStrategy("onebit", options={"warmup_steps": 0}),
        sl.CompressedModelParallelStrategy("qsgd", options={"bits": 2}),
    ]
    assert [s._sylvie_config.codec for s in strategies] == ["onebit", "acpsgd", "auto", "qsgd", "fp16", "onebit",
                                                            "qsgd"]  # fmt: skip
    assert threading.active_count() == before
    assert all(s.compression_state is None for s in strategies)  # nothing registered before fit
