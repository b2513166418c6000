"""Triton fused sampling (greedy / temperature; Gumbel noise per token, or per block then per
token inside the drawn block) against exact formulas."""

import pytest
import torch

from atom_kernels.testing import assert_close, assert_equal

KERNELS = ["gumbel", "block"]


def _logits(rows, vocab, seed, dtype=torch.float32, device="cpu", spread=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * spread).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 64, 150])  # one block, exactly one, several with a tail
@pytest.mark.parametrize("kernel", KERNELS)
def test_greedy_ids_and_logprobs(triton_backend, kernel, dtype, vocab):
    logits = _logits(5, vocab, seed=vocab, dtype=dtype, device=triton_backend.device)
    logits[1, 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the lower id wins
    temperature = torch.zeros(5, device=logits.device)
    temperature[4] = 1e-6  # below vLLM's epsilon: greedy too
    ids, logprobs = triton_backend.sampling.fused_sample(logits, temperature, kernel=kernel)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    expected = torch.tensor(
        [max(range(vocab), key=lambda i, r=r: (r[i], -i)) for r in logits.float().tolist()]
    )
    assert_equal(ids.cpu(), expected, name="greedy ids")
    assert ids[1].item() == 3
    raw = torch.log_softmax(logits.double(), dim=-1).gather(1, ids[:, None]).squeeze(1)
    assert_close(logprobs.double(), raw, atol=2e-5, rtol=2e-5, name="logprobs")


@pytest.mark.interpreter_slow
def test_draws_follow_the_tempered_softmax(triton_backend, kernel="gumbel"):
    """The per-token kernel (the block kernel: test_triton_sampling_block.py)."""
    torch.manual_seed(0)
    vocab, draws, temperature = 12, 2000, 0.8
    row = _logits(1, vocab, seed=1, spread=1.0)[0]
    row[5] = float("-inf")  # a masked token is never drawn
    logits = row.expand(draws, vocab).contiguous().to(triton_backend.device)
    ids, logprobs = triton_backend.sampling.fused_sample(
        logits, torch.full((draws,), temperature, device=logits.device), kernel=kernel
    )
    ids = ids.cpu()
    assert int((ids == 5).sum()) == 0
    freq = torch.bincount(ids, minlength=vocab).double() / draws
    probs = torch.softmax(row.double() / temperature, dim=-1)
    sigma = (probs * (1 - probs) / draws).sqrt()
    assert bool(((freq - probs).abs() <= 4 * sigma + 1e-3).all()), (freq, probs)
    raw = torch.log_softmax(row.double(), dim=-1)[ids]
    assert_close(logprobs.cpu().double(), raw, atol=2e-5, rtol=2e-5, name="drawn logprobs")


@pytest.mark.parametrize("kernel", KERNELS)
def test_mixed_batch_seeded_by_torch(triton_backend, kernel):
    device = triton_backend.device
    logits = _logits(6, 90, seed=3, spread=0.3, device=device)  # flat: many tokens likely
    temperature = torch.tensor([0.0, 1.0, 1.0, 0.0, 2.0, 1.0], device=device)
    torch.manual_seed(7)
    first, _ = triton_backend.sampling.fused_sample(logits, temperature, kernel=kernel)
    torch.manual_seed(7)
    again, _ = triton_backend.sampling.fused_sample(logits, temperature, kernel=kernel)
    assert_equal(first, again, name="same torch seed, same draws")
    greedy = logits.argmax(-1)
    assert first[0] == greedy[0] and first[3] == greedy[3]
    later, _ = triton_backend.sampling.fused_sample(logits, temperature, kernel=kernel)
    assert not torch.equal(first, later), "a new call draws new noise"


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("kernel", KERNELS)
def test_vocabulary_splits_give_the_same_draws(triton_backend, kernel, num_splits):
    """The noise is keyed by the global column: splitting a row over programs (few rows) changes
    nothing but the launch."""
    device = triton_backend.device
    logits = _logits(3, 150, seed=6, spread=0.5, device=device)
    logits[0, 149] = logits[0].max() + 1  # the greedy winner in the last split
    temperature = torch.tensor([0.0, 1.0, 0.7], device=device)
    torch.manual_seed(3)
    one_ids, one_lp = triton_backend.sampling.fused_sample(
        logits, temperature, num_splits=1, kernel=kernel
    )
    torch.manual_seed(3)
    ids, lp = triton_backend.sampling.fused_sample(
        logits, temperature, num_splits=num_splits, kernel=kernel
    )
    assert_equal(ids, one_ids, name="split draws")
    assert ids[0].item() == 149
    assert_close(lp, one_lp, atol=1e-5, rtol=1e-5, name="split logprobs")


def test_choose_splits(triton_backend):
    choose = triton_backend.sampling.choose_splits
    assert choose(256, 151936, 2048, 132, 8192) == (1, 151552 + 2048)  # rows fill the SMs
    for rows in (1, 16, 64):  # few rows: >= 8192 columns a program, about 2 programs an SM
        splits, chunk = choose(rows, 151936, 2048, 132, 8192)
        assert (
            chunk % 2048 == 0 and chunk >= 8192 and (splits - 1) * chunk < 151936 <= splits * chunk
        )
        assert rows * splits <= 2 * 132 or splits == 1
    assert choose(1, 151936, 2048, 132, 8192)[0] > 8


def test_sample_op_routes_filters_to_the_reference(triton_backend):
    device = triton_backend.device
    logits = _logits(4, 40, seed=4, device=device)
    temperature = torch.ones(4, device=device)
    top_k = torch.ones(4, dtype=torch.int64, device=device)  # top_k = 1: greedy via the reference
    gens = [None, torch.Generator(device).manual_seed(1), None, None]
    out = triton_backend.custom_ops.sample_op(logits, temperature, top_k, None, None, gens, 0)
    assert_equal(out.token_ids, logits.argmax(-1), name="top_k=1")
    out = triton_backend.custom_ops.sample_op(logits, temperature * 0, None, None, None, None, 3)
    assert out.top_logprobs.shape == (4, 3)  # top logprobs: the reference
    out = triton_backend.custom_ops.sample_op(logits, temperature, None, None, None, None, 0)
    assert out.token_ids.shape == (4,) and out.top_logprobs.shape == (4, 0)


def test_empty_batch(triton_backend):
    logits = torch.empty(0, 10, device=triton_backend.device)
    ids, logprobs = triton_backend.sampling.fused_sample(
        logits, torch.empty(0, device=logits.device)
    )
    assert ids.shape == (0,) and logprobs.shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_gpu_qwen_vocab_batch_256(triton_backend, kernel):
    logits = _logits(256, 151936, seed=5, dtype=torch.bfloat16, device="cuda")
    temperature = torch.ones(256, device="cuda")
    temperature[::2] = 0
    ids, logprobs = triton_backend.sampling.fused_sample(logits, temperature, kernel=kernel)
    assert_equal(ids[::2], logits[::2].float().argmax(-1), name="greedy rows")
    assert bool(((ids >= 0) & (ids < 151936)).all())
    raw = torch.log_softmax(logits.float(), dim=-1).gather(1, ids[:, None]).squeeze(1)
    assert_close(logprobs, raw, atol=1e-4, rtol=1e-4, name="logprobs")
