"""silu_and_mul / gelu_and_mul against closed forms in fp64."""

import math

import pytest
import torch

import atom_kernels as ak
from atom_kernels.testing import assert_close, strided_copy, tolerances

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(4, 2 * 64), (5, 2 * 123), (2, 3, 2 * 7)]


def _x(shape, dtype, strided):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 2.5).to(dtype)
    return strided_copy(x) if strided else x


def _naive(x, fn):
    n = x.shape[-1] // 2
    gate, up = x[..., :n].double().contiguous(), x[..., n:].double()
    return gate.apply_(fn) * up  # apply_: the Python function, element by element


def _silu(v):
    return v / (1.0 + math.exp(-v))


def _gelu_erf(v):
    return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))


def _gelu_tanh(v):
    return 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, shape, strided):
    x = _x(shape, dtype, strided)
    out = ak.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    atol, rtol = tolerances(dtype)
    assert_close(out, _naive(x, _silu), atol=atol, rtol=rtol, name="silu_and_mul")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_and_mul(dtype, shape, strided, approximate):
    x = _x(shape, dtype, strided)
    out = ak.gelu_and_mul(x, approximate=approximate)
    fn = _gelu_erf if approximate == "none" else _gelu_tanh
    atol, rtol = tolerances(dtype)
    assert_close(out, _naive(x, fn), atol=atol, rtol=rtol, name=f"gelu_and_mul({approximate})")


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"silu_and_mul: x has shape \(3, 5\); its last dim"):
        ak.silu_and_mul(torch.randn(3, 5))
    with pytest.raises(ValueError, match="gelu_and_mul: approximate"):
        ak.gelu_and_mul(torch.randn(3, 4), approximate="erf")
    with pytest.raises(ValueError, match="silu_and_mul: x has dtype torch.int64"):
        ak.silu_and_mul(torch.ones(3, 4, dtype=torch.int64))
