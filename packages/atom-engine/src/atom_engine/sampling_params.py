"""Per-request sampling parameters (vLLM-shaped, so code switches with one import)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ValueError naming the field.

    temperature 0 is greedy. `stop` strings are matched on the detokenized text and not included in
    the output; `stop_token_ids` finish the request (and, like EOS, are not part of the text).
    `logprobs` = N returns the top-N log-probs of every generated token (plus the chosen one);
    `prompt_logprobs` = N does the same for every prompt token after the first.
    `output_kind` (vLLM's RequestOutputKind): "cumulative" gives a RequestOutput from every step
    that advanced the request, "final_only" only the finished one (what `LLM.generate` uses; it
    saves copying every request's tokens at every step).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: str = "cumulative"
    # Filled by the engine from the model's generation config (not a user field).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check()

    def _check(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if self.output_kind not in ("cumulative", "final_only"):
            fail("output_kind", "must be 'cumulative' or 'final_only'")
        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if not self.temperature >= 0.0:
            fail("temperature", "must be >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", "must be an integer: -1 or 0 to disable, or >= 1")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not 0 <= self.seed < 2**63 - self.n
        ):
            fail("seed", "must be an integer in [0, 2**63 - n) or None")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            fail("max_tokens", "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", "must be > 0 (1 = off)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
