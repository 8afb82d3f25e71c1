"""The GNN trainer with ``compile=True``: the same losses and logits as eager, synchronous and stale.

The model is compiled around DDP (DDPOptimizer splits it at DDP's buckets); the halo exchange is opaque to
Dynamo (``torch.compiler.disable``), so each layer's dense part is compiled and the exchange runs as in eager.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from tests.dist_utils import run_distributed
from tests.gnn import workloads as gw

pytestmark = pytest.mark.multiprocess

EPOCHS = 4
CASES = [("sage", 0), ("sage", 1), ("gcn", 1)]


def _worker(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for model, staleness in CASES:
        base = {"model": model, "hidden": 16, "layers": 2, "backend": "torch", "staleness": staleness}
        eager = gw.run(rank, world, base, EPOCHS)
        compiled_before = counters["aot_autograd"]["total"]
        compiled = gw.run(rank, world, {**base, "compile": True}, EPOCHS)
        out[f"{model}/{staleness}"] = {
            "eager": eager,
            "compiled": compiled,
            "graphs": counters["aot_autograd"]["total"] - compiled_before,
        }
    return out


def test_compiled_gnn_trains_as_eager():
    results = run_distributed(_worker, 2, timeout=600)
    for res in results:
        for key, r in res.items():
            eager, compiled = r["eager"], r["compiled"]
            losses_e = [h["loss"] for h in eager["history"]]
            losses_c = [h["loss"] for h in compiled["history"]]
            assert len(losses_c) == EPOCHS
            torch.testing.assert_close(losses_c, losses_e, rtol=0, atol=1e-5, msg=key)
            torch.testing.assert_close(compiled["logits"], eager["logits"], rtol=0, atol=1e-5, msg=key)
            for g, h in zip(compiled["grads"], eager["grads"], strict=True):
                torch.testing.assert_close(g, h, rtol=0, atol=1e-5, msg=key)
            # The same halo traffic (the exchange ran, every layer, every epoch) and the model compiled.
            assert [h["halo_bytes"] for h in compiled["history"]] == [h["halo_bytes"] for h in eager["history"]]
            assert compiled["history"][-1]["halo_bytes"] > 0, key
        assert res["sage/0"]["graphs"] >= 2, res["sage/0"]["graphs"]  # pieces between the exchanges
    # Staleness 1 moved the losses away from synchronous training (the stale rows were used), as in eager.
    first = results[0]
    assert first["sage/1"]["compiled"]["history"][2]["loss"] != first["sage/0"]["compiled"]["history"][2]["loss"]
