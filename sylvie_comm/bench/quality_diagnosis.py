"""What compression does to each kind of layer, measured in a quality run (``sylvie-comm bench quality --diagnose``).

:func:`layer_kinds` sorts a model's parameters into convolution, linear, embedding, attention, LayerNorm and bias;
:class:`Diagnosis` measures, every step and per kind, the cosine and the relative error between the sent and the
true averaged gradient, the relative residual, how much of ``||g||^2`` one compression removes
(:func:`one_shot_removed`) and, with Adam, the second moment the optimizer holds over the one the true gradients
build.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sylvie_comm.algorithms import ALGORITHMS

KINDS = ("conv", "linear", "embedding", "attention", "layernorm", "bias")


def layer_kinds(model: nn.Module) -> dict[str, str]:
    """Each parameter's kind: conv, linear, embedding, attention (the projections of an attention layer),
    layernorm, or bias (any other 1-D parameter)."""
    kinds: dict[str, str] = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if isinstance(module, nn.LayerNorm):
                kind = "layernorm"
            elif p.dim() < 2:
                kind = "bias"
            elif isinstance(module, nn.MultiheadAttention) or ".self_attn." in f".{name}":
                kind = "attention"
            elif isinstance(module, nn.Conv2d):
                kind = "conv"
            elif isinstance(module, nn.Embedding):
                kind = "embedding"
            else:
                kind = "linear"
            kinds[name] = kind
    return kinds


def one_shot_removed(hook: str, options: Mapping[str, Any], g: torch.Tensor) -> float | None:
    """The fraction of ``||g||^2`` one compression by ``hook``'s codec removes (no error feedback), for the
    codecs that compress one tensor alone; for the low-rank hooks, the best rank-r approximation's (SVD)."""
    from sylvie_comm.codecs import get_codec

    cls = ALGORITHMS.get(hook)
    low_rank = cls is not None and cls.record.low_rank
    if g.dim() < 2 and low_rank:
        return None
    energy = float(g.pow(2).sum())
    if energy == 0:
        return None
    if low_rank:
        from sylvie_comm.codecs import lowrank

        alternate = bool(getattr(cls, "alternate", False))  # one factor per step (ACP-SGD): its own auto rank
        r = lowrank.effective_rank(g.shape, options.get("rank", lowrank.AUTO), alternate=alternate)
        s = torch.linalg.svdvals(g.reshape(g.shape[0], -1).double())
        return float(s[r:].pow(2).sum() / s.pow(2).sum())
    codecs: dict[str, tuple[str, dict[str, Any]]] = {
              "onebit": ("onebit", {k: options[k] for k in ("chunk_size", "scale") if k in options}),
              "sign": ("sign", {}), "topk": ("topk", {k: options[k] for k in ("ratio",) if k in options}),
              "qsgd": ("qbit", {"bits": int(options.get("bits", 4))})}  # fmt: skip
    if hook not in codecs:
        return None
    name, opts = codecs[hook]
    codec = get_codec(name, **opts)
    out = codec.decode(codec.encode(g.detach().clone()))
    return float((g - out.reshape(g.shape)).pow(2).sum()) / energy


class Diagnosis:
    """What compression does to each kind of layer, measured in the run itself.

    Every step, the batch's gradient is first taken locally (``no_sync``) and averaged in fp32 (the true
    gradient); then the hook's backward pass runs on the same batch (what is sent). Per kind: the mean
    cosine between sent and true, their relative error, the relative residual (the norm of the summed
    differences, ``sum(true - sent)``, over the norm of the summed true gradients: what error feedback
    still owes, as a share of all that was to be sent), the fraction of ``||g||^2`` one compression
    removes, and with Adam the second moment the optimizer holds over the one the true gradients build.
    """

    def __init__(self, model: nn.Module, hook: str, options: Mapping[str, Any], opt: torch.optim.Optimizer) -> None:
        self.kinds = layer_kinds(model)
        self.params = dict(model.named_parameters())
        self.hook, self.options, self.opt = hook, options, opt
        self.cum_err = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.cum_true = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.v_true = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.sums: dict[str, dict[str, float]] = {}
        self.steps = 0

    def true_gradients(self) -> dict[str, torch.Tensor]:
        from sylvie_comm.collectives import fusion

        names = [n for n, p in self.params.items() if p.grad is not None]
        out = {n: torch.empty_like(self.params[n]) for n in names}
        flat = fusion.pack([self.params[n].grad for n in names])  # type: ignore[misc]
        dist.all_reduce(flat)
        fusion.unpack(flat, list(out.values()), divide_by=dist.get_world_size())
        return out

    def _add(self, kind: str, key: str, value: float, weight: float = 1.0) -> None:
        row = self.sums.setdefault(kind, {})
        row[key] = row.get(key, 0.0) + value * weight
        row[key + "#w"] = row.get(key + "#w", 0.0) + weight

    def observe(self, true: dict[str, torch.Tensor], beta2: float | None) -> None:
        self.steps += 1
        shot = self.steps % 50 == 1
        for n, t in true.items():
            p = self.params[n]
            if p.grad is None:
                continue
            sent, kind, w = p.grad, self.kinds[n], float(t.pow(2).sum())
            tn, sn = float(t.norm()), float(sent.norm())
            if tn > 0 and sn > 0:
                self._add(kind, "cosine", float((sent * t).sum()) / (tn * sn), w)
            if tn > 0:
                self._add(kind, "relative_error", float((sent - t).norm()) / tn, w)
            self.cum_err[n] += t - sent
            self.cum_true[n] += t
            if beta2 is not None:
                self.v_true[n].mul_(beta2).addcmul_(t, t, value=1 - beta2)
            if shot:
                removed = one_shot_removed(self.hook, self.options, t)
                if removed is not None:
                    self._add(kind, "one_shot_removed", removed, w)

    def report(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for kind, row in self.sums.items():
            out[kind] = {k: row[k] / row[k + "#w"] for k in row if not k.endswith("#w") and row[k + "#w"] > 0}
        for kind in out:
            names = [n for n in self.params if self.kinds[n] == kind]
            err = sum(float(self.cum_err[n].pow(2).sum()) for n in names) ** 0.5
            tot = sum(float(self.cum_true[n].pow(2).sum()) for n in names) ** 0.5
            out[kind]["relative_residual"] = err / tot if tot > 0 else 0.0
            states = [self.opt.state.get(self.params[n], {}).get("exp_avg_sq") for n in names]
            if all(v is not None for v in states) and states:
                held = sum(float(v.sum()) for v in states if v is not None)
                built = sum(float(self.v_true[n].sum()) for n in names)
                if built > 0:
                    out[kind]["adam_v_ratio"] = held / built
            out[kind]["parameters"] = float(sum(self.params[n].numel() for n in names))
        return out
