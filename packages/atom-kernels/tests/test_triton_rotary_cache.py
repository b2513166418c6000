"""Triton rotary_embedding_and_cache (rotary, optional q/k RMSNorm, and the K/V cache write in one
launch) against the torch reference and against the two unfused Triton ops it replaces: neox and
gptj, partial rotary, q/k/v as strided views of one qkv projection, NaN-poisoned caches, -1 slots
skipped, bf16 / fp32 caches and fp8 caches with float and tensor scales."""

import pytest
import torch

from atom_kernels import rope_cos_sin_cache
from atom_kernels.backends.torch import rotary as reference
from atom_kernels.testing import assert_close, assert_equal, tolerances

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8 = torch.float8_e4m3fn
# (T, H, Hk, D, R, num_blocks, block_size): full rotary, partial rotary with odd sizes
CASES = [(9, 4, 2, 64, 64, 4, 8), (5, 3, 3, 40, 24, 3, 3)]


def _inputs(case, dtype, cache_dtype, device, strided=True, seed=0, max_positions=300):
    num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, num_blocks, block_size = case
    g = torch.Generator().manual_seed(seed)
    cos_sin = rope_cos_sin_cache(rotary_dim, max_positions, 10000.0)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=g)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g).to(dtype)
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    if not strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan")).to(cache_dtype)
    value_cache = torch.full(shape, float("nan")).to(cache_dtype)
    tensors = (positions, q, k, v, cos_sin, key_cache, value_cache, slots)
    return tuple(t.to(device) for t in tensors)


def _norm_weights(head_dim, dtype, device, seed=4):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(device) for _ in "qk")


def _assert_cache_close(actual, expected, name, interpreted):
    """fp8: equal, or one fp8 step apart on a GPU (its fp32 rotary may round one ulp off the
    reference's); other dtypes: within the dtype's tolerance. NaN (unwritten slots) must match."""
    a, e = actual.float(), expected.float()
    if actual.dtype == FP8:
        if interpreted:
            assert_equal(a, e, name=name)
        else:
            assert_close(a, e, atol=2.0**-9, rtol=0.125, name=name, equal_nan=True)
        return
    atol, rtol = tolerances(actual.dtype)
    assert_close(a, e, atol=atol, rtol=rtol, name=name, equal_nan=True)


def _run(triton_backend, inputs, is_neox, scales=(None, None), norms=(None, None)):
    positions, q, k, v, cos_sin, key_cache, value_cache, slots = inputs
    before = (q.clone(), k.clone(), v.clone())
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    q_ref = reference.rotary_embedding_and_cache(
        positions, q, k, v, cos_sin, is_neox, expected_k, expected_v, slots, *scales, *norms, 1e-6
    )
    # The two launches the fused op replaces, on the same backend.
    custom_ops = triton_backend.custom_ops
    unfused_k, unfused_v = key_cache.clone(), value_cache.clone()
    q_two, k_two = custom_ops.rotary_embedding(positions, q, k, cos_sin, is_neox, *norms, 1e-6)
    custom_ops.reshape_and_cache(k_two, v, unfused_k, unfused_v, slots, *scales)

    q_out = custom_ops.rotary_embedding_and_cache(
        positions, q, k, v, cos_sin, is_neox, key_cache, value_cache, slots, *scales, *norms, 1e-6
    )
    atol, rtol = tolerances(q.dtype)
    assert q_out.dtype == q.dtype and q_out.shape == q.shape
    assert_close(q_out, q_ref, atol=atol, rtol=rtol, name="q")
    interpreted = triton_backend.interpreted
    for name, actual, expected, unfused in (
        ("key_cache", key_cache, expected_k, unfused_k),
        ("value_cache", value_cache, expected_v, unfused_v),
    ):
        _assert_cache_close(actual, expected, f"{name} vs reference", interpreted)
        if interpreted:  # the same arithmetic as the unfused pair: bit-exact
            assert_equal(actual.float(), unfused.float(), name=f"{name} vs unfused")
        else:
            _assert_cache_close(actual, unfused, f"{name} vs unfused", interpreted)
    if interpreted:
        assert_equal(q_out, q_two, name="q vs unfused")
    for name, t, b in zip(("q", "k", "v"), (q, k, v), before, strict=True):
        assert_equal(t, b, name=f"{name} unchanged")
    written = slots[slots >= 0]
    block_size = key_cache.shape[1]
    assert not key_cache[written // block_size, written % block_size].float().isnan().any()
    return q_out


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_and_cache(triton_backend, is_neox, dtype, case, strided):
    inputs = _inputs(case, dtype, dtype, triton_backend.device, strided)
    _run(triton_backend, inputs, is_neox)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_with_qk_norm(triton_backend, dtype, case):
    """Qwen3's per-head q/k RMSNorm first (the pass-through dims of a partial rotary too)."""
    device = triton_backend.device
    inputs = _inputs(case, dtype, dtype, device, seed=3)
    norms = _norm_weights(case[3], dtype, device)
    q_out = _run(triton_backend, inputs, True, norms=norms)
    plain_q, _ = reference.rotary_embedding(inputs[0], inputs[1], inputs[2], inputs[4], True)
    assert (q_out.float() - plain_q.float()).abs().max() > 0.1, "the norm was not applied"


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("scale_as_tensor", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_cache(triton_backend, dtype, scale_as_tensor, with_norm):
    device = triton_backend.device
    inputs = list(_inputs(CASES[1], dtype, FP8, device, seed=5))
    inputs[2] = inputs[2] * 100  # keys beyond 448 * k_scale: the clamp
    k_scale, v_scale = 0.25, 0.0125
    if scale_as_tensor:
        k_scale, v_scale = torch.tensor([k_scale], device=device), torch.tensor(v_scale).to(device)
    norms = _norm_weights(CASES[1][3], dtype, device) if with_norm else (None, None)
    _run(triton_backend, tuple(inputs), True, (k_scale, v_scale), norms)


def test_cache_dtype_differs_int32_slots_all_padding(triton_backend):
    device = triton_backend.device
    inputs = list(_inputs(CASES[0], torch.float32, torch.bfloat16, device, seed=6))
    inputs[7] = inputs[7].int()
    _run(triton_backend, tuple(inputs), True)
    inputs[7] = torch.full_like(inputs[7], -1)  # every token a padding token: nothing cached
    inputs[5], inputs[6] = inputs[5].fill_(float("nan")), inputs[6].fill_(float("nan"))
    _run(triton_backend, tuple(inputs), False)
    assert inputs[5].float().isnan().all() and inputs[6].float().isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gpu_real_sizes(triton_backend, cache_dtype):
    # A 2048-token prefill of Llama-3-8B (32 / 8 heads x 128) and a Qwen3-0.6B decode row with
    # its q/k norms (16 / 8 heads x 128), into 16-token blocks.
    scales = (0.05, 0.03) if cache_dtype == FP8 else (None, None)
    for case, with_norm in (
        ((2048, 32, 8, 128, 128, 256, 16), False),
        ((1, 16, 8, 128, 128, 4, 16), True),
    ):
        inputs = _inputs(case, torch.bfloat16, cache_dtype, "cuda", max_positions=8192)
        norms = _norm_weights(128, torch.bfloat16, "cuda") if with_norm else (None, None)
        _run(triton_backend, inputs, True, scales, norms)


@pytest.mark.gpu
def test_gpu_pdl_behind_the_qkv_gemm_changes_nothing(triton_backend, monkeypatch):
    """PDL (ATOM_PDL, on by default): the fused kernel launches behind Qwen3-0.6B's norm + QKV
    GEMM (a PDL kernel) and waits for it; q and the caches equal, bit for bit, what they are
    without PDL."""
    from atom_kernels.backends.triton import gated_linear, pdl

    if not pdl._supported(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs sm_90+ and a Triton with gdc_wait")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 1024, generator=g).to(torch.bfloat16).cuda()
    norm_w = (torch.rand(1024, generator=g) + 0.5).to(torch.bfloat16).cuda()
    qkv_w = (torch.randn(4096, 1024, generator=g) / 32).to(torch.bfloat16).cuda()
    q_w, k_w = _norm_weights(128, torch.bfloat16, "cuda")
    cos_sin = rope_cos_sin_cache(128, 4096, 1e6).cuda()
    positions, slots = torch.tensor([517]).cuda(), torch.tensor([37]).cuda()

    def step(key_cache, value_cache):
        qkv, _ = gated_linear.norm_skinny_linear(x, None, norm_w, 1e-6, qkv_w, None)
        q, k, v = qkv.view(1, 32, 128).split([16, 8, 8], dim=1)
        return triton_backend.custom_ops.rotary_embedding_and_cache(
            positions, q, k, v, cos_sin, True, key_cache, value_cache, slots, 0.05, 0.03,
            q_w, k_w, 1e-6,
        )  # fmt: skip

    def caches():
        return [torch.zeros(4, 16, 8, 128, device="cuda").to(FP8) for _ in "kv"]

    monkeypatch.setattr(pdl, "ENABLED", False)
    want_caches = caches()
    want = step(*want_caches)
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.enabled(x.device)
    for _ in range(20):  # back to back
        got_caches = caches()
        got = step(*got_caches)
        assert_equal(got, want, name="q")
        for a, e in zip(got_caches, want_caches, strict=True):
            assert_equal(a.float(), e.float(), name="cache")
