"""Triton rotary_embedding against the torch reference: neox and gptj, partial rotary, q/k as
strided views of a fused qkv projection."""

import pytest
import torch

import atom_kernels as ak
from atom_kernels.backends.torch import rotary as reference
from atom_kernels.testing import assert_close, assert_equal, tolerances

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (T, H, Hk, D, R): full rotary, partial rotary, odd sizes
CASES = [(7, 4, 2, 64, 64), (5, 3, 1, 40, 24), (2, 2, 2, 16, 8)]


def _inputs(case, dtype, device, strided, seed=0, max_positions=300):
    num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim = case
    g = torch.Generator().manual_seed(seed)
    cache = ak.rope_cos_sin_cache(rotary_dim, max_positions, 10000.0)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=g)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=g).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    if not strided:
        q, k = q.contiguous(), k.contiguous()
    return positions.to(device), q.to(device), k.to(device), cache.to(device)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding(triton_backend, is_neox, dtype, case, strided):
    positions, q, k, cache = _inputs(case, dtype, triton_backend.device, strided)
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = triton_backend.custom_ops.rotary_embedding(positions, q, k, cache, is_neox)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cache, is_neox)
    atol, rtol = tolerances(dtype)
    assert q_out.dtype == dtype and k_out.dtype == dtype
    assert_close(q_out, q_ref, atol=atol, rtol=rtol, name="q")
    assert_close(k_out, k_ref, atol=atol, rtol=rtol, name="k")
    assert_equal(q, q_before, name="q unchanged")
    assert_equal(k, k_before, name="k unchanged")
    rotary_dim = cache.shape[1]
    assert_equal(q_out[..., rotary_dim:], q[..., rotary_dim:], name="pass-through dims")


def test_int32_positions_bf16_cache_different_k_head_dim(triton_backend):
    device = triton_backend.device
    positions, q, _, cache = _inputs((6, 2, 1, 32, 16), torch.bfloat16, device, False)
    k = torch.randn(6, 3, 24).to(torch.bfloat16).to(device)  # k head dim != q head dim
    cache = cache.to(torch.bfloat16)
    q_out, k_out = triton_backend.custom_ops.rotary_embedding(positions.int(), q, k, cache, True)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cache, True)
    assert_close(q_out, q_ref, atol=1.6e-2, rtol=1.6e-2, name="q")
    assert_close(k_out, k_ref, atol=1.6e-2, rtol=1.6e-2, name="k")


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_gpu_real_sizes(triton_backend, is_neox):
    # Llama-3-8B: 4096 tokens, 32 q heads, 8 kv heads, head dim 128; positions up to 8K
    case = (4096, 32, 8, 128, 128)
    positions, q, k, cache = _inputs(case, torch.bfloat16, "cuda", True, max_positions=8192)
    q_out, k_out = triton_backend.custom_ops.rotary_embedding(positions, q, k, cache, is_neox)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cache, is_neox)
    assert_close(q_out, q_ref, atol=1.6e-2, rtol=1.6e-2, name="q")
    assert_close(k_out, k_ref, atol=1.6e-2, rtol=1.6e-2, name="k")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_with_qk_norm(triton_backend, is_neox, dtype, case):
    """The fused q/k RMSNorm + rotary (Qwen3) equals the reference's norm then rotary, partial
    rotary included (the pass-through dims are normalized too)."""
    positions, q, k, cache = _inputs(case, dtype, triton_backend.device, strided=True, seed=3)
    g = torch.Generator().manual_seed(4)
    q_w = (torch.rand(q.shape[2], generator=g) + 0.5).to(dtype).to(q.device)
    k_w = (torch.rand(k.shape[2], generator=g) + 0.5).to(dtype).to(q.device)
    q_out, k_out = triton_backend.custom_ops.rotary_embedding(
        positions, q, k, cache, is_neox, q_w, k_w, 1e-6
    )
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cache, is_neox, q_w, k_w, 1e-6)
    atol, rtol = tolerances(dtype)
    assert_close(q_out, q_ref, atol=atol, rtol=rtol, name="q")
    assert_close(k_out, k_ref, atol=atol, rtol=rtol, name="k")
    plain_q, _ = reference.rotary_embedding(positions, q, k, cache, is_neox)
    assert (q_out.float() - plain_q.float()).abs().max() > 0.1, "the norm was not applied"


@pytest.mark.parametrize("is_neox", [True, False])
def test_mla_views(triton_backend, is_neox):
    """DeepSeek's MLA passes views, not copies: q_pe [T, H, R] of q [T, H, Dn + R] (a head
    stride of Dn + R) and k_pe [T, 1, R] of the latent [T, L + R]; the latent's [T, L] part
    goes to the RMSNorm the same way."""
    device = triton_backend.device
    g = torch.Generator().manual_seed(3)
    tokens, heads, nope, rope, lora = 5, 3, 24, 16, 40
    q = torch.randn(tokens, heads, nope + rope, generator=g).to(torch.bfloat16).to(device)
    latent = torch.randn(tokens, lora + rope, generator=g).to(torch.bfloat16).to(device)
    positions = torch.randint(0, 100, (tokens,), generator=g).to(device)
    cache = ak.rope_cos_sin_cache(rope, 100, 10000.0).to(device)
    q_pe, k_pe = q[:, :, nope:], latent[:, lora:].view(tokens, 1, rope)
    rotary = triton_backend.custom_ops.rotary_embedding
    got = rotary(positions, q_pe, k_pe, cache, is_neox)
    copies = rotary(positions, q_pe.contiguous(), k_pe.contiguous(), cache, is_neox)
    want = reference.rotary_embedding(
        positions, q_pe.contiguous(), k_pe.contiguous(), cache, is_neox
    )
    atol, rtol = tolerances(torch.bfloat16)
    for out, same, ref, name in zip(got, copies, want, ("q", "k"), strict=True):
        assert_equal(out, same, name=f"{name} from views as from copies")
        assert_close(out, ref, atol=atol, rtol=rtol, name=name)
    weight = (torch.rand(lora, generator=g) + 0.5).to(torch.bfloat16).to(device)
    kv_c = latent[:, :lora]
    assert_equal(
        triton_backend.norm.rms_norm(kv_c, weight, 1e-6),
        triton_backend.norm.rms_norm(kv_c.contiguous(), weight, 1e-6),
        name="normed latent",
    )
