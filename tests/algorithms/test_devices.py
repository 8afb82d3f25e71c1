"""Every tensor follows the data it serves: the algorithms, codecs and fused buffers on the ``meta`` device.

A tensor on ``meta`` has a device, a shape and a dtype but no data: a buffer made on the CPU for it fails to
mix with it (``Cannot copy out of meta tensor``), and so does any read of a value on the host (``.item()``,
``.tolist()``, ``float(t)``), as they would mix devices or stall the stream on a GPU. Each algorithm runs, ranks
as threads of the in-process transport (which carries meta tensors), behind its policy for enough steps to pass
its warm-up (and ``auto``'s probes), with its outputs and every tensor of its state on ``meta``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import ALGORITHMS, Group, Member, Policy, make_algorithm
from sylvie_comm.codecs import CODECS, get_codec
from sylvie_comm.collectives import fusion
from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import Config

META = torch.device("meta")
SHAPES = {"a.weight": (24, 40), "a.bias": (24,), "b.weight": (16, 24), "c.weight": (3, 5, 7)}
STEPS = 12  # warm-up (2), auto's probes (2 x 4 candidates), then its choice


def tensors_of(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    return []


def run_on(device: torch.device, name: str, world: int, flat: bool = True,
           options: dict[str, Any] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    config = Config(codec=name, options=options or {})

    def body(tr: Any) -> dict[str, Any]:
        alg = make_algorithm(name, tr, config.options)
        policy = Policy(alg, config)
        outs: list[torch.Tensor] = []
        for step in range(STEPS):
            numel = sum(torch.Size(s).numel() for s in SHAPES.values())
            buf = torch.empty(numel, device=device) if device == META else torch.randn(numel)
            members, at = [], 0
            for n, s in SHAPES.items():
                k = torch.Size(s).numel()
                compress, options = policy.member_options(n, s)
                t = buf[at : at + k].view(s) if flat else buf[at : at + k].view(s).clone()
                members.append(Member(n, t, compress, options))
                at += k
            policy(Group(0, members, flat=buf if flat else None), step).wait()
            outs = [m.tensor for m in members]
        state = alg.state_dict()
        alg.close()
        return {"outs": outs, "state": tensors_of(state), "memory": alg.memory_bytes()}

    return run_local(world, body)


# One rank, two ranks on separate tensors, four on one bucket: each world size and both layouts once (a meta run
# is about thirty times a CPU run's time, as every op goes through Python's meta functions).
@pytest.mark.parametrize(
    ("world", "flat"), [(1, True), (2, False), (4, True)], ids=["1-bucket", "2-tensors", "4-bucket"]
)
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_runs_with_its_tensors_on_the_meta_device(name: str, world: int, flat: bool) -> None:
    for r in run_on(META, name, world, flat):
        assert all(t.device == META for t in r["outs"]), name
        assert all(t.device == META for t in r["state"]), (name, {t.device for t in r["state"]})
        if ALGORITHMS[name].record.error_feedback and name != "auto":
            assert r["state"], f"{name} kept no state"


def test_qsgd_merged_rows_run_on_the_meta_device() -> None:
    """qsgd's ``block``: rows viewed under fewer scales, the no-feedback encode too, with no buffer off ``meta``."""
    for options in ({"block": 64}, {"block": 64, "error_feedback": False}):
        for r in run_on(META, "qsgd", 2, True, options):
            assert all(t.device == META for t in r["outs"] + r["state"]), options


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_the_same_state_structure_on_the_cpu_and_on_meta(name: str) -> None:
    """The meta run keeps what the CPU run keeps: as many tensors, of the same shapes and dtypes."""
    cpu, meta = run_on(torch.device("cpu"), name, 2)[0], run_on(META, name, 2)[0]
    if name != "auto":  # auto's choice, and hence what its candidates keep, depends on timing
        assert [(t.shape, t.dtype) for t in cpu["state"]] == [(t.shape, t.dtype) for t in meta["state"]]
        assert cpu["memory"] == meta["memory"]


@pytest.mark.parametrize("name", sorted(CODECS))
def test_every_codec_encodes_and_decodes_on_meta(name: str) -> None:
    codec = get_codec(name)
    x = torch.empty(24, 40, device=META)
    enc = codec.encode(x)
    assert all(p.device == META for p in enc.payload), name
    out = codec.decode(enc)
    assert out.device == META and out.shape == x.shape and out.dtype == x.dtype


def test_fused_buffers_stay_on_the_device_of_their_tensors() -> None:
    ts = [torch.empty(3, 4, device=META), torch.empty(5, device=META)]
    buf = fusion.pack(ts)
    assert buf.device == META and buf.numel() == 17
    fusion.unpack(buf, ts, divide_by=2.0)


@pytest.mark.parametrize("name", ["acpsgd", "powersgd", "onebit", "topk", "qsgd", "sign"])
def test_a_cpu_checkpoint_is_placed_on_the_device_of_the_tensors_it_serves(name: str) -> None:
    """State written where the gradients were on the CPU, loaded where they are on another device (``meta``
    here, as CUDA on a GPU): every state tensor ends up on that device."""
    config = Config(codec=name)
    saved = {}

    def write(tr: Any) -> None:
        alg = make_algorithm(name, tr, config.options)
        policy = Policy(alg, config)
        for step in range(4):
            members = [Member(n, torch.randn(s), *policy.member_options(n, s)) for n, s in SHAPES.items()]
            policy(Group(0, members), step).wait()
        saved[tr.rank] = alg.state_dict()
        alg.close()

    run_local(2, write)

    def resume(tr: Any) -> list[torch.device]:
        alg = make_algorithm(name, tr, config.options)
        policy = Policy(alg, config)
        alg.check_state_dict(saved[tr.rank], policy.compressed_tensors(SHAPES.items()), stepped=True)
        alg.load_state_dict(saved[tr.rank])
        for step in range(4, 6):
            members = [Member(n, torch.empty(s, device=META), *policy.member_options(n, s)) for n, s in SHAPES.items()]
            policy(Group(0, members), step).wait()
        devices = [t.device for t in tensors_of(alg.state_dict())]
        alg.close()
        return devices

    for devices in run_local(2, resume):
        assert devices and all(d == META for d in devices), (name, set(devices))
