"""Integer-quantized ops on the torch reference against computations written here from the layout
spec (``atom_kernels.ops.int_quant``): WNA16 packing by hand, element-by-element dequantization,
per-token int8 quantization with ties rounded to even, and the argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import atom_kernels as ak
from atom_kernels.testing import assert_close, assert_equal

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [N, K] -> int32 [N, K * bits / 32]: 32 / bits consecutive k per word, the
    first in the lowest bits (the spec), written word by word in Python integers."""
    n, k = values.shape
    per_int = 32 // bits
    words = []
    for row in values.tolist():
        out = []
        for start in range(0, k, per_int):
            word = sum(v << (bits * j) for j, v in enumerate(row[start : start + per_int]))
            out.append(word - (1 << 32) if word >= 1 << 31 else word)  # as a signed int32
        words.append(out)
    return torch.tensor(words, dtype=torch.int32).reshape(n, k // per_int)


def wna16_case(n, k, bits, groups, zeros, g_idx, seed, dtype=torch.float32):
    """(qweight, scales, zeros, g_idx, the weight [N, K] in float64 computed per element)."""
    values = torch.randint(0, 1 << bits, (n, k), generator=_gen(seed))
    scales = (torch.rand(n, groups, generator=_gen(seed + 1)) + 0.5) / (k**0.5 * (1 << bits))
    scales = scales.to(dtype)
    zero = (
        torch.randint(0, 1 << bits, (n, groups), generator=_gen(seed + 2)).to(dtype)
        if zeros
        else None
    )
    gi = (
        torch.randint(0, groups, (k,), generator=_gen(seed + 3), dtype=torch.int32)
        if g_idx
        else None
    )
    weight = torch.empty(n, k, dtype=torch.float64)
    for c in range(k):
        g = int(gi[c]) if gi is not None else c // (k // groups)
        z = zero[:, g].double() if zero is not None else 2.0 ** (bits - 1)
        weight[:, c] = (values[:, c].double() - z) * scales[:, g].double()
    return pack(values, bits), scales, zero, gi, weight


def test_pack_is_lowest_bits_first():
    # 4-bit 1..8 in one word: 0x87654321; 8-bit 1, 2, 3, 250: 0xFA030201 (negative as int32)
    assert pack(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), 4).item() == 0x87654321 - (1 << 32)
    assert pack(torch.tensor([[1, 2, 3, 250]]), 8).item() == 0xFA030201 - (1 << 32)
    # and the reference unpacks them in that order
    qweight = pack(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), 4)
    scales = torch.ones(1, 1)
    expected = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]) - 8.0  # symmetric zero 2**3
    assert_equal(ak.dequantize_wna16(qweight, scales, None, None, 4), expected)


# (bits, N, K, G, zeros, g_idx): groups of 32 / 64 / 128, channel-wise, GPTQ's act-order
WNA16_CASES = [
    (4, 24, 256, 8, False, False), (4, 24, 256, 4, True, False), (4, 16, 256, 2, False, False),
    (4, 12, 96, 1, True, False), (4, 20, 128, 4, True, True), (8, 24, 256, 8, False, False),
    (8, 10, 192, 3, True, False), (8, 9, 60, 1, False, False), (8, 16, 128, 2, True, True),
    (4, 16, 128, 4, False, True),
]  # fmt: skip


@pytest.mark.parametrize(("bits", "n", "k", "groups", "zeros", "g_idx"), WNA16_CASES)
def test_dequantize_wna16_is_the_spec(bits, n, k, groups, zeros, g_idx):
    qweight, scales, zero, gi, expected = wna16_case(n, k, bits, groups, zeros, g_idx, seed=k + n)
    out = ak.dequantize_wna16(qweight, scales, zero, gi, bits)
    assert out.dtype == torch.float32 and out.shape == (n, k)
    assert_close(out.double(), expected, atol=0.0, rtol=1e-6)  # one fp32 rounding
    out16 = ak.dequantize_wna16(qweight, scales, zero, gi, bits, torch.bfloat16)
    assert_equal(out16, expected.float().to(torch.bfloat16))


@pytest.mark.parametrize(("bits", "n", "k", "groups", "zeros", "g_idx"), WNA16_CASES[::3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_wna16_linear_is_the_dequantized_linear(bits, n, k, groups, zeros, g_idx, dtype):
    qweight, scales, zero, gi, weight = wna16_case(n, k, bits, groups, zeros, g_idx, 7, dtype)
    x = torch.randn(2, 3, k, generator=_gen(8)).to(dtype)
    bias = torch.randn(n, generator=_gen(9)).to(dtype)
    out = ak.wna16_linear(x, qweight, scales, zero, gi, bits, bias)
    assert out.dtype == dtype and out.shape == (2, 3, n)
    # the weight in x's dtype (one rounding of the exact value), then the float linear
    assert_equal(out, F.linear(x, weight.float().to(dtype), bias))
    # and against float64 throughout, within the dtype's rounding
    exact = x.double() @ weight.T + bias.double()
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    assert_close(out.double(), exact, atol=tol, rtol=tol)


def test_int8_quantization_rounds_ties_to_even_and_saturates():
    # max |x| = 127 -> scale 1: x / scale is x itself; ties 0.5, 1.5, 2.5, -2.5 go to even
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -126.6]])
    w = torch.eye(8, dtype=torch.int8)
    out = ak.int8_linear(x, w, torch.ones(8))
    assert_equal(out, torch.tensor([[127.0, 0, 2, 2, 0, -2, 4, -127]]))
    # a static scale of 0.5: 100 / 0.5 = 200 saturates to 127, -300 / 0.5 to -128; ties 1.5,
    # -2.5, 0.5, -0.5 to 2, -2, 0, 0
    x = torch.tensor([[100.0, -300.0, 0.75, -1.25, 1.0, 0.0, 0.25, -0.25]])
    out = ak.int8_linear(x, w, torch.ones(8), torch.tensor([0.5]))
    assert_equal(out, torch.tensor([[63.5, -64.0, 1.0, -1.0, 1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
def test_int8_linear_is_the_int_product_scaled(dtype, static):
    rows, n, k = 5, 12, 80
    x = (torch.randn(rows, k, generator=_gen(1)) * 3).to(dtype)
    w = torch.randint(-128, 128, (n, k), generator=_gen(2), dtype=torch.int8)
    w_scale = torch.rand(n, generator=_gen(3)) / 100 + 1e-3
    bias = torch.randn(n, generator=_gen(4)).to(dtype)
    input_scale = torch.tensor([0.02]) if static else None
    out = ak.int8_linear(x, w, w_scale, input_scale, bias)
    # per row, written out: the scale, the quantized row, the integer dot products
    expected = torch.empty(rows, n, dtype=torch.float64)
    for r in range(rows):
        xr = x[r].float()
        scale = input_scale[0] if static else xr.abs().max() / 127.0
        q = torch.clamp(torch.round(xr / scale), -128, 127).long()
        acc = (q[None, :] * w.long()).sum(dim=1)  # exact integers
        expected[r] = acc.double() * scale.double() * w_scale.double()
    expected = (expected.float() + bias.float()).to(dtype)
    assert_equal(out, expected)


def test_int8_linear_zero_row_is_zero():
    w = torch.randint(-128, 128, (4, 16), generator=_gen(5), dtype=torch.int8)
    out = ak.int8_linear(torch.zeros(2, 16), w, torch.ones(4))
    assert_equal(out, torch.zeros(2, 4))


# --- argument checks ------------------------------------------------------------------------------


def _wna16_args():
    x = torch.randn(2, 64)
    return dict(x=x, qweight=torch.zeros(8, 8, dtype=torch.int32), scales=torch.ones(8, 2),
                zeros=None, g_idx=None, bits=4, bias=None)  # fmt: skip


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (dict(bits=3), "bits must be one of"),
        (dict(bits=True), "bits must be one of"),
        (dict(qweight=torch.zeros(8, 8)), "qweight has dtype torch.float32"),
        (dict(qweight=torch.zeros(8, 7, dtype=torch.int32)), r"qweight has shape \(8, 7\)"),
        (dict(scales=torch.ones(8, 3)), "scales has 3 groups along K = 64"),
        (dict(scales=torch.ones(7, 2)), r"scales has shape \(7, 2\)"),
        (dict(scales=torch.ones(8, 2, dtype=torch.float16)), "scales has dtype torch.float16"),
        (dict(zeros=torch.ones(8, 2, dtype=torch.float16)), "zeros has dtype torch.float16"),
        (dict(zeros=torch.ones(8, 1)), r"zeros has shape \(8, 1\)"),
        (dict(g_idx=torch.zeros(64)), "g_idx has dtype torch.float32"),
        (dict(g_idx=torch.zeros(60, dtype=torch.int32)), r"g_idx has shape \(60,\)"),
        (dict(bias=torch.ones(9)), r"bias has shape \(9,\)"),
        (dict(x=torch.randn(2, 4), qweight=torch.zeros(8, 1, dtype=torch.int32),
              scales=torch.ones(8, 1)), "K = 4 is not a multiple of 8"),
        (dict(x=torch.randn(2, 64).to(torch.int32)), "x has dtype torch.int32"),
    ],
)  # fmt: skip
def test_wna16_linear_argument_errors(mutate, message):
    args = {**_wna16_args(), **mutate}
    with pytest.raises(ValueError, match=f"wna16_linear: {message}"):
        ak.wna16_linear(**args)


def test_wna16_g_idx_lifts_the_group_multiple():
    # with g_idx the groups need not split K evenly: 3 groups over K = 64
    qweight = torch.zeros(4, 8, dtype=torch.int32)  # all values 0: weight = -8 * scale
    g_idx = (torch.arange(64) % 3).to(torch.int32)
    scales = torch.tensor([[1.0, 2.0, 4.0]]).expand(4, 3).contiguous()
    out = ak.dequantize_wna16(qweight, scales, None, g_idx, 4)
    assert_equal(out, (-8.0 * scales[:, g_idx.long()]))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (dict(input_scale=torch.ones(2)), "input_scale must be per-tensor"),
        (dict(input_scale=torch.ones(1, dtype=torch.float16)), "input_scale has dtype"),
        (dict(weight=torch.zeros(8, 64, dtype=torch.uint8)), "weight has dtype torch.uint8"),
        (dict(weight=torch.zeros(8, 63, dtype=torch.int8)), r"weight has shape \(8, 63\)"),
        (dict(weight_scale=torch.ones(8).half()), "weight_scale has dtype torch.float16"),
        (dict(weight_scale=torch.ones(7)), r"weight_scale has shape \(7,\)"),
        (dict(bias=torch.ones(8).half()), "bias has dtype torch.float16"),
    ],
)  # fmt: skip
def test_int8_linear_argument_errors(mutate, message):
    args = dict(x=torch.randn(2, 64), weight=torch.zeros(8, 64, dtype=torch.int8),
                weight_scale=torch.ones(8), input_scale=None, bias=None)  # fmt: skip
    with pytest.raises(ValueError, match=f"int8_linear: {message}"):
        ak.int8_linear(**{**args, **mutate})


def test_dequantize_wna16_argument_errors():
    qweight, scales = torch.zeros(8, 8, dtype=torch.int32), torch.ones(8, 2)
    with pytest.raises(ValueError, match="dequantize_wna16: dtype must be a float dtype"):
        ak.dequantize_wna16(qweight, scales, None, None, 4, torch.int32)
    with pytest.raises(ValueError, match="dequantize_wna16: bits must be one of"):
        ak.dequantize_wna16(qweight, scales, None, None, 5)
    with pytest.raises(ValueError, match="dequantize_wna16: qweight has dtype torch.int64"):
        ak.dequantize_wna16(qweight.long(), scales, None, None, 4)
