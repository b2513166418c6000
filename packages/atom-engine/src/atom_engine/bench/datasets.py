"""Benchmark requests: random token-id prompts, or prompts from a ShareGPT-format JSON file."""

from __future__ import annotations

import functools
import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# vLLM's ShareGPT filters, so sampled sets match theirs: drop conversations whose prompt or reply
# is under 4 tokens, whose prompt is over 1024, or whose prompt + output is over 2048.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
_HUMAN = ("human", "user")
_GPT = ("gpt", "assistant", "chatgpt")


@dataclass
class SampleRequest:
    """One benchmark request: the prompt's token ids (and its text, for HTTP benchmarks)."""

    prompt_token_ids: list[int]
    expected_output_len: int
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str | None = None, trust_remote_code: bool = False):
    """A tokenizer, loaded once per process.

    None is the bundled SmolLM2 (its GGUF file); a .gguf file, a local HF directory or a Hub ID
    (its tokenizer files fetched through the HF cache: `atom_engine.hub`) otherwise.
    """
    if name is None:
        from atom_models.bundled import smollm2_gguf_path
        from atom_models.gguf_file import gguf_tokenizer

        return gguf_tokenizer(smollm2_gguf_path())
    from atom_engine.hub import resolve_tokenizer
    from atom_engine.tokenizer import load_tokenizer as load

    return load(resolve_tokenizer(name), trust_remote_code=trust_remote_code)


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds of lengths uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    return low, max(low, math.ceil(length * (1.0 + range_ratio)))


def ordinary_token_ids(tokenizer, vocab_size: int | None = None) -> list[int]:
    """Token ids below `vocab_size` that are not special (BOS, EOS, chat markers, ...)."""
    size = len(tokenizer) if vocab_size is None else min(len(tokenizer), vocab_size)
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    return [i for i in range(size) if i not in special]


def _text_of_length(tokenizer, ids: list[int], vocab: list[int], rng: random.Random):
    """Decode `ids` to text whose re-encoding has (nearly) len(ids) tokens: (text, token ids).

    Decoding random ids and encoding the text again merges or splits tokens, so the length drifts;
    a few rounds of truncating or topping up bring it back (vLLM does one round).
    """
    target = len(ids)
    for _ in range(4):
        text = tokenizer.decode(ids)
        encoded = tokenizer(text, add_special_tokens=False).input_ids
        if len(encoded) == target:
            break
        ids = encoded[:target] + [rng.choice(vocab) for _ in range(target - len(encoded))]
    return text, encoded


def sample_random(
    tokenizer,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    as_text: bool = False,
    vocab_size: int | None = None,
) -> list[SampleRequest]:
    """Prompts of random ordinary token ids; input and output lengths uniform in their ranges.

    `as_text` also decodes each prompt to text (HTTP benchmarks send text); its token ids are then
    the text's re-encoding, whose length can differ from the drawn one by a token or two.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    input_low, input_high = length_range(input_len, range_ratio)
    output_low, output_high = length_range(output_len, range_ratio)
    vocab = ordinary_token_ids(tokenizer, vocab_size)
    requests = []
    for _ in range(num_requests):
        ids = [rng.choice(vocab) for _ in range(rng.randint(input_low, input_high))]
        prompt = None
        if as_text:
            prompt, ids = _text_of_length(tokenizer, ids, vocab, rng)
        requests.append(SampleRequest(ids, rng.randint(output_low, output_high), prompt))
    return requests


def _first_exchange(conversation: list[dict]) -> tuple[str, str] | None:
    """The first human turn and the first gpt reply after it, or None."""
    roles = [turn.get("from") for turn in conversation]
    for i, role in enumerate(roles):
        if role in _HUMAN:
            for j in range(i + 1, len(roles)):
                if roles[j] in _GPT:
                    return conversation[i]["value"], conversation[j]["value"]
            return None
    return None


def sample_sharegpt(
    path: str | Path,
    tokenizer,
    num_requests: int,
    output_len: int | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts from a ShareGPT JSON file: [{"conversations": [{"from", "value"}, ...]}, ...].

    The prompt is the first human turn; the output length is the token count of the first gpt reply,
    capped at `output_len` when given. Entries are shuffled with `seed` and filtered like vLLM's.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of {{'conversations': [...]}} entries")
    exchanges = [
        pair
        for entry in entries
        if isinstance(entry, dict) and isinstance(entry.get("conversations"), list)
        if (pair := _first_exchange(entry["conversations"])) is not None
    ]
    random.Random(seed).shuffle(exchanges)
    requests = []
    for prompt, reply in exchanges:
        if len(requests) == num_requests:
            break
        prompt_ids = tokenizer(prompt).input_ids
        reply_len = count_tokens(tokenizer, reply)
        new_output_len = reply_len if output_len is None else min(reply_len, output_len)
        if (
            len(prompt_ids) < SHAREGPT_MIN_LEN
            or reply_len < SHAREGPT_MIN_LEN
            or len(prompt_ids) > SHAREGPT_MAX_PROMPT_LEN
            or len(prompt_ids) + new_output_len > SHAREGPT_MAX_TOTAL_LEN
        ):
            continue
        requests.append(SampleRequest(prompt_ids, new_output_len, prompt))
    if not requests:
        raise ValueError(f"{path}: no conversation fits the length limits")
    if len(requests) < num_requests:
        logger.warning("%s: only %d of %d requests fit", path, len(requests), num_requests)
    return requests


def sample_requests(
    dataset_name: str,
    tokenizer,
    num_requests: int,
    input_len: int,
    output_len: int | None,
    range_ratio: float = 0.0,
    dataset_path: str | None = None,
    seed: int = 0,
    as_text: bool = False,
    vocab_size: int | None = None,
) -> list[SampleRequest]:
    """Requests of `dataset_name` (random | sharegpt); output_len None: the replies' lengths."""
    if dataset_name == "random":
        if output_len is None:
            raise ValueError("the random dataset needs an output length")
        return sample_random(
            tokenizer, num_requests, input_len, output_len, range_ratio, seed, as_text, vocab_size
        )
    if dataset_name == "sharegpt":
        if dataset_path is None:
            raise ValueError("the sharegpt dataset needs --dataset-path FILE.json")
        return sample_sharegpt(dataset_path, tokenizer, num_requests, output_len, seed)
    raise ValueError(f"unknown dataset {dataset_name!r}: choose random or sharegpt")
