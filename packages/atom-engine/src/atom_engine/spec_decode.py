"""Speculative decoding: the configuration (vLLM's `speculative_config`) and the n-gram drafter.

The verification is `atom_kernels.rejection_sample` (lossless: the emitted tokens follow the
target model's distribution). Drafts come from prompt lookup (`method: "ngram"`: the tokens that
followed the latest earlier occurrence of the sequence's last n tokens, any model) or from a
DeepSeek-V3-family checkpoint's MTP layer (`method: "mtp"`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "mtp")
_FIELDS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram: longest n-gram matched
    prompt_lookup_min: int | None = None  # ngram: shortest n-gram matched

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's spelling: {"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_max": n, "prompt_lookup_min": m} or {"method": "mtp", ...}."""
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {raw!r}")
        unknown = sorted(set(raw) - _FIELDS)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {unknown}; ATOM takes {sorted(_FIELDS)} "
                "(draft models are not supported: use method 'ngram' or 'mtp')"
            )
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
        k = _positive_int(raw, "num_speculative_tokens", None)
        if method == "mtp":
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if name in raw:
                    raise ValueError(f"speculative_config.{name} applies to method 'ngram' only")
            return cls(method, k)
        # vLLM's defaults: both 5; one given stands for the other.
        given_hi, given_lo = raw.get("prompt_lookup_max"), raw.get("prompt_lookup_min")
        default = given_hi if given_hi is not None else given_lo if given_lo is not None else 5
        hi = _positive_int(raw, "prompt_lookup_max", default)
        lo = _positive_int(raw, "prompt_lookup_min", default)
        if lo > hi:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({lo}) is larger than prompt_lookup_max "
                f"({hi})"
            )
        return cls(method, k, hi, lo)


def _positive_int(raw: dict, name: str, default: int | None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise ValueError(f"speculative_config.{name} is required")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
    return value


def ngram_propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens by prompt lookup: for n from max_n down to min_n, find the latest
    earlier occurrence of the last n tokens and propose the (up to k) tokens that followed it;
    [] when no suffix of those lengths occurred before."""
    if k < 1 or len(tokens) < min_n + 1:
        return []
    # Search the token ids as 4-byte words with bytes.rfind (C speed), keeping word alignment.
    data = array("i", tokens).tobytes()
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        pattern = data[-4 * n :]
        end = len(data) - 4  # an occurrence must end before the last token (not be the suffix)
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return list(tokens[start : start + k])
            end = at + len(pattern) - 1
    return []
