"""Triton paged_attention against the torch reference: mixed prefill-with-prefix + decode batches
over NaN-poisoned caches with shuffled block tables; GQA / MQA / Dv != D; window, sinks, soft-cap;
fp8 caches; several decode splits. Small shapes run everywhere (interpreted on CPU), real sizes on
a GPU (``gpu`` marker)."""

import math

import pytest
import torch

from atom_kernels.backends.torch import attention as reference
from atom_kernels.testing import assert_close, assert_equal

FP8 = torch.float8_e4m3fn
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# (H, Hk, D, Dv, block_size): GQA, MQA, MHA with a value head dim != key head dim
GQA, MQA, DV = (8, 2, 64, 64, 16), (4, 1, 40, 40, 5), (3, 3, 24, 17, 7)
# (seq_len, q_len): prefill, prefill over a cached prefix, decodes, an empty query, a short prefill
MIXED = [(37, 37), (50, 13), (20, 1), (1, 1), (64, 1), (9, 0), (33, 4)]
FEATURES = {
    "causal": {},
    "window": {"sliding_window": 8},
    "sinks_softcap": {"sinks": True, "soft_cap": 5.0},
    "window_sinks": {"sliding_window": 3, "sinks": True},
}


class PagedBatch:
    """Random K/V per sequence written through shuffled blocks into a NaN-poisoned paged cache;
    block-table entries past a sequence's blocks point far outside the cache."""

    def __init__(
        self,
        seqs,
        heads,
        dtype,
        device,
        *,
        cache_dtype=None,
        strided=False,
        pad_rows=2,
        spare_blocks=1,
        index_dtype=torch.int32,
        seed=0,
    ):
        num_heads, num_kv_heads, head_dim, head_dim_v, block_size = heads
        g = torch.Generator().manual_seed(seed)
        self.seq_lens = [s for s, _ in seqs]
        self.q_lens = [q for _, q in seqs]
        num_tokens = sum(self.q_lens) + pad_rows
        width = num_heads * head_dim
        qkv = torch.randn(num_tokens, 2 * width, generator=g).to(dtype).to(device)
        query = qkv[:, :width] if strided else qkv[:, :width].contiguous()
        self.query = query.view(num_tokens, num_heads, head_dim)  # [T, H, D]

        blocks_per_seq = [-(-s // block_size) for s in self.seq_lens]
        max_blocks = max(blocks_per_seq) + spare_blocks
        num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
        self.block_tables = torch.full((len(seqs), max_blocks), num_blocks + 1000)
        shape_k = (num_blocks, block_size, num_kv_heads, head_dim)
        shape_v = (num_blocks, block_size, num_kv_heads, head_dim_v)
        fp8 = cache_dtype == FP8
        self.k_scale, self.v_scale = (0.02, 0.015) if fp8 else (None, None)
        cache_dtype = cache_dtype or dtype
        if strided and head_dim == head_dim_v:  # one [num_blocks, 2, ...] buffer, K and V views
            kv = torch.full((num_blocks, 2, *shape_k[1:]), float("nan")).to(cache_dtype)
            key_cache, value_cache = kv[:, 0], kv[:, 1]
        else:
            key_cache = torch.full(shape_k, float("nan")).to(cache_dtype)
            value_cache = torch.full(shape_v, float("nan")).to(cache_dtype)
        free = torch.randperm(num_blocks, generator=g).tolist()
        for b, seq_len in enumerate(self.seq_lens):
            ids = torch.tensor([free.pop() for _ in range(blocks_per_seq[b])], dtype=torch.long)
            self.block_tables[b, : len(ids)] = ids
            pos = torch.arange(seq_len)
            blocks, offsets = ids[pos // block_size], pos % block_size
            k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
            v = torch.randn(seq_len, num_kv_heads, head_dim_v, generator=g)
            if fp8:
                k, v = k / self.k_scale, v / self.v_scale
            key_cache[blocks, offsets] = k.to(dtype).to(cache_dtype)
            value_cache[blocks, offsets] = v.to(dtype).to(cache_dtype)
        self.key_cache, self.value_cache = key_cache.to(device), value_cache.to(device)
        self.block_tables = self.block_tables.to(index_dtype).to(device)
        self.seq_lens_t = torch.tensor(self.seq_lens, dtype=index_dtype, device=device)
        starts = [0, *torch.tensor(self.q_lens).cumsum(0).tolist()]
        self.query_start_loc = torch.tensor(starts, dtype=index_dtype, device=device)
        self.sinks = (torch.randn(num_heads, generator=g) * 2).to(device)
        self.scale = 1 / math.sqrt(head_dim)

    def args(self, features, k_scale=None, v_scale=None):
        """The op's positional arguments, without ``out``."""
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens_t,
            self.query_start_loc,
            self.scale,
            features.get("sliding_window"),
            self.sinks if features.get("sinks") else None,
            features.get("soft_cap"),
            self.k_scale if k_scale is None else k_scale,
            self.v_scale if v_scale is None else v_scale,
        )


def _check(triton_backend, batch, features, tolerances, num_splits=None, **scales):
    args = batch.args(features, **scales)
    out = torch.full(
        (*batch.query.shape[:2], batch.value_cache.shape[3]),
        float("nan"),
        dtype=batch.query.dtype,
        device=batch.query.device,
    )
    result = triton_backend.attention.paged_attention(*args, out, num_splits=num_splits)
    assert result is out
    expected = reference.paged_attention(*args, None)
    atol, rtol = tolerances
    assert_close(out, expected, atol=atol, rtol=rtol, name="paged_attention")
    return out


# (heads, dtype, feature, strided, num_splits): every feature, head layout and dtype at least once;
# one and several decode splits. (The full product is the torch backend's grid; the interpreter
# needs ~1 s a case, so this is a covering subset.)
CASES = [
    (GQA, torch.float32, "causal", False, 1),
    (GQA, torch.bfloat16, "causal", True, 3),
    (GQA, torch.float16, "window", False, 2),
    (GQA, torch.bfloat16, "sinks_softcap", False, 3),
    (GQA, torch.bfloat16, "window_sinks", True, 1),
    (MQA, torch.float32, "window_sinks", False, 4),
    (MQA, torch.bfloat16, "sinks_softcap", True, 1),
    (MQA, torch.float16, "causal", False, 2),
    (DV, torch.float32, "causal", True, 2),
    (DV, torch.float16, "window", False, 1),
    (DV, torch.bfloat16, "sinks_softcap", False, 2),
]


@pytest.mark.parametrize(
    ("heads", "dtype", "feature", "strided", "num_splits"),
    CASES,
    ids=[f"{h[0]}x{h[1]}x{h[2]}-{str(d)[6:]}-{f}-s{int(s)}-{n}split" for h, d, f, s, n in CASES],
)
def test_mixed_batch(triton_backend, heads, dtype, feature, strided, num_splits):
    batch = PagedBatch(MIXED, heads, dtype, triton_backend.device, strided=strided, seed=1)
    _check(triton_backend, batch, FEATURES[feature], TOLERANCES[dtype], num_splits)


@pytest.mark.parametrize("feature", ["causal", "window_sinks"])
def test_fp8_cache(triton_backend, feature):
    batch = PagedBatch(MIXED, GQA, torch.bfloat16, triton_backend.device, cache_dtype=FP8, seed=3)
    scales = {}
    if feature == "causal":  # scales as one-element device tensors
        device = triton_backend.device
        scales = dict(k_scale=torch.tensor([0.02], device=device), v_scale=torch.tensor(0.015))
        scales["v_scale"] = scales["v_scale"].to(device)
    _check(triton_backend, batch, FEATURES[feature], TOLERANCES[torch.bfloat16], 3, **scales)


# (block_m, block_n, block_size, heavy_first, feature): the prefill page reads (several pages per
# KV tile, a tile inside one page, more than 8 pages per tile, pages straddling tiles) and the
# tile order, with small tiles the interpreter runs in a second.
PREFILL_TILES = [
    (16, 32, 16, True, "causal"),
    (32, 16, 32, True, "window_sinks"),
    (16, 64, 4, True, "sinks_softcap"),
    (32, 32, 4, False, "window"),
    (16, 16, 5, False, "causal"),
]


@pytest.mark.parametrize(
    ("block_m", "block_n", "block_size", "heavy_first", "feature"),
    PREFILL_TILES,
    ids=[f"{m}x{n}-page{b}-{'heavy' if h else 'fwd'}-{f}" for m, n, b, h, f in PREFILL_TILES],
)
def test_prefill_tiles_and_pages(
    triton_backend, block_m, block_n, block_size, heavy_first, feature
):
    from dataclasses import replace

    attention = triton_backend.attention
    seqs = [(70, 70), (90, 45), (20, 1), (33, 4), (5, 5)]
    heads = (4, 2, 32, 32, block_size)
    batch = PagedBatch(seqs, heads, torch.bfloat16, triton_backend.device, seed=7)
    config = replace(
        attention.default_config(32, torch.bfloat16, interpreted=True),
        prefill_block_m=block_m,
        prefill_block_n=block_n,
        prefill_heavy_first=heavy_first,
    )
    args = batch.args(FEATURES[feature])
    out = torch.full((*batch.query.shape[:2], 32), float("nan"), dtype=torch.bfloat16)
    out = attention.paged_attention(*args, out.to(batch.query.device), config=config)
    expected = reference.paged_attention(*args, None)
    assert_close(out, expected, atol=1.6e-2, rtol=1.6e-2, name="paged_attention")


def test_decode_only_batch_with_padding(triton_backend):
    seqs = [(40, 1), (65, 1), (3, 1), (0, 0), (17, 1)]
    batch = PagedBatch(seqs, GQA, torch.float32, triton_backend.device, pad_rows=3, seed=4)
    out = _check(triton_backend, batch, FEATURES["sinks_softcap"], TOLERANCES[torch.float32], 4)
    assert bool((out[-3:] == 0).all()), "padding rows must be zeroed"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_only_hint(triton_backend, num_splits):
    """max_query_len=1 on a decode-only batch (T == B, as in the engine's decode graphs) skips the
    prefill kernel and still gives the reference's result; the hint alone never drops rows."""
    seqs = [(40, 1), (65, 1), (3, 1), (17, 1)]
    batch = PagedBatch(seqs, GQA, torch.bfloat16, triton_backend.device, pad_rows=0, seed=8)
    args = batch.args(FEATURES["window_sinks"])
    out = torch.full_like(batch.query, float("nan"))
    triton_backend.attention.paged_attention(*args, out, max_query_len=1, num_splits=num_splits)
    expected = reference.paged_attention(*args, None)
    atol, rtol = TOLERANCES[torch.bfloat16]
    assert_close(out, expected, atol=atol, rtol=rtol, name="paged_attention")


@pytest.mark.parametrize("feature", ["causal", "window_sinks", "sinks_softcap"])
def test_decode_per_sequence_splits(triton_backend, feature):
    """Each sequence cuts its own context: at most num_splits splits of at least min_split_len
    (here 16: one split for 5 and 16 tokens, 3 for 40, 4 of 32 for 100, 4 of 48 for 190)."""
    seqs = [(5, 1), (40, 1), (100, 1), (16, 1), (190, 1), (30, 4)]
    batch = PagedBatch(seqs, GQA, torch.bfloat16, triton_backend.device, pad_rows=1, seed=12)
    args = batch.args(FEATURES[feature])
    out = torch.full_like(batch.query, float("nan"))
    triton_backend.attention.paged_attention(*args, out, num_splits=4, min_split_len=16)
    expected = reference.paged_attention(*args, None)
    atol, rtol = TOLERANCES[torch.bfloat16]
    assert_close(out, expected, atol=atol, rtol=rtol, name="paged_attention")


@pytest.mark.parametrize("feature", ["causal", "window_sinks"])
def test_decode_split_merge_fused_and_separate(triton_backend, monkeypatch, feature):
    """The decode kernel's last split merges the partials (counters, no reduce kernel) and sets
    its counters back to zero; the separate reduce kernel (the path without counters) gives the
    same rows up to the order of the fp32 sums."""
    from atom_kernels.backends.triton.common import zeroed_counters

    seqs = [(5, 1), (40, 1), (100, 1), (16, 1), (190, 1), (30, 4)]
    batch = PagedBatch(seqs, GQA, torch.bfloat16, triton_backend.device, pad_rows=1, seed=13)
    args = batch.args(FEATURES[feature])
    outs = {}
    for fused in (True, False):
        monkeypatch.setattr(triton_backend.attention, "FUSED_DECODE_REDUCE", fused)
        outs[fused] = torch.full_like(batch.query, float("nan"))
        triton_backend.attention.paged_attention(*args, outs[fused], num_splits=4, min_split_len=16)
    counters = zeroed_counters(batch.query.device, len(seqs) * GQA[1])
    assert int(counters.abs().sum()) == 0, "every merging program resets its counter"
    expected = reference.paged_attention(*args, None)
    atol, rtol = TOLERANCES[torch.bfloat16]
    assert_close(outs[True], expected, atol=atol, rtol=rtol, name="fused merge")
    assert_close(outs[True], outs[False], atol=1e-2, rtol=1e-2, name="fused vs separate")


# (block_size, feature, num_splits, min_split_len): the decode kernel compiled for the page size
# (shift and mask) over pages smaller than, as large as and larger than the 16-token KV tile; a
# page size that is not a power of two falls back to the runtime division.
PAGE_CONSTEXPR = [
    (4, "causal", 1, None),
    (16, "window_sinks", 4, 16),
    (32, "sinks_softcap", 3, None),
    (5, "window", 2, None),
]


@pytest.mark.parametrize(
    ("block_size", "feature", "num_splits", "min_split_len"),
    PAGE_CONSTEXPR,
    ids=[f"page{b}-{f}-{n}split" for b, f, n, _ in PAGE_CONSTEXPR],
)
def test_decode_page_constexpr(triton_backend, block_size, feature, num_splits, min_split_len):
    from dataclasses import replace

    attention = triton_backend.attention
    seqs = [(5, 1), (40, 1), (100, 1), (16, 1), (190, 1), (33, 1)]
    heads = (8, 2, 64, 64, block_size)
    batch = PagedBatch(seqs, heads, torch.bfloat16, triton_backend.device, pad_rows=0, seed=14)
    config = replace(
        attention.default_config(64, torch.bfloat16, triton_backend.interpreted, 4),
        decode_page_constexpr=True,
    )
    args = batch.args(FEATURES[feature])
    out = torch.full_like(batch.query, float("nan"))
    attention.paged_attention(
        *args, out, max_query_len=1, num_splits=num_splits, min_split_len=min_split_len,
        config=config,
    )  # fmt: skip
    expected = reference.paged_attention(*args, None)
    atol, rtol = TOLERANCES[torch.bfloat16]
    assert_close(out, expected, atol=atol, rtol=rtol, name="paged_attention")


def test_prefill_only_batch_int64_metadata(triton_backend):
    seqs = [(30, 30), (45, 20), (18, 2)]
    batch = PagedBatch(
        seqs, MQA, torch.float16, triton_backend.device, pad_rows=5, index_dtype=torch.int64
    )
    _check(triton_backend, batch, FEATURES["window"], TOLERANCES[torch.float16])


def test_public_op_through_the_registry(triton_backend, monkeypatch):
    """ak.paged_attention with ATOM_KERNEL_BACKEND=triton runs the Triton entry; out= semantics."""
    import atom_kernels as ak
    from atom_kernels import registry

    monkeypatch.setenv(registry.ENV_VAR, "triton")
    if triton_backend.interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    registry._reset_for_tests()
    try:
        device = triton_backend.device
        entry = triton_backend.custom_ops.ENTRIES["paged_attention"]
        assert ak.get_op("paged_attention", device) is entry
        batch = PagedBatch(MIXED[:4], MQA, torch.bfloat16, device, seed=6)
        args = batch.args({"sliding_window": 5})
        keywords = ("sliding_window", "sinks", "soft_cap", "k_scale", "v_scale")
        kwargs = dict(zip(keywords, args[7:], strict=True))
        out = torch.full((*batch.query.shape[:2], 40), float("nan"), dtype=torch.bfloat16)
        out = out.to(device)
        assert ak.paged_attention(*args[:7], **kwargs, out=out) is out
        fresh = ak.paged_attention(*args[:7], **kwargs)
        assert fresh.dtype == torch.bfloat16
        assert_equal(fresh, out, name="out= vs returned")
        expected = reference.paged_attention(*args, None)
        assert_close(out, expected, atol=1.6e-2, rtol=1.6e-2, name="via registry")
    finally:
        registry._reset_for_tests()


def test_empty_batches(triton_backend):
    device = triton_backend.device
    batch = PagedBatch([(5, 2)], GQA, torch.float32, device, pad_rows=0)
    query, kc, vc, bt, sl, qsl, *rest = batch.args({})
    run = triton_backend.attention.paged_attention
    empty = run(query[:0], kc, vc, bt, sl, qsl[:1] * 0, *rest, None)
    assert empty.shape == (0, 8, 64)
    no_seqs = run(query, kc, vc, bt[:0], sl[:0], qsl[:1] * 0, *rest, None)
    assert bool((no_seqs == 0).all()), "with no sequences every row is padding"


def test_choose_splits(triton_backend):
    choose = triton_backend.attention.choose_splits
    attention = triton_backend.attention
    # A batch that fills the SMs: LARGE_BATCH_SPLITS per sequence of at least
    # LARGE_BATCH_SPLIT_TOKENS, none when the table is no wider than one split.
    large = (attention.LARGE_BATCH_SPLITS, attention.LARGE_BATCH_SPLIT_TOKENS)
    if large[0] > 1:
        assert choose(64, 8, 8192, 132, 64) == large
    else:
        assert choose(64, 8, 8192, 132, 64) == (1, 8192)
    assert choose(64, 8, large[1], 132, 64) == (1, large[1])
    # Large-batch splits only below LARGE_BATCH_SPLITS_BELOW programs an SM.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "LARGE_BATCH_SPLITS", 4)
        mp.setattr(attention, "LARGE_BATCH_SPLIT_TOKENS", 512)
        mp.setattr(attention, "LARGE_BATCH_SPLITS_BELOW", 8)
        assert choose(64, 8, 4096, 132, 64) == (4, 512)  # 3.9 programs an SM
        assert choose(256, 8, 4096, 132, 128) == (1, 4096)  # 15.5
    assert choose(64, 8, 300, 132, 64) == (1, 320)
    # Batch 1 x 8 kv heads x 8K context on 132 SMs: 128-token splits, at most MAX_SPLITS (64);
    # at 4K, 32 such splits leave SMs idle: 64 splits of 64 tokens.
    assert choose(1, 8, 8192, 132, 64) == (64, 128)
    assert choose(1, 8, 4096, 132, 64) == (64, 64)
    assert choose(2, 8, 4096, 132, 64) == (32, 128)
    # 8 sequences: splits of a multiple of the KV tile covering the context.
    num_splits, split_len = choose(8, 8, 3000, 132, 64)
    assert num_splits == 24 and split_len == 128 and num_splits * split_len >= 3000
    # Short contexts and MQA: at most MAX_SPLITS, splits of at least MIN_SPLIT_TOKENS / 2 (64).
    assert choose(1, 1, 300, 132, 64) == (5, 64)
    assert choose(1, 1, 1 << 20, 132, 64)[0] == triton_backend.attention.MAX_SPLITS
    assert choose(4, 2, 100, 132, 16) == (1, 112)


def test_decode_tile_regimes_and_env_tiles(triton_backend, monkeypatch):
    """decode_tile by programs an SM (split / unsplit / large), and the A/B tiles read from the
    environment: 'tokens,warps,stages', replacing only their regime's tile."""
    from atom_kernels.backends.triton import attention_config as ac

    config = ac.AttentionConfig(128, 64, 8, 2, 64, 4, 3, 2, 128, 4, 2)
    assert config.decode_tile(0.5) == (64, 4, 3)
    assert config.decode_tile(ac.PROGRAMS_PER_SM) == (64, 2, 3)
    assert config.decode_tile(ac.LARGE_BATCH_PROGRAMS_PER_SM) == (128, 4, 2)
    assert ac._env_tile("ATOM_TEST_TILE", "32,2,4") == (32, 2, 4)
    assert ac._env_tile("ATOM_TEST_TILE", "") is None
    for bad in ("64,2", "a,b,c", "48,2,3", "64,0,3"):
        with pytest.raises(ValueError, match="ATOM_TEST_TILE"):
            ac._env_tile("ATOM_TEST_TILE", bad)
    monkeypatch.setattr(ac, "DECODE_UNSPLIT_TILE", (32, 2, 4))
    monkeypatch.setattr(ac, "DECODE_LARGE_TILE", (64, 8, 2))
    tuned = ac.default_config(128, torch.bfloat16, False, 2)
    base = ac._default_tiles(128, torch.bfloat16, False, 2)
    assert tuned.decode_tile(0.5) == base.decode_tile(0.5)
    assert tuned.decode_tile(ac.PROGRAMS_PER_SM) == (32, 2, 4)
    assert tuned.decode_tile(1e9) == (64, 8, 2)
    monkeypatch.setattr(ac, "DECODE_SPLIT_TILE", (16, 2, 3))
    tuned = ac.default_config(128, torch.bfloat16, False, 2)
    assert tuned.decode_tile(0.5) == (16, 2, 3)
    assert tuned.decode_tile(ac.PROGRAMS_PER_SM) == (32, 2, 4)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_default_config(triton_backend, head_dim):
    config = triton_backend.attention.default_config(head_dim, torch.bfloat16, False)
    assert config.prefill_block_m >= 16 and config.prefill_block_n >= 16
    assert config.decode_block_n >= 16
    fp32 = triton_backend.attention.default_config(head_dim, torch.float32, False)
    assert fp32.prefill_block_m <= config.prefill_block_m
    mqa = triton_backend.attention.default_config(head_dim, torch.bfloat16, False, group=128)
    assert mqa.decode_block_n == 16 and mqa.decode_num_warps_unsplit == 4


# --- real sizes on a GPU ----------------------------------------------------------------------

LLAMA3_8B = (32, 8, 128, 128, 16)


@pytest.mark.gpu
def test_gpu_prefill_4096_with_prefix_and_decodes(triton_backend):
    seqs = [(4096, 4096), (6144, 1024), (8192, 1), (300, 1), (2048, 17)]
    batch = PagedBatch(seqs, LLAMA3_8B, torch.bfloat16, "cuda", seed=10)
    _check(triton_backend, batch, {}, TOLERANCES[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs", [1, 8, 64])
def test_gpu_decode_8k(triton_backend, num_seqs):
    # Context lengths from 1K to 8K; the split count comes from the heuristic.
    lens = torch.linspace(1024, 8192, num_seqs).long().tolist() if num_seqs > 1 else [8192]
    batch = PagedBatch([(n, 1) for n in lens], LLAMA3_8B, torch.bfloat16, "cuda", seed=11)
    _check(triton_backend, batch, {}, TOLERANCES[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_decode_large_batch_tiles(triton_backend):
    # 256 sequences x 8 kv heads: the large-batch KV tiles (LARGE_BATCH_PROGRAMS_PER_SM).
    lens = torch.linspace(100, 2048, 256).long().tolist()
    heads = (16, 8, 128, 128, 16)  # Qwen3-0.6B
    batch = PagedBatch([(n, 1) for n in lens], heads, torch.bfloat16, "cuda", seed=13)
    assert 256 * 8 >= triton_backend.attention.LARGE_BATCH_PROGRAMS_PER_SM * 132
    _check(triton_backend, batch, {}, TOLERANCES[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_decode_group16_unsplit_tiles(triton_backend):
    # 64 sequences x 4 kv heads of 64 / 4 query heads (Qwen3-235B): unsplit on 128-token tiles
    # (attention_config's group-16 NOTE), contexts across several tiles and a ragged last one.
    lens = torch.linspace(100, 4100, 64).long().tolist()
    heads = (64, 4, 128, 128, 16)
    batch = PagedBatch([(n, 1) for n in lens], heads, torch.bfloat16, "cuda", seed=15)
    _check(triton_backend, batch, {}, TOLERANCES[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80, 96, 256])
@pytest.mark.parametrize("feature", ["window_sinks", "sinks_softcap"])
def test_gpu_head_dims_and_features(triton_backend, head_dim, feature):
    seqs = [(1500, 1500), (3000, 700), (5000, 1), (64, 1)]
    features = dict(FEATURES[feature])
    if "sliding_window" in features:
        features["sliding_window"] = 1024
    batch = PagedBatch(seqs, (16, 4, head_dim, head_dim, 32), torch.bfloat16, "cuda", seed=12)
    _check(triton_backend, batch, features, TOLERANCES[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_fp8_cache_and_fp32_query(triton_backend):
    seqs = [(2000, 2000), (4000, 300), (6000, 1), (100, 1)]
    batch = PagedBatch(seqs, LLAMA3_8B, torch.bfloat16, "cuda", cache_dtype=FP8, seed=13)
    _check(triton_backend, batch, FEATURES["window_sinks"], TOLERANCES[torch.bfloat16])
    batch = PagedBatch(seqs, (8, 2, 128, 128, 16), torch.float32, "cuda", seed=14)
    _check(triton_backend, batch, {}, (1e-4, 1e-4))


@pytest.mark.gpu
def test_gpu_cuda_graph_and_torch_compile(triton_backend):
    """The custom ops capture into a CUDA graph (no host sync in the launchers) and compile with
    fullgraph=True; replays give the eager result."""
    ops = triton_backend.custom_ops
    seqs = [(3000, 1), (700, 1), (5000, 1), (20, 1)]
    batch = PagedBatch(seqs, LLAMA3_8B, torch.bfloat16, "cuda", pad_rows=0, seed=15)
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    hidden = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    args = batch.args({})

    def step(hidden):
        normed = ops.rms_norm(hidden, weight, 1e-5)
        return ops.paged_attention(*args, None), normed

    eager_attn, eager_norm = step(hidden)
    compiled = torch.compile(step, fullgraph=True)
    attn, normed = compiled(hidden)
    assert_equal(attn, eager_attn, name="compiled attention")
    assert_equal(normed, eager_norm, name="compiled rms_norm")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(hidden)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_attn, graph_norm = step(hidden)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(graph_attn, eager_attn, name="graph attention")
    assert_equal(graph_norm, eager_norm, name="graph rms_norm")
