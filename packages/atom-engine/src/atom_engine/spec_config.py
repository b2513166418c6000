"""The configuration of speculative decoding (vLLM's `speculative_config`), parsed and checked.

A leaf: `config.EngineConfig` holds one, and the drafters (`spec_decode`) read it.
"""

from __future__ import annotations

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

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def _positive_int(raw: dict, name: str, default: int | None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise ValueError(f"speculative_config.{name} is required")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
    return value
