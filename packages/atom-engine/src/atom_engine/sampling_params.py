"""Per-request sampling parameters (vLLM-shaped, so code switches with one import)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# NOTE: below this a temperature divides logits into inf/NaN in float32; vLLM clamps the same way.
MIN_TEMPERATURE = 1e-2
# Penalties outside this range overflow float32 logits (|logit| ~ 1e3 times or over 1e4).
MAX_REPETITION_PENALTY = 1e4
MAX_BIAS = 100.0  # OpenAI's logit_bias range


class InvalidRequest(ValueError):
    """A request that can never run; `param` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# The kinds of structured output, as StructuredOutputsParams' fields name them.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's `StructuredOutputsParams`): exactly one of a
    JSON schema (`json`: a dict or its JSON text), a regular expression, a `choice` of strings,
    an EBNF `grammar` (xgrammar's dialect: `root ::= ...`), or `json_object` (any JSON object).
    JSON is generated compactly (one space after `,` and `:`, no other whitespace)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "SamplingParams.structured_outputs must set exactly one of "
                f"{', '.join(KINDS)}, got {given or 'none'}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                "SamplingParams.structured_outputs choice must be a non-empty list of non-empty "
                f"strings, got {self.choice!r}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"SamplingParams.structured_outputs {name} must be a non-empty string"
                )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(
                "SamplingParams.structured_outputs json must be a JSON schema (a dict or its "
                f"JSON text), got {type(self.json).__name__}"
            )

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ValueError naming the field.

    temperature 0 is greedy. `stop` strings are matched on the detokenized text and not included in
    the output; `stop_token_ids` finish the request (and, like EOS, are not part of the text).
    `logprobs` = N returns the top-N log-probs of every generated token (plus the chosen one);
    `prompt_logprobs` = N does the same for every prompt token after the first.
    `allowed_token_ids` restricts sampling to those ids. `logit_bias` ({token id: bias in
    [-100, 100]}, OpenAI's) is added to those tokens' logits before any sampling (greedy too, and
    the target's rows under speculative decoding), before penalties; log-probs stay the model's.
    `seed` is any 64-bit integer (negative ones too, as vLLM accepts them); choice i of n
    samples with seed + i (mod 2**64). A temperature in (0, 0.01) is raised to 0.01 (float32
    logits overflow below it).
    `output_kind` (vLLM's RequestOutputKind): "cumulative" gives a RequestOutput from every step
    that advanced the request, "final_only" only the finished one (what `LLM.generate` uses; it
    saves copying every request's tokens at every step).
    `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar
    (`atom_engine.structured_output`); the request ends when its grammar is complete.
    `thinking_budget` (with `thinking_end_ids`, the token ids of the model's end-of-reasoning
    marker, e.g. `</think>`): once that many tokens are out and the marker is not among them, the
    marker is forced, token by token (the Anthropic API's `thinking.budget_tokens`); with
    `thinking_start_ids`, only in an output that opens with them (a model that may not think).
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
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: str = "cumulative"
    structured_outputs: StructuredOutputsParams | None = None
    thinking_budget: int | None = None
    thinking_end_ids: list[int] | None = None
    thinking_start_ids: list[int] | None = None
    # Filled by the engine from the model's generation config (not a user field).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # The compiled grammar of structured_outputs (filled by the engine's checks; not a user field).
    compiled_grammar: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.thinking_end_ids is not None:
            self.thinking_end_ids = list(self.thinking_end_ids)
        if self.thinking_start_ids is not None:
            self.thinking_start_ids = list(self.thinking_start_ids)
        self._check()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def _check(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if self.output_kind not in ("cumulative", "final_only"):
            fail("output_kind", "must be 'cumulative' or 'final_only'")
        if not _is_int(self.n) or self.n < 1:
            fail("n", "must be an integer >= 1")
        for name in (
            "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                fail(name, "must be a number")
            if not math.isfinite(value):
                fail(name, "must be a finite number")
        if not self.temperature >= 0.0:
            fail("temperature", "must be >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            fail("top_k", "must be an integer: -1 or 0 to disable, or >= 1")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.seed is not None and (
            not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX
        ):
            fail("seed", "must be a 64-bit integer or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if not all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.allowed_token_ids)
        ):
            fail("allowed_token_ids", "must be a non-empty list of non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                _is_int(t) and 0 <= t <= INT64_MAX and _is_number(b) and -MAX_BIAS <= b <= MAX_BIAS
                for t, b in self.logit_bias.items()
            ):
                fail("logit_bias", f"must map token ids to biases in [{-MAX_BIAS}, {MAX_BIAS}]")
            self.logit_bias = dict(self.logit_bias) or None  # a copy; {}: no bias
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if not 1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            fail("repetition_penalty", "must be in [1e-4, 1e4] (1 = off)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if (self.thinking_budget is None) != (self.thinking_end_ids is None):
            fail("thinking_budget", "and thinking_end_ids go together")
        if self.thinking_budget is not None:
            if not _is_int(self.thinking_budget) or self.thinking_budget < 0:
                fail("thinking_budget", "must be a non-negative integer")
            for name in ("thinking_end_ids", "thinking_start_ids"):
                ids = getattr(self, name)
                if name == "thinking_start_ids" and ids is None:
                    continue
                if not ids or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids):
                    fail(name, "must be a non-empty list of token ids")
        elif self.thinking_start_ids is not None:
            fail("thinking_start_ids", "needs thinking_budget")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                fail("structured_outputs", "must be a StructuredOutputsParams")
            if self.min_tokens:
                fail(
                    "min_tokens",
                    "cannot be combined with structured_outputs (the grammar decides where the "
                    "output ends)",
                )

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must be in the model's vocabulary (the engine calls this on add)."""
        for name in (
            "stop_token_ids",
            "allowed_token_ids",
            "logit_bias",
            "thinking_end_ids",
            "thinking_start_ids",
        ):
            bad = [t for t in getattr(self, name) or () if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"SamplingParams.{name} must be token ids below the vocabulary size "
                    f"{vocab_size}, got {bad[:5]}"
                )

    def seed_of(self, index: int) -> int | None:
        """The generator seed of choice `index` (an unsigned 64-bit value), or None."""
        return None if self.seed is None else (self.seed + index) % 2**64

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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
