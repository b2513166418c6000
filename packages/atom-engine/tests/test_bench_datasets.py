"""Benchmark requests: random lengths stay in range, ShareGPT files parse and filter like vLLM's."""

from __future__ import annotations

import json

import pytest

from atom_engine.bench import datasets


@pytest.fixture(scope="module")
def tokenizer():
    return datasets.load_tokenizer(None)  # the bundled SmolLM2's; cached for the session


def test_length_range():
    assert datasets.length_range(100, 0.25) == (75, 125)
    assert datasets.length_range(10, 0.0) == (10, 10)
    assert datasets.length_range(1, 0.9) == (1, 2)  # never below 1
    with pytest.raises(ValueError, match="range ratio"):
        datasets.length_range(10, 1.0)
    with pytest.raises(ValueError, match="length"):
        datasets.length_range(0, 0.0)


def test_random_token_ids_in_range_and_ordinary(tokenizer):
    requests = datasets.sample_random(tokenizer, 64, input_len=32, output_len=8, range_ratio=0.5)
    assert len(requests) == 64
    input_lens = {r.prompt_len for r in requests}
    output_lens = {r.expected_output_len for r in requests}
    assert min(input_lens) >= 16 and max(input_lens) <= 48 and len(input_lens) > 5
    assert min(output_lens) >= 4 and max(output_lens) <= 12 and len(output_lens) > 3
    special = set(tokenizer.all_special_ids) | set(range(17))  # SmolLM2's added special tokens
    assert not special & {t for r in requests for t in r.prompt_token_ids}
    assert all(r.prompt is None for r in requests)
    again = datasets.sample_random(tokenizer, 64, input_len=32, output_len=8, range_ratio=0.5)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests]
    other = datasets.sample_random(tokenizer, 64, 32, 8, range_ratio=0.5, seed=1)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in requests]


def test_random_fixed_lengths_and_vocab_cap(tokenizer):
    requests = datasets.sample_random(tokenizer, 8, input_len=16, output_len=8, vocab_size=1000)
    assert {r.prompt_len for r in requests} == {16}
    assert {r.expected_output_len for r in requests} == {8}
    assert max(t for r in requests for t in r.prompt_token_ids) < 1000


def test_random_text_prompts_reencode_to_their_ids(tokenizer):
    requests = datasets.sample_random(tokenizer, 8, input_len=32, output_len=4, as_text=True)
    for r in requests:
        assert isinstance(r.prompt, str) and r.prompt
        assert tokenizer(r.prompt, add_special_tokens=False).input_ids == r.prompt_token_ids
        assert abs(r.prompt_len - 32) <= 2


def _turn(role: str, value: str) -> dict:
    return {"from": role, "value": value}


def test_sharegpt_parsing_and_filters(tmp_path, tokenizer):
    long_reply = "The quick brown fox jumps over the lazy dog. " * 4
    entries = [
        {
            "conversations": [
                _turn("human", "Tell me about the Eiffel Tower in Paris."),
                _turn("gpt", long_reply),
            ]
        },
        # The first human turn need not come first; the reply is the next gpt turn after it.
        {
            "conversations": [
                _turn("gpt", "Hello there, how can I help?"),
                _turn("human", "Explain how rainbows form in the sky."),
                _turn("human", "ignored second question"),
                _turn("gpt", "Sunlight refracts inside raindrops and splits up."),
            ]
        },
        {"conversations": [_turn("human", "Hi"), _turn("gpt", long_reply)]},  # prompt too short
        {
            "conversations": [_turn("human", "Write a poem about the ocean."), _turn("gpt", "OK")]
        },  # reply too short
        {"conversations": [_turn("human", "word " * 1100), _turn("gpt", long_reply)]},  # too long
        {"conversations": [_turn("human", "A question with no answer at all?")]},
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))

    requests = datasets.sample_sharegpt(path, tokenizer, num_requests=10)
    by_prompt = {r.prompt: r for r in requests}
    assert set(by_prompt) == {
        "Tell me about the Eiffel Tower in Paris.",
        "Explain how rainbows form in the sky.",
    }
    eiffel = by_prompt["Tell me about the Eiffel Tower in Paris."]
    assert eiffel.prompt_token_ids == tokenizer(eiffel.prompt).input_ids
    assert eiffel.expected_output_len == datasets.count_tokens(tokenizer, long_reply)
    rainbow = by_prompt["Explain how rainbows form in the sky."]
    reply = "Sunlight refracts inside raindrops and splits up."
    assert rainbow.expected_output_len == datasets.count_tokens(tokenizer, reply)

    capped = datasets.sample_sharegpt(path, tokenizer, num_requests=10, output_len=5)
    assert {r.expected_output_len for r in capped} == {5}
    one = datasets.sample_sharegpt(path, tokenizer, num_requests=1, seed=3)
    assert len(one) == 1 and one[0].prompt in by_prompt

    via_dispatch = datasets.sample_requests("sharegpt", tokenizer, 10, 0, None, dataset_path=path)
    assert sorted(r.prompt for r in via_dispatch) == sorted(by_prompt)


def test_sharegpt_with_nothing_usable_raises(tmp_path, tokenizer):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps([{"conversations": [_turn("human", "Hi"), _turn("gpt", "Yo")]}]))
    with pytest.raises(ValueError, match="no conversation fits"):
        datasets.sample_sharegpt(path, tokenizer, num_requests=2)
    with pytest.raises(ValueError, match="dataset-path"):
        datasets.sample_requests("sharegpt", tokenizer, 2, 16, 8)
    with pytest.raises(ValueError, match="unknown dataset"):
        datasets.sample_requests("sonnet", tokenizer, 2, 16, 8)
