"""paged_attention against a dense masked softmax per sequence over the original (unpaged) K/V."""

import math

import pytest
import torch

import atom_kernels as ak
from atom_kernels.testing import assert_close, assert_equal

FP8 = torch.float8_e4m3fn
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# (H, Hk, D, Dv, block_size): GQA, MQA, MHA with a value head dim != key head dim
HEADS = [(8, 2, 64, 64, 16), (4, 1, 40, 40, 5), (3, 3, 24, 17, 7)]
# (seq_len, q_len) per sequence: prefill, prefill over a cached prefix, decodes, an empty query
SEQS = [(37, 37), (50, 13), (20, 1), (1, 1), (64, 1), (9, 0), (33, 4)]
FEATURES = {
    "causal": {},
    "window": {"sliding_window": 8},
    "sinks_softcap": {"sinks": True, "soft_cap": 5.0},
    "window_sinks": {"sliding_window": 3, "sinks": True},
}


class Batch:
    """Random K/V per sequence, written to a NaN-poisoned paged cache through shuffled blocks."""

    def __init__(self, heads, dtype, cache_dtype=None, strided=False, pad_rows=2, seed=0):
        num_heads, num_kv_heads, head_dim, head_dim_v, block_size = heads
        g = torch.Generator().manual_seed(seed)
        self.seq_lens = [s for s, _ in SEQS]
        self.q_lens = [q for _, q in SEQS]
        num_tokens = sum(self.q_lens) + pad_rows
        self.keys = [torch.randn(s, num_kv_heads, head_dim, generator=g) for s in self.seq_lens]
        self.values = [torch.randn(s, num_kv_heads, head_dim_v, generator=g) for s in self.seq_lens]
        self.keys = [k.to(dtype) for k in self.keys]
        self.values = [v.to(dtype) for v in self.values]
        width = num_heads * head_dim
        qkv = torch.randn(num_tokens, 2 * width, generator=g).to(dtype)
        query = qkv[:, :width] if strided else qkv[:, :width].contiguous()
        self.query = query.view(num_tokens, num_heads, head_dim)

        blocks_per_seq = [-(-s // block_size) for s in self.seq_lens]
        max_blocks = max(blocks_per_seq) + 1
        num_blocks = sum(blocks_per_seq) + 5  # spare blocks stay NaN
        perm = torch.randperm(num_blocks, generator=g).tolist()
        self.block_tables = torch.full((len(SEQS), max_blocks), 10_000, dtype=torch.int32)
        shape_k = (num_blocks, block_size, num_kv_heads, head_dim)
        shape_v = (num_blocks, block_size, num_kv_heads, head_dim_v)
        self.k_scale, self.v_scale = (0.02, 0.015) if cache_dtype == FP8 else (None, None)
        cache_dtype = cache_dtype or dtype

        def poisoned(shape):
            return torch.full(shape, float("nan")).to(cache_dtype)

        if strided and head_dim == head_dim_v:  # one [num_blocks, 2, ...] buffer, K and V views
            kv = poisoned((num_blocks, 2, *shape_k[1:]))
            self.key_cache, self.value_cache = kv[:, 0], kv[:, 1]
        else:
            self.key_cache, self.value_cache = poisoned(shape_k), poisoned(shape_v)
        for b, seq_len in enumerate(self.seq_lens):
            ids = [perm.pop() for _ in range(blocks_per_seq[b])]
            self.block_tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            for pos in range(seq_len):
                block, offset = ids[pos // block_size], pos % block_size
                self.key_cache[block, offset] = self._store(self.keys[b][pos], self.k_scale)
                self.value_cache[block, offset] = self._store(self.values[b][pos], self.v_scale)
        self.query_start_loc = torch.tensor([0, *torch.tensor(self.q_lens).cumsum(0)]).int()
        self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32)
        g2 = torch.Generator().manual_seed(seed + 1)
        self.sinks = torch.randn(num_heads, generator=g2) * 2

    def _store(self, x, scale):
        if scale is None:
            return x
        return (x.float() / scale).to(FP8)

    def stored(self, which, b):
        # The values attention should see: fp8 entries dequantized, others as given.
        x, scale = (self.keys[b], self.k_scale) if which == "k" else (self.values[b], self.v_scale)
        if scale is None:
            return x.double()
        return (x.float() / scale).to(FP8).double() * scale

    def run(self, scale, features, **kwargs):
        return ak.paged_attention(
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens_t,
            self.query_start_loc,
            scale,
            sliding_window=features.get("sliding_window"),
            sinks=self.sinks if features.get("sinks") else None,
            soft_cap=features.get("soft_cap"),
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            **kwargs,
        )


def dense_reference(batch, scale, features, dequantized=True):
    """fp64, one sequence at a time: scores of its query rows against all its keys, a mask from
    each query row's position, softmax with the sink in the denominator, P @ V."""
    num_tokens, num_heads, _ = batch.query.shape
    num_kv_heads = batch.keys[0].shape[1]
    kv_head_of = [h * num_kv_heads // num_heads for h in range(num_heads)]
    out = torch.zeros(num_tokens, num_heads, batch.values[0].shape[2], dtype=torch.float64)
    window, cap = features.get("sliding_window"), features.get("soft_cap")
    row = 0
    for b, (seq_len, q_len) in enumerate(zip(batch.seq_lens, batch.q_lens, strict=True)):
        if q_len == 0:
            continue
        k = batch.stored("k", b) if dequantized else batch.keys[b].double()
        v = batch.stored("v", b) if dequantized else batch.values[b].double()
        k, v = k[:, kv_head_of], v[:, kv_head_of]  # [L, H, D]: each query head's kv head
        q = batch.query[row : row + q_len].double()  # [q_len, H, D]
        s = (q[:, None] * k[None]).sum(-1) * scale  # [q_len, L, H]
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]  # each query row's position
        j = torch.arange(seq_len)[None]  # each key's
        visible = (j <= pos) & ((pos - j < window) if window is not None else True)  # [q_len, L]
        s = s.masked_fill(~visible[..., None], -math.inf)
        m = s.max(dim=1).values  # [q_len, H]
        if features.get("sinks"):
            sink = batch.sinks.double()
            m = torch.maximum(m, sink)
            denominator = torch.exp(s - m[:, None]).sum(1) + torch.exp(sink - m)
        else:
            denominator = torch.exp(s - m[:, None]).sum(1)
        p = torch.exp(s - m[:, None]) / denominator[:, None]  # [q_len, L, H]
        out[row : row + q_len] = (p[..., None] * v[None]).sum(1)
        row += q_len
    return out


# Strided inputs change how the query and the caches are addressed, not the masks: every feature
# runs contiguous, and strided runs with the feature that has every mask term.
LAYOUTS = [(feature, False) for feature in FEATURES] + [("window_sinks", True)]


@pytest.mark.parametrize(
    ("feature", "strided"), LAYOUTS, ids=[f + ("-strided" if st else "") for f, st in LAYOUTS]
)
@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mqa", "dv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_attention(dtype, heads, feature, strided):
    batch = Batch(heads, dtype, strided=strided, seed=len(feature))
    features = FEATURES[feature]
    scale = 1 / math.sqrt(heads[2])
    out = torch.full((*batch.query.shape[:2], heads[3]), float("nan"), dtype=dtype)
    result = batch.run(scale, features, out=out)
    assert result is out
    atol, rtol = TOLERANCES[dtype]
    expected = dense_reference(batch, scale, features)
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"paged_attention[{feature}]")
    # Without out=, a new tensor in query's dtype.
    fresh = batch.run(scale, features)
    assert fresh.dtype == dtype
    assert_equal(fresh, out, name="out= vs returned")


@pytest.mark.parametrize("feature", ["causal", "window_sinks"])
def test_paged_attention_fp8_cache(feature):
    batch = Batch(HEADS[0], torch.bfloat16, cache_dtype=FP8, seed=3)
    features = FEATURES[feature]
    scale = 1 / 8
    out = batch.run(scale, features)
    assert out.dtype == torch.bfloat16
    # Exact semantics: attention over the dequantized fp8 entries.
    expected = dense_reference(batch, scale, features, dequantized=True)
    assert_close(out, expected, atol=1.6e-2, rtol=1.6e-2, name="fp8 vs dequantized")
    # And close to attention over the original values (fp8 e4m3 keeps 3 mantissa bits).
    original = dense_reference(batch, scale, features, dequantized=False)
    assert_close(out, original, atol=0.15, rtol=0.1, name="fp8 vs original")


def test_sinks_change_the_result():
    # Guards the reference itself: a large sink takes probability mass from every key.
    batch = Batch(HEADS[1], torch.float32, seed=5)
    batch.sinks.fill_(4.0)
    plain = batch.run(0.2, {})
    with_sinks = batch.run(0.2, {"sinks": True})
    assert (plain - with_sinks).abs().max() > 0.1
    assert_close(with_sinks, dense_reference(batch, 0.2, {"sinks": True}), atol=2e-5, rtol=2e-5)


def test_bad_arguments():
    batch = Batch(HEADS[0], torch.float32, seed=0)
    args = (batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens_t)
    qsl = batch.query_start_loc
    with pytest.raises(ValueError, match=r"paged_attention: query has 7 heads, not a multiple"):
        ak.paged_attention(batch.query[:, :7], *args, qsl, 0.1)
    with pytest.raises(ValueError, match=r"paged_attention: query_start_loc has shape \(7,\)"):
        ak.paged_attention(batch.query, *args, qsl[:-1], 0.1)
    with pytest.raises(
        ValueError,
        match=r"paged_attention: key_cache has dtype torch.float32, expected torch.float16",
    ):
        ak.paged_attention(batch.query.half(), *args, qsl, 0.1)
    with pytest.raises(ValueError, match=r"paged_attention: sinks has shape \(3,\)"):
        ak.paged_attention(batch.query, *args, qsl, 0.1, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="paged_attention: sliding_window"):
        ak.paged_attention(batch.query, *args, qsl, 0.1, sliding_window=0)
    with pytest.raises(ValueError, match="paged_attention: max_query_len must be"):
        ak.paged_attention(batch.query, *args, qsl, 0.1, max_query_len=-1)
    with pytest.raises(ValueError, match=r"paged_attention: out has shape"):
        ak.paged_attention(batch.query, *args, qsl, 0.1, out=torch.empty(3, 8, 64))
    with pytest.raises(ValueError, match=r"paged_attention: seq_lens has dtype torch.float32"):
        ak.paged_attention(batch.query, *args[:3], batch.seq_lens_t.float(), qsl, 0.1)
