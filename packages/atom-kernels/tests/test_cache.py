"""reshape_and_cache: NaN-poisoned caches; written slots equal direct indexing, others stay NaN."""

import pytest
import torch

import atom_kernels as ak
from atom_kernels.testing import assert_close, assert_equal, transposed_copy

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (num_blocks, block_size, Hk, D, Dv, T)
CASES = [(8, 16, 2, 64, 64, 40), (5, 3, 3, 24, 17, 11)]


def _setup(case, dtype, cache_dtype, strided, seed=0):
    num_blocks, block_size, num_kv_heads, head_dim, head_dim_v, num_tokens = case
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim_v, generator=g).to(dtype)
    if strided:
        key, value = transposed_copy(key), transposed_copy(value)
        assert not key.is_contiguous()
    # Distinct random slots, some tokens padding (-1).
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    value_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim_v), float("nan"))
    return key, value, key_cache.to(cache_dtype), value_cache.to(cache_dtype), slots


def _check_written(cache, expected_rows, slots):
    # Independent view of the layout: the cache flattened to [num_blocks * block_size, Hk, D].
    flat = cache.float().flatten(0, 1)
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert_equal(flat[s], expected_rows[t], name=f"slot {s} (token {t})")
            written[s] = True
    assert bool(flat[~written].isnan().all()), "a slot that was not in slot_mapping was written"


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(dtype, case, strided):
    key, value, key_cache, value_cache, slots = _setup(case, dtype, dtype, strided)
    assert ak.reshape_and_cache(key, value, key_cache, value_cache, slots) is None
    _check_written(key_cache, key.float(), slots)
    _check_written(value_cache, value.float(), slots)


@pytest.mark.parametrize("scale_as_tensor", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reshape_and_cache_fp8(dtype, scale_as_tensor):
    fp8 = torch.float8_e4m3fn
    key, value, key_cache, value_cache, slots = _setup(CASES[1], dtype, fp8, False)
    key = key * 100  # some values beyond 448 * k_scale, to exercise the clamp
    k_scale, v_scale = 0.25, 0.0125
    if scale_as_tensor:
        k_arg, v_arg = torch.tensor([k_scale]), torch.tensor(v_scale)
    else:
        k_arg, v_arg = k_scale, v_scale
    ak.reshape_and_cache(key, value, key_cache, value_cache, slots, k_arg, v_arg)
    expected_k = (key.double() / k_scale).clamp(-448, 448).to(fp8).float()
    expected_v = (value.double() / v_scale).clamp(-448, 448).to(fp8).float()
    assert bool((key.double().abs() / k_scale > 448).any())
    _check_written(key_cache, expected_k, slots)
    _check_written(value_cache, expected_v, slots)
    # Dequantized values are within fp8 e4m3 precision (3 mantissa bits) of the clamped inputs.
    written = slots >= 0
    blocks, offsets = slots[written] // key_cache.shape[1], slots[written] % key_cache.shape[1]
    dequant_v = value_cache[blocks, offsets].float() * v_scale
    assert_close(dequant_v, value[written].float(), atol=v_scale * 2**-6, rtol=2**-4, name="v")


def test_int32_slot_mapping():
    key, value, key_cache, value_cache, slots = _setup(
        CASES[0], torch.float32, torch.float32, False
    )
    ak.reshape_and_cache(key, value, key_cache, value_cache, slots.int())
    _check_written(key_cache, key, slots)


def test_bad_arguments():
    key, value, key_cache, value_cache, slots = _setup(
        CASES[1], torch.float32, torch.float32, False
    )
    with pytest.raises(ValueError, match=r"reshape_and_cache: slot_mapping has shape \(10,\)"):
        ak.reshape_and_cache(key, value, key_cache, value_cache, slots[:10])
    with pytest.raises(ValueError, match="reshape_and_cache: key has shape"):
        ak.reshape_and_cache(key[..., :5], value, key_cache, value_cache, slots)
    with pytest.raises(ValueError, match="reshape_and_cache: value_cache has dtype"):
        ak.reshape_and_cache(key, value, key_cache, value_cache.half(), slots)
    fp8_k, fp8_v = key_cache.to(torch.float8_e4m3fn), value_cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        ak.reshape_and_cache(key, value, fp8_k, fp8_v, slots)
    with pytest.raises(ValueError, match="k_scale must be per-tensor"):
        ak.reshape_and_cache(key, value, fp8_k, fp8_v, slots, torch.ones(2), 1.0)
