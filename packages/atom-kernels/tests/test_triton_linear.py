"""Triton skinny GEMM (the linear op's decode path) against torch.nn.functional.linear."""

import pytest
import torch
import torch.nn.functional as F

from atom_kernels.backends.triton import linear as triton_linear
from atom_kernels.backends.triton.common import zeroed_counters
from atom_kernels.backends.triton.linear import SkinnyConfig
from atom_kernels.testing import assert_close

# (rows, N, K): one row and several; K a multiple of the tile and not; N not a multiple of BLOCK_N
SHAPES = [(1, 48, 64), (1, 37, 100), (3, 64, 96), (8, 40, 64), (16, 33, 70), (2, 3, 5)]
CONFIGS = [
    SkinnyConfig(16, 32, 4, 1),
    SkinnyConfig(32, 64, 4, 2),
    SkinnyConfig(16, 32, 4, 1, False),
    SkinnyConfig(16, 32, 4, 1, True, split_k=3),  # K = 64 / 70: the last split short or empty
    SkinnyConfig(16, 16, 4, 1, False, split_k=2),
    # the next W tile loaded ahead (one row, K a multiple of 32; other shapes: the plain loop)
    SkinnyConfig(16, 32, 4, 1, False, prefetch=True),
    SkinnyConfig(8, 16, 4, 1, False, split_k=3, prefetch=True),
]


def _inputs(rows, n, k, dtype, device, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def _expected(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize(
    "config",
    CONFIGS,
    ids=lambda c: (
        f"{c.block_n}x{c.block_k}-dot{c.use_dot}-split{c.split_k}"
        + ("-ahead" if c.prefetch else "")
    ),
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_linear(triton_backend, dtype, shape, bias, config):
    rows, n, k = shape
    x, w, b = _inputs(rows, n, k, dtype, triton_backend.device, bias)
    out = triton_linear.skinny_linear(x, w, b, config)
    assert out.shape == (rows, n) and out.dtype == dtype
    # fp32 accumulation of 16-bit products: the only rounding is the output's
    assert_close(out.float(), _expected(x, w, b), atol=2e-2, rtol=1.6e-2, name="skinny_linear")


def test_skinny_linear_split_k_is_deterministic_and_resets_its_counters(triton_backend):
    # 3 N tiles x 4 splits: each tile's last program sums the partials and zeroes its counter,
    # so a second call (as a graph replay) finds the counters ready and gives the same bits.
    x, w, b = _inputs(1, 40, 256, torch.bfloat16, triton_backend.device, True)
    config = SkinnyConfig(16, 32, 4, 1, False, split_k=4)
    first = triton_linear.skinny_linear(x, w, b, config)
    counters = zeroed_counters(x.device, 3)
    assert int(counters.abs().sum()) == 0
    again = triton_linear.skinny_linear(x, w, b, config)
    assert torch.equal(first, again)
    assert_close(first.float(), _expected(x, w, b), atol=2e-2, rtol=1.6e-2)
    # the same sum split 1 way: the fp32 accumulations differ only in order
    single = triton_linear.skinny_linear(x, w, b, SkinnyConfig(16, 32, 4, 1, False))
    assert_close(first.float(), single.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "config",
    [
        SkinnyConfig(16, 32, 4, 1, block_m=16),
        SkinnyConfig(16, 32, 4, 1, split_k=3, block_m=32),  # K = 70: the last split short
    ],
    ids=["m16", "m32-split3"],
)
@pytest.mark.parametrize("rows", [17, 40, 64])
def test_skinny_linear_tiles_rows(triton_backend, rows, config):
    # More rows than a program's block_m: the grid's third axis takes the row tiles (the last
    # one partly masked), each (row tile, N tile) with its own split-K counter.
    x, w, b = _inputs(rows, 33, 70, torch.bfloat16, triton_backend.device, True)
    out = triton_linear.skinny_linear(x, w, b, config)
    assert out.shape == (rows, 33)
    assert_close(out.float(), _expected(x, w, b), atol=2e-2, rtol=1.6e-2, name="row tiles")
    tiles = triton_linear.triton.cdiv(rows, config.block_m) * 3
    assert int(zeroed_counters(x.device, tiles).abs().sum()) == 0
    again = triton_linear.skinny_linear(x, w, b, config)  # counters ready: the same bits
    assert torch.equal(out, again)


def test_split_k_policy():
    # few N tiles: split K to about two programs per SM; enough tiles: no split
    one_row = SkinnyConfig(16, 512, 4, 5, use_dot=False)
    assert triton_linear.split_k_for(1024, 2048, one_row, 132) == 4  # 64 tiles, 4 K tiles
    assert triton_linear.split_k_for(1024, 3072, one_row, 132) == 5
    assert triton_linear.split_k_for(4096, 4096, one_row, 132) == 1
    assert triton_linear.split_k_for(1024, 256, one_row, 132) == 1  # one K tile


def test_skinny_linear_leading_dims_and_strided_x(triton_backend):
    x, w, b = _inputs(4, 24, 40, torch.bfloat16, triton_backend.device, True)
    x3 = x.view(2, 2, 40)
    out = triton_linear.skinny_linear(x3, w, b, CONFIGS[0])
    assert out.shape == (2, 2, 24)
    assert_close(out.float().view(4, 24), _expected(x, w, b), atol=2e-2, rtol=1.6e-2)
    wide = torch.zeros(4, 80, dtype=x.dtype, device=x.device)
    wide[:, ::2] = x  # x with a last-dim stride of 2
    out = triton_linear.skinny_linear(wide[:, ::2], w, None, CONFIGS[1])
    assert_close(out.float(), _expected(x, w, None), atol=2e-2, rtol=1.6e-2)


def test_skinny_linear_empty(triton_backend):
    x, w, b = _inputs(2, 8, 16, torch.bfloat16, triton_backend.device, True)
    assert triton_linear.skinny_linear(x[:0], w, b).shape == (0, 8)
    out = triton_linear.skinny_linear(x[:, :0], w[:, :0], b)
    assert torch.equal(out, b.expand(2, 8))


def test_linear_op_routes_by_rows(triton_backend):
    # Interpreted runs keep F.linear for every shape: the registered op equals the reference.
    x, w, b = _inputs(3, 16, 32, torch.float32, triton_backend.device, True)
    out = triton_backend.custom_ops.linear_op(x, w, b)
    assert torch.equal(out, F.linear(x, w, b))


def test_use_skinny_policy():
    sms, bf16 = 132, torch.bfloat16
    most = triton_linear.SKINNY_MAX_ROWS
    assert triton_linear.use_skinny(1, 4096, 4096, bf16, sms)
    assert triton_linear.use_skinny(most, 4096, 4096, torch.float16, sms)
    assert not triton_linear.use_skinny(most + 1, 4096, 4096, bf16, sms)
    assert not triton_linear.use_skinny(1, 4096, 4096, torch.float32, sms)
    # too few programs for the plain kernel: the split-K one, unless turned off
    assert not triton_linear.use_skinny(1, 1024, 14336, bf16, sms)  # split-K off: cuBLAS
    assert triton_linear.use_skinny(1, 1024, 14336, bf16, sms, split_k=True)
    assert triton_linear.use_skinny(1, 1024, 3072, bf16, sms, split_k=True)  # 6 MB
    assert not triton_linear.use_skinny(1, 1024, 512, bf16, sms, split_k=True)  # 1 MB
    assert not triton_linear.use_skinny(1, 1024, 512, bf16, sms)  # 1 MB: cuBLAS
    assert not triton_linear.use_skinny(1, 4096, 1024, bf16, sms)  # a small weight
    assert triton_linear.use_skinny(1, 151936, 1024, bf16, sms)  # an LM head
    assert not triton_linear.use_skinny(0, 4096, 4096, bf16, sms)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("nk", [(6144, 4096), (4096, 14336), (28672, 4096), (128256, 4096)])
def test_skinny_linear_gpu_real_sizes(triton_backend, rows, nk):
    # Llama-3-8B: qkv, down, gate_up, LM head
    n, k = nk
    x, w, b = _inputs(rows, n, k, torch.bfloat16, "cuda", False)
    out = triton_linear.skinny_linear(x, w, b)
    assert_close(out.float(), _expected(x, w, b), atol=3e-2, rtol=1.6e-2)
