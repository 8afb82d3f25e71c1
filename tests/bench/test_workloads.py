"""The DDP benchmarks' workloads: shapes, determinism, a causal language model, named errors."""

from __future__ import annotations

import pytest
import torch

from sylvie_comm.bench import workloads as wl


def test_every_workload_trains_one_step_the_same_way_twice():
    for name, work in wl.WORKLOADS.items():
        grads = []
        for _ in range(2):
            model = work.model(0)
            x, y = work.batch(torch.Generator().manual_seed(3))
            assert x.shape[0] == work.batch_size, name
            work.loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b), name


def test_language_model_is_causal_and_predicts_every_position():
    model = wl.transformer_lm(0).eval()
    x, y = wl.lm_batch(torch.Generator().manual_seed(0), batch=2)
    assert x.shape == y.shape == (2, wl.SEQ_LEN)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    stride = (y - x) % wl.VOCAB
    assert ((stride >= 1) & (stride <= wl.MAX_STRIDE)).all() and (stride == stride[:, :1]).all()
    out = model(x)
    assert out.shape == (2, wl.SEQ_LEN, wl.VOCAB)
    changed = x.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % wl.VOCAB  # a later token cannot change an earlier prediction
    out2 = model(changed)
    torch.testing.assert_close(out2[:, :20], out[:, :20])
    assert not torch.allclose(out2[:, 20:], out[:, 20:])
    with pytest.raises(ValueError, match=r"sequence length 33 is over the model's 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_language_model_size_and_unknown_names():
    params = sum(p.numel() for p in wl.transformer_lm(0).parameters())
    assert 5_000_000 < params < 7_000_000
    with pytest.raises(ValueError, match=r"unknown model 'gpt'; valid: mlp_17m, lm, small"):
        wl.check_workload("gpt")
