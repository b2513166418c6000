"""The value ranges the server checks, added to the OpenAPI document's request schemas
(`openapi.build_openapi`): sampling values, token ids within the served model's vocabulary, `n`
up to its batch size, lengths within its context, for each request model by its schema name."""

from __future__ import annotations

from typing import Any

from atom_engine.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
)


def _numbers(**bounds: float) -> dict[str, dict[str, float]]:
    return {"integer": bounds, "number": bounds}


def request_bounds(state) -> dict[str, dict[str, dict[str, dict]]]:
    """Request schema -> field -> JSON type -> the keywords bounding values of that type."""
    max_len, vocab = state.engine.max_model_len, state.engine.engine.vocab_size
    token_ids = {"integer": {"minimum": 0, "maximum": vocab - 1}}
    logprobs = _numbers(minimum=0, maximum=MAX_LOGPROBS)
    common = {
        "n": _numbers(minimum=1, maximum=state.max_n),
        "seed": _numbers(minimum=INT64_MIN, maximum=INT64_MAX),
        "stop": {"string": {"minLength": 1}},
        "temperature": _numbers(minimum=0),
        "top_p": _numbers(exclusiveMinimum=0, maximum=1),
        "top_k": _numbers(minimum=-1, maximum=INT64_MAX),
        "min_p": _numbers(minimum=0, maximum=1),
        "presence_penalty": _numbers(minimum=-2, maximum=2),
        "frequency_penalty": _numbers(minimum=-2, maximum=2),
        "repetition_penalty": _numbers(
            minimum=1 / MAX_REPETITION_PENALTY, maximum=MAX_REPETITION_PENALTY
        ),
        "min_tokens": _numbers(minimum=0, maximum=max_len),
        "stop_token_ids": token_ids,
        "allowed_token_ids": {**token_ids, "array": {"minItems": 1}},
        "prompt_logprobs": logprobs,
        "logit_bias": {
            "object": {
                "propertyNames": {"pattern": "^[0-9]+$"},  # token ids
                "additionalProperties": {
                    "type": "number",
                    "minimum": -MAX_BIAS,
                    "maximum": MAX_BIAS,
                },
            }
        },
    }
    return {
        "CompletionRequest": {
            **common,
            # 0 only with echo (scores the prompt)
            "max_tokens": _numbers(minimum=0, maximum=max_len),
            "logprobs": logprobs,
            "prompt": {**token_ids, "string": {"minLength": 1}, "array": {"minItems": 1}},
        },
        "ChatCompletionRequest": {
            **common,
            "max_tokens": _numbers(minimum=1, maximum=max_len),
            "max_completion_tokens": _numbers(minimum=1, maximum=max_len),
            "top_logprobs": logprobs,
            "messages": {"array": {"minItems": 1}},
        },
        "MessagesRequest": {
            "max_tokens": _numbers(minimum=1, maximum=max_len),
            "temperature": common["temperature"],
            "top_p": common["top_p"],
            "top_k": common["top_k"],
            "stop_sequences": {"string": {"minLength": 1}},
            "messages": {"array": {"minItems": 1}},
        },
        "ResponsesRequest": {
            **{k: common[k] for k in ("seed", "stop", "temperature", "top_p", "top_k", "min_p")},
            "repetition_penalty": common["repetition_penalty"],
            "max_output_tokens": _numbers(minimum=1, maximum=max_len),
            "input": {"array": {"minItems": 1}},
        },
        "CountTokensRequest": {"messages": {"array": {"minItems": 1}}},
        "TokenizeChatRequest": {"messages": {"array": {"minItems": 1}}},
        "DetokenizeRequest": {"tokens": token_ids},
    }


def bound(schema: dict[str, Any], by_type: dict[str, dict]) -> None:
    """Add `by_type[t]` to each (sub)schema of JSON type t: anyOf branches, array items."""
    for branch in schema.get("anyOf", ()):
        bound(branch, by_type)
    kind = schema.get("type")
    schema.update(by_type.get(kind, {}))
    if kind == "array" and isinstance(schema.get("items"), dict):
        bound(schema["items"], by_type)
