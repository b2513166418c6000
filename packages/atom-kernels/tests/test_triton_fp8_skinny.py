"""The weight-only block-FP8 GEMM for a few rows (`backends/triton/fp8_skinny.py`) against the
torch reference (`fp8_block_linear`: the weight dequantized to x's dtype, then the GEMM)."""

import pytest
import torch

from atom_kernels.backends.torch import quant as reference
from atom_kernels.testing import assert_close, tolerances


def _weights(n, k, block, seed):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    groups = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(groups, generator=g) * 1e-3 + 1e-4
    return weight, scale


# (rows, N, K, block): one row and 2-8 rows (dots); N past a scale block; K of whole groups and
# of a partial last group; several groups a tile (one row)
@pytest.mark.parametrize(
    ("rows", "n", "k", "block"),
    [
        (1, 40, 256, (128, 128)),
        (1, 100, 320, (64, 32)),
        (3, 40, 256, (16, 64)),
        (8, 24, 96, (128, 32)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_reference(triton_backend, rows, n, k, block, dtype, bias):
    from atom_kernels.backends.triton import fp8_skinny

    device = triton_backend.device
    weight, scale = _weights(n, k, block, seed=rows + n)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = reference.fp8_block_linear(x, weight, scale, block, b)
    configs = [None, fp8_skinny.Fp8SkinnyConfig(8, 2, 4)] if rows == 1 else [None]
    for config in configs:  # the default tile, and two scale groups a tile at one row
        got = fp8_skinny.fp8_block_skinny_linear(
            x.to(device), weight.to(device), scale.to(device), block,
            None if b is None else b.to(device), config,
        )  # fmt: skip
        atol, rtol = tolerances(dtype)
        assert got.shape == (rows, n) and got.dtype == dtype
        assert_close(got, want.to(device), atol=atol * 4, rtol=rtol, name=f"{config}")


def test_takes_only_when_switched_on(triton_backend, monkeypatch):
    from atom_kernels.backends.triton import fp8_skinny

    x = torch.zeros(2, 256, dtype=torch.bfloat16, device=triton_backend.device)
    weight = torch.zeros(16, 256, dtype=torch.float8_e4m3fn)
    monkeypatch.setattr(fp8_skinny, "ENABLED", False)
    assert not fp8_skinny.takes(x, weight, (128, 128))
    monkeypatch.setattr(fp8_skinny, "ENABLED", True)
    assert fp8_skinny.takes(x, weight, (128, 128)) == x.is_cuda
    assert not fp8_skinny.takes(x, weight, (128, 96))  # not a power of two
    assert not fp8_skinny.takes(torch.zeros(9, 256, device=x.device), weight, (128, 128))
