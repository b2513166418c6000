"""@triton.jit pieces shared by the paged-attention kernels: the KV gather through the block
table, the score transform (scale, soft-cap, fp8 key scale) and one online-softmax step."""

import triton
import triton.language as tl

from atom_kernels.backends.triton.jit_utils import tanh

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def load_scale(scale_ptr, scale, IS_PTR: tl.constexpr):
    """A per-tensor scale: read from device memory (no host sync) or passed by value."""
    if IS_PTR:
        return tl.load(scale_ptr).to(tl.float32)
    return scale


@triton.jit
def find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_M: tl.constexpr):
    """The sequence owning query tile ``tile``: sequence b owns tiles qsl[b] // BLOCK_M + b ...
    (an upper bound on its tile count, so no host sync is needed to size the grid)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_M + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def gather_kv(
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    tokens,
    token_mask,
    kv_head,
    head_dim,
    head_dim_v,
    block_size,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    compute_dtype: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr = 0,
):
    """K [BLOCK_N, BLOCK_D] and V [BLOCK_N, BLOCK_DV] of ``tokens`` (positions in the sequence)
    through the block table; masked tokens and padded dims read as 0. fp8 entries are converted
    (exactly) to ``compute_dtype``; their scales are applied by the caller. ``PAGE_SIZE`` > 0 is
    ``block_size`` as a compile-time power of two: the page and slot of a token are a shift and
    a mask instead of a division by a runtime value per token row."""
    if PAGE_SIZE > 0:
        page = (tokens.to(tl.uint32) // PAGE_SIZE).to(tl.int32)  # tokens >= 0: a plain shift
        slot = (tokens.to(tl.uint32) % PAGE_SIZE).to(tl.int32)
    else:
        page = tokens // block_size
        slot = tokens % block_size
    block = tl.load(block_table_ptr + page, mask=token_mask, other=0)
    block = block.to(tl.int64)
    offset = slot.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k_ptrs = (
        k_cache_ptr
        + (block * stride_kb + offset * stride_ks + kv_head * stride_kh)[:, None]
        + d[None, :] * stride_kd
    )
    k = tl.load(k_ptrs, mask=token_mask[:, None] & (d < head_dim)[None, :], other=0.0)
    v_ptrs = (
        v_cache_ptr
        + (block * stride_vb + offset * stride_vs + kv_head * stride_vh)[:, None]
        + dv[None, :] * stride_vd
    )
    v = tl.load(v_ptrs, mask=token_mask[:, None] & (dv < head_dim_v)[None, :], other=0.0)
    return k.to(compute_dtype), v.to(compute_dtype)


@triton.jit
def scores(q, k, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """log2-domain logits [M, N] of q [M, D] against k [N, D]: qk_scale = scale * k_scale, then
    ``softcap * tanh(s / softcap)`` when HAS_SOFTCAP, times log2(e)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if HAS_SOFTCAP:
        return (softcap * LOG2E) * tanh(s * (qk_scale / softcap))
    return s * (qk_scale * LOG2E)


@triton.jit
def softmax_step(acc, l_i, m_i, s, v, PRECISION: tl.constexpr):
    """One online-softmax update with logits s [M, N] (log2 domain, -inf = masked) and values
    v [N, Dv]. Rows whose logits are all -inf so far keep m = -inf and add nothing."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new
