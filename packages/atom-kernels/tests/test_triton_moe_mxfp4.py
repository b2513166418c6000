"""fused_moe with MXFP4 experts in each of its ways (``moe_mxfp4.MODES``: "legacy", "bits",
"scaled") against the torch reference: the per-pair path (register multiply-adds, or the
16-row MMA for "scaled") and the sorted one, every GEMM 2 combine of the per-pair path, uneven
tiles with strided operands, GPT-OSS's layer (swiglu_oai, interleaved gate/up, biases), and on a
GPU the real GPT-OSS-120B and DeepSeek-V3 layer widths."""

from __future__ import annotations

import pytest
import torch

from atom_kernels.backends.torch import moe as moe_reference
from atom_kernels.testing import assert_close, quantize_mxfp4, strided_copy

MODES = ["legacy", "bits", "scaled", "words"]
# (atol, rtol), as test_triton_quant.py's MOE_TOLERANCES: both sides multiply the same
# dequantized weights; summation order and the per-pair rounding differ.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def _randn(*shape, seed, device, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device)


def _experts(num_experts, hidden, inter, device, seed):
    """(w13, w2, w13_scale, w2_scale) quantized from random weights of unit-variance outputs."""
    w13 = _randn(num_experts, 2 * inter, hidden, seed=seed, device=device, scale=2 * hidden**-0.5)
    w2 = _randn(num_experts, hidden, inter, seed=seed + 1, device=device, scale=inter**-0.5)
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    return q13, q2, s13, s2


def _check(x, experts, num_experts, top_k, mode, seed, config=None, oai=False, atol=None):
    from atom_kernels.backends.triton import moe

    device = x.device
    logits = _randn(x.shape[0], num_experts, seed=seed, device=device)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    b13 = b2 = None
    if oai:
        b13 = _randn(num_experts, experts[0].shape[1], seed=seed + 1, device=device).to(x.dtype)
        b2 = _randn(num_experts, experts[1].shape[1], seed=seed + 2, device=device).to(x.dtype)
    activation = "swiglu_oai" if oai else "silu"
    args = (x, experts[0], experts[1], weights, ids.int(), activation, b13, b2, oai, 1.702, 7.0)
    qargs = dict(quant="mxfp4", w13_scale=experts[2], w2_scale=experts[3])
    out = moe.fused_moe(*args, config=config, mxfp4_mode=mode, **qargs)
    expected = moe_reference.fused_moe(*args, **qargs)
    tol_a, tol_r = TOLERANCES[x.dtype]
    assert_close(out, expected, atol=atol or tol_a, rtol=atol or tol_r,
                 name=f"fused_moe(mxfp4 {mode}, T={x.shape[0]})")  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_tokens", [2, 9])  # per-pair (4 pairs), sorted (18)
@pytest.mark.parametrize("oai", [False, True])
def test_fused_moe_mxfp4_modes(triton_backend, mode, num_tokens, oai):
    device = triton_backend.device
    experts = _experts(4, 64, 32, device, seed=50)
    x = _randn(num_tokens, 64, seed=51, device=device).to(torch.bfloat16)
    _check(x, experts, 4, 2, mode, seed=52, oai=oai)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("combine", ["token", "atomic"])
def test_fused_moe_mxfp4_per_pair_combines(triton_backend, mode, combine):
    device = triton_backend.device
    experts = _experts(3, 64, 64, device, seed=53)
    x = _randn(2, 64, seed=54, device=device).to(torch.bfloat16)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=4, GROUP_M=1)
    config = {"per_pair": True, "combine": combine, "gemm1": cfg, "gemm2": cfg}
    _check(x, experts, 3, 2, mode, seed=55, config=config)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_pair", [True, False])
@pytest.mark.parametrize("strided", [True, False])  # strided packed rows: "words" runs "bits"
def test_fused_moe_mxfp4_odd_shapes(triton_backend, mode, per_pair, strided):
    """64-column tiles over H = 96 and I = 32 (partial column tiles), 64-input K tiles over
    K = 96 (the last scale group of a tile masked off); strided activations, packed weights
    and scales, or contiguous ones."""
    device = triton_backend.device
    experts = _experts(5, 96, 32, device, seed=56)
    num_tokens = 3 if per_pair else 7
    x = _randn(num_tokens, 96, seed=57, device=device).to(torch.bfloat16)
    if strided:
        experts = tuple(strided_copy(t) for t in experts)
        x = strided_copy(x)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, GROUP_M=2)
    config = {"per_pair": per_pair, "combine": "sum", "gemm1": cfg, "gemm2": cfg}
    _check(x, experts, 5, 2, mode, seed=58, config=config)


@pytest.mark.parametrize("mode", ["bits", "scaled"])  # "scaled" needs bf16: these run "bits"
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_moe_mxfp4_other_dtypes(triton_backend, mode, dtype):
    device = triton_backend.device
    experts = _experts(4, 32, 32, device, seed=59)
    for num_tokens in (3, 5):  # per-pair, sorted
        x = _randn(num_tokens, 32, seed=60, device=device).to(dtype)
        _check(x, experts, 4, 2, mode, seed=61, oai=True)


def test_fused_moe_mxfp4_mode_names(triton_backend, monkeypatch):
    from atom_kernels.backends.triton import moe_mxfp4

    monkeypatch.setenv(moe_mxfp4.ENV, "bits")
    assert moe_mxfp4.resolve_mode(None, torch.bfloat16, True) == moe_mxfp4.MODES["bits"]
    assert moe_mxfp4.resolve_mode("scaled", torch.bfloat16, True) == moe_mxfp4.MODES["scaled"]
    assert moe_mxfp4.resolve_mode("scaled", torch.float16, False) == moe_mxfp4.MODES["bits"]
    monkeypatch.setenv(moe_mxfp4.ENV, "fast")
    with pytest.raises(ValueError, match="mxfp4 mode 'fast'"):
        moe_mxfp4.resolve_mode(None, torch.bfloat16, True)


# --- real layer widths on a GPU -------------------------------------------------------------------


# The default way at decode and prefill sizes, the others at decode sizes (per-pair, sorted).
GPU_CASES = [("scaled", 1), ("scaled", 16), ("scaled", 300), ("words", 1), ("words", 16),
             ("bits", 1), ("bits", 16), ("legacy", 16)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "num_tokens"), GPU_CASES)
@pytest.mark.parametrize(
    ("shape", "oai"),
    [((8, 4, 2880, 2880), True), ((16, 8, 7168, 2048), False)],  # GPT-OSS-120B, DeepSeek-V3
)  # fmt: skip
def test_fused_moe_mxfp4_gpu_real_sizes(triton_backend, mode, num_tokens, shape, oai):
    num_experts, top_k, hidden, inter = shape
    experts = _experts(num_experts, hidden, inter, "cuda", seed=62)
    x = _randn(num_tokens, hidden, seed=63, device="cuda").to(torch.bfloat16)
    _check(x, experts, num_experts, top_k, mode, seed=64, oai=oai, atol=5e-2)
