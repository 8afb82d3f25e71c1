from __future__ import annotations

import re

import pytest
import torch

import sylvie_comm
from sylvie_comm.codecs import CODECS


def test_available_codecs_lists_the_registry():
    assert sylvie_comm.available_codecs() == sorted(CODECS)
    assert {"none", "fp16", "bf16", "onebit", "qbit", "topk", "sign"} <= set(sylvie_comm.available_codecs())


def test_unknown_codec_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown codec 'twobit'.*onebit.*qbit"):
        sylvie_comm.get_codec("twobit")


def test_unknown_option_lists_valid_options():
    with pytest.raises(ValueError, match=r"no option\(s\) bit.*bits, seed, meta_dtype, row_size"):
        sylvie_comm.get_codec("qbit", bit=2)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("none", {"bits": 2}, "codec 'none' takes no options, got bits (bits is an option of qbit)"),
        ("none", {"ratio": 0.1, "zap": 1},
         "codec 'none' takes no options, got ratio, zap (ratio is an option of topk; no codec takes zap)"),
        ("fp16", {"bits": 2}, "codec 'fp16' has no option(s) bits; its options: divide_by (bits is an option of qbit)"),
        ("sign", {"scale": "max", "chunk_size": 8},
         "codec 'sign' has no option(s) chunk_size; its options: scale (chunk_size is an option of onebit)"),
    ],
)  # fmt: skip
def test_an_option_a_codec_does_not_take_names_the_codecs_that_do(name, options, message):
    """A codec without options says so (not "its options: none", nor object's ``args, kwargs``)."""
    with pytest.raises(ValueError) as exc:
        sylvie_comm.get_codec(name, **options)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("none", {"bits": 2}, "none: takes no options, got bits (bits is an option of qsgd)"),
        ("fp16", {"rank": 2, "zap": 1},
         "fp16: takes no options, got rank, zap (rank is an option of acpsgd, auto, powersgd; no algorithm takes zap)"),
        ("qsgd", {"ratio": 0.1},
         "qsgd: unknown option(s) ratio; valid: bits, block, error_feedback (ratio is an option of topk)"),
    ],
)  # fmt: skip
def test_an_option_an_algorithm_does_not_take_names_the_algorithms_that_do(name, options, message):
    """``ddp.register(model, "none", bits=2)``: the algorithm's check of its options (``codec="none", bits=2``),
    as the hooks build it."""
    from sylvie_comm.algorithms.registry import ALGORITHMS, make_algorithm
    from sylvie_comm.collectives.local import LocalGroup

    with pytest.raises(ValueError) as exc:
        ALGORITHMS[name].validate_options(options)
    assert str(exc.value) == message
    with pytest.raises(ValueError, match=re.escape(message)):
        make_algorithm(name, LocalGroup(1).transport(0), options)


@pytest.mark.parametrize(
    "name,options,message",
    [
        ("qbit", {"bits": 3}, r"\{1, 2, 4, 8\}, got 3"),
        ("qbit", {"bits": True}, r"\{1, 2, 4, 8\}"),
        ("qbit", {"meta_dtype": "fp16"}, "meta_dtype must be one of"),
        ("qbit", {"row_size": 0}, "row_size must be a positive integer"),
        ("qbit", {"seed": 1.5}, "seed must be an integer"),
        ("onebit", {"chunk_size": 12}, "positive multiple of 8, got 12"),
        ("onebit", {"scale": "max"}, "scale must be one of"),
        ("topk", {"ratio": 0.0}, r"ratio must be in \(0, 1\], got 0.0"),
        ("topk", {"ratio": 1.5}, r"ratio must be in \(0, 1\]"),
        ("fp16", {"divide_by": 0}, "divide_by must be a finite number > 0"),
        ("bf16", {"divide_by": float("inf")}, "divide_by"),
    ],
)
def test_invalid_options(name, options, message):
    with pytest.raises(ValueError, match=message):
        sylvie_comm.get_codec(name, **options)


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float64])
def test_unsupported_dtypes_raise_type_error(name, dtype):
    x = torch.zeros(4, dtype=dtype)
    with pytest.raises(TypeError, match=rf"float32, float16 or bfloat16 tensor, got {dtype}"):
        sylvie_comm.get_codec(name).encode(x)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_non_tensor_input(name):
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor, got list"):
        sylvie_comm.get_codec(name).encode([1.0, 2.0])


def test_repr_shows_options():
    assert repr(sylvie_comm.get_codec("qbit", bits=2)) == "QBitCodec(bits=2, seed=0, meta_dtype='fp32', row_size=None)"
