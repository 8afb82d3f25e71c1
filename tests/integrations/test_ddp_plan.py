"""A DDP bucket's plan is built once: the group of views into its buffer is reused step after step, the bucket's
parameters read again only until DDP has rebuilt its buckets, and a new buffer or new parameters make a new plan.

One in-process rank and a stand-in for DDP's ``GradBucket`` (index, buffer, parameters): the plan is the adapter's,
with no process group in it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sylvie_comm.algorithms.session import merge_config
from sylvie_comm.collectives.local import LocalGroup
from sylvie_comm.integrations.ddp import HookState


class Bucket:
    """What the hook reads of DDP's ``GradBucket``; counts the reads of its parameters."""

    def __init__(self, index: int, params: list[nn.Parameter], buffer: torch.Tensor) -> None:
        self._index, self._params, self._buffer = index, params, buffer
        self.reads = 0

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[nn.Parameter]:
        self.reads += 1
        return self._params

    def is_last(self) -> bool:
        return True


class Model:
    """DDP's flag as the hook reads it (``_has_rebuilt_buckets``)."""

    _has_rebuilt_buckets = False


def _state(net: nn.Module, model: Any = None) -> HookState:
    config = merge_config("ddp", "onebit", None, {"warmup_steps": 2})
    state = HookState(config, LocalGroup(1).transport(0), net.named_parameters())  # type: ignore[arg-type]
    if model is not None:
        state.watch(model)
    return state


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def test_the_group_is_built_once_and_the_parameters_read_until_the_buckets_are_final() -> None:
    net, model = _net(), Model()
    params = list(net.parameters())
    buf = torch.zeros(sum(p.numel() for p in params))
    bucket = Bucket(0, params, buf)
    state = _state(net, model)
    try:
        assert state._group(bucket, 0).members == [] and bucket.reads == 0  # the warm-up: the whole buffer
        first = state._group(bucket, 2)
        assert [m.name for m in first.members] == ["0.weight", "0.bias", "1.weight", "1.bias"]
        assert first.members[0].tensor.data_ptr() == buf.data_ptr() and first.members[0].tensor.shape == (16, 8)
        assert state._group(bucket, 3) is first and bucket.reads == 2  # DDP may still rebuild: read, not rebuilt
        model._has_rebuilt_buckets = True
        assert state._group(bucket, 4) is first and bucket.reads == 3
        for step in range(5, 10):
            assert state._group(bucket, step) is first
        assert bucket.reads == 3  # final buckets, same buffer: nothing read
        assert first.signature is first.signature  # computed once per group
        other = Bucket(0, params, torch.zeros_like(buf))  # DDP hands over another buffer
        second = state._group(other, 10)
        assert second is not first and second.members[0].tensor.data_ptr() == other.buffer().data_ptr()
        assert other.reads == 1
    finally:
        state.close()


def test_without_ddps_flag_the_parameters_are_read_every_step_and_a_change_makes_a_new_plan() -> None:
    net = _net()
    params = list(net.parameters())
    buf = torch.zeros(sum(p.numel() for p in params))
    state = _state(net)
    try:
        bucket = Bucket(0, params, buf)
        first = state._group(bucket, 2)
        assert state._group(bucket, 3) is first and bucket.reads == 2
        rebuilt = Bucket(0, params[::-1], buf)  # the same buffer, the parameters in another order
        second = state._group(rebuilt, 4)
        assert second is not first and [m.name for m in second.members] == ["1.bias", "1.weight", "0.bias", "0.weight"]
        assert second.members[1].tensor.shape == (4, 16) and second.members[1].tensor.storage_offset() == 4
    finally:
        state.close()
