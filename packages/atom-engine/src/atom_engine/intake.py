"""Requests as they enter the engine: the prompt forms, the checks a request must pass before it
is queued (the server runs them on its own threads), and the engine's record of a request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from atom_engine.outputs import RequestMetrics
from atom_engine.sampling_params import InvalidRequest, SamplingParams
from atom_engine.sequence import Sequence


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # a loop, not all() over a generator: read per request per step
            if not seq.is_finished:
                return False
        return True


def prompt_of(
    prompt: str | list[int] | dict, tokenize: Callable[[str], list[int]] | None
) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt: a string, token ids, or a dict with "prompt" and / or
    "prompt_token_ids" (both: the ids are used and the text is kept for the outputs)."""
    text = None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if tokenize is None:
            raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set)")
        return prompt, tokenize(prompt)
    return text, list(prompt)


def check_request(
    token_ids: list[int],
    params: SamplingParams,
    vocab: int,
    max_model_len: int,
    kv_tokens: int,
) -> None:
    """Raise ValueError when a request can never run: token ids outside the vocabulary, a
    prompt too long for the context or the KV cache. Fills params' per-model defaults
    (max_tokens, top_k past the vocabulary). Reads only what never changes after start-up,
    so the server calls it from any thread before the request reaches the engine."""
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(
            f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}", "prompt"
        )
    params.check_vocab(vocab)
    if params.top_k >= vocab:
        params.top_k = 0  # every token is in the top k
    if not token_ids:
        raise InvalidRequest("the prompt is empty (0 tokens)", "prompt")
    n = len(token_ids)
    if n >= max_model_len:
        raise InvalidRequest(
            f"the prompt has {n} tokens, but the model's context length (max_model_len) is "
            f"{max_model_len}; it leaves no room to generate",
            "prompt",
        )
    total = kv_tokens  # the whole KV cache
    if params.max_tokens is None:  # as many as fit
        params.max_tokens = max(1, min(max_model_len, total) - n)
    if n + params.max_tokens > max_model_len:
        raise InvalidRequest(
            f"the prompt has {n} tokens and max_tokens is {params.max_tokens}: {n} + "
            f"{params.max_tokens} exceeds the context length (max_model_len) "
            f"{max_model_len}",
            "max_tokens",
        )
    if n + params.max_tokens > total:
        raise InvalidRequest(
            f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) needs more than "
            f"the whole KV cache ({total} tokens)",
            "max_tokens",
        )
