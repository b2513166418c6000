"""sample / apply_top_k_top_p_min_p / apply_penalties against per-row Python formulations."""

import math

import pytest
import torch

import atom_kernels as ak
from atom_kernels.testing import assert_close, assert_equal

VOCAB = 50


def _logits(num_seqs, vocab=VOCAB, seed=0, dtype=torch.float32, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_seqs, vocab, generator=g) * spread).to(dtype)


def _params(num_seqs, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    def full(v, dtype):
        return torch.full((num_seqs,), v, dtype=dtype)

    return (
        full(temperature, torch.float32),
        full(top_k, torch.int32),
        full(top_p, torch.float32),
        full(min_p, torch.float32),
    )


def naive_allowed(row, temperature, top_k, top_p, min_p):
    """The token ids a row may sample: top-k, then top-p, then min-p, one token at a time."""
    values = [v / temperature for v in row.double().tolist()]
    ids = sorted(range(len(values)), key=lambda i: -values[i])
    if 0 < top_k < len(values):
        kth = values[ids[top_k - 1]]
        ids = [i for i in ids if values[i] >= kth]
    z = sum(math.exp(values[i] - values[ids[0]]) for i in ids)
    probs = {i: math.exp(values[i] - values[ids[0]]) / z for i in ids}
    if top_p < 1.0:
        kept, mass = [], 0.0
        for i in ids:
            kept.append(i)
            mass += probs[i]
            if mass >= top_p:
                break
        ids = kept
    best = max(probs[i] for i in ids)
    return {i for i in ids if probs[i] >= min_p * best}


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = _logits(6)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1  # tie: 7 wins
    out = ak.sample(logits, *_params(6, temperature=0.0), num_logprobs=3)
    expected = torch.tensor(
        [max(range(VOCAB), key=lambda i, r=r: (r[i], -i)) for r in logits.tolist()]
    )
    assert_equal(out.token_ids, expected, name="greedy ids")
    assert out.token_ids[2].item() == 7 and out.token_ids.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_logprobs", [0, 5])
def test_logprobs_are_raw_log_softmax(dtype, num_logprobs):
    logits = _logits(4, dtype=dtype, seed=1)
    # Sampling params must not change the reported logprobs (vLLM's raw logprobs).
    temperature, top_k, top_p, min_p = _params(4, temperature=0.7, top_k=5, top_p=0.8)
    temperature[0] = 0.0
    out = ak.sample(logits, temperature, top_k, top_p, min_p, num_logprobs=num_logprobs)
    rows = logits.double()
    reference = (
        rows
        - torch.stack([torch.tensor(math.log(sum(math.exp(v) for v in r.tolist()))) for r in rows])[
            :, None
        ]
    )
    chosen = reference.gather(1, out.token_ids[:, None]).squeeze(1)
    assert out.logprobs.dtype == torch.float32
    assert_close(out.logprobs, chosen, atol=1e-5, rtol=1e-5, name="chosen logprobs")
    assert out.top_logprobs.shape == (4, num_logprobs)
    assert out.top_token_ids.shape == (4, num_logprobs) and out.top_token_ids.dtype == torch.int64
    top_ref = reference.sort(dim=-1, descending=True)
    assert_close(out.top_logprobs, top_ref.values[:, :num_logprobs], atol=1e-5, rtol=1e-5)
    assert_close(
        reference.gather(1, out.top_token_ids), top_ref.values[:, :num_logprobs], atol=1e-5, rtol=0
    )


def test_top_k_1_is_greedy():
    logits = _logits(8, seed=2)
    out = ak.sample(logits, *_params(8, temperature=1.3, top_k=1))
    assert_equal(out.token_ids, logits.argmax(-1), name="top_k=1 ids")


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = _logits(1, seed=3, spread=0.5)[0]  # flat-ish: many tokens likely
    alone, in_batch = [], []
    for seed in range(16):
        g = torch.Generator().manual_seed(seed)
        alone.append(ak.sample(logits[None], *_params(1), generators=[g]).token_ids.item())
        # The same row at position 2 of 4, next to unseeded rows and a differently seeded row.
        batch = torch.stack([_logits(1, seed=9)[0], logits, logits, _logits(1, seed=8)[0]])
        gens = [
            None,
            torch.Generator().manual_seed(1000 + seed),
            torch.Generator().manual_seed(seed),
            None,
        ]
        temperature, top_k, top_p, min_p = _params(4)
        temperature[0] = 0.0
        in_batch.append(
            ak.sample(batch, temperature, top_k, top_p, min_p, gens).token_ids[2].item()
        )
    assert alone == in_batch
    assert len(set(alone)) > 3, "different seeds should draw different tokens"


@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(0, 0.6, 0.0), (0, 1.0, 0.2), (10, 0.9, 0.0), (12, 0.7, 0.1), (3, 1.0, 0.0)],
)
def test_draws_stay_in_the_allowed_set(top_k, top_p, min_p):
    torch.manual_seed(1234)
    num_draws, temperature = 4000, 0.8
    row = _logits(1, seed=4)[0]
    allowed = naive_allowed(row, temperature, top_k, top_p, min_p)
    assert 1 < len(allowed) < VOCAB
    logits = row.expand(num_draws, VOCAB)
    out = ak.sample(logits, *_params(num_draws, temperature, top_k, top_p, min_p))
    drawn = out.token_ids.bincount(minlength=VOCAB)
    outside = [i for i in range(VOCAB) if drawn[i] > 0 and i not in allowed]
    assert not outside, f"sampled excluded tokens {outside} (allowed {sorted(allowed)})"
    # Frequencies follow the renormalized probabilities over the allowed set.
    values = torch.tensor(
        [row[i].item() / temperature if i in allowed else -math.inf for i in range(VOCAB)]
    )
    probs = torch.softmax(values.double(), dim=0)
    assert_close(drawn.double() / num_draws, probs, atol=0.03, rtol=0, name="frequencies")


def test_apply_top_k_top_p_min_p_masks_exactly_the_excluded_tokens():
    logits = _logits(6, seed=5)
    top_k = torch.tensor([0, 5, 50, 7, -1, 3], dtype=torch.int32)
    top_p = torch.tensor([0.5, 1.0, 0.9, 0.8, 1.0, 0.3])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.3, 0.5, 0.0])
    masked = ak.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    for b in range(6):
        allowed = naive_allowed(logits[b], 1.0, top_k[b].item(), top_p[b].item(), min_p[b].item())
        kept = {i for i in range(VOCAB) if masked[b, i] > -math.inf}
        assert kept == allowed, f"row {b}: kept {sorted(kept)} != allowed {sorted(allowed)}"
        assert_equal(masked[b, sorted(kept)], logits[b, sorted(kept)], name=f"row {b} kept values")
    off = ak.apply_top_k_top_p_min_p(logits, None, None, None)
    assert_equal(off, logits, name="all off")


def test_strided_and_half_logits():
    base = _logits(4, vocab=2 * VOCAB, seed=6, dtype=torch.bfloat16)
    logits = base[:, ::2]
    assert not logits.is_contiguous()
    out = ak.sample(logits, *_params(4, temperature=0.0), num_logprobs=2)
    assert_equal(out.token_ids, logits.float().argmax(-1), name="ids")


def naive_penalties(logits, prompt, output, presence, frequency, repetition):
    out = logits.double().clone()
    for b in range(logits.shape[0]):
        prompt_ids = [t for t in prompt[b].tolist() if 0 <= t < logits.shape[1]]
        output_ids = [t for t in output[b].tolist() if 0 <= t < logits.shape[1]]
        for t in set(prompt_ids) | set(output_ids):
            v = out[b, t].item()
            out[b, t] = v / repetition[b].item() if v > 0 else v * repetition[b].item()
        for t in set(output_ids):
            out[b, t] -= frequency[b].item() * output_ids.count(t) + presence[b].item()
    return out


def test_apply_penalties():
    logits = _logits(3, seed=7)
    prompt = torch.tensor([[1, 2, 3, -1], [4, 4, 5, VOCAB], [-1, -1, -1, -1]])
    output = torch.tensor([[2, 2, 9], [7, -1, -1], [11, 12, 11]])
    presence = torch.tensor([0.5, 0.0, 1.0])
    frequency = torch.tensor([0.3, 0.1, 0.0])
    repetition = torch.tensor([1.2, 1.0, 0.8])
    out = ak.apply_penalties(logits, prompt, output, presence, frequency, repetition)
    expected = naive_penalties(logits, prompt, output, presence, frequency, repetition)
    assert_close(out, expected, atol=1e-5, rtol=1e-5, name="penalized logits")


def test_bad_arguments():
    logits = _logits(3)
    temperature, top_k, top_p, min_p = _params(3)
    with pytest.raises(ValueError, match=r"sample: top_k has shape \(2,\), expected \(3,\)"):
        ak.sample(logits, temperature, top_k[:2], top_p, min_p)
    with pytest.raises(ValueError, match="sample: top_k has dtype torch.float32"):
        ak.sample(logits, temperature, top_p, top_p, min_p)
    with pytest.raises(ValueError, match="sample: generators has 1 entries, expected 3"):
        ak.sample(logits, temperature, top_k, top_p, min_p, generators=[None])
    with pytest.raises(ValueError, match="sample: logits must have 2 dims"):
        ak.sample(logits[0], temperature, top_k, top_p, min_p)
    with pytest.raises(ValueError, match="sample: num_logprobs"):
        ak.sample(logits, temperature, top_k, top_p, min_p, num_logprobs=-1)


def test_greedy_argmax_is_torch_argmax_and_checks_out():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the lower id
    assert torch.equal(ak.greedy_argmax(logits), logits.argmax(dim=-1))
    out = torch.empty(3, dtype=torch.int64)
    assert ak.greedy_argmax(logits, out) is out and out[1] == 7
    with pytest.raises(ValueError, match="out"):
        ak.greedy_argmax(logits, torch.empty(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        ak.greedy_argmax(logits, torch.empty(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="logits"):
        ak.greedy_argmax(logits[0])
