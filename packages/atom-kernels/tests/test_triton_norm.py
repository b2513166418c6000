"""Triton rms_norm / fused_add_rms_norm against the torch reference (interpreted on CPU, compiled
on a GPU; see conftest.py)."""

import pytest
import torch

from atom_kernels.backends.torch import norm as reference
from atom_kernels.testing import assert_close, assert_equal, strided_copy, tolerances

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(4, 64), (5, 123), (2, 3, 17)]


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    return x.to(device), weight.to(device)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(triton_backend, dtype, shape, strided):
    x, weight = _inputs(shape, dtype, triton_backend.device)
    if strided:
        x = strided_copy(x)
    out = triton_backend.custom_ops.rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    atol, rtol = tolerances(dtype)
    assert_close(out, reference.rms_norm(x, weight, 1e-6), atol=atol, rtol=rtol, name="rms_norm")


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(triton_backend, dtype, shape, strided):
    x, weight = _inputs(shape, dtype, triton_backend.device)
    residual, _ = _inputs(shape, dtype, triton_backend.device, seed=7)
    if strided:
        x, residual = strided_copy(x), strided_copy(residual)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = triton_backend.custom_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    expected, expected_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_equal(new_residual, expected_residual, name="new_residual")
    atol, rtol = tolerances(dtype)
    assert_close(out, expected, atol=atol, rtol=rtol, name="out")
    assert_equal(x, x_before, name="x unchanged")
    assert_equal(residual, residual_before, name="residual unchanged")


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_in_place(triton_backend, dtype, shape, strided):
    # Contiguous rows: the kernel overwrites x and residual; strided ones: computed, copied back.
    x, weight = _inputs(shape, dtype, triton_backend.device)
    residual, _ = _inputs(shape, dtype, triton_backend.device, seed=7)
    if strided:
        x, residual = strided_copy(x), strided_copy(residual)
    expected, expected_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
    assert triton_backend.custom_ops.fused_add_rms_norm_(x, residual, weight, 1e-6) is None
    assert (x.data_ptr(), residual.data_ptr()) == (x_ptr, residual_ptr)
    assert_equal(residual, expected_residual, name="residual")
    atol, rtol = tolerances(dtype)
    assert_close(x, expected, atol=atol, rtol=rtol, name="x")


@pytest.mark.parametrize(("rows", "num_warps"), [(2, 4), (4, 8)])
@pytest.mark.parametrize("residual", [False, True])
def test_several_rows_a_program(triton_backend, rows, num_warps, residual):
    # ROWS rows a program (benchmarks' launch option): 7 rows leave the last program a partial
    # block, whose masked rows must neither be stored nor disturb the others' statistics.
    from atom_kernels.backends.triton import norm

    x, weight = _inputs((7, 123), torch.bfloat16, triton_backend.device)
    res, _ = _inputs((7, 123), torch.bfloat16, triton_backend.device, seed=7)
    config = {"ROWS": rows, "num_warps": num_warps}
    out, new_res = norm._launch(x, res if residual else None, weight, 1e-6, config)
    if residual:
        expected, expected_res = reference.fused_add_rms_norm(x, res, weight, 1e-6)
        assert_equal(new_res, expected_res, name="new_residual")
    else:
        expected = reference.rms_norm(x, weight, 1e-6)
    atol, rtol = tolerances(torch.bfloat16)
    assert_close(out, expected, atol=atol, rtol=rtol, name="out")


@pytest.mark.parametrize("rows", [1, 2])
def test_in_place_launch(triton_backend, rows):
    # INPLACE (benchmarks' launch option): the outputs overwrite x and residual, equal to the
    # out-of-place results.
    from atom_kernels.backends.triton import norm

    x, weight = _inputs((7, 123), torch.bfloat16, triton_backend.device)
    res, _ = _inputs((7, 123), torch.bfloat16, triton_backend.device, seed=7)
    expected, expected_res = norm._launch(x, res, weight, 1e-6)
    out, new_res = norm._launch(x, res, weight, 1e-6, {"INPLACE": True, "ROWS": rows})
    assert out.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()
    assert_equal(out, expected, name="out")
    assert_equal(new_res, expected_res, name="new_residual")


def test_fp32_weight_bf16_x(triton_backend):
    x, _ = _inputs((3, 32), torch.bfloat16, triton_backend.device)
    weight = torch.rand(32, device=triton_backend.device) + 0.5
    out = triton_backend.custom_ops.rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.bfloat16
    assert_close(out, reference.rms_norm(x, weight, 1e-6), atol=1.6e-2, rtol=1.6e-2)


def test_empty_rows(triton_backend):
    x, weight = _inputs((0, 16), torch.float32, triton_backend.device)
    out, res = triton_backend.custom_ops.fused_add_rms_norm(x, x, weight, 1e-6)
    assert out.shape == (0, 16) and res.shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [4096, 5120, 8192])
def test_rms_norm_gpu_real_sizes(triton_backend, hidden):
    x, weight = _inputs((4096, hidden), torch.bfloat16, "cuda", seed=1)
    residual, _ = _inputs((4096, hidden), torch.bfloat16, "cuda", seed=2)
    out, new_residual = triton_backend.custom_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected, expected_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_equal(new_residual, expected_residual, name="new_residual")
    assert_close(out, expected, atol=1.6e-2, rtol=1.6e-2, name="out")
    assert_close(
        triton_backend.custom_ops.rms_norm(x, weight, 1e-5),
        reference.rms_norm(x, weight, 1e-5),
        atol=1.6e-2,
        rtol=1.6e-2,
        name="rms_norm",
    )
