"""The cpu backend's `DecodeStep` (a decode-only step's cache write and attention) against the torch
reference, the oracle: `reshape_and_cache` then `paged_attention`, over shuffled paged layouts,
sequences of different lengths, GQA / MQA / Dv != D, sliding windows, NaN-poisoned slots outside
what each sequence may read, and one plan reused by several layers of a step."""

import pytest
import torch

from atom_kernels.backends.cpu.decode_step import DecodeStep
from atom_kernels.backends.torch import attention as ref_attention
from atom_kernels.backends.torch import cache as ref_cache
from atom_kernels.testing import assert_close, assert_equal

# (H, Hk, D, Dv, block_size)
HEADS = [(9, 3, 64, 64, 16), (4, 1, 40, 40, 5), (3, 3, 24, 17, 7)]
SEQ_LENS = {"one": [160], "one_short": [1], "varied": [20, 1, 64, 37, 5], "equal": [33, 33]}


def make_step(heads, seq_lens, seed=0):
    """Caches holding each sequence's first seq_len - 1 tokens (NaN elsewhere, the new token's
    slot included), a shuffled block table with garbage past each sequence's blocks, and this
    step's q / k / v."""
    num_heads, num_kv_heads, head_dim, head_dim_v, block_size = heads
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    value_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim_v), float("nan"))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(seq_lens), max(blocks_per_seq) + 2), perm[-1], dtype=torch.int32)
    slots = []
    for b, seq_len in enumerate(seq_lens):
        ids = [perm.pop(0) for _ in range(blocks_per_seq[b])]
        table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        flat_ids = torch.tensor(ids).repeat_interleave(block_size)[: seq_len - 1]
        offsets = torch.arange(seq_len - 1) % block_size
        key_cache[flat_ids, offsets] = torch.randn(seq_len - 1, num_kv_heads, head_dim, generator=g)
        value_cache[flat_ids, offsets] = torch.randn(
            seq_len - 1, num_kv_heads, head_dim_v, generator=g
        )
        pos = seq_len - 1
        slots.append(ids[pos // block_size] * block_size + pos % block_size)
    num_seqs = len(seq_lens)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    key = torch.randn(num_seqs, num_kv_heads, head_dim, generator=g)
    value = torch.randn(num_seqs, num_kv_heads, head_dim_v, generator=g)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return query, key, value, key_cache, value_cache, table, seq_lens_t, torch.tensor(slots)


def reference(batch, scale, sliding_window):
    query, key, value, key_cache, value_cache, table, seq_lens, slots = batch
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    ref_cache.reshape_and_cache(key, value, key_cache, value_cache, slots, None, None)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    out = ref_attention.paged_attention(
        query, key_cache, value_cache, table, seq_lens, qsl, scale, sliding_window,
        None, None, None, None, None,
    )  # fmt: skip
    return out, key_cache, value_cache


@pytest.mark.parametrize("window", [None, 8, 1])
@pytest.mark.parametrize("lens", list(SEQ_LENS))
@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mqa", "dv"])
def test_decode_step_matches_reference(heads, lens, window):
    batch = make_step(heads, SEQ_LENS[lens])
    query, key, value, key_cache, value_cache, table, seq_lens, slots = batch
    expected, expected_k, expected_v = reference(batch, 0.125, window)
    step = DecodeStep.build(slots, table, seq_lens, heads[4], window)
    # The mask is left out only where every position is visible.
    all_visible = len(set(SEQ_LENS[lens])) == 1 and (
        window is None or window >= max(SEQ_LENS[lens])
    )
    assert (step.bias is None) == all_visible
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    flat_k, flat_v = (
        key_cache.view(-1, *key_cache.shape[2:]),
        value_cache.view(-1, *value_cache.shape[2:]),
    )
    got = step.attend(query, key, value, flat_k, flat_v, 0.125)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert_close(got, expected, atol=2e-5, rtol=2e-5, name=f"{lens}, window {window}")
    assert_equal(key_cache, expected_k, name="key cache")
    assert_equal(value_cache, expected_v, name="value cache")


def test_one_plan_serves_every_layer_of_a_step():
    """Three layers (caches of their own, the same metadata), strided q / k / v as a fused QKV
    projection's output gives them."""
    heads = HEADS[0]
    num_heads, num_kv_heads, head_dim, _, block_size = heads
    step = None
    for layer in range(3):
        # The same block table and lengths (one step), each layer's own cache and inputs
        query, key, value, key_cache, value_cache, table, seq_lens, slots = make_step(
            heads, SEQ_LENS["varied"]
        )
        query, key, value = query * (1 + layer), key - layer, value + layer
        key_cache, value_cache = key_cache * (1 + layer), value_cache - layer
        batch = query, key, value, key_cache, value_cache, table, seq_lens, slots
        expected, expected_k, _ = reference(batch, 0.1, None)
        if step is None:
            step = DecodeStep.build(slots, table, seq_lens, block_size, None)
        qkv = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
        q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim :][:, : num_kv_heads * head_dim].view_as(key)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view_as(value)
        assert not q.is_contiguous()
        flat_k = key_cache.view(-1, *key_cache.shape[2:])
        flat_v = value_cache.view(-1, *value_cache.shape[2:])
        got = step.attend(q, k, v, flat_k, flat_v, 0.1)
        assert_close(got, expected, atol=2e-5, rtol=2e-5, name=f"layer {layer}")
        assert_equal(key_cache, expected_k, name=f"layer {layer} key cache")


def test_build_refuses_what_is_not_a_decode_step():
    table = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="one of each per sequence"):
        DecodeStep.build(torch.tensor([1, 2, 3]), table, lens, 4, None)
    with pytest.raises(ValueError, match="a slot and a length"):
        DecodeStep.build(torch.tensor([1, -1]), table, lens, 4, None)
    with pytest.raises(ValueError, match="does not fit a block table"):
        DecodeStep.build(torch.tensor([1, 2]), table, torch.tensor([3, 17]), 4, None)
