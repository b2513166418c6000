"""The public linear op: F.linear semantics and argument checks."""

import pytest
import torch
import torch.nn.functional as F

import atom_kernels


def test_linear_matches_functional_linear():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(5)
    assert torch.equal(atom_kernels.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(atom_kernels.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize(
    "x, w, b, message",
    [
        (torch.randn(2, 8), torch.randn(5, 7), None, "to match x's last dim"),
        (torch.randn(2, 8), torch.randn(5, 8, dtype=torch.bfloat16), None, "dtype"),
        (torch.randn(2, 8), torch.randn(5, 8), torch.randn(4), "to match weight's rows"),
        (torch.randn(2, 8), torch.randn(5, 8, 1), None, "must have 2 dims"),
        (torch.ones(2, 8, dtype=torch.int32), torch.randn(5, 8), None, "expected one of"),
    ],
)
def test_linear_rejects_bad_arguments(x, w, b, message):
    with pytest.raises(ValueError, match=message):
        atom_kernels.linear(x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_silu_and_mul_is_the_two_ops(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, generator=g).to(dtype)
    w, b = torch.randn(10, 8, generator=g).to(dtype), torch.randn(10, generator=g).to(dtype)
    for bias in (b, None):
        expected = atom_kernels.silu_and_mul(atom_kernels.linear(x, w, bias))
        out = atom_kernels.linear_silu_and_mul(x, w, bias)
        assert out.shape == (2, 3, 5) and out.dtype == dtype
        assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "x, w, b, message",
    [
        (torch.randn(2, 8), torch.randn(6, 7), None, "to match x's last dim"),
        (torch.randn(2, 8), torch.randn(5, 8), None, "rows must be even"),
        (torch.randn(2, 8), torch.randn(6, 8, dtype=torch.bfloat16), None, "dtype"),
        (torch.randn(2, 8), torch.randn(6, 8), torch.randn(3), "to match weight's rows"),
        (torch.ones(2, 8, dtype=torch.int32), torch.randn(6, 8), None, "expected one of"),
    ],
)
def test_linear_silu_and_mul_rejects_bad_arguments(x, w, b, message):
    with pytest.raises(ValueError, match=message):
        atom_kernels.linear_silu_and_mul(x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_linear_silu_and_mul_is_the_two_ops(dtype):
    g = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(3, 8, generator=g).to(dtype) for _ in range(2))
    norm_weight, w = torch.randn(8, generator=g).to(dtype), torch.randn(10, 8).to(dtype)
    normed, expected_residual = atom_kernels.fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    expected = atom_kernels.linear_silu_and_mul(normed, w)
    out, new_residual = atom_kernels.fused_add_rms_norm_linear_silu_and_mul(
        x, residual, norm_weight, 1e-6, w
    )
    assert torch.equal(out, expected) and torch.equal(new_residual, expected_residual)


def test_fused_add_rms_norm_linear_silu_and_mul_rejects_bad_arguments():
    x, w = torch.randn(2, 8), torch.randn(6, 8)
    op = atom_kernels.fused_add_rms_norm_linear_silu_and_mul
    with pytest.raises(ValueError, match="to match x"):
        op(x, torch.randn(2, 7), torch.randn(8), 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight"):
        op(x, torch.randn(2, 8), torch.randn(7), 1e-6, w)
    with pytest.raises(ValueError, match="eps"):
        op(x, torch.randn(2, 8), torch.randn(8), -1.0, w)
    with pytest.raises(ValueError, match="rows must be even"):
        op(x, torch.randn(2, 8), torch.randn(8), 1e-6, torch.randn(5, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_linear_is_the_two_ops(dtype):
    g = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(3, 8, generator=g).to(dtype) for _ in range(2))
    norm_weight, w = torch.randn(8, generator=g).to(dtype), torch.randn(5, 8).to(dtype)
    normed, expected_residual = atom_kernels.fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    out, new_residual = atom_kernels.rms_norm_linear(x, residual, norm_weight, 1e-6, w)
    assert torch.equal(out, atom_kernels.linear(normed, w))
    assert torch.equal(new_residual, expected_residual)
    out, new_residual = atom_kernels.rms_norm_linear(x, None, norm_weight, 1e-6, w)
    assert torch.equal(out, atom_kernels.linear(atom_kernels.rms_norm(x, norm_weight, 1e-6), w))
    assert torch.equal(new_residual, x)


def test_rms_norm_linear_rejects_bad_arguments():
    x, w = torch.randn(2, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match="to match x"):
        atom_kernels.rms_norm_linear(x, torch.randn(2, 7), torch.randn(8), 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight"):
        atom_kernels.rms_norm_linear(x, None, torch.randn(7), 1e-6, w)
    with pytest.raises(ValueError, match="to match x's last dim"):
        atom_kernels.rms_norm_linear(x, None, torch.randn(8), 1e-6, torch.randn(5, 7))
