"""Triton silu_and_mul / gelu_and_mul against the torch reference."""

import pytest
import torch

from atom_kernels.backends.torch import activation as reference
from atom_kernels.testing import assert_close, strided_copy, tolerances

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(4, 2 * 64), (5, 2 * 123), (2, 3, 2 * 7), (3, 2 * 1500)]


def _x(shape, dtype, device, strided):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 2.5).to(dtype).to(device)
    x.view(-1)[:2] = torch.tensor([-100.0, 100.0])  # saturated tails of silu / gelu
    return strided_copy(x) if strided else x


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(triton_backend, dtype, shape, strided):
    x = _x(shape, dtype, triton_backend.device, strided)
    out = triton_backend.custom_ops.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    atol, rtol = tolerances(dtype)
    assert_close(out, reference.silu_and_mul(x), atol=atol, rtol=rtol, name="silu_and_mul")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_and_mul(triton_backend, dtype, shape, strided, approximate):
    x = _x(shape, dtype, triton_backend.device, strided)
    out = triton_backend.custom_ops.gelu_and_mul(x, approximate)
    atol, rtol = tolerances(dtype)
    expected = reference.gelu_and_mul(x, approximate)
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"gelu_and_mul({approximate})")


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", [None, "none", "tanh"])
def test_gated_gpu_real_sizes(triton_backend, approximate):
    # Llama-3-8B MLP: 4096 tokens x 2 * 14336
    x = _x((4096, 2 * 14336), torch.bfloat16, "cuda", strided=False)
    if approximate is None:
        out, expected = triton_backend.custom_ops.silu_and_mul(x), reference.silu_and_mul(x)
    else:
        out = triton_backend.custom_ops.gelu_and_mul(x, approximate)
        expected = reference.gelu_and_mul(x, approximate)
    assert_close(out, expected, atol=1.6e-2, rtol=1.6e-2)
