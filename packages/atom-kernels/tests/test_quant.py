"""Quantized-weight ops on the torch reference: dequantization against transformers' own loaders,
FP8 activation quantization against a per-group loop, the quantized GEMMs and fused_moe as exactly
the dequantized model, and the argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import atom_kernels as ak
from atom_kernels.testing import (
    assert_close,
    assert_equal,
    quantize_fp8_block,
    quantize_fp8_channel,
    quantize_mxfp4,
)

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# --- dequantization ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_fp8_block_matches_transformers(dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w, s = quantize_fp8_block(_randn(256, 384, seed=1), (128, 128))
    s = s * torch.rand(s.shape, generator=torch.Generator().manual_seed(2))  # distinct scales
    expected = Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=dtype)
    assert_equal(ak.dequantize_fp8_block(w, s, (128, 128), dtype), expected)


@pytest.mark.parametrize(("shape", "block"), [((576, 200), (128, 128)), ((37, 50), (16, 32))])
def test_dequantize_fp8_block_partial_edge_blocks(shape, block):
    # DeepSeek's kv_a_proj_with_mqa: 576 rows in 128-row blocks (the last one holds 64)
    w, s = quantize_fp8_block(_randn(*shape, seed=3), block)
    out = ak.dequantize_fp8_block(w, s, block, torch.bfloat16)
    expected = torch.empty(shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = (
                slice(i * block[0], (i + 1) * block[0]),
                slice(j * block[1], (j + 1) * block[1]),
            )
            expected[rows, cols] = w[rows, cols].float() * s[i, j]
    assert_equal(out, expected.to(torch.bfloat16))
    # and the quantization round trip is within fp8's relative step (2^-4)
    assert_close(out.float(), _randn(*shape, seed=3), atol=2e-2, rtol=7e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_mxfp4_matches_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (2, 6, 3), dtype=torch.uint8, generator=g)
    scales[0, 0] = torch.tensor([0, 1, 254], dtype=torch.uint8)  # the e8m0 extremes
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    out = ak.dequantize_mxfp4(blocks, scales, dtype)
    assert out.shape == (2, 6, 96) and out.dtype == dtype
    assert_equal(out, expected)


def test_quantize_mxfp4_round_trip():
    w = _randn(4, 64, seed=5)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (4, 32) and scales.shape == (4, 2)
    out = ak.dequantize_mxfp4(blocks.view(4, 2, 16), scales, torch.float32).view(4, 64)
    # e2m1 steps are at most 1/3 of a value (4 -> 6) and the top of a block maps to <= 6
    assert_close(out, w, atol=0.26 * w.abs().max().item(), rtol=0.0)


# --- activation quantization ---------------------------------------------------------------


@pytest.mark.parametrize(("rows", "k", "group_size"), [(3, 256, 128), (5, 100, 32), (2, 7, 16)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token_group_quant_fp8(rows, k, group_size, dtype):
    x = (_randn(rows, k, seed=k) * 3).to(dtype)
    x[0, :group_size] = 0  # an all-zero group: the eps floor, zeros out
    x_q, x_s = ak.per_token_group_quant_fp8(x, group_size)
    num_groups = -(-k // group_size)
    assert x_q.dtype == FP8 and x_q.shape == (rows, k)
    assert x_s.dtype == torch.float32 and x_s.shape == (rows, num_groups)
    for r in range(rows):
        for gi in range(num_groups):
            group = x[r, gi * group_size : (gi + 1) * group_size].float()
            scale = group.abs().max().clamp(min=1e-10) / 448.0
            assert x_s[r, gi] == scale, (r, gi)
            q = (group / scale).clamp(-448, 448).to(FP8)
            assert_equal(x_q[r, gi * group_size : (gi + 1) * group_size].float(), q.float())
    zero = x_q[0, :group_size].float()
    assert_equal(zero, torch.zeros_like(zero))


# --- GEMMs: exactly the dequantized model -------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_block_linear_is_the_dequantized_linear(dtype, bias):
    w, s = quantize_fp8_block(_randn(72, 80, seed=6), (32, 64))  # partial blocks in N and K
    x = _randn(2, 3, 80, seed=7).to(dtype)
    b = _randn(72, seed=8).to(dtype) if bias else None
    out = ak.fp8_block_linear(x, w, s, (32, 64), b)
    assert out.shape == (2, 3, 72) and out.dtype == dtype
    expected = F.linear(x, ak.dequantize_fp8_block(w, s, (32, 64), dtype), b)
    assert_equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("input_scale", [None, 0.05])
def test_fp8_linear_is_the_dequantized_linear(dtype, input_scale):
    w, s = quantize_fp8_channel(_randn(24, 40, seed=9))
    x = _randn(5, 40, seed=10).to(dtype)
    b = _randn(24, seed=11).to(dtype)
    scale = None if input_scale is None else torch.tensor(input_scale)
    out = ak.fp8_linear(x, w, s, scale, b)
    expected = F.linear(x, (w.float() * s[:, None]).to(dtype), b)
    assert out.dtype == dtype
    assert_equal(out, expected)


# --- fused_moe with quantized experts -----------------------------------------------------------


def quantized_experts(quant, num_experts, hidden, inter, seed, block=(16, 32)):
    """(w13, w2, w13_scale, w2_scale, block_size) quantized from random weights, and the
    dequantized float32 weights (w13 [E, 2I, H], w2 [E, H, I])."""
    w13 = _randn(num_experts, 2 * inter, hidden, seed=seed) * hidden**-0.5 * 2
    w2 = _randn(num_experts, hidden, inter, seed=seed + 1) * inter**-0.5
    if quant == "fp8_block":
        (q13, s13), (q2, s2) = quantize_fp8_block(w13, block), quantize_fp8_block(w2, block)
        d13, d2 = (
            ak.dequantize_fp8_block(q, s, block, torch.float32) for q, s in ((q13, s13), (q2, s2))
        )
        return (q13, q2, s13, s2, block), (d13, d2)
    if quant == "fp8_channel":
        (q13, s13), (q2, s2) = quantize_fp8_channel(w13), quantize_fp8_channel(w2)
        d13, d2 = (q.float() * s[..., None] for q, s in ((q13, s13), (q2, s2)))
        return (q13, q2, s13, s2, None), (d13, d2)
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)

    def dequant(q, s):
        return ak.dequantize_mxfp4(q.unflatten(-1, (s.shape[-1], 16)), s, torch.float32)

    return (q13, q2, s13, s2, None), (dequant(q13, s13), dequant(q2, s2))


@pytest.mark.parametrize("quant", ["fp8_block", "fp8_channel", "mxfp4"])
@pytest.mark.parametrize(
    ("dtype", "activation"), [(torch.bfloat16, "silu"), (torch.float32, "swiglu_oai")]
)
def test_fused_moe_quantized_is_the_dequantized_model(quant, dtype, activation):
    hidden, inter, num_experts, top_k = 64, 32, 4, 2
    (q13, q2, s13, s2, block), (d13, d2) = quantized_experts(quant, num_experts, hidden, inter, 12)
    x = _randn(6, hidden, seed=13).to(dtype)
    weights, ids = torch.softmax(_randn(6, num_experts, seed=14), -1).topk(top_k, dim=-1)
    ids = ids.int()
    ids[0] = torch.tensor([0, 1])  # expert 3 gets no token below: never dequantized
    ids[ids == 3] = 2
    bias = activation == "swiglu_oai"  # GPT-OSS: biases in the activation dtype
    b13 = _randn(num_experts, 2 * inter, seed=15).to(dtype) if bias else None
    b2 = _randn(num_experts, hidden, seed=16).to(dtype) if bias else None
    common = dict(activation=activation, w13_bias=b13, w2_bias=b2)
    out = ak.fused_moe(
        x,
        q13,
        q2,
        weights,
        ids,
        quant=quant,
        w13_scale=s13,
        w2_scale=s2,
        block_size=block,
        **common,
    )
    expected = ak.fused_moe(x, d13.to(dtype), d2.to(dtype), weights, ids, **common)
    assert_equal(out, expected)


# --- argument checks ------------------------------------------------------------------------------


def _fp8_args():
    w, s = quantize_fp8_block(_randn(40, 48, seed=17), (16, 32))
    return _randn(3, 48, seed=18), w, s


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda x, w, s: (x, w.float(), s),
            "weight has dtype torch.float32, expected one of float8_e4m3fn",
        ),
        (lambda x, w, s: (x, w, s.half()), "weight_scale_inv has dtype torch.float16"),
        (
            lambda x, w, s: (x, w, s[:2]),
            r"weight_scale_inv has shape \(2, 2\), expected \(3, 2\) \(ceil-div",
        ),
        (
            lambda x, w, s: (x[:, :40], w, s),
            r"weight has shape \(40, 48\), expected \(40, 40\) to match x",
        ),
    ],
)
def test_fp8_block_linear_argument_errors(mutate, message):
    x, w, s = mutate(*_fp8_args())
    with pytest.raises(ValueError, match=f"fp8_block_linear: {message}"):
        ak.fp8_block_linear(x, w, s, (16, 32))


@pytest.mark.parametrize("block_size", [(16,), (16, 0), (16.0, 32), 16, (True, 32)])
def test_block_size_must_be_a_pair_of_positive_ints(block_size):
    x, w, s = _fp8_args()
    with pytest.raises(ValueError, match="block_size must be a pair of positive ints"):
        ak.fp8_block_linear(x, w, s, block_size)


def test_fp8_linear_argument_errors():
    x, w, _ = _fp8_args()
    s = torch.ones(40)
    with pytest.raises(
        ValueError, match=r"fp8_linear: weight_scale has shape \(1,\), expected \(40,\)"
    ):
        ak.fp8_linear(x, w, s[:1])
    with pytest.raises(ValueError, match="fp8_linear: input_scale must be per-tensor"):
        ak.fp8_linear(x, w, s, torch.ones(2))
    with pytest.raises(ValueError, match="fp8_linear: weight_scale has dtype torch.float16"):
        ak.fp8_linear(x, w, s.half())


def test_dequantize_argument_errors():
    blocks = torch.zeros(2, 3, 16, dtype=torch.uint8)
    with pytest.raises(
        ValueError, match=r"dequantize_mxfp4: scales has shape \(2, 4\), expected \(2, 3\)"
    ):
        ak.dequantize_mxfp4(blocks, torch.zeros(2, 4, dtype=torch.uint8), torch.bfloat16)
    with pytest.raises(ValueError, match="dequantize_mxfp4: blocks has dtype torch.int8"):
        ak.dequantize_mxfp4(
            blocks.to(torch.int8), torch.zeros(2, 3, dtype=torch.uint8), torch.bfloat16
        )
    with pytest.raises(ValueError, match="dequantize_fp8_block: dtype must be one of"):
        _, w, s = _fp8_args()
        ak.dequantize_fp8_block(w, s, (16, 32), torch.int32)


def test_fused_moe_quant_argument_errors():
    (q13, q2, s13, s2, block), _ = quantized_experts("fp8_block", 2, 64, 32, 19)
    x = _randn(3, 64, seed=20)
    weights, ids = torch.full((3, 1), 1.0), torch.zeros(3, 1, dtype=torch.int32)
    args = (x, q13, q2, weights, ids)
    with pytest.raises(ValueError, match="fused_moe: quant must be None or one of"):
        ak.fused_moe(*args, quant="int4", w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="fused_moe: w13_scale is given but quant is None"):
        ak.fused_moe(x, q13.float(), q2.float(), weights, ids, w13_scale=s13)
    with pytest.raises(ValueError, match="fused_moe: quant='fp8_block' needs w2_scale"):
        ak.fused_moe(*args, quant="fp8_block", w13_scale=s13, block_size=block)
    with pytest.raises(ValueError, match=r"fused_moe: w13_scale has shape .* \(ceil-div of w13"):
        ak.fused_moe(*args, quant="fp8_block", w13_scale=s13[:, :1], w2_scale=s2, block_size=block)
    with pytest.raises(ValueError, match="fused_moe: block_size must be a pair"):
        ak.fused_moe(*args, quant="fp8_block", w13_scale=s13, w2_scale=s2)
    with pytest.raises(
        ValueError,
        match=r"fused_moe: w13_scale has shape \(2, 4\), expected \(2, 64\) \(one scale per",
    ):
        ak.fused_moe(*args, quant="fp8_channel", w13_scale=s13[..., 0], w2_scale=s2[..., 0])
    with pytest.raises(
        ValueError, match="fused_moe: w13 has dtype torch.float8_e4m3fn, expected one of uint8"
    ):
        ak.fused_moe(*args, quant="mxfp4", w13_scale=s13, w2_scale=s2)
    (m13, m2, ms13, ms2, _), _ = quantized_experts("mxfp4", 2, 64, 32, 21)
    with pytest.raises(
        ValueError, match=r"fused_moe: w13 has shape \(2, 64, 16\), expected \(2, 64, 32\)"
    ):
        ak.fused_moe(
            x, m13[..., :16], m2, weights, ids, quant="mxfp4", w13_scale=ms13, w2_scale=ms2
        )
