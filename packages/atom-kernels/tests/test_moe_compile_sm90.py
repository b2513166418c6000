"""The quantized fused-MoE kernels compile for a real Hopper GPU (sm_90), without one: Triton's
ahead-of-time compiler down to a cubin with its bundled ptxas. The interpreter runs the numerics
(test_triton_quant.py) but accepts code the GPU compiler rejects (types, layouts, shared memory);
this catches those on a CPU-only machine, at the tiles ``_configs`` / ``_quant_config`` pick for
DeepSeek-V3 (FP8) and GPT-OSS-120B (MXFP4, interleaved gate/up, biases)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter child: nothing to compile
    pytest.skip("compiles for a GPU target; not under TRITON_INTERPRET", allow_module_level=True)
triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - a Triton without the AOT entry points
    pytest.skip("this Triton has no ASTSource / GPUTarget", allow_module_level=True)

from atom_kernels.backends.triton import moe  # noqa: E402
from atom_kernels.backends.triton.moe_mxfp4 import MODES, mxfp4_tiles  # noqa: E402

H100_SHARED_BYTES = 227 * 1024
# kernel pointer arguments by QUANT: the weight's and the scale's element types
WEIGHT_TYPE = {1: "*fp8e4nv", 2: "*u8"}
SCALE_TYPE = {1: "*fp32", 2: "*u8"}


def _compile(kernel, pointers: dict, constexprs: dict, cfg: dict):
    """Compile ``kernel`` for sm_90: ``pointers`` name -> pointer type, ``constexprs`` name ->
    value, every other argument a 32-bit int (``alpha`` / ``limit`` fp32)."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in ("alpha", "limit") else "i32"
    blocks = {k: v for k, v in cfg.items() if k.startswith("BLOCK")}
    src = ASTSource(kernel, signature, {**constexprs, **blocks})
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")


MXFP4_CASES = [  # every MXFP4 way (moe_mxfp4.MODES) on both paths; T = 1: per-pair
    ("mxfp4", shape, num_tokens, mode)
    for shape in ((128, 4, 2880, 2880), (256, 8, 7168, 2048))
    for num_tokens in (16, 1)
    for mode in ("legacy", "bits", "scaled", "words")
] + [  # the default way at prefill sizes: 1024 pairs (hist-align tiles), 128-row tiles
    ("mxfp4", (128, 4, 2880, 2880), num_tokens, "scaled") for num_tokens in (256, 4096)
]


@pytest.mark.parametrize(
    ("quant", "shape", "num_tokens", "mode"),
    [("fp8_block", (256, 8, 7168, 2048), 1, None), *MXFP4_CASES],
)
def test_quantized_moe_kernels_compile_for_sm90(monkeypatch, quant, shape, num_tokens, mode):
    num_experts, top_k, hidden, inter = shape
    monkeypatch.setattr(moe, "num_sms", lambda device: 132)  # an H100's, with no GPU here
    monkeypatch.setattr(moe, "_tma_capable", lambda device: True)  # (quantized experts: no TMA)
    mxfp4 = quant == "mxfp4"
    config = moe._configs(num_tokens, top_k, num_experts, hidden, inter, torch.device("cuda"))
    code = moe._QUANT[quant] if mode is None else MODES[mode]
    if mxfp4:
        config = mxfp4_tiles(config, code, num_tokens * top_k)
    config = moe._quant_config(config, quant, (128, 128))
    w, s = WEIGHT_TYPE[min(code, 2)], SCALE_TYPE[min(code, 2)]
    per_pair = config["per_pair"]
    assert per_pair == (num_tokens * top_k <= moe.PER_PAIR_MAX_PAIRS)
    common = dict(HAS_BIAS=mxfp4, PRECISION="tf32", QUANT=code)
    sorted_args = dict(TMA=False, WS=False, REMAINDER_M=config.get("remainder_m", 0), BLOCK_E=256)
    gemm1 = _compile(
        moe._gemm1_kernel,
        dict(x_ptr="*bf16", w_ptr=w, w_desc=w, bias_ptr="*bf16", out_ptr="*bf16",
             sorted_ptr="*i32", counts_ptr="*i32", ends_ptr="*i32", ids_ptr="*i32",
             topk_weights_ptr="*fp32", s_ptr=s),
        dict(common, ACTIVATION=2 if mxfp4 else 0, INTERLEAVED=mxfp4, PER_PAIR=per_pair,
             **sorted_args),
        config["gemm1"],
    )  # fmt: skip
    if per_pair:
        gemm2 = _compile(
            moe._gemm2_pair_kernel,
            dict(a_ptr="*bf16", w_ptr=w, bias_ptr="*bf16", ids_ptr="*i32",
                 topk_weights_ptr="*fp32", out_ptr="*fp32", s_ptr=s),
            dict(common, ATOMIC=False),
            config["gemm2"],
        )  # fmt: skip
    else:
        gemm2 = _compile(
            moe._gemm2_kernel,
            dict(a_ptr="*bf16", w_ptr=w, w_desc=w, bias_ptr="*bf16", topk_weights_ptr="*fp32",
                 out_ptr="*bf16", sorted_ptr="*i32", counts_ptr="*i32", ends_ptr="*i32", s_ptr=s),
            dict(common, ATOMIC=False, **sorted_args),
            config["gemm2"],
        )  # fmt: skip
    for kernel in (gemm1, gemm2):
        assert 0 < len(kernel.asm["cubin"])
        assert kernel.metadata.shared <= H100_SHARED_BYTES
