"""MLA over an fp8 latent cache (torch reference): the write stores clamp(x / kv_scale) in
float8_e4m3fn, attention reads x.float() * kv_scale: exactly attention over the dequantized cache,
and within fp8 e4m3's precision of attention over the original latents."""

import math

import pytest
import torch

import atom_kernels as ak
from atom_kernels.testing import assert_close, assert_equal

FP8 = torch.float8_e4m3fn
# (H, L, R, block_size)
SHAPE = (5, 40, 8, 7)
# (seq_len, q_len): prefill, prefill over a cached prefix, decodes, an empty query
SEQS = [(37, 37), (50, 13), (20, 1), (1, 1), (9, 0), (33, 4)]


def _batch(dtype, kv_scale, seed=0):
    """Latents written by mla_cache_write into an fp8 cache and into a `dtype` cache (the same
    shuffled slots); returns (fp8 cache, original cache, the attention args without the cache)."""
    num_heads, latent_dim, rope_dim, block_size = SHAPE
    g = torch.Generator().manual_seed(seed)
    seq_lens = [s for s, _ in SEQS]
    q_lens = [q for _, q in SEQS]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(SEQS), max(blocks_per_seq), dtype=torch.int32)
    slots = []
    for b, seq_len in enumerate(seq_lens):
        ids = [free.pop() for _ in range(blocks_per_seq[b])]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(seq_len)]
    slots = torch.tensor(slots)
    kv = torch.randn(len(slots), latent_dim + rope_dim, generator=g).to(dtype)
    kv_c, k_pe = kv[:, :latent_dim], kv[:, latent_dim:]
    shape = (num_blocks, block_size, latent_dim + rope_dim)
    fp8_cache = torch.full(shape, float("nan")).to(FP8)
    ak.mla_cache_write(kv_c, k_pe, fp8_cache, slots, kv_scale=kv_scale)
    cache = torch.full(shape, float("nan")).to(dtype)
    ak.mla_cache_write(kv_c, k_pe, cache, slots)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_heads, latent_dim + rope_dim, generator=g).to(dtype)
    args = (
        q[..., :latent_dim].contiguous(),
        q[..., latent_dim:].contiguous(),
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        1 / math.sqrt(latent_dim + rope_dim),
    )
    return fp8_cache, cache, args


def _attend(q_latent, q_pe, cache, tables, seq_lens, qsl, scale, **kwargs):
    return ak.mla_paged_attention(q_latent, q_pe, cache, tables, seq_lens, qsl, scale, **kwargs)


@pytest.mark.parametrize("scale_as_tensor", [False, True])
def test_mla_cache_write_fp8(scale_as_tensor):
    g = torch.Generator().manual_seed(3)
    kv_c = torch.randn(11, 40, generator=g) * 30  # some beyond 448 * kv_scale: the clamp
    k_pe = torch.randn(11, 8, generator=g)
    kv_scale = 0.05
    cache = torch.full((4, 4, 48), float("nan")).to(FP8)
    slots = torch.tensor([3, 0, -1, 15, 7, 8, 2, 1, 9, 10, -1])
    scale_arg = torch.tensor([kv_scale]) if scale_as_tensor else kv_scale
    ak.mla_cache_write(kv_c, k_pe, cache, slots, kv_scale=scale_arg)
    keep = slots >= 0
    rows = cache.view(16, 48)[slots[keep]]
    expected = (torch.cat((kv_c, k_pe), -1)[keep].double() / kv_scale).clamp(-448, 448).to(FP8)
    assert bool((kv_c.double().abs() / kv_scale > 448).any())
    assert_equal(rows.float(), expected.float(), name="fp8 latent rows")
    unwritten = torch.ones(16, dtype=torch.bool)
    unwritten[slots[keep]] = False
    assert bool(cache.view(16, 48)[unwritten].float().isnan().all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_paged_attention_fp8(dtype):
    kv_scale = 0.02
    fp8_cache, cache, (q_latent, q_pe, *rest) = _batch(dtype, kv_scale)
    out = _attend(q_latent, q_pe, fp8_cache, *rest, kv_scale=kv_scale)
    # Exact semantics: attention over the dequantized entries (fp32 math in both).
    dequantized = (fp8_cache.float() * kv_scale).to(torch.float32)
    exact = _attend(q_latent.float(), q_pe.float(), dequantized, *rest)
    assert_close(out, exact.to(dtype), atol=1e-5, rtol=1e-5, name="fp8 vs dequantized")
    # Within fp8 e4m3 precision (3 mantissa bits: relative step 1/16) of the original latents.
    original = _attend(q_latent, q_pe, cache, *rest)
    assert_close(out, original, atol=0.1, rtol=0.1, name="fp8 vs original")


def test_fp8_latent_cache_errors():
    fp8_cache, _, (q_latent, q_pe, *rest) = _batch(torch.float32, 1.0)
    with pytest.raises(ValueError, match="mla_paged_attention: an torch.float8_e4m3fn cache needs"):
        _attend(q_latent, q_pe, fp8_cache, *rest)
    with pytest.raises(ValueError, match="kv_scale must be per-tensor"):
        _attend(q_latent, q_pe, fp8_cache, *rest, kv_scale=torch.ones(2))
    with pytest.raises(ValueError, match="mla_cache_write: an torch.float8_e4m3fn cache needs"):
        ak.mla_cache_write(torch.zeros(1, 40), torch.zeros(1, 8), fp8_cache, torch.zeros(1).long())
