"""MLA ops (torch reference): mla_cache_write against direct indexing over a NaN-poisoned cache;
mla_paged_attention against a dense fp64 softmax per sequence over the original (unpaged)
latents and rope keys, with the key written out as one concatenated vector."""

import math

import pytest
import torch

import atom_kernels as ak
from atom_kernels.testing import assert_close, assert_equal

TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# (H, L, R, block_size): DeepSeek-V3's latent and rope dims (16 heads: 128 over TP 8), odd ones
SHAPES = [(16, 512, 64, 16), (5, 40, 8, 16), (3, 40, 16, 7)]
# (seq_len, q_len) per sequence: prefill, prefill over a cached prefix, decodes, an empty query
SEQS = [(37, 37), (50, 13), (20, 1), (1, 1), (64, 1), (9, 0), (33, 4)]


class MlaBatch:
    """Random latents / rope keys per sequence, written by indexing into a NaN-poisoned latent
    cache through shuffled blocks; table entries past a sequence's blocks point outside it."""

    def __init__(self, seqs, shape, dtype, *, strided=False, pad_rows=2, seed=0):
        num_heads, latent_dim, rope_dim, block_size = shape
        g = torch.Generator().manual_seed(seed)
        self.seq_lens = [s for s, _ in seqs]
        self.q_lens = [q for _, q in seqs]
        num_tokens = sum(self.q_lens) + pad_rows
        self.latents = [torch.randn(s, latent_dim, generator=g).to(dtype) for s in self.seq_lens]
        self.ropes = [torch.randn(s, rope_dim, generator=g).to(dtype) for s in self.seq_lens]
        # q as one [T, H, L + R] buffer: strided q_latent / q_pe are its two views.
        q = torch.randn(num_tokens, num_heads, latent_dim + rope_dim, generator=g).to(dtype)
        if strided:
            self.q_latent, self.q_pe = q[..., :latent_dim], q[..., latent_dim:]
        else:
            self.q_latent = q[..., :latent_dim].contiguous()
            self.q_pe = q[..., latent_dim:].contiguous()
        blocks_per_seq = [-(-s // block_size) for s in self.seq_lens]
        num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
        self.block_tables = torch.full((len(seqs), max(blocks_per_seq) + 1), num_blocks + 1000)
        self.kv_cache = torch.full(
            (num_blocks, block_size, latent_dim + rope_dim), float("nan")
        ).to(dtype)
        free = torch.randperm(num_blocks, generator=g).tolist()
        for b, seq_len in enumerate(self.seq_lens):
            ids = torch.tensor([free.pop() for _ in range(blocks_per_seq[b])], dtype=torch.long)
            self.block_tables[b, : len(ids)] = ids
            pos = torch.arange(seq_len)
            blocks, offsets = ids[pos // block_size], pos % block_size
            self.kv_cache[blocks, offsets] = torch.cat((self.latents[b], self.ropes[b]), dim=-1)
        self.block_tables = self.block_tables.int()
        self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32)
        self.query_start_loc = torch.tensor([0, *torch.tensor(self.q_lens).cumsum(0)]).int()
        self.scale = 1 / math.sqrt(latent_dim + rope_dim)

    def run(self, **kwargs):
        return ak.mla_paged_attention(
            self.q_latent,
            self.q_pe,
            self.kv_cache,
            self.block_tables,
            self.seq_lens_t,
            self.query_start_loc,
            self.scale,
            **kwargs,
        )


def dense_reference(batch):
    """fp64, one sequence at a time: q = cat(q_latent, q_pe) against k = cat(c, k_pe), a causal mask
    written out position by position, softmax, P @ c."""
    num_tokens, num_heads, latent_dim = batch.q_latent.shape
    out = torch.zeros(num_tokens, num_heads, latent_dim, dtype=torch.float64)
    q_all = torch.cat((batch.q_latent, batch.q_pe), dim=-1).double()  # [T, H, L + R]
    row = 0
    for b, (seq_len, q_len) in enumerate(zip(batch.seq_lens, batch.q_lens, strict=True)):
        if q_len == 0:
            continue
        k = torch.cat((batch.latents[b], batch.ropes[b]), dim=-1).double()  # [S, L + R]
        v = batch.latents[b].double()  # [S, L]
        q = q_all[row : row + q_len]  # [q_len, H, L + R]
        s = q @ k.T * batch.scale  # [q_len, H, S]
        visible = [[j <= pos for j in range(seq_len)] for pos in range(seq_len - q_len, seq_len)]
        s = s.masked_fill(~torch.tensor(visible)[:, None, :], -math.inf)
        p = torch.exp(s - s.max(dim=-1, keepdim=True).values)
        out[row : row + q_len] = (p / p.sum(-1, keepdim=True)) @ v
        row += q_len
    return out


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=["deepseek", "l40r8", "l40r16-page7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mla_paged_attention(dtype, shape, strided):
    batch = MlaBatch(SEQS, shape, dtype, strided=strided, seed=shape[0])
    assert batch.q_latent.is_contiguous() != strided
    out = torch.full_like(batch.q_latent, float("nan"))
    assert batch.run(out=out) is out
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, dense_reference(batch), atol=atol, rtol=rtol, name="mla_paged_attention")
    assert bool((out[-2:] == 0).all()), "rows past query_start_loc[B] must be zeroed"
    fresh = batch.run()  # without out=: a new tensor in q's dtype
    assert fresh.dtype == dtype and fresh.shape == out.shape
    assert_equal(fresh, out, name="out= vs returned")


def test_decode_only_batch_with_hint():
    seqs = [(40, 1), (65, 1), (3, 1), (17, 1)]
    batch = MlaBatch(seqs, SHAPES[1], torch.float32, pad_rows=0, seed=4)
    out = batch.run(max_query_len=1)
    assert_close(out, dense_reference(batch), atol=2e-5, rtol=2e-5, name="decode-only")


def test_rope_part_matters():
    # Guards the reference: the rope scores change the result (q_pe is not ignored).
    batch = MlaBatch(SEQS, SHAPES[1], torch.float32, seed=2)
    with_pe = batch.run()
    batch.q_pe = batch.q_pe * 0
    assert (with_pe - batch.run()).abs().max() > 0.1


def _write_inputs(num_tokens, latent_dim, rope_dim, dtype, strided, seed=0):
    g = torch.Generator().manual_seed(seed)
    # kv_a_proj's output [T, L + R]: strided kv_c / k_pe are its two views.
    kv = torch.randn(num_tokens, latent_dim + rope_dim, generator=g).to(dtype)
    if strided:
        return kv[:, :latent_dim], kv[:, latent_dim:], g
    return kv[:, :latent_dim].contiguous(), kv[:, latent_dim:].contiguous(), g


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize(
    ("num_blocks", "block_size", "latent_dim", "rope_dim"), [(6, 16, 512, 64), (5, 7, 40, 8)]
)
def test_mla_cache_write(num_blocks, block_size, latent_dim, rope_dim, dtype, cache_dtype, strided):
    num_tokens = 23
    kv_c, k_pe, g = _write_inputs(num_tokens, latent_dim, rope_dim, dtype, strided)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    cache = torch.full((num_blocks, block_size, latent_dim + rope_dim), float("nan"))
    cache = cache.to(cache_dtype)
    assert ak.mla_cache_write(kv_c, k_pe, cache, slots.int() if strided else slots) is None
    # Independent view of the layout: the cache flattened to [num_blocks * block_size, L + R].
    flat = cache.float().flatten(0, 1)
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected = torch.cat((kv_c[t], k_pe[t])).to(cache_dtype).float()
            assert_equal(flat[s], expected, name=f"slot {s} (token {t})")
            written[s] = True
    assert bool(written.any())
    assert bool(flat[~written].isnan().all()), "a slot that was not in slot_mapping was written"


def test_write_then_attend():
    """The cache the write op fills is the one attention reads: one prefill of 21 tokens over a
    cached prefix of 10, slots through a shuffled block table."""
    latent_dim, rope_dim, block_size, num_heads = 40, 8, 16, 4
    kv_c, k_pe, g = _write_inputs(31, latent_dim, rope_dim, torch.float32, False, seed=3)
    cache = torch.full((4, block_size, latent_dim + rope_dim), float("nan"))
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    slots = table[0, torch.arange(31) // block_size].long() * block_size
    slots += torch.arange(31) % block_size
    ak.mla_cache_write(kv_c[:10], k_pe[:10], cache, slots[:10])
    ak.mla_cache_write(kv_c[10:], k_pe[10:], cache, slots[10:])
    q = torch.randn(21, num_heads, latent_dim + rope_dim, generator=g)
    q_latent, q_pe = q[..., :latent_dim], q[..., latent_dim:]
    seq_lens, qsl = torch.tensor([31], dtype=torch.int32), torch.tensor([0, 21]).int()
    out = ak.mla_paged_attention(q_latent, q_pe, cache, table, seq_lens, qsl, 0.15)
    batch = MlaBatch([(31, 21)], (num_heads, latent_dim, rope_dim, block_size), torch.float32)
    batch.latents, batch.ropes = [kv_c], [k_pe]
    batch.q_latent, batch.q_pe, batch.scale = q_latent, q_pe, 0.15
    assert_close(out, dense_reference(batch), atol=2e-5, rtol=2e-5, name="write then attend")


def test_bad_arguments():
    batch = MlaBatch(SEQS, SHAPES[1], torch.float32, seed=0)
    q, q_pe, cache = batch.q_latent, batch.q_pe, batch.kv_cache
    meta = (batch.block_tables, batch.seq_lens_t, batch.query_start_loc)
    run = ak.mla_paged_attention
    with pytest.raises(
        ValueError,
        match=r"mla_paged_attention: kv_cache has shape \(\d+, 16, 48\), expected \(\d+, 16, 47\)",
    ):
        run(q, q_pe[..., :7], cache, *meta, 0.1)
    with pytest.raises(
        ValueError, match=r"mla_paged_attention: q_pe has shape \(\d+, 4, 8\), expected"
    ):
        run(q, q_pe[:, :4], cache, *meta, 0.1)
    with pytest.raises(ValueError, match="mla_paged_attention: q_pe has dtype torch.bfloat16"):
        run(q, q_pe.bfloat16(), cache, *meta, 0.1)
    with pytest.raises(
        ValueError,
        match="mla_paged_attention: kv_cache has dtype torch.float32, expected torch.bfloat16",
    ):
        run(q.bfloat16(), q_pe.bfloat16(), cache, *meta, 0.1)
    with pytest.raises(ValueError, match="mla_paged_attention: kv_cache must have 3 dims"):
        run(q, q_pe, cache[:, :, None], *meta, 0.1)
    with pytest.raises(ValueError, match=r"mla_paged_attention: query_start_loc has shape \(7,\)"):
        run(q, q_pe, cache, *meta[:2], meta[2][:-1], 0.1)
    with pytest.raises(ValueError, match="mla_paged_attention: seq_lens has dtype torch.float32"):
        run(q, q_pe, cache, meta[0], meta[1].float(), meta[2], 0.1)
    with pytest.raises(ValueError, match="mla_paged_attention: scale must be a float"):
        run(q, q_pe, cache, *meta, None)
    with pytest.raises(ValueError, match="mla_paged_attention: max_query_len must be"):
        run(q, q_pe, cache, *meta, 0.1, max_query_len=-1)
    with pytest.raises(ValueError, match=r"mla_paged_attention: out has shape \(3, 5, 40\)"):
        run(q, q_pe, cache, *meta, 0.1, out=torch.empty(3, 5, 40))
    with pytest.raises(ValueError, match="mla_paged_attention: sequence 0 has 37 query rows"):
        run(q, q_pe, cache, meta[0], meta[1] * 0 + 1, meta[2], 0.1)

    kv_c, k_pe, _ = _write_inputs(5, 40, 8, torch.float32, False)
    slots = torch.arange(5)
    with pytest.raises(
        ValueError,
        match=r"mla_cache_write: kv_cache has shape \(\d+, 16, 48\), expected \(\d+, 16, 50\)",
    ):
        ak.mla_cache_write(kv_c, torch.zeros(5, 10), cache, slots)
    with pytest.raises(
        ValueError, match=r"mla_cache_write: k_pe has shape \(4, 8\), expected \(5, 8\)"
    ):
        ak.mla_cache_write(kv_c, k_pe[:4], cache, slots)
    with pytest.raises(ValueError, match=r"mla_cache_write: slot_mapping has shape \(4,\)"):
        ak.mla_cache_write(kv_c, k_pe, cache, slots[:4])
    with pytest.raises(ValueError, match="mla_cache_write: slot_mapping has dtype torch.float32"):
        ak.mla_cache_write(kv_c, k_pe, cache, slots.float())
    with pytest.raises(ValueError, match="mla_cache_write: kv_c must have 2 dims"):
        ak.mla_cache_write(kv_c[None], k_pe, cache, slots)
