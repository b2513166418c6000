"""The Sampler's logit_bias on each of its paths, on random logits (no model): the overlapped
path (`sample_on_device`), the synchronous one (`sample`, greedy and random, with log-probs or
penalties) and speculative verification (`verify`, greedy and rejection sampling)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atom_engine.sampler import Sampler
from atom_engine.sampling_params import SamplingParams

VOCAB = 123  # an odd size


def seq(seq_id: int, drafts: list[int] | None = None, **params) -> SimpleNamespace:
    return SimpleNamespace(
        seq_id=seq_id,
        params=SamplingParams(**params),
        spec_token_ids=drafts or [],
        num_output_tokens=0,
        generator=None,
        token_ids=[1, 2],  # the prompt (penalties read it)
        num_prompt_tokens=2,
        output_token_ids=[],
    )


@pytest.fixture
def logits() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(3, VOCAB, generator=generator) * 3  # [rows, V]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "path", ["sample", "sample_on_device", "sample_logprobs", "sample_penalties"]
)
def test_bias_on_every_sampling_path(logits, temperature, path):
    top = logits.argmax(dim=-1).tolist()
    forced = (top[0] + 1) % VOCAB
    common = {"temperature": temperature, "seed": None}
    if path == "sample_logprobs":
        common["logprobs"] = 2
    if path == "sample_penalties":  # the bias goes in before the penalties
        common["repetition_penalty"] = 1.5
    seqs = [
        seq(0, logit_bias={forced: 100}, **common),
        seq(1, logit_bias={top[1]: -100}, **common),
        seq(2, **{**common, "temperature": 0.0}),
    ]
    sampler = Sampler(torch.device("cpu"))
    before = logits.clone()
    for _ in range(20):  # random sampling: a biased token always wins, a banned one never
        if path == "sample_on_device":
            ids = sampler.sample_on_device(seqs, logits).tolist()
        else:
            result = sampler.sample(seqs, logits)
            ids = [result[s.seq_id][0] for s in seqs]
            if path == "sample_logprobs":  # log-probs stay the model's (unbiased)
                info = result[0][1]
                expected = torch.log_softmax(logits[0], dim=-1)[forced].item()
                assert info.token_id == forced and info.logprob == pytest.approx(expected)
        assert ids[0] == forced and ids[1] != top[1] and ids[2] == top[2], ids
    assert torch.equal(logits, before)  # the caller's logits are not changed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bias_in_speculative_verification(temperature):
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(5, VOCAB, generator=generator) * 3  # 2 sequences: 3 + 2 rows
    top = logits.argmax(dim=-1).tolist()
    forced = next(t for t in range(VOCAB) if t not in top)
    sampler = Sampler(torch.device("cpu"))
    for _ in range(10):
        seqs = [
            # drafts of the forced token: all accepted, then the bonus token is forced too
            seq(0, [forced, forced], temperature=temperature, logit_bias={forced: 100}),
            # a draft of a banned token is rejected; the token drawn instead is not it
            seq(1, [top[3]], temperature=temperature, logit_bias={top[3]: -100}),
        ]
        out = sampler.verify(seqs, logits)
        assert [t for t, _ in out[0]] == [forced] * 3
        ids = [t for t, _ in out[1]]
        assert len(ids) == 1 and ids[0] != top[3], ids


@pytest.mark.parametrize(
    "bias", [{-1: 1.0}, {5: 100.5}, {5: -101}, {5: float("nan")}, {5: True}, {"5": 1.0}, [(5, 1)]]
)
def test_bad_bias_is_a_value_error_naming_it(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_bias_beyond_the_vocabulary():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={VOCAB: 1.0}).check_vocab(VOCAB)
