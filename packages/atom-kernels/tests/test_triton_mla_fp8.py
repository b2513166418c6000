"""Triton MLA over an fp8 latent cache against the torch reference: the write (bit-exact: the
same IEEE division and clamp), and attention for mixed prefill / decode batches (one and several
decode splits, float and tensor scales, through the custom op too)."""

import math

import pytest
import torch

from atom_kernels.backends.torch import mla as reference
from atom_kernels.testing import assert_close

FP8 = torch.float8_e4m3fn
# Attention over the same dequantized entries: only the kernels' summation order differs.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}
# (H, L, R, block_size)
ODD = (5, 40, 8, 7)
# (seq_len, q_len): prefill, prefill over a cached prefix, decodes, an empty query
MIXED = [(37, 37), (50, 13), (20, 1), (1, 1), (64, 1), (9, 0), (33, 4)]


def _assert_fp8_close(actual, expected, name):
    """Equal, except that a GPU may round a few entries to the neighbouring fp8 value."""
    a, e = actual.float(), expected.float()
    same = (a == e) | (a.isnan() & e.isnan())
    if not bool(same.all()):
        step = (e.abs() / 8).clamp_min(2.0**-9)  # one e4m3 step (3 mantissa bits)
        far = ~same & ((a - e).abs() > step * 1.01)
        assert not bool(far.any()), f"{name}: entries differ by more than one fp8 step"
        assert int((~same).sum()) <= max(1, a.numel() // 1000), f"{name}: too many differ"


def _fp8_batch(shape, seqs, dtype, device, kv_scale, seed=0):
    """A NaN-poisoned fp8 latent cache filled by the reference write through shuffled blocks, and
    the attention arguments (q_latent, q_pe, cache, tables, seq_lens, qsl, scale)."""
    num_heads, latent_dim, rope_dim, block_size = shape
    g = torch.Generator().manual_seed(seed)
    seq_lens = [s for s, _ in seqs]
    q_lens = [q for _, q in seqs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seqs), max(blocks_per_seq) + 1), num_blocks + 1000)
    slots = []
    for b, seq_len in enumerate(seq_lens):
        ids = [free.pop() for _ in range(blocks_per_seq[b])]
        tables[b, : len(ids)] = torch.tensor(ids)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(seq_len)]
    kv = torch.randn(len(slots), latent_dim + rope_dim, generator=g).to(dtype)
    cache = torch.full((num_blocks, block_size, latent_dim + rope_dim), float("nan")).to(FP8)
    reference.mla_cache_write(
        kv[:, :latent_dim], kv[:, latent_dim:], cache, torch.tensor(slots), kv_scale
    )
    q = torch.randn(sum(q_lens) + 2, num_heads, latent_dim + rope_dim, generator=g).to(dtype)
    return tuple(
        x.to(device) if isinstance(x, torch.Tensor) else x
        for x in (
            q[..., :latent_dim].contiguous(),
            q[..., latent_dim:].contiguous(),
            cache,
            tables.int(),
            torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
            1 / math.sqrt(latent_dim + rope_dim),
        )
    )


@pytest.mark.parametrize("scale_as_tensor", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_cache_write_fp8(triton_backend, dtype, scale_as_tensor):
    device = triton_backend.device
    g = torch.Generator().manual_seed(5)
    kv = (torch.randn(23, 48, generator=g) * 30).to(dtype).to(device)  # beyond 448 * scale
    kv_c, k_pe = kv[:, :40], kv[:, 40:]  # strided views
    slots = torch.randperm(35, generator=g)[:23]
    slots[torch.rand(23, generator=g) < 0.2] = -1
    slots = slots.to(device)
    kv_scale = torch.tensor([0.05], device=device) if scale_as_tensor else 0.05
    cache = torch.full((5, 7, 48), float("nan")).to(FP8).to(device)
    expected = cache.clone()
    reference.mla_cache_write(kv_c, k_pe, expected, slots, kv_scale)
    entry = triton_backend.custom_ops.ENTRIES["mla_cache_write"]
    assert entry(kv_c, k_pe, cache, slots, kv_scale) is None
    _assert_fp8_close(cache, expected, "fp8 latent cache")
    # The traced entry (the custom op) writes the same.
    traced = torch.full((5, 7, 48), float("nan")).to(FP8).to(device)
    triton_backend.backend.mla_custom_ops.mla_cache_write(kv_c, k_pe, traced, slots, kv_scale)
    _assert_fp8_close(traced, expected, "fp8 latent cache (custom op)")


@pytest.mark.parametrize(
    ("dtype", "num_splits", "scale_as_tensor"),
    [
        (torch.float32, 1, False),
        (torch.float32, 3, True),
        (torch.bfloat16, 2, False),
    ],
)
def test_mla_paged_attention_fp8(triton_backend, dtype, num_splits, scale_as_tensor):
    device = triton_backend.device
    kv_scale = 0.02
    args = _fp8_batch(ODD, MIXED, dtype, device, kv_scale, seed=num_splits)
    scale_arg = torch.tensor(kv_scale, device=device) if scale_as_tensor else kv_scale
    q_latent = args[0]
    out = torch.full(q_latent.shape, float("nan"), dtype=dtype, device=device)
    triton_backend.mla_attention.mla_paged_attention(
        *args, out, kv_scale=scale_arg, num_splits=num_splits
    )
    expected = reference.mla_paged_attention(*args, None, kv_scale=kv_scale)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, name="fp8 mla_paged_attention")
    assert bool((out[-2:] == 0).all()), "rows past query_start_loc[B] must be zeroed"
    # The traced entry takes the scale as the custom op's two arguments.
    traced = triton_backend.backend.mla_custom_ops.mla_paged_attention(
        *args, None, kv_scale=scale_arg
    )
    assert_close(traced, expected, atol=atol, rtol=rtol, name="fp8 mla (custom op)")


# --- real sizes on a GPU ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 128])  # DeepSeek-V3 over TP 8, one rank
@pytest.mark.parametrize("decode_only", [False, True])
def test_gpu_fp8_real_sizes(triton_backend, num_heads, decode_only):
    """DeepSeek-V3's latent (L 512, R 64, page 16) in an fp8 cache with a tensor scale: decodes
    from 300 to 8K tokens (split and unsplit) with, or without (the decode-only launch,
    max_query_len 1), a prefill over a cached prefix."""
    seqs = [(8192, 1), (4096, 1), (1000, 1), (300, 1)]
    if not decode_only:
        seqs.append((3000, 700))
    kv_scale = 0.02
    args = _fp8_batch((num_heads, 512, 64, 16), seqs, torch.bfloat16, "cuda", kv_scale, seed=7)
    if decode_only:  # exactly one query row per sequence
        args = (args[0][: len(seqs)], args[1][: len(seqs)], *args[2:])
    scale = torch.tensor([kv_scale], device="cuda")
    out = triton_backend.mla_attention.mla_paged_attention(
        *args, None, kv_scale=scale, max_query_len=1 if decode_only else None
    )
    expected = reference.mla_paged_attention(*args, None, kv_scale=kv_scale)
    atol, rtol = TOLERANCES[torch.bfloat16]
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"fp8 mla {num_heads} heads (GPU)")
