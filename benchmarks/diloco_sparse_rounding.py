"""Deterministic against stochastic rounding in SparseLoCo's codec under its error feedback (decay 0.95): a stream
of 64 steps x = mean + noise (a persistent direction plus fresh noise, as pseudo-gradients), 262,144 values in
chunks of 4,096, density 1/64. Reports the error of what was sent in total against the error-fed ideal."""
import json, torch
from sylvie_comm.codecs import sparse
from sylvie_comm.codecs.sparse import ChunkPlan
n, steps, decay = 1 << 18, 64, 0.95
plan = ChunkPlan.of(n, 4096, 1 / 64)
out = {}
for rounding in ("deterministic", "stochastic"):
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(n, generator=g)
    e = torch.zeros(n); sent_total = torch.zeros(n); ideal = torch.zeros(n); step_err = 0.0
    topk_only = torch.zeros(n); e2 = torch.zeros(n)
    for t in range(steps):
        x = mean + 2 * torch.randn(n, generator=g)
        e = decay * e + x
        enc = sparse.encode(e, plan, rounding, seed=t)
        sent = sparse.decode(enc, plan)
        kept = torch.zeros(n); kept[(sent != 0)] = e[(sent != 0)]
        step_err += float((sent - kept).norm() / kept.norm()) / steps
        e = e - sent
        sent_total += sent; ideal += x
    out[rounding] = {"quantization_error_of_kept_values": step_err,
                     "sent_total_vs_input_total_rel_error": float((sent_total - ideal).norm() / ideal.norm()),
                     "cosine_sent_total_input_total": float(torch.nn.functional.cosine_similarity(sent_total, ideal, dim=0))}
print(json.dumps(out, indent=1))
