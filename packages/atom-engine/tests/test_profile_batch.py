"""The memory profile's dummy prefill stays inside the model's length (positions index the
rotary table, which the GPU rotary+cache kernel reads unchecked)."""

from __future__ import annotations

import pytest

from atom_engine.kv_cache import profile_batch


@pytest.mark.parametrize(
    ("num_tokens", "max_model_len", "block_size"),
    [(2048, 1024, 16), (2048, 4096, 16), (1000, 300, 16), (17, 16, 16), (5, 1, 4)],
)
def test_profile_batch_positions_stay_in_the_model_length(num_tokens, max_model_len, block_size):
    lens, tables, positions = profile_batch(num_tokens, max_model_len, block_size)
    assert sum(lens) == num_tokens == len(positions)
    assert max(lens) <= max_model_len and max(positions) < max_model_len
    start = 0
    for n in lens:  # each prompt's positions count from 0
        assert positions[start : start + n] == list(range(n))
        start += n
    blocks = [b for t in tables for b in t]
    assert blocks == list(range(len(blocks)))  # fresh, distinct blocks
    assert all(len(t) * block_size >= n for t, n in zip(tables, lens, strict=True))
