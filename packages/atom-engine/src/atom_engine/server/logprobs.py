"""Log-probabilities as the OpenAI API returns them: completions' `logprobs`, chat's
`logprobs.content` and vLLM's `prompt_logprobs`, from the engine's per-token `Logprob` dicts."""

from __future__ import annotations

from atom_engine.outputs import Logprob
from atom_engine.server.responses import (
    ChatLogProb,
    ChatLogProbContent,
    CompletionLogProbs,
    PromptLogprob,
)

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _token_text(entry: dict[int, Logprob] | None, token_id: int, tokenizer) -> str:
    chosen = entry.get(token_id) if entry else None
    if chosen is not None and chosen.decoded_token is not None:
        return chosen.decoded_token
    return tokenizer.decode([token_id])


def _top(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= num_top]
    return sorted(ranked, key=lambda item: item[1].rank)


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob] | None],
    num_top: int,
    tokenizer,
    text_offset: int,
) -> tuple[CompletionLogProbs, int]:
    """The completions-API log-probs of `token_ids`, and the text offset after them.

    `logprobs` entries are None for tokens without log-probs (the first prompt token).
    """
    result = CompletionLogProbs()
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        token = _token_text(entry, token_id, tokenizer)
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(token)
        chosen = entry.get(token_id) if entry else None
        if chosen is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_clamp(chosen.logprob))
        top = {lp.decoded_token or "": _clamp(lp.logprob) for _, lp in _top(entry, num_top)}
        top.setdefault(token, _clamp(chosen.logprob))
        result.top_logprobs.append(top)
    return result, text_offset


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int, tokenizer
) -> list[ChatLogProbContent]:
    """The chat-API log-probs (`choices[i].logprobs.content`) of `token_ids`."""
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        token = _token_text(entry, token_id, tokenizer)
        chosen = entry.get(token_id)
        top = [
            ChatLogProb(
                token=lp.decoded_token or "",
                logprob=_clamp(lp.logprob),
                bytes=list((lp.decoded_token or "").encode()),
            )
            for _, lp in _top(entry, num_top)
        ]
        content.append(
            ChatLogProbContent(
                token=token,
                logprob=_clamp(chosen.logprob) if chosen else _MIN_LOGPROB,
                bytes=list(token.encode()),
                top_logprobs=top,
            )
        )
    return content


def prompt_logprobs_json(
    prompt_logprobs: list[dict[int, Logprob] | None] | None,
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None (the first) or {token id: its logprob,
    rank and text} for the top N asked for and the prompt's own token."""
    return [
        None
        if entry is None
        else {
            str(token_id): PromptLogprob(
                logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token_id, lp in entry.items()
        }
        for entry in prompt_logprobs or []
    ]
