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


def test_takes_what_the_switch_says(triton_backend, monkeypatch):
    """`0`: never; `1`: 1-8 rows; `auto`: one row of a weight of at most AUTO_MAX_WEIGHTS."""
    from atom_kernels.backends.triton import fp8_skinny

    x = torch.zeros(2, 256, dtype=torch.bfloat16, device=triton_backend.device)
    weight = torch.zeros(16, 256, dtype=torch.float8_e4m3fn)
    monkeypatch.setattr(fp8_skinny, "MODE", "0")
    assert not fp8_skinny.takes(x, weight, (128, 128))
    assert not fp8_skinny.takes(x[:1], weight, (128, 128))
    monkeypatch.setattr(fp8_skinny, "MODE", "auto")
    assert not fp8_skinny.takes(x, weight, (128, 128))  # two rows
    assert fp8_skinny.takes(x[:1], weight, (128, 128)) == x.is_cuda
    monkeypatch.setattr(fp8_skinny, "AUTO_MAX_WEIGHTS", weight.numel() - 1)
    assert not fp8_skinny.takes(x[:1], weight, (128, 128))  # a larger weight
    monkeypatch.setattr(fp8_skinny, "MODE", "1")
    assert fp8_skinny.takes(x, weight, (128, 128)) == x.is_cuda
    assert not fp8_skinny.takes(x, weight, (128, 96))  # not a power of two
    assert not fp8_skinny.takes(torch.zeros(9, 256, device=x.device), weight, (128, 128))


# DeepSeek-V3's block-FP8 projections (N, K) at one row: the ones ATOM_FP8_SKINNY=auto takes
# (q_a, kv_a, shared gate_up / down: at most 2**25 weights) and two it leaves to the w8a8 path.
DEEPSEEK_V3 = [(1536, 7168), (576, 7168), (4096, 7168), (7168, 2048), (24576, 1536), (7168, 16384)]


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), DEEPSEEK_V3)
def test_gpu_default_dispatch_at_deepseek_shapes(triton_backend, monkeypatch, n, k):
    """`fp8_block_linear` at one row on a GPU (the default `auto`: this kernel for the smaller
    weights, within x's rounding of the weight-only reference; the w8a8 path for the others,
    within its activation quantization)."""
    from atom_kernels.backends.triton import fp8_skinny, quant

    monkeypatch.setattr(fp8_skinny, "MODE", "auto")
    weight, scale = _weights(n, k, (128, 128), seed=n)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    want = reference.fp8_block_linear(x, weight, scale, (128, 128), None)
    weight, scale, x = weight.cuda(), scale.cuda(), x.cuda()
    skinny = n * k <= fp8_skinny.AUTO_MAX_WEIGHTS
    assert fp8_skinny.takes(x, weight, (128, 128)) == skinny
    got = quant.fp8_block_linear(x, weight, scale, (128, 128), None)
    atol, rtol = tolerances(torch.bfloat16)
    atol, rtol = (atol * 4, rtol) if skinny else (0.15 * want.abs().max().item(), 0.05)
    assert_close(got, want.cuda(), atol=atol, rtol=rtol, name=f"{n}x{k}")
