"""Triton reshape_and_cache against the torch reference: NaN-poisoned caches, -1 slots skipped,
strided key/value and cache views, fp8 caches with float and tensor scales."""

import pytest
import torch

from atom_kernels.backends.torch import cache as reference
from atom_kernels.testing import assert_equal, transposed_copy

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8 = torch.float8_e4m3fn
# (num_blocks, block_size, Hk, D, Dv, T)
CASES = [(8, 16, 2, 64, 64, 40), (5, 3, 3, 24, 17, 11)]


def _setup(case, dtype, cache_dtype, strided, device, seed=0):
    num_blocks, block_size, num_kv_heads, head_dim, head_dim_v, num_tokens = case
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim_v, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    key, value, slots = key.to(device), value.to(device), slots.to(device)
    if strided:
        key, value = transposed_copy(key), transposed_copy(value)
        # K and V caches as two halves of one [num_blocks, 2, block_size, Hk, D] buffer
        kv = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"))
        kv = kv.to(cache_dtype).to(device)
        key_cache, value_cache = kv[:, 0], kv[:, 1, ..., :head_dim_v]
    else:
        shape = (num_blocks, block_size, num_kv_heads)
        key_cache = torch.full((*shape, head_dim), float("nan")).to(cache_dtype).to(device)
        value_cache = torch.full((*shape, head_dim_v), float("nan")).to(cache_dtype).to(device)
    return key, value, key_cache, value_cache, slots


def _assert_fp8_close(actual, expected, name):
    """Equal, except that a GPU may round a few entries to the neighbouring fp8 value: the torch
    reference on CUDA divides by a float scale as x * (1 / scale), one fp32 ulp from x / scale."""
    a, e = actual.float(), expected.float()
    differ = (a != e) & ~(a.isnan() & e.isnan())
    if not bool(differ.any()):
        return
    one_step = (a - e).abs() <= 0.125 * torch.maximum(a.abs(), e.abs()) + 2.0**-9
    assert bool(one_step[differ].all()) and int(differ.sum()) <= max(1, differ.numel() // 100), (
        f"{name}: {int(differ.sum())} fp8 entries differ, first at "
        f"{differ.nonzero()[0].tolist()}: {a[differ][:4].tolist()} vs {e[differ][:4].tolist()}"
    )


def _run_both(triton_backend, key, value, key_cache, value_cache, slots, k_scale, v_scale):
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots, k_scale, v_scale)
    result = triton_backend.custom_ops.reshape_and_cache(
        key, value, key_cache, value_cache, slots, k_scale, v_scale
    )
    assert result is None
    for name, actual, expected in (
        ("key_cache", key_cache, expected_k),
        ("value_cache", value_cache, expected_v),
    ):
        if key_cache.dtype == FP8 and not triton_backend.interpreted:
            _assert_fp8_close(actual, expected, name)
        else:  # bit-exact, NaN (unwritten slots) included
            assert_equal(actual.float(), expected.float(), name=name)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(triton_backend, dtype, case, strided):
    tensors = _setup(case, dtype, dtype, strided, triton_backend.device)
    _run_both(triton_backend, *tensors, None, None)


@pytest.mark.parametrize("int32_slots", [False, True])
def test_cache_dtype_differs_from_input(triton_backend, int32_slots):
    key, value, key_cache, value_cache, slots = _setup(
        CASES[0], torch.float32, torch.bfloat16, False, triton_backend.device
    )
    slots = slots.int() if int32_slots else slots
    _run_both(triton_backend, key, value, key_cache, value_cache, slots, None, None)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("scale_as_tensor", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reshape_and_cache_fp8(triton_backend, dtype, scale_as_tensor, strided):
    key, value, key_cache, value_cache, slots = _setup(
        CASES[1], dtype, FP8, strided, triton_backend.device
    )
    key = key * 100  # some values beyond 448 * k_scale, to exercise the clamp
    k_scale, v_scale = 0.25, 0.0125
    if scale_as_tensor:
        device = triton_backend.device
        k_scale, v_scale = torch.tensor([k_scale], device=device), torch.tensor(v_scale).to(device)
    _run_both(triton_backend, key, value, key_cache, value_cache, slots, k_scale, v_scale)


@pytest.mark.gpu
def test_reshape_and_cache_gpu_real_sizes(triton_backend):
    # A 2048-token prefill of Llama-3-8B (8 kv heads x 128) into a 16-token-block cache.
    case = (4096, 16, 8, 128, 128, 2048)
    for cache_dtype, scales in ((torch.bfloat16, (None, None)), (FP8, (0.05, 0.03))):
        tensors = _setup(case, torch.bfloat16, cache_dtype, False, "cuda")
        _run_both(triton_backend, *tensors, *scales)
