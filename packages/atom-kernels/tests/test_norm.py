"""rms_norm / fused_add_rms_norm against a naive fp64 formulation (HF Llama rounding points)."""

import pytest
import torch

import atom_kernels as ak
from atom_kernels.testing import assert_close, assert_equal, strided_copy, tolerances

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(4, 64), (5, 123), (2, 3, 17)]


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Row by row in fp64; the normalized row rounds to x's dtype before the weight multiply (HF).
    rows = x.reshape(-1, x.shape[-1]).double()
    out = torch.empty_like(rows)
    for i, row in enumerate(rows):
        rms = (sum(v * v for v in row.tolist()) / row.numel() + eps) ** 0.5
        out[i] = (row / rms).to(x.dtype).double() * weight.double()
    return out.reshape(x.shape)


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    return x, weight


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, shape, strided):
    x, weight = _inputs(shape, dtype)
    if strided:
        x = strided_copy(x)
    out = ak.rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    atol, rtol = tolerances(dtype)
    assert_close(out, naive_rms_norm(x, weight, 1e-6), atol=atol, rtol=rtol, name="rms_norm")


def test_rms_norm_matches_hf_llama():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in DTYPES:
        x, weight = _inputs((5, 123), dtype, seed=1)
        hf = LlamaRMSNorm(123, eps=1e-5).to(dtype)
        hf.weight.data.copy_(weight)
        assert_equal(ak.rms_norm(x, weight, 1e-5), hf(x), name=f"rms_norm vs HF ({dtype})")


def test_rms_norm_fp32_weight_bf16_x_returns_x_dtype():
    x, _ = _inputs((3, 32), torch.bfloat16)
    weight = torch.rand(32) + 0.5
    out = ak.rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.bfloat16
    assert_close(out, naive_rms_norm(x, weight, 1e-6), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype, shape, strided):
    x, weight = _inputs(shape, dtype)
    residual, _ = _inputs(shape, dtype, seed=7)
    if strided:
        x, residual = strided_copy(x), strided_copy(residual)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = ak.fused_add_rms_norm(x, residual, weight, 1e-6)
    expected_residual = (x.double() + residual.double()).to(dtype)
    assert_equal(new_residual, expected_residual, name="new_residual")
    atol, rtol = tolerances(dtype)
    expected = naive_rms_norm(expected_residual, weight, 1e-6)
    assert_close(out, expected, atol=atol, rtol=rtol, name="out")
    assert_equal(x, x_before, name="x unchanged")
    assert_equal(residual, residual_before, name="residual unchanged")


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_in_place(dtype, strided):
    x, weight = _inputs((5, 123), dtype)
    residual, _ = _inputs((5, 123), dtype, seed=7)
    if strided:
        x, residual = strided_copy(x), strided_copy(residual)
    expected, expected_residual = ak.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert ak.fused_add_rms_norm_(x, residual, weight, 1e-6) is None
    assert_equal(residual, expected_residual, name="residual")
    assert_equal(x, expected, name="x")


def test_in_place_rejects_shared_memory():
    x, weight = _inputs((4, 64), torch.float32)
    with pytest.raises(ValueError, match="x and residual must not share memory"):
        ak.fused_add_rms_norm_(x, x, weight, 1e-6)


def test_bad_arguments_name_the_argument():
    x, weight = _inputs((4, 64), torch.float32)
    with pytest.raises(ValueError, match=r"rms_norm: weight has shape \(63,\), expected \(64,\)"):
        ak.rms_norm(x, weight[:63], 1e-6)
    with pytest.raises(ValueError, match="rms_norm: x has dtype torch.int64"):
        ak.rms_norm(x.long(), weight, 1e-6)
    with pytest.raises(ValueError, match="fused_add_rms_norm: residual has shape"):
        ak.fused_add_rms_norm(x, x[:3], weight, 1e-6)
    with pytest.raises(ValueError, match="fused_add_rms_norm: residual has dtype"):
        ak.fused_add_rms_norm(x, x.half(), weight, 1e-6)
    with pytest.raises(ValueError, match="eps"):
        ak.rms_norm(x, weight, -1.0)
