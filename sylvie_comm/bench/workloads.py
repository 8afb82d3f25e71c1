"""The DDP benchmarks' workloads: a model, the batch each worker trains on, and its loss.

* ``mlp_17m``: the communication-heavy MLP of the DDP benchmarks (:func:`mlp_17m`: 512 -> 2048,
  four 2048 x 2048 layers, -> 10; 17.9M parameters), batch 32 of Gaussian inputs (the hook-cost
  benchmark of :mod:`sylvie_comm.bench.ddp` trains each rank on one fixed batch, :func:`fixed_batch`);
* ``lm``: a small decoder-only transformer language model (vocabulary 8192, width 256,
  2 pre-norm layers of 4 heads, feed-forward 1024, causal; 5.8M parameters, 72% of them in
  the token embedding and the output projection), batch 8 sequences of 32 synthetic tokens;
* ``small``: a 0.2M-parameter MLP for quick checks of the benchmark itself.

The language model's tokens are synthetic (generated on the fly, no data set to load) and
follow a pattern rather than noise: each sequence starts at a random token and steps by a
random stride in 1..8 (modulo the vocabulary); the model predicts the next token. Dropout
is 0, so every run from the same seeds computes the same gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 8192
SEQ_LEN = 32
LM_WIDTH = 256
LM_LAYERS = 2
LM_HEADS = 4
LM_FF = 1024
MAX_STRIDE = 8
IN_FEATURES = 512


def mlp_17m(seed: int = 0) -> nn.Module:
    """The 17.9M-parameter MLP (512 -> 2048, four 2048 x 2048 layers, -> 10, ReLU between), from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(IN_FEATURES, 2048), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    layers.append(nn.Linear(2048, 10))
    return nn.Sequential(*layers)


def fixed_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch of 32 samples of :func:`mlp_17m` rank ``rank`` trains on in every run of the hook-cost
    benchmark (:mod:`sylvie_comm.bench.ddp`, and its Horovod rows)."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(32, IN_FEATURES, generator=g), torch.randint(0, 10, (32,), generator=g)


class TransformerLM(nn.Module):
    """A decoder-only transformer: token + position embeddings, pre-norm causal layers, a vocabulary projection."""

    def __init__(self, vocab: int = VOCAB, width: int = LM_WIDTH, layers: int = LM_LAYERS, heads: int = LM_HEADS,
                 ff: int = LM_FF, seq_len: int = SEQ_LEN) -> None:  # fmt: skip
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq_len, width)
        layer = nn.TransformerEncoderLayer(width, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.seq_len = seq_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        if n > self.seq_len:
            raise ValueError(f"TransformerLM: sequence length {n} is over the model's {self.seq_len}")
        pos = torch.arange(n, device=tokens.device)
        h = self.tokens(tokens) + self.positions(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        h = self.layers(h, mask=mask, is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out


def transformer_lm(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TransformerLM()


def small_mlp(seed: int = 0) -> nn.Module:
    """A 0.2M-parameter MLP (512 -> 256 -> 256 -> 10) for quick checks of the benchmark itself."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _classify_batch(batch: int) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def make(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, IN_FEATURES, generator=gen), torch.randint(0, 10, (batch,), generator=gen)

    return make


def lm_batch(gen: torch.Generator, batch: int = 8, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` synthetic sequences of ``seq_len + 1`` tokens: inputs and next-token targets."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
    stride = torch.randint(1, MAX_STRIDE + 1, (batch, 1), generator=gen)
    seq = (start + stride * torch.arange(seq_len + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def _cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


@dataclass(frozen=True)
class Workload:
    """What one benchmark step trains: ``model(seed)``, ``batch(generator) -> (input, target)``, ``loss``."""

    model: Callable[[int], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    batch_size: int  # samples (sequences for the language model) per worker and step
    describe: str
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _cross_entropy


LM_DESCRIPTION = (
    f"transformer LM (vocab {VOCAB}, width {LM_WIDTH}, {LM_LAYERS} layers x {LM_HEADS} heads, ff {LM_FF}), "
    f"batch 8 x {SEQ_LEN} synthetic tokens"
)
WORKLOADS: dict[str, Workload] = {
    "mlp_17m": Workload(mlp_17m, _classify_batch(32), 32, "MLP 512-2048x5-10, batch 32 of Gaussian inputs"),
    "lm": Workload(transformer_lm, lm_batch, 8, LM_DESCRIPTION),
    "small": Workload(small_mlp, _classify_batch(32), 32, "MLP 512-256-256-10, batch 32 (quick checks)"),
}


def check_workload(name: str) -> Workload:
    """The workload named ``name``; ValueError naming it and the valid ones otherwise."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]
