"""SparseLoCo's 2-bit values: deterministic against stochastic rounding under its decaying error feedback.

A stream of 64 steps ``x = mean + 2 * noise`` (a steady direction plus fresh noise, as pseudo-gradients are),
262,144 values in chunks of 4,096, density 1/64, decay 0.95. Per rounding: the relative error of the kept values'
2-bit form (mean over steps), and how far the sum of what was sent is from the sum of the inputs.

Run: ``PYTHONPATH=. python benchmarks/diloco_sparse_rounding.py``.
"""

import json

import torch

from sylvie_comm.codecs import sparse
from sylvie_comm.codecs.sparse import ChunkPlan

N, STEPS, DECAY = 1 << 18, 64, 0.95


def measure(rounding: str) -> dict[str, float]:
    plan = ChunkPlan.of(N, 4096, 1 / 64)
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(N, generator=g)
    e, sent_total, input_total, error = torch.zeros(N), torch.zeros(N), torch.zeros(N), 0.0
    for t in range(STEPS):
        x = mean + 2 * torch.randn(N, generator=g)
        e = DECAY * e + x
        sent = sparse.decode(sparse.encode(e, plan, rounding, seed=t), plan)
        kept = torch.where(sent != 0, e, torch.zeros(()))
        error += float((sent - kept).norm() / kept.norm()) / STEPS
        e = e - sent
        sent_total += sent
        input_total += x
    return {
        "quantization_error_of_kept_values": error,
        "sent_total_vs_input_total_rel_error": float((sent_total - input_total).norm() / input_total.norm()),
        "cosine_sent_total_input_total": float(torch.nn.functional.cosine_similarity(sent_total, input_total, dim=0)),
    }


if __name__ == "__main__":
    print(json.dumps({r: measure(r) for r in sparse.ROUNDINGS}, indent=1))
