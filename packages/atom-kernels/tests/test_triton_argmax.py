"""Triton greedy argmax (the ``greedy_argmax`` op's GPU path) against torch.argmax: the same ids
exactly, ties, NaNs and -inf rows included, at every split of the vocabulary."""

import pytest
import torch

from atom_kernels.registry import get_op
from atom_kernels.testing import assert_equal


def _logits(rows, vocab, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 3).to(dtype)


def _argmax_module():
    from atom_kernels.backends.triton import argmax

    return argmax


@pytest.mark.parametrize("num_splits", [None, 1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [5, 64, 301])  # under one block, one, several with a tail
def test_greedy_argmax_matches_torch(triton_backend, dtype, vocab, num_splits):
    logits = _logits(6, vocab, seed=vocab, dtype=dtype)
    logits[1, 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the lower id
    logits[2] = float("-inf")  # all -inf: id 0
    logits[3, vocab // 2] = float("nan")  # a NaN wins (torch.argmax)
    logits[3, vocab - 1] = float("nan")  # the first NaN
    logits[4, 0] = float("inf")
    logits[5, vocab - 1] = float("inf")  # +inf in the last column (the tail)
    expected = logits.argmax(dim=-1)
    ids = _argmax_module().greedy_argmax(
        logits.to(triton_backend.device), block_v=16, num_splits=num_splits
    )
    assert ids.dtype == torch.int64
    assert_equal(ids.cpu(), expected, name="greedy ids")
    assert ids[1].item() == 3


def test_greedy_argmax_repeats_and_leaves_counters_zero(triton_backend):
    # The last program of a row resets its counter: back-to-back calls (graph replays, the next
    # step) need no zeroing in between.
    from atom_kernels.backends.triton.common import zeroed_counters

    module = _argmax_module()
    for seed in range(3):
        logits = _logits(3, 200, seed, torch.bfloat16).to(triton_backend.device)
        ids = module.greedy_argmax(logits, block_v=16, num_splits=5)
        assert_equal(ids.cpu(), logits.cpu().argmax(dim=-1), name=f"call {seed}")
    counters = zeroed_counters(torch.device(triton_backend.device), 3)
    assert int(counters[:3].abs().sum()) == 0


def test_greedy_argmax_default_tiles_and_empty(triton_backend):
    module = _argmax_module()
    logits = _logits(2, 1000, 3, torch.float32).to(triton_backend.device)
    assert_equal(module.greedy_argmax(logits).cpu(), logits.cpu().argmax(dim=-1))
    empty = module.greedy_argmax(logits[:0])
    assert empty.shape == (0,) and empty.dtype == torch.int64
    strided = logits.t().contiguous().t()  # a non-unit column stride
    assert_equal(module.greedy_argmax(strided).cpu(), logits.cpu().argmax(dim=-1))
    out = torch.full((4,), -1, dtype=torch.int64, device=logits.device)
    assert module.greedy_argmax(logits, out[1:3]) is not None
    assert out[0] == -1 and out[3] == -1  # written in place, nothing around it
    assert_equal(out[1:3].cpu(), logits.cpu().argmax(dim=-1))


@pytest.mark.parametrize("enabled", [False, True])
def test_registry_entry(triton_backend, monkeypatch, enabled):
    # ATOM_TRITON_ARGMAX=0 keeps torch's argmax; either way the ids are torch's.
    monkeypatch.setattr(_argmax_module(), "ENABLED", enabled)
    logits = _logits(2, 100, 5, torch.bfloat16).to(triton_backend.device)
    ids = get_op("greedy_argmax", logits.device)(logits, None)
    assert_equal(ids.cpu(), logits.cpu().argmax(dim=-1))
    out = torch.empty(2, dtype=torch.int64, device=logits.device)
    get_op("greedy_argmax", logits.device)(logits, out)
    assert_equal(out.cpu(), logits.cpu().argmax(dim=-1))
