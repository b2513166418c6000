"""rotary_embedding: neox vs transformers' apply_rotary_pos_emb, gptj vs the pair formula."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import atom_kernels as ak
from atom_kernels.testing import assert_close, assert_equal, tolerances

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (T, H, Hk, D, R): full rotary, partial rotary, odd sizes
CASES = [(7, 4, 2, 64, 64), (5, 3, 1, 40, 24), (2, 2, 2, 16, 8)]


def _inputs(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, strided, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = ak.rope_cos_sin_cache(rotary_dim, 300, 10000.0)
    positions = torch.randint(0, 300, (num_tokens,), generator=g)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=g).to(dtype)
    if strided:  # q and k as views into a fused qkv projection, as a model produces them
        q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
        k = k.view(num_tokens, num_kv_heads, head_dim)
        assert not q.is_contiguous() and not k.is_contiguous()
    else:
        q = qkv[:, : num_heads * head_dim].reshape(num_tokens, num_heads, head_dim).clone()
        k = qkv[:, -num_kv_heads * head_dim :].reshape(num_tokens, num_kv_heads, head_dim).clone()
    return positions, q, k, cache


def _hf_neox(positions, x, cache):
    # HF's rotate_half formula in fp64 on the first R dims; the rest passes through.
    rotary_dim = cache.shape[1]
    cos, sin = cache[positions].double().chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # [T, R]
    x_rot = x[..., :rotary_dim].double()
    rotated, _ = apply_rotary_pos_emb(x_rot, x_rot, cos, sin, unsqueeze_dim=1)
    return torch.cat((rotated, x[..., rotary_dim:].double()), dim=-1)


def _gptj_pairs(positions, x, cache):
    # out[2i] = x[2i] cos_i - x[2i+1] sin_i, out[2i+1] = x[2i+1] cos_i + x[2i] sin_i (fp64)
    half = cache.shape[1] // 2
    out = x.double().clone()
    for t, p in enumerate(positions.tolist()):
        for i in range(half):
            c, s = cache[p, i].double(), cache[p, half + i].double()
            even, odd = x[t, :, 2 * i].double(), x[t, :, 2 * i + 1].double()
            out[t, :, 2 * i] = even * c - odd * s
            out[t, :, 2 * i + 1] = odd * c + even * s
    return out


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding(is_neox, dtype, case, strided):
    positions, q, k, cache = _inputs(*case, dtype, strided)
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = ak.rotary_embedding(positions, q, k, cache, is_neox=is_neox)
    reference = _hf_neox if is_neox else _gptj_pairs
    atol, rtol = tolerances(dtype)
    assert q_out.dtype == dtype and k_out.dtype == dtype
    assert_close(q_out, reference(positions, q, cache), atol=atol, rtol=rtol, name="q")
    assert_close(k_out, reference(positions, k, cache), atol=atol, rtol=rtol, name="k")
    assert_equal(q, q_before, name="q unchanged")
    assert_equal(k, k_before, name="k unchanged")
    rotary_dim = cache.shape[1]
    assert_equal(q_out[..., rotary_dim:], q[..., rotary_dim:], name="pass-through dims")


def test_int32_positions_and_bf16_cache():
    positions, q, k, cache = _inputs(6, 2, 1, 32, 32, torch.bfloat16, False)
    q32, k32 = ak.rotary_embedding(positions.int(), q, k, cache.to(torch.bfloat16))
    q_ref = _hf_neox(positions, q, cache.to(torch.bfloat16))
    assert_close(q32, q_ref, atol=1.6e-2, rtol=1.6e-2, name="q")


def test_bad_arguments():
    positions, q, k, cache = _inputs(4, 2, 1, 16, 16, torch.float32, False)
    with pytest.raises(ValueError, match=r"rotary_embedding: k has shape \(3, 1, 16\)"):
        ak.rotary_embedding(positions, q, k[:3], cache)
    with pytest.raises(ValueError, match="rotary_embedding: positions has dtype torch.float32"):
        ak.rotary_embedding(positions.float(), q, k, cache)
    with pytest.raises(ValueError, match="rotary_embedding: k has dtype"):
        ak.rotary_embedding(positions, q, k.half(), cache)
    with pytest.raises(ValueError, match="rotary_embedding: q has head dim 8, smaller than"):
        ak.rotary_embedding(positions, q[..., :8], k, cache)


def test_qk_norm_is_rms_norm_then_rotary():
    """rotary_embedding's q/k norm is exactly rms_norm per head, then the rotation."""
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 100, (5,), generator=g)
    q, k = torch.randn(5, 4, 32, generator=g), torch.randn(5, 2, 32, generator=g)
    q_w, k_w = torch.rand(32, generator=g) + 0.5, torch.rand(32, generator=g) + 0.5
    cache = ak.rope_cos_sin_cache(16, 100, 10000.0)
    fused = ak.rotary_embedding(
        positions, q, k, cache, True, q_norm_weight=q_w, k_norm_weight=k_w, norm_eps=1e-5
    )
    composed = ak.rotary_embedding(
        positions, ak.rms_norm(q, q_w, 1e-5), ak.rms_norm(k, k_w, 1e-5), cache, True
    )
    for a, b in zip(fused, composed, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="give both q_norm_weight and k_norm_weight"):
        ak.rotary_embedding(positions, q, k, cache, True, q_norm_weight=q_w)
    with pytest.raises(ValueError, match=r"k_norm_weight has .*32"):
        ak.rotary_embedding(
            positions, q, k, cache, True, q_norm_weight=q_w, k_norm_weight=torch.ones(8)
        )
