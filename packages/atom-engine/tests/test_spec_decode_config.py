"""Speculative decoding's configuration (vLLM's spelling, errors naming the field) and the n-gram
drafter (prompt lookup)."""

from __future__ import annotations

import pytest

from atom_engine.spec_config import SpeculativeConfig
from atom_engine.spec_decode import ngram_propose


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] occurred at 1..2 (then 9) and 5..6 (then 7, 8): the latest wins
    assert ngram_propose(tokens, 3, 1, 2) == [7, 8, 5]
    # a longer suffix [5, 2, 3] never occurred before; [2, 3] did
    assert ngram_propose(tokens, 2, 2, 3) == [7, 8]
    # k larger than what follows: what there is
    assert ngram_propose([4, 5, 6, 4, 5], 5, 1, 2) == [6, 4, 5]
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert ngram_propose([7], 3, 1, 3) == []
    # ids over 255 and byte patterns that only match across word boundaries
    assert ngram_propose([256, 1, 70000, 256, 1], 1, 2, 2) == [70000]
    assert ngram_propose([1 << 8, 1, 1 << 16], 1, 1, 1) == []


def test_speculative_config_in_vllm_spelling():
    cfg = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    )
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (4, 3, 3)
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (5, 5)  # vLLM's defaults
    cfg = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2})
    assert cfg.method == "mtp" and cfg.prompt_lookup_max is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, r"method must be one of"),
        ({"method": "ngram"}, r"num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be a pos"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, r"unknown field.*model"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },  # fmt: skip
            r"prompt_lookup_min \(4\) is larger than prompt_lookup_max \(2\)",
        ),
        (
            {"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 2},
            r"applies to method 'ngram' only",
        ),
    ],
)
def test_invalid_speculative_config_names_the_field(raw, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(raw)
