"""Triton quantized ops against the torch reference: activation quantization and dequantization
bit for bit; the w8a8 GEMMs against a reference that quantizes activations the same way (tight)
and against the dequantized model (loose); fused_moe with FP8 / MXFP4 experts (weights dequantized
in the K loop) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from atom_kernels.backends.torch import moe as moe_reference
from atom_kernels.backends.torch import quant as reference
from atom_kernels.testing import (
    assert_close,
    assert_equal,
    quantize_fp8_block,
    quantize_fp8_channel,
    quantize_mxfp4,
    strided_copy,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol) of the w8a8 GEMMs against the same quantized operands multiplied in float64: both
# accumulate exact products in float32 (in another order); the output is rounded to its dtype.
W8A8_TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# (atol, rtol) against the dequantized model (x unquantized): the activations' fp8 rounding (3
# mantissa bits: up to 2^-4 relative per element) moves unit-variance outputs by ~0.03 (std);
# the largest error measured (the emulated w8a8 in float64 against the dequantized model, x and
# outputs ~N(0, 1), K = 80..4096, 128x128 and smaller blocks, 5 seeds) was 0.115.
DEQUANT_TOLERANCES = (0.15, 0.05)


@pytest.fixture(scope="module")
def quant(triton_backend):
    from atom_kernels.backends.triton import quant, quant_custom_ops

    return quant, quant_custom_ops


def _randn(*shape, seed, device, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device)


# --- activation quantization and dequantization: bit for bit -----------------------------------


# The tiled kernel (groups <= TILED_GROUP_MAX: programs of several (row, group) pairs, pairs
# spanning rows, partial last groups, an odd group width) and the per-(row, group) loop (wider).
GROUP_QUANT_CASES = [
    (3, 256, 128), (5, 100, 32), (2, 7, 16), (37, 300, 128), (4, 1000, 100), (2, 1300, 1100),
]  # fmt: skip


@pytest.mark.parametrize(("rows", "k", "group_size"), GROUP_QUANT_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token_group_quant_fp8(triton_backend, quant, rows, k, group_size, dtype):
    device = triton_backend.device
    x = _randn(rows, k, seed=k, device=device, scale=3.0).to(dtype)
    x[0, :group_size] = 0  # an all-zero group
    x_q, x_s = quant[1].per_token_group_quant_fp8(x, group_size)
    q_ref, s_ref = reference.per_token_group_quant_fp8(x, group_size)
    assert x_q.dtype == torch.float8_e4m3fn and x_s.shape == s_ref.shape
    assert_equal(x_s, s_ref, name="x_s")
    assert_equal(x_q.float(), q_ref.float(), name="x_q")
    # a strided x (every other column of a wider buffer)
    x_q, x_s = quant[0].per_token_group_quant_fp8(strided_copy(x), group_size)
    assert_equal(x_q.float(), q_ref.float(), name="x_q (strided x)")


def test_static_quant_fp8(triton_backend, quant):
    x = _randn(4, 50, seed=1, device=triton_backend.device, scale=10.0)
    scale = torch.tensor(0.02, device=x.device)  # saturates: |x| / 0.02 > 448 for |x| > 8.96
    expected = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert_equal(quant[0].static_quant_fp8(x, scale).float(), expected.float())


@pytest.mark.parametrize(("shape", "block"), [((72, 80), (32, 64)), ((2, 40, 48), (16, 16))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_fp8_block(triton_backend, quant, shape, block, dtype):
    w, s = quantize_fp8_block(_randn(*shape, seed=2, device=triton_backend.device), block)
    s = s * torch.rand(s.shape, generator=torch.Generator().manual_seed(3)).to(s.device)
    out = quant[1].dequantize_fp8_block(w, s, list(block), dtype)
    assert_equal(out, reference.dequantize_fp8_block(w, s, block, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_mxfp4(triton_backend, quant, dtype):
    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (2, 5, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(115, 135, (2, 5, 3), dtype=torch.uint8, generator=g)
    blocks, scales = blocks.to(triton_backend.device), scales.to(triton_backend.device)
    out = quant[1].dequantize_mxfp4(blocks, scales, dtype)
    assert out.shape == (2, 5, 96)
    assert_equal(out, reference.dequantize_mxfp4(blocks, scales, dtype))


# --- the w8a8 GEMMs ------------------------------------------------------------------------------


def _w8a8_expected(x_q, x_s, group_k, w, w_scale_full, bias, dtype):
    """x_q * its group scales times the dequantized weight, in float64, cast to dtype."""
    k = x_q.shape[-1]
    x_deq = x_q.double() * x_s.double().repeat_interleave(group_k, dim=-1)[:, :k]
    out = x_deq @ (w.double() * w_scale_full.double()).T
    if bias is not None:
        out = out + bias.double()
    return out.to(dtype)


# (M, N, K, block): partial blocks in N and K; K tiles of 32 inside 64- and 128-wide groups
LINEAR_CASES = [(5, 72, 80, (32, 64)), (1, 48, 96, (16, 32)), (17, 40, 200, (32, 128))]


@pytest.mark.parametrize(("rows", "n", "k", "block"), LINEAR_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_block_linear(triton_backend, quant, rows, n, k, block, dtype, monkeypatch):
    """The w8a8 path (the weight-only one-row kernel off: test_triton_fp8_skinny.py tests it)."""
    from atom_kernels.backends.triton import fp8_skinny

    monkeypatch.setattr(fp8_skinny, "MODE", "0")
    device = triton_backend.device
    w_float = _randn(n, k, seed=n + k, device=device, scale=k**-0.5)
    w, s = quantize_fp8_block(w_float, block)
    x = _randn(rows, k, seed=rows, device=device).to(dtype)
    bias = _randn(n, seed=9, device=device).to(dtype) if rows > 1 else None
    out = quant[1].fp8_block_linear(x, w, s, list(block), bias)
    assert out.shape == (rows, n) and out.dtype == dtype
    x_q, x_s = reference.per_token_group_quant_fp8(x, block[1])
    full_scale = reference.expand_block_scale(s, w.shape, block)
    expected = _w8a8_expected(x_q, x_s, block[1], w, full_scale, bias, dtype)
    atol, rtol = W8A8_TOLERANCES[dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, name="fp8_block_linear vs w8a8 reference")
    dequantized = reference.fp8_block_linear(x.float(), w, s, block, None)
    if bias is not None:
        dequantized = dequantized + bias.float()
    assert_close(out.float(), dequantized, atol=DEQUANT_TOLERANCES[0], rtol=DEQUANT_TOLERANCES[1],
                 name="fp8_block_linear vs the dequantized model")  # fmt: skip


# Split-K and tile launches of the block GEMM at DeepSeek-V3's format (128 x 128 weight blocks):
# N = 576 (kv_a_proj_with_mqa: 4.5 weight blocks), K whole 128-blocks (384) and a partial last one
# (320 = 2.5 blocks: the format's scales cover ceil(K / 128) blocks). Interpreted K tiles are 32.
GEMM_LAUNCHES = {
    "no split": dict(SPLIT_K=1),
    "split 3": dict(SPLIT_K=3),
    "split 3, reduce kernel": dict(SPLIT_K=3, FUSED_REDUCE=False),
    "split 5, 64 wide": dict(SPLIT_K=5, BLOCK_N=64),
    "split 2, TMA": dict(SPLIT_K=2, TMA=True),
    "128 wide, GROUP_M 2": dict(SPLIT_K=1, BLOCK_N=128, GROUP_M=2),
    "split 2, 128 wide": dict(SPLIT_K=2, BLOCK_N=128, GROUP_M=4),
}
LARGE_M_LAUNCHES = ("128 wide, GROUP_M 2", "split 2, 128 wide")  # 300 rows (interpreter time)
LAUNCH_CASES = [
    (rows, k, launch)
    for rows in (1, 3, 16, 33, 300)
    for k in ((320,) if rows == 300 else (384, 320))
    for launch in GEMM_LAUNCHES
    if (rows == 300) == (launch in LARGE_M_LAUNCHES)
]


@pytest.mark.parametrize(("rows", "k", "launch"), LAUNCH_CASES)
def test_w8a8_gemm_launches(triton_backend, quant, rows, k, launch):
    device, n, block, dtype = triton_backend.device, 576, (128, 128), torch.bfloat16
    w, s = quantize_fp8_block(_randn(n, k, seed=k, device=device, scale=k**-0.5), block)
    s = s * (0.5 + torch.rand(s.shape, generator=torch.Generator().manual_seed(k)).to(device))
    x = _randn(rows, k, seed=rows, device=device, scale=2.0).to(dtype)
    bias = _randn(n, seed=33, device=device).to(dtype) if rows % 2 else None
    x_q, x_s = reference.per_token_group_quant_fp8(x, block[1])
    mod = quant[0]
    block_k = mod.block_k_for(block[1], triton_backend.interpreted)  # GPU: 128, a partial K tile
    out = mod.w8a8_gemm(x_q, x_s, w, s, *block, block_k, bias, dtype, GEMM_LAUNCHES[launch])
    full_scale = reference.expand_block_scale(s, w.shape, block)
    expected = _w8a8_expected(x_q, x_s, block[1], w, full_scale, bias, dtype)
    atol, rtol = W8A8_TOLERANCES[dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"w8a8_gemm ({launch})")
    if launch == "split 3" and rows == 3:  # splits summed in a fixed order: bitwise reproducible
        again = mod.w8a8_gemm(x_q, x_s, w, s, *block, block_k, bias, dtype, GEMM_LAUNCHES[launch])
        assert_equal(again, out)  # (and the counters were reset by the first call)
        unfused = dict(GEMM_LAUNCHES[launch], FUSED_REDUCE=False)
        assert_equal(mod.w8a8_gemm(x_q, x_s, w, s, *block, block_k, bias, dtype, unfused), out)


def test_gemm_config_fills_the_sms_at_deepseek_shapes(quant):
    """At M = 1-16 every DeepSeek-V3 projection launches >= one program per SM (H100: 132), by
    narrower N tiles and then split-K; splits cover whole K tiles and the workspace stays small."""
    mod = quant[0]
    shapes = [(1536, 7168), (24576, 1536), (576, 7168), (7168, 16384), (4096, 7168), (7168, 2048)]
    for n, k in shapes:
        for rows in (1, 4, 16):
            cfg = mod.gemm_config(rows, n, k, 128, sms=132)
            tiles = -(-rows // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
            # the SMs filled, or the split at its cap (whole K tiles, the workspace's bytes)
            cap = min(k // 128 // mod.SPLIT_MIN_K_TILES,
                      int(mod.SPLIT_MAX_WORKSPACE_FRACTION * k / (8 * rows)))  # fmt: skip
            filled = tiles * cfg["SPLIT_K"] >= 132 or cfg["SPLIT_K"] == cap
            assert cfg["BLOCK_M"] == 16 and filled, (n, k, rows, cfg)
            assert cfg["SPLIT_K"] <= k // 128 // mod.SPLIT_MIN_K_TILES or cfg["SPLIT_K"] == 1
            assert 8 * cfg["SPLIT_K"] * rows * n <= mod.SPLIT_MAX_WORKSPACE_FRACTION * n * k
        big = mod.gemm_config(4096, n, k, 128, sms=132)
        assert big["SPLIT_K"] == 1 and big["BLOCK_M"] >= 64
    # kv_a_proj at M = 1: 64-column tiles (9) cannot fill 132 SMs: split K
    small = mod.gemm_config(1, 576, 7168, 128, sms=132)
    assert small["BLOCK_N"] == 64
    assert small["SPLIT_K"] == mod.auto_split_k(1, 576, 7168, 128, tiles=9, sms=132)
    assert mod.auto_split_k(1, 576, 7168, 128, tiles=18, sms=132) == 15
    assert mod.auto_split_k(1, 7168, 16384, 128, tiles=56, sms=132) == 5


def test_fp8_block_linear_leading_dims_and_odd_block(triton_backend, quant):
    device = triton_backend.device
    w, s = quantize_fp8_block(_randn(24, 48, seed=5, device=device, scale=0.15), (8, 24))
    x = _randn(2, 3, 48, seed=6, device=device).to(torch.bfloat16)
    out = quant[0].fp8_block_linear(x, w, s, (8, 24), None)
    assert out.shape == (2, 3, 24)
    # 24 columns a group: no power-of-two K tile >= 16 divides it -> the dequantized model
    assert_equal(out, reference.fp8_block_linear(x, w, s, (8, 24), None))
    w, s = quantize_fp8_block(_randn(24, 64, seed=7, device=device, scale=0.125), (16, 32))
    x = _randn(2, 3, 64, seed=8, device=device)
    out = quant[0].fp8_block_linear(x, w, s, (16, 32), None)
    expected = quant[0].fp8_block_linear(x.view(6, 64), w, s, (16, 32), None)
    assert out.shape == (2, 3, 24)
    assert_equal(out.view(6, 24), expected)


@pytest.mark.parametrize(("rows", "n", "k"), [(5, 40, 72), (1, 16, 32), (9, 33, 100)])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_linear(triton_backend, quant, rows, n, k, static, dtype):
    device = triton_backend.device
    w, w_s = quantize_fp8_channel(_randn(n, k, seed=n * k, device=device, scale=k**-0.5))
    x = _randn(rows, k, seed=rows + k, device=device).to(dtype)
    bias = _randn(n, seed=10, device=device).to(dtype)
    if static:
        input_scale = (x.float().abs().max() / 448.0 * 1.25).reshape(())
        x_q = (x.float() / input_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        x_s = input_scale.reshape(1, 1).expand(rows, 1)
    else:
        input_scale = None
        x_q, x_s = reference.per_token_group_quant_fp8(x, k)
    out = quant[1].fp8_linear(x, w, w_s, input_scale, bias)
    assert out.shape == (rows, n) and out.dtype == dtype
    expected = _w8a8_expected(x_q, x_s, k, w, w_s[:, None].expand(n, k), bias, dtype)
    atol, rtol = W8A8_TOLERANCES[dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, name="fp8_linear vs w8a8 reference")
    dequantized = reference.fp8_linear(x.float(), w, w_s, None, bias.float())
    assert_close(out.float(), dequantized, atol=DEQUANT_TOLERANCES[0], rtol=DEQUANT_TOLERANCES[1],
                 name="fp8_linear vs the dequantized model")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
def test_fp8_linear_scaled_mm_agrees_with_the_triton_gemm(triton_backend, quant, rows):
    """On an FP8 GPU bf16 goes through torch._scaled_mm; the Triton w8a8 GEMM (fp16 output takes
    it) must give the same numbers within the output rounding."""
    mod = quant[0]
    if not mod.has_fp8_mma(triton_backend.device):
        pytest.skip("no FP8 MMA on this GPU")
    w, w_s = quantize_fp8_channel(_randn(256, 512, seed=11, device="cuda", scale=512**-0.5))
    # The same values in both dtypes (bf16 values are fp16 values at this scale), so both paths
    # quantize identical activations: bf16 and fp16 roundings of one float32 x flipped fp8 codes
    # and moved outputs by up to 0.067 (H100, 2026-11-23).
    x = _randn(rows, 512, seed=12, device="cuda").bfloat16()
    assert mod._scaled_mm_takes(x, w)
    out = mod.fp8_linear(x, w, w_s, None, None)
    triton_out = mod.fp8_linear(x.half(), w, w_s, None, None)
    assert_close(out.float(), triton_out.float(), atol=2e-2, rtol=1.6e-2)


# --- fused_moe with quantized experts ---------------------------------------------------------


# (atol, rtol): as test_triton_moe.py's (both sides run the GEMMs on the same dequantized weights
# in the input dtype; summation order and the per-pair rounding differ).
MOE_TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def _experts(quant, num_experts, hidden, inter, device, seed, block=(16, 32)):
    """(w13, w2, w13_scale, w2_scale, block_size) quantized from random weights."""
    w13 = _randn(num_experts, 2 * inter, hidden, seed=seed, device=device, scale=2 * hidden**-0.5)
    w2 = _randn(num_experts, hidden, inter, seed=seed + 1, device=device, scale=inter**-0.5)
    if quant == "fp8_block":
        (q13, s13), (q2, s2) = quantize_fp8_block(w13, block), quantize_fp8_block(w2, block)
        return q13, q2, s13, s2, block
    if quant == "fp8_channel":
        (q13, s13), (q2, s2) = quantize_fp8_channel(w13), quantize_fp8_channel(w2)
        return q13, q2, s13, s2, None
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    return q13, q2, s13, s2, None


def _check_moe(triton_backend, x, experts, weights, ids, quant, activation="silu", b13=None,
               b2=None, config=None):  # fmt: skip
    from atom_kernels.backends.triton import moe

    q13, q2, s13, s2, block = experts
    args = (x, q13, q2, weights, ids, activation, b13, b2, False, 1.702, 7.0)
    qargs = dict(quant=quant, w13_scale=s13, w2_scale=s2, block_size=block)
    if config is None:
        out = triton_backend.custom_ops.fused_moe(*args, **qargs)
    else:
        out = moe.fused_moe(*args, config=config, **qargs)
    expected = moe_reference.fused_moe(*args, **qargs)
    atol, rtol = MOE_TOLERANCES[x.dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"fused_moe({quant}, {activation})")


QUANTS = ["fp8_block", "fp8_channel", "mxfp4"]


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("num_tokens", [2, 9])  # the per-pair path (4 pairs) and the sorted one
def test_fused_moe_quantized(triton_backend, quant, num_tokens):
    device = triton_backend.device
    experts = _experts(quant, 4, 64, 32, device, seed=13)
    x = _randn(num_tokens, 64, seed=14, device=device).to(torch.bfloat16)
    logits = _randn(num_tokens, 4, seed=15, device=device)
    weights, ids = torch.softmax(logits, dim=-1).topk(2, dim=-1)
    _check_moe(triton_backend, x, experts, weights, ids.int(), quant)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize(
    ("activation", "dtype"), [("gelu", torch.float16), ("swiglu_oai", torch.float32)]
)
def test_fused_moe_quantized_activations_biases(triton_backend, quant, activation, dtype):
    device = triton_backend.device
    experts = _experts(quant, 4, 32, 32, device, seed=16)
    x = _randn(5, 32, seed=17, device=device).to(dtype)
    weights, ids = torch.softmax(_randn(5, 4, seed=18, device=device), dim=-1).topk(2, dim=-1)
    b13 = _randn(4, 64, seed=19, device=device).to(dtype)
    b2 = _randn(4, 32, seed=20, device=device).to(dtype)
    _check_moe(triton_backend, x, experts, weights, ids.int(), quant, activation, b13, b2)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("combine", ["token", "atomic"])
def test_fused_moe_quantized_per_pair_combines(triton_backend, combine, quant):
    """The per-pair path's other GEMM 2 kernels (per token over its experts; fp32 atomics), with
    FP8 experts whose blocks split H = 48 and I = 40 unevenly (partial scale blocks; MXFP4:
    H = 64, I = 32, whole scale groups)."""
    device = triton_backend.device
    hidden, inter = (64, 32) if quant == "mxfp4" else (48, 40)
    experts = _experts(quant, 3, hidden, inter, device, seed=21, block=(32, 32))
    x = _randn(2, hidden, seed=22, device=device).to(torch.bfloat16)
    weights, ids = torch.softmax(_randn(2, 3, seed=23, device=device), dim=-1).topk(2, dim=-1)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, GROUP_M=1)
    config = {"per_pair": True, "combine": combine, "gemm1": cfg, "gemm2": cfg}
    _check_moe(triton_backend, x, experts, weights, ids.int(), quant, config=config)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("per_pair", [True, False])
def test_fused_moe_quantized_odd_shapes(triton_backend, quant, per_pair):
    """Both paths with tiles that split every dim unevenly: 64-column tiles over H = 96 / 80 and
    I = 32 / 56 (partial column tiles), 64-input K tiles over K = 96 / 80 / 56 (a partial last
    tile; MXFP4: its last 32-input scale group masked off), FP8 blocks of 48 x 32 (rows of a
    block straddle the gate / up halves; BLOCK_K 64 must shrink to 32, one scale column per K
    tile), strided activations, scales and (MXFP4) packed weights."""
    device = triton_backend.device
    hidden, inter = (96, 32) if quant == "mxfp4" else (80, 56)
    q13, q2, s13, s2, block = _experts(quant, 5, hidden, inter, device, seed=40, block=(48, 32))
    if quant == "mxfp4":
        q13, q2 = strided_copy(q13), strided_copy(q2)
    experts = (q13, q2, strided_copy(s13), strided_copy(s2), block)
    num_tokens = 3 if per_pair else 7  # 6 pairs (per-pair path) / 14
    x = strided_copy(_randn(num_tokens, hidden, seed=41, device=device).to(torch.bfloat16))
    logits = _randn(num_tokens, 5, seed=42, device=device)
    weights, ids = torch.softmax(logits, dim=-1).topk(2, dim=-1)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, GROUP_M=2)
    config = {"per_pair": per_pair, "combine": "sum", "gemm1": cfg, "gemm2": cfg}
    _check_moe(triton_backend, x, experts, weights, ids.int(), quant, config=config)


def test_fused_moe_fp8_block_k_not_a_multiple_of_16(triton_backend):
    """A K block the dequantizing loop cannot tile (BLOCK_K must divide it, and dots need 16)."""
    device = triton_backend.device
    experts = _experts("fp8_block", 2, 32, 32, device, seed=43, block=(16, 8))
    x = _randn(2, 32, seed=44, device=device).to(torch.bfloat16)
    weights = torch.ones(2, 1, device=device)
    ids = torch.zeros(2, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple of 16"):
        _check_moe(triton_backend, x, experts, weights, ids, "fp8_block")


def test_custom_ops_opcheck(triton_backend, quant):
    """Schemas and fake implementations (torch.library.opcheck), as test_triton_custom_ops.py's."""
    device = triton_backend.device
    ops = torch.ops.atom
    w, s = quantize_fp8_block(_randn(40, 64, seed=24, device=device), (16, 32))
    w_c, s_c = quantize_fp8_channel(_randn(40, 64, seed=25, device=device))
    x = _randn(3, 64, seed=26, device=device).to(torch.bfloat16)
    blocks = torch.randint(0, 256, (2, 3, 16), dtype=torch.uint8).to(device)
    scales = torch.randint(120, 130, (2, 3), dtype=torch.uint8).to(device)
    experts = _experts("mxfp4", 2, 32, 32, device, seed=27)
    weights = torch.full((3, 1), 1.0, device=device)
    ids = torch.tensor([[1], [0], [1]], dtype=torch.int32, device=device)
    cases = [
        (ops.triton_dequantize_fp8_block, (w, s, [16, 32], torch.bfloat16)),
        (ops.triton_dequantize_mxfp4, (blocks, scales, torch.float32)),
        (ops.triton_per_token_group_quant_fp8, (x, 32)),
        (ops.triton_fp8_block_linear, (x, w, s, [16, 32], None)),
        (ops.triton_fp8_linear, (x, w_c, s_c, torch.tensor(0.01, device=device), None)),
        (ops.triton_fused_moe, (x[:, :32], experts[0], experts[1], weights, ids, "silu", None,
                                None, False, 1.702, 7.0, "mxfp4", experts[2], experts[3], None)),
    ]  # fmt: skip
    for op, args in cases:
        # NOTE (torch 2.15): test_schema compares the inputs before and after the call with ops
        # that have no float8 CPU kernel ("mul_cpu_reduced_float"): fake tensors only for those.
        has_fp8 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
        utils = ("test_faketensor",) if has_fp8 else ("test_schema", "test_faketensor")
        torch.library.opcheck(op, args, test_utils=utils)


# --- real layer shapes on a GPU -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize(("n", "k"), [(576, 7168), (7168, 2048)])  # DeepSeek-V3 kv_a, o_proj
def test_fp8_block_linear_gpu_real_sizes(triton_backend, quant, rows, n, k, monkeypatch):
    from atom_kernels.backends.triton import fp8_skinny

    monkeypatch.setattr(fp8_skinny, "MODE", "0")  # the w8a8 path (test_triton_fp8_skinny.py)
    w, s = quantize_fp8_block(_randn(n, k, seed=28, device="cuda", scale=k**-0.5), (128, 128))
    x = _randn(rows, k, seed=29, device="cuda").to(torch.bfloat16)
    out = quant[0].fp8_block_linear(x, w, s, (128, 128), None)
    x_q, x_s = reference.per_token_group_quant_fp8(x, 128)
    w_scale = reference.expand_block_scale(s, w.shape, (128, 128))
    expected = _w8a8_expected(x_q, x_s, 128, w, w_scale, None, torch.bfloat16)
    assert_close(out, expected, atol=2e-2, rtol=1.6e-2, name="fp8_block_linear (GPU)")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 512])
@pytest.mark.parametrize(
    ("quant_name", "shape"),
    [("fp8_block", (16, 4, 2048, 768)), ("fp8_channel", (16, 4, 2048, 768)),
     ("mxfp4", (8, 4, 2880, 2880))],  # Qwen3-30B-A3B-FP8 layer (16 of its 128 experts), GPT-OSS
)  # fmt: skip
def test_fused_moe_quantized_gpu_real_sizes(triton_backend, quant_name, shape, num_tokens):
    num_experts, top_k, hidden, inter = shape
    block = (128, 128)
    experts = _experts(quant_name, num_experts, hidden, inter, "cuda", seed=30, block=block)
    x = _randn(num_tokens, hidden, seed=31, device="cuda").to(torch.bfloat16)
    logits = _randn(num_tokens, num_experts, seed=32, device="cuda")
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    from atom_kernels.backends.triton import moe

    q13, q2, s13, s2, block_size = experts
    args = (x, q13, q2, weights, ids.int(), "silu", None, None, False, 1.702, 7.0)
    qargs = dict(quant=quant_name, w13_scale=s13, w2_scale=s2, block_size=block_size)
    out = moe.fused_moe(*args, **qargs)
    expected = moe_reference.fused_moe(*args, **qargs)
    assert_close(out, expected, atol=5e-2, rtol=5e-2, name=f"fused_moe({quant_name}, GPU)")
