"""Real models built from code, random weights, for the whole-step benchmark (:mod:`sylvie_comm.bench.step`).

* :func:`resnet50`: the bottleneck ResNet-50 of He et al. 2016 (https://arxiv.org/abs/1512.03385), as torchvision
  builds it (stride on the 3 x 3 convolution, "v1.5"): a 7 x 7 stem and max-pool, four stages of bottleneck blocks
  (3, 4, 6, 3) of widths 64, 128, 256, 512 (x 4 out), average pool, a linear classifier: 25,557,032 parameters at
  1,000 classes, torchvision's count. ``width`` and ``blocks`` scale it down for quick checks.
* :class:`SmallResNet`: a BatchNorm ResNet of three basic blocks for 28 x 28 images (the quality benchmark's
  ``resnet`` workload, :mod:`sylvie_comm.bench.quality`).
* :func:`gpt2`: a decoder of GPT-2 small's sizes (Radford et al. 2019): 12 pre-norm layers of width 768, 12 heads,
  feed-forward 3,072 with GELU, a vocabulary of 50,257, 1,024 learned positions, the output projection tied to
  the token embedding: 124,439,808 parameters, GPT-2 small's count. It is
  :class:`~sylvie_comm.bench.workloads.TransformerLM` (PyTorch's ``nn.TransformerEncoderLayer`` under a causal
  mask) with GPT-2's activation and its tied head without bias; every size is an argument.

Random weights, PyTorch's default initialization but for the decoder's embeddings (GPT-2's normal of standard
deviation 0.02); no data set is read: what a step costs does not depend on the values.

:func:`workload` gives each at the benchmark's sizes (``full``) or tiny ones for a quick check on the CPU, with its
synthetic batch (made on the device) and its optimizer: SGD momentum 0.9 for ResNet-50, AdamW for the decoder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sylvie_comm.bench.kit import LR, MOMENTUM
from sylvie_comm.bench.workloads import TransformerLM

RESNET50_BLOCKS = (3, 4, 6, 3)
EXPANSION = 4  # a bottleneck block's output is 4x its width
ADAMW_LR = 3e-4


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout)]


class Bottleneck(nn.Module):
    """1 x 1 down to ``width``, 3 x 3 at ``stride``, 1 x 1 up to ``4 * width``, plus the (projected) input."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        out = EXPANSION * width
        self.body = nn.Sequential(
            *_conv_bn(cin, width, 1), nn.ReLU(inplace=True),
            *_conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
            *_conv_bn(width, out, 1),
        )  # fmt: skip
        self.skip = nn.Sequential(*_conv_bn(cin, out, 1, stride)) if stride != 1 or cin != out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


class ResNet(nn.Module):
    """Stem (7 x 7 stride 2, max-pool), stages of :class:`Bottleneck` blocks, average pool, classifier."""

    def __init__(self, width: int = 64, blocks: Sequence[int] = RESNET50_BLOCKS, classes: int = 1000) -> None:
        super().__init__()
        if width < 1 or classes < 1 or not blocks or min(blocks) < 1:
            raise ValueError(f"ResNet: width, classes and every stage's blocks must be >= 1, got width {width}, "
                             f"blocks {tuple(blocks)}, classes {classes}")  # fmt: skip
        stages: list[nn.Module] = []
        cin = width
        for i, n in enumerate(blocks):
            w = width << i
            for j in range(n):
                stages.append(Bottleneck(cin, w, 2 if i > 0 and j == 0 else 1))
                cin = EXPANSION * w
        self.stem = nn.Sequential(*_conv_bn(3, width, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stages(self.stem(x))
        out: torch.Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))
        return out


class BasicBlock(nn.Module):
    """Two 3 x 3 convolutions with BatchNorm (the first at ``stride``), plus the input (projected by a 1 x 1
    convolution and BatchNorm where the shape changes): ResNet-18's block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(cin, cout, 3, stride), nn.ReLU(inplace=True), *_conv_bn(cout, cout, 3))
        self.skip = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


class SmallResNet(nn.Module):
    """A small BatchNorm ResNet for 28 x 28 grey images: a 3 x 3 stem of ``width`` channels with BatchNorm, one
    :class:`BasicBlock` per stage at widths ``width``, ``2 width``, ``4 width`` (the later two at stride 2), average
    pool, a linear classifier. At ``width`` 16: 29 parameter tensors, 77,754 parameters."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        if width < 1 or classes < 1:
            raise ValueError(f"SmallResNet: width and classes must be >= 1, got width {width}, classes {classes}")
        self.stem = nn.Sequential(*_conv_bn(1, width, 3), nn.ReLU(inplace=True))
        self.stages = nn.Sequential(BasicBlock(width, width, 1), BasicBlock(width, 2 * width, 2),
                                    BasicBlock(2 * width, 4 * width, 2))  # fmt: skip
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stages(self.stem(x))
        out: torch.Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))
        return out


def resnet50(width: int = 64, blocks: Sequence[int] = RESNET50_BLOCKS, classes: int = 1000, seed: int = 0) -> ResNet:
    """ResNet-50 (bottleneck, 25,557,032 parameters at the defaults) from ``seed``; ``width``, ``blocks`` shrink it."""
    torch.manual_seed(seed)
    return ResNet(width, blocks, classes)


class GPT2(TransformerLM):
    """:class:`~sylvie_comm.bench.workloads.TransformerLM` with GPT-2's GELU and its output projection tied to the
    token embedding (no bias)."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__(vocab, width, layers, heads, EXPANSION * width, context)
        for layer in self.layers.layers:
            layer.activation = F.gelu  # TransformerLM's layers use ReLU; GPT-2's feed-forward uses GELU
            layer.activation_relu_or_gelu = 2  # what nn.TransformerEncoderLayer sets for activation="gelu"
        for emb in (self.tokens, self.positions):
            nn.init.normal_(emb.weight, std=0.02)  # GPT-2's (PyTorch's N(0, 1) makes the tied head's logits huge)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as GPT-2's


def gpt2(vocab: int = 50257, width: int = 768, layers: int = 12, heads: int = 12, context: int = 1024,
         seed: int = 0) -> GPT2:  # fmt: skip
    """A decoder of GPT-2 small's sizes (124,439,808 parameters at the defaults) from ``seed``."""
    if width % heads:
        raise ValueError(f"gpt2: width {width} must be a multiple of heads {heads}")
    torch.manual_seed(seed)
    return GPT2(vocab, width, layers, heads, context)


# The sizes of each model: ``full`` the benchmark's, ``tiny`` for a quick check of the bench itself on the CPU.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "resnet50": {
        "full": {"width": 64, "blocks": RESNET50_BLOCKS, "classes": 1000, "image": 224, "batch": 32},
        "tiny": {"width": 4, "blocks": (1, 1, 1, 1), "classes": 10, "image": 32, "batch": 4},
    },
    "gpt2": {
        "full": {"vocab": 50257, "width": 768, "layers": 12, "heads": 12, "context": 1024, "seq": 512, "batch": 8},
        "tiny": {"vocab": 256, "width": 32, "layers": 2, "heads": 2, "context": 32, "seq": 16, "batch": 4},
    },
}
MODEL_NAMES = tuple(SIZES)


@dataclass(frozen=True)
class Work:
    """One model's step: ``build()`` the model (seed 0), ``batch(generator, device) -> (input, target)``,
    ``optimizer(parameters)`` and the words that describe them."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, torch.device], tuple[torch.Tensor, torch.Tensor]]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    describe: str


def workload(model: str, size: str) -> Work:
    """The :class:`Work` of ``model`` at ``size`` (a key of :data:`SIZES`); ValueError naming a bad one."""
    if model not in SIZES:
        raise ValueError(f"bench step: unknown model {model!r}; expected one of {', '.join(MODEL_NAMES)}")
    if size not in SIZES[model]:
        raise ValueError(f"bench step: unknown size {size!r}; expected one of {', '.join(SIZES[model])}")
    s = SIZES[model][size]
    n = s["batch"]
    if model == "resnet50":
        blocks = "-".join(map(str, s["blocks"]))

        def images(gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randn(n, 3, s["image"], s["image"], generator=gen, device=device)
            return x, torch.randint(0, s["classes"], (n,), generator=gen, device=device)

        return Work(lambda: resnet50(s["width"], s["blocks"], s["classes"]), images,
                    lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
                    f"ResNet-50 (bottleneck, width {s['width']}, blocks {blocks}, {s['classes']} classes), batch "
                    f"{n} x 3 x {s['image']} x {s['image']}, SGD lr {LR} momentum {MOMENTUM}")  # fmt: skip

    def tokens(gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.randint(0, s["vocab"], (n, s["seq"] + 1), generator=gen, device=device)
        return seq[:, :-1], seq[:, 1:]

    return Work(lambda: gpt2(s["vocab"], s["width"], s["layers"], s["heads"], s["context"]), tokens,
                lambda params: torch.optim.AdamW(params, lr=ADAMW_LR),
                f"GPT-2-sized decoder ({s['layers']} layers, width {s['width']}, {s['heads']} heads, vocab "
                f"{s['vocab']}, tied head), batch {n} x {s['seq']} random tokens, AdamW lr {ADAMW_LR}")  # fmt: skip


def parameter_count(model: nn.Module) -> int:
    """Parameters of ``model``, a tied tensor counted once."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["GPT2", "MODEL_NAMES", "SIZES", "BasicBlock", "Bottleneck", "ResNet", "SmallResNet", "Work", "gpt2",
           "parameter_count", "resnet50", "workload"]  # fmt: skip
