"""What the one-bit Triton kernel tests share: the device they run on, why they cannot run here (None: they can),
their module marks, and the op namespace with the one-bit ops registered."""

from __future__ import annotations

import pytest
import torch

from sylvie_comm.kernels.triton import NAMESPACE, interpreted, unavailable_reason

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WHY_NOT = unavailable_reason() or (
    None if DEVICE == "cuda" or interpreted() else "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)"
)
MARKS = [
    pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)),
    # the interpreter's numpy on inf - inf, or on a scale that overflows fp16: the results are the IEEE ones
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

if WHY_NOT is None:
    from sylvie_comm.kernels.triton import onebit  # noqa: F401  (registers the ops)

OPS = getattr(torch.ops, NAMESPACE)
U8 = torch.uint8
