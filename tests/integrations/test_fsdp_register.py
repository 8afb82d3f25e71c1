"""What ``sylvie_comm.fsdp.register`` refuses at register time, before any training step, on gloo: a model that is
registered already (2 ranks), and an HSDP ``replicas`` group that is not the replica dimension of the model's
device mesh (4 ranks: 2 replicas of 2 shards). Tiny models; one start of the processes per test."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.integrations import fsdp_worker as fw

pytestmark = pytest.mark.multiprocess


def test_a_second_register_is_refused_until_the_first_state_is_closed() -> None:
    for res in run_distributed(fw.register_twice, 2, timeout=300):
        for key, model, unit in (("again", "FSDPSequential", "0"), ("unit", "FSDPLinear", "<root>")):
            msg = res[key]
            assert msg.startswith(f"ValueError: sylvie_comm.fsdp.register: this {model} is registered already: "
                                  f"its FSDP unit '{unit}' belongs to an open state (codec 'qsgd')"), msg  # fmt: skip
            assert "close() of that state releases it, then register again" in msg, msg
        assert res["first_bytes"] > 0  # the first state kept its units
        assert res["second_bytes"] > 0  # registered after the first's close(), and that close() once more left it
        assert res["first_bytes_after"] == res["first_bytes"]


def test_a_replicas_group_that_is_not_the_mesh_replica_dimension_is_refused_at_register() -> None:
    res = run_distributed(fw.replica_groups, 4, timeout=300)
    for rank, r in enumerate(res):
        mine = rank % 2  # shard index; mesh [[0, 1], [2, 3]]
        shards = [2 * (rank // 2), 2 * (rank // 2) + 1]
        msg = r["world"]
        assert msg.startswith("ValueError: sylvie_comm.fsdp.register: replicas is a group of 4 ranks [0, 1, 2, 3] "
                              "that does not match the model's shard layout"), msg  # fmt: skip
        assert f"expected the ranks [{mine}, {mine + 2}]: the 'replicate' dimension of the model's device mesh" in msg
        assert f"rank {rank} shards over the FSDP group of ranks {shards}" in msg, msg
        msg = r["shard_group"]
        assert f"replicas is a group of 2 ranks {shards} that does not match" in msg, msg
        assert f"expected the ranks [{mine}, {mine + 2}]" in msg, msg
        msg = r["native_hsdp"]
        assert "the model's FSDP mesh replicates already (HSDP: a 2-D mesh in fully_shard)" in msg, msg
        msg = r["one_d"]  # a 1-D mesh of its own: no replicate dimension to name
        assert "replicas is a group of 4 ranks [0, 1, 2, 3] that does not match the model's shard layout" in msg, msg
        assert "holds other ranks of this rank's own shard group [0, 1, 2, 3]" in msg, msg
        assert (
            "is registered already: its FSDP unit '0' belongs to an open state (codec 'acpsgd', replicas)"
            in (r["twice"])
        ), r["twice"]
        assert r["good_bytes"] > 0
        assert r["wide"] == "bitwise", r["wide"]  # 1 replica of 4 shards: codec none is FSDP2's own, bit for bit
