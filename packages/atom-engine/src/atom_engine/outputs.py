"""What the engine returns: vLLM-shaped request outputs (cumulative, not deltas)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One entry per token: token id -> Logprob (the chosen token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # None for the first prompt token


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_prompt_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # Set when the engine failed this request (finished, with finish_reason "error").
    error: str | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_prompt_tokens if self.metrics else 0
