"""The cpu backend's `sample` (inverse-CDF over vocabulary blocks) against the torch reference:
greedy ids and log-probs equal, draws that follow the probabilities, never a zero-weight token."""

import pytest
import torch

from atom_kernels import registry
from atom_kernels.backends.cpu import sampling as cpu_sampling
from atom_kernels.backends.torch import sampling as ref_sampling
from atom_kernels.testing import assert_close, assert_equal


def _logits(rows, vocab, seed, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * spread


def test_cpu_sample_is_the_automatic_choice_on_cpu():
    assert registry.get_op("sample", "cpu") is cpu_sampling.sample


@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152])
@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("num_logprobs", [0, 3])
def test_greedy_ids_and_logprobs_match_reference(vocab, filtered, num_logprobs):
    rows = 6
    logits = _logits(rows, vocab, seed=vocab)
    temperature = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0])
    top_k = torch.full((rows,), 5, dtype=torch.int64) if filtered else None
    top_p = torch.full((rows,), 0.9) if filtered else None
    min_p = torch.full((rows,), 0.05) if filtered else None
    args = (logits, temperature, top_k, top_p, min_p, None, min(num_logprobs, vocab))
    out = cpu_sampling.sample(*args)
    ref = ref_sampling.sample(*args)
    greedy = temperature == 0
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (rows,)
    assert_equal(out.token_ids[greedy], ref.token_ids[greedy], name="greedy ids")
    raw = torch.log_softmax(logits.double(), dim=-1)
    chosen = raw.gather(1, out.token_ids[:, None]).squeeze(1)
    assert out.logprobs.dtype == torch.float32
    assert_close(out.logprobs, chosen, atol=1e-5, rtol=1e-5, name="chosen logprobs")
    assert_close(out.top_logprobs, ref.top_logprobs, atol=1e-6, rtol=0, name="top logprobs")
    assert_equal(out.top_token_ids, ref.top_token_ids, name="top ids")
    if filtered:  # every draw is one the reference's filters keep
        masked = ref_sampling.apply_top_k_top_p_min_p(
            logits / torch.where(greedy, 1.0, temperature)[:, None], top_k, top_p, min_p
        )
        assert bool(masked.gather(1, out.token_ids[:, None]).isfinite().all())


def test_draws_follow_the_probabilities_across_blocks():
    # 700 tokens: two full blocks and a padded third; the mass spread over all three, with
    # excluded (-inf) tokens at the block edges.
    torch.manual_seed(0)
    vocab, draws = 700, 40_000
    row = _logits(1, vocab, seed=5, spread=1.0)[0]
    excluded = [0, 255, 256, 511, 512, 699]
    row[excluded] = float("-inf")
    logits = row.expand(draws, vocab)
    temperature = torch.full((draws,), 0.9)
    out = cpu_sampling.sample(logits, temperature, None, None, None, None, 0)
    counts = out.token_ids.bincount(minlength=vocab)
    assert counts[excluded].sum().item() == 0
    probs = torch.softmax(row.double() / 0.9, dim=0)
    for lo in range(0, vocab, 100):  # the mass of each 100-token range
        share = counts[lo : lo + 100].sum().item() / draws
        assert abs(share - probs[lo : lo + 100].sum().item()) < 0.01, lo
    assert_close(counts.double() / draws, probs, atol=0.004, rtol=0, name="frequencies")


@pytest.mark.parametrize("vocab", [5, 256, 300, 1024])
def test_draw_at_the_ends_of_the_unit_interval_takes_positive_weights(vocab):
    weights = torch.zeros(3, vocab)
    first, last = 1, vocab - 2
    weights[:, first] = 0.5
    weights[:, last] = 2.0**-30  # tiny, so rounding of the totals matters
    weights[1, vocab // 2] = 1.0
    for uniform, expected in ((0.0, first), (1.0 - 2**-53, last)):
        ids, totals = cpu_sampling.draw(weights, torch.full((3,), uniform, dtype=torch.float64))
        assert ids.tolist() == [expected] * 3
        assert_close(totals, weights.double().sum(-1), atol=1e-12, rtol=1e-12, name="totals")


def test_a_nan_row_still_gets_an_id_in_range():
    logits = _logits(3, 600, seed=6)
    logits[1] = float("nan")
    out = cpu_sampling.sample(logits, torch.ones(3), None, None, None, None, 0)
    assert bool(((out.token_ids >= 0) & (out.token_ids < 600)).all())


def test_seeded_rows_draw_from_their_generator_only():
    logits = _logits(4, 3000, seed=7, spread=0.5)
    temperature = torch.ones(4)

    def draw_row_2(seed):
        gens = [None, None, torch.Generator().manual_seed(seed), None]
        return cpu_sampling.sample(logits, temperature, None, None, None, gens, 0).token_ids[2]

    first = [draw_row_2(s).item() for s in range(8)]
    torch.manual_seed(123)  # the global stream moves; the seeded row does not
    assert [draw_row_2(s).item() for s in range(8)] == first
    assert len(set(first)) > 3
