"""Sampling features end to end on the bundled model: seeds, n, stops, logprobs, penalties."""

from __future__ import annotations

import pytest
import torch

from atom_engine import SamplingParams

PROMPT = "1, 2, 3, 4,"


def ids_of(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


def generate_one(llm, prompt, params):
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out


def test_seed_reproducible_across_batch_compositions(smollm2_llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = generate_one(smollm2_llm, "Tell me a story.", params)
    mixed = smollm2_llm.generate(
        ["Another prompt entirely", "Tell me a story.", "x"],
        [SamplingParams(temperature=1.0, max_tokens=7), params, SamplingParams(max_tokens=3)],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    other = generate_one(
        smollm2_llm,
        "Tell me a story.",
        SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True),
    )
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_completions(smollm2_llm):
    out = generate_one(
        smollm2_llm,
        "My favourite animal is",
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
    )
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_string_cuts_text(smollm2_llm):
    full = generate_one(smollm2_llm, PROMPT, SamplingParams(temperature=0, max_tokens=20))
    text = full.outputs[0].text
    stop = "7,"
    assert stop in text, text
    cut = generate_one(
        smollm2_llm, PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=[stop, "zzz"])
    )
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].stop_reason == stop
    kept = generate_one(
        smollm2_llm,
        PROMPT,
        SamplingParams(temperature=0, max_tokens=20, stop=stop, include_stop_str_in_output=True),
    )
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids(smollm2_llm):
    full = generate_one(smollm2_llm, PROMPT, SamplingParams(temperature=0, max_tokens=10))
    tokens = full.outputs[0].token_ids
    stop_id = tokens[3]
    out = generate_one(
        smollm2_llm, PROMPT, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id])
    )
    end = tokens.index(stop_id) + 1
    assert out.outputs[0].token_ids == tokens[:end]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_min_tokens_holds_back_stop_tokens(smollm2_llm):
    """Before min_tokens, stop tokens (EOS and stop_token_ids alike) cannot be sampled."""
    full = generate_one(smollm2_llm, PROMPT, SamplingParams(temperature=0, max_tokens=10))
    tokens = full.outputs[0].token_ids
    stop_id = tokens[1]
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=6, stop_token_ids=[stop_id])
    out = generate_one(smollm2_llm, PROMPT, params).outputs[0]
    assert stop_id not in out.token_ids[:5]
    assert len(out.token_ids) >= 6
    assert out.finish_reason == ("stop" if out.token_ids[-1] == stop_id else "length")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_thinking_budget_forces_the_end_marker(smollm2_llm, temperature):
    """After thinking_budget tokens without the marker, the marker's ids are forced one per step
    (greedy and sampled alike); the tokens before the budget are the unconstrained ones."""
    marker = ids_of(smollm2_llm, "</think>")
    assert len(marker) > 1  # several tokens: the forcing goes on across steps
    free = SamplingParams(temperature=temperature, seed=7, max_tokens=12, ignore_eos=True)
    full = generate_one(smollm2_llm, PROMPT, free).outputs[0].token_ids
    params = SamplingParams(
        temperature=temperature,
        seed=7,
        max_tokens=12,
        ignore_eos=True,
        thinking_budget=3,
        thinking_end_ids=marker,
    )
    out = generate_one(smollm2_llm, PROMPT, params).outputs[0].token_ids
    assert out[:3] == full[:3]
    assert out[3 : 3 + len(marker)] == marker
    assert len(out) == 12


def test_thinking_budget_leaves_a_closed_reasoning_alone(smollm2_llm):
    """A marker the model wrote before the budget ends the forcing: the output is unchanged."""
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    full = generate_one(smollm2_llm, PROMPT, free).outputs[0].token_ids
    params = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, thinking_budget=4, thinking_end_ids=full[1:3]
    )
    assert generate_one(smollm2_llm, PROMPT, params).outputs[0].token_ids == full
    with pytest.raises(ValueError, match="go together"):
        SamplingParams(thinking_budget=4)
    with pytest.raises(ValueError, match="thinking_end_ids"):
        SamplingParams(thinking_budget=4, thinking_end_ids=[])


@torch.no_grad()
def test_logprobs_match_transformers(smollm2_llm, smollm2_hf):
    prompt = ids_of(smollm2_llm, "The quick brown fox")
    out = generate_one(
        smollm2_llm,
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2),
    )
    completion = out.outputs[0]
    seq = prompt + completion.token_ids
    ref = torch.log_softmax(smollm2_hf(torch.tensor([seq])).logits[0].float(), dim=-1)
    for step, (token, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        row = ref[len(prompt) - 1 + step]
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-3)
        top = row.topk(3)
        assert list(entry)[:3] == top.indices.tolist() or set(entry) >= set(top.indices.tolist())
        for tid, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[tid].logprob == pytest.approx(value, abs=1e-3)
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True))
    )
    # Prompt log-probs: None for the first token, then the log-prob of each prompt token.
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(
            ref[pos - 1, prompt[pos]].item(), abs=1e-3
        )
        assert len(entry) in (2, 3)


def test_repetition_penalty_matches_transformers(smollm2_llm, smollm2_hf):
    prompt = ids_of(smollm2_llm, PROMPT)
    out = generate_one(
        smollm2_llm,
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5, ignore_eos=True),
    )
    with torch.no_grad():
        ref = smollm2_hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.5,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            pad_token_id=2,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
    assert out.outputs[0].token_ids == ref


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -3),
        ("min_p", 2.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("logprobs", 100),
        ("prompt_logprobs", -1),
        ("stop", [""]),
        ("stop_token_ids", [-4]),
        ("output_kind", "delta"),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_requests_that_cannot_fit_are_rejected(smollm2_llm):
    engine = smollm2_llm.engine
    limit = engine.max_model_len
    with pytest.raises(ValueError, match=f"{limit - 10} tokens and max_tokens is 20.*{limit}"):
        smollm2_llm.generate(
            {"prompt_token_ids": [5] * (limit - 10)}, SamplingParams(max_tokens=20), use_tqdm=False
        )
    with pytest.raises(ValueError, match="empty"):
        smollm2_llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="token ids must be integers in"):
        smollm2_llm.generate({"prompt_token_ids": [1, 10**9]}, use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        smollm2_llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_abort_frees_blocks(smollm2_llm):
    engine = smollm2_llm.engine
    engine.add_request("to-abort", "A long story begins", SamplingParams(max_tokens=200))
    engine.step()
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    assert engine.abort_request("to-abort")
    assert engine.stats().kv_cache_usage == 0 and not engine.has_unfinished_requests()
    assert not engine.abort_request("to-abort")


def test_async_scheduling_gives_the_same_outputs(smollm2_llm):
    """Async scheduling (steps launched before the previous one's ids are read) gives what the
    synchronous loop gives: greedy and seeded rows, n > 1, stop strings and tokens, min_tokens,
    max_tokens, and an abort while a step is in flight.

    The same engine runs both ways: `LLMEngine.step` is the only reader of `async_scheduling`, and
    a second engine costs 26 s of CPU time (the GGUF file read again; see `smollm2_engine`)."""
    prompts = ["1, 2, 3, 4,", "Tell me a story.", "def f(x):", "Hello", "The capital of France"]
    params = [
        SamplingParams(temperature=0, max_tokens=20, stop=["7,"]),
        SamplingParams(temperature=0.8, seed=5, max_tokens=16, n=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, min_tokens=4),
        SamplingParams(temperature=1.0, seed=9, top_k=20, top_p=0.9, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=1),
    ]
    engine = smollm2_llm.engine
    assert not engine.async_scheduling  # the CPU default
    expected = smollm2_llm.generate(prompts, params, use_tqdm=False)
    hits_before = engine.block_manager.num_hit_tokens
    engine.async_scheduling = True
    try:
        _check_async_scheduling(smollm2_llm, prompts, params, expected)
    finally:
        engine.async_scheduling = False
    # Every prompt is shorter than a block: both runs computed everything, none hit the cache.
    assert engine.block_manager.num_hit_tokens == hits_before


def _check_async_scheduling(llm, prompts, params, expected) -> None:
    actual = llm.generate(prompts, params, use_tqdm=False)
    for want, got in zip(expected, actual, strict=True):
        for a, b in zip(want.outputs, got.outputs, strict=True):
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    engine = llm.engine
    assert engine.async_scheduling and not engine.has_unfinished_requests()
    assert engine.stats().kv_cache_usage == 0.0

    engine.add_request("f", "Count:", SamplingParams(max_tokens=3, output_kind="final_only"))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, o.finished, len(o.outputs[0].token_ids)) for o in outputs] == [
        ("f", True, 3)
    ]  # final_only: one output, the finished one

    engine.add_request("a", "A long story begins", SamplingParams(max_tokens=200))
    assert engine.step() == []  # the prefill is launched; its token is read by the next step
    engine.step()
    assert engine.abort_request("a")
    assert not engine.has_unfinished_requests() and engine.stats().kv_cache_usage == 0.0
    assert engine.step() == []  # the in-flight step of the aborted request is dropped


def _seq(out: list[int], budget: int, marker: list[int], start=None, drafts=()):
    from types import SimpleNamespace

    params = SimpleNamespace(
        thinking_budget=budget, thinking_end_ids=marker, thinking_start_ids=start
    )
    return SimpleNamespace(params=params, output_token_ids=out, spec_token_ids=list(drafts))


def test_thinking_budget_forcing_cases():
    """`_forced_thinking_end` over hand-made outputs: a marker written before the budget stops
    the forcing (also when a later token equals the marker's first); the forcing follows its own
    forced tokens; drafts before a verified row count as output; with start ids, only a reply
    that opened its reasoning is closed."""
    from atom_engine.sampler import _forced_thinking_end as forced

    m = [7, 8, 9]
    assert forced(_seq([1, 2, 3], 5, m), 3) is None  # under the budget
    assert forced(_seq([1, 2, 3, 4, 5], 5, m), 5) == 7
    assert forced(_seq([1, 2, 3, 4, 5, 7], 5, m), 6) == 8  # goes on with what it forced
    assert forced(_seq([1, 2, 3, 4, 5, 7, 8], 5, m), 7) == 9
    assert forced(_seq([1, 2, 3, 4, 5, 7, 8, 9], 5, m), 8) is None  # closed
    assert forced(_seq([1, 7, 8, 9, 2, 3], 5, m), 6) is None  # closed by the model before
    assert forced(_seq([1, 7, 8, 9, 2, 7], 5, m), 6) is None  # ... a later 7 is the answer's
    assert forced(_seq([1, 2, 3, 4, 5, 6], 5, m), 6) is None  # the model wrote no 7 at 5: not ours
    # Speculative decoding: row j sees the j drafts before it.
    assert forced(_seq([1, 2, 3, 4], 5, [9], drafts=[9, 7]), 5, ahead=1) is None
    assert forced(_seq([1, 2, 3, 4], 5, [9], drafts=[6, 7]), 5, ahead=1) == 9
    assert forced(_seq([1, 2, 3, 4], 4, m, drafts=[7, 5]), 5, ahead=1) == 8
    # Start ids: a reply that never opened a reasoning block is left alone.
    assert forced(_seq([1, 2, 3, 4, 5], 5, m, start=[1]), 5) == 7
    assert forced(_seq([2, 2, 3, 4, 5], 5, m, start=[1]), 5) is None
