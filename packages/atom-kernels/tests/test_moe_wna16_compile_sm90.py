"""The WNA16 fused-MoE kernels (``moe_wna16``) compile for a real Hopper GPU (sm_90), without one:
Triton's ahead-of-time compiler down to a cubin with its bundled ptxas (as
test_moe_compile_sm90.py for the other quantized experts). The interpreter runs the numerics
(test_triton_moe_wna16.py) but accepts code the GPU compiler rejects; this catches that on a
CPU-only machine, at the tiles ``wna16_configs`` picks for Kimi-K2's experts (int4, group 32,
symmetric) from decode to prefill, and for 8-bit asymmetric channel-wise experts."""

from __future__ import annotations

import os
import re

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

from atom_kernels.backends.triton import moe_wna16  # noqa: E402

H100_SHARED_BYTES = 227 * 1024
KIMI = (384, 8, 7168, 2048)  # E, K, H, I


# What the JIT specializes at a real call (contiguous rows, 16-aligned pointers and widths):
# integer arguments equal to 1 become constants, multiples of 16 carry tt.divisibility.
ONES = ("stride_xh", "stride_wk", "stride_sk", "stride_zk", "stride_tw")


def compile_sm90(kernel, pointers: dict, constexprs: dict, cfg: dict):
    """Compile ``kernel`` for sm_90: ``pointers`` name -> pointer type, ``constexprs`` name ->
    value, every other argument a 32-bit int (``alpha`` / ``limit`` fp32) with the JIT's
    specializations of a call on contiguous, aligned Kimi-K2 tensors (``ONES``, 16-divisible)."""
    constexprs = {**constexprs, **{n: 1 for n in ONES if n in kernel.arg_names}}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in ("alpha", "limit") else "i32"
    blocks = {k: v for k, v in cfg.items() if k.startswith("BLOCK")}
    runtime = ("alpha", "limit", "num_row_blocks", "group_m", "num_experts", "top_k")
    divisible = [
        n for n in kernel.arg_names if n not in {**constexprs, **blocks, **dict.fromkeys(runtime)}
    ]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(kernel, signature, {**constexprs, **blocks}, attrs)
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 2))
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")


def compile_gemms(shape, num_tokens, bits, group, zeros, dtype="bf16", monkeypatch=None,
                  packed=False):  # fmt: skip
    """(GEMM 1, GEMM 2) compiled at the tiles ``wna16_configs`` picks on an H100 (``packed``:
    with PACKED, its unpack in PTX)."""
    num_experts, top_k, hidden, inter = shape
    monkeypatch.setattr(moe_wna16, "num_sms", lambda device: 132)  # an H100's, no GPU here
    config = moe_wna16.wna16_configs(num_tokens, top_k, num_experts, hidden, inter, bits,
                                     torch.device("cuda"))  # fmt: skip
    assert config["per_pair"] == (num_tokens == 1)
    kernels = []
    for gemm, k in (("gemm1", hidden), ("gemm2", inter)):
        group_k = group or k
        x = torch.empty(0, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)
        launch = dict(config[gemm], PACKED=True) if packed else config[gemm]
        cfg, _, quant = moe_wna16._launch(launch, 1, k, group_k, bits, x=x)
        quant["ASM"] = packed  # a GPU's launch (x here is on the CPU)
        common = dict(HAS_ZEROS=zeros, **quant, HAS_BIAS=False, PRECISION="tf32",
                      PER_PAIR=config["per_pair"], BLOCK_E=512)  # fmt: skip
        quant_ptrs = dict(w_ptr="*i32", s_ptr=f"*{dtype}", z_ptr=f"*{dtype}",
                          bias_ptr=f"*{dtype}", ids_ptr="*i32", sorted_ptr="*i32",
                          counts_ptr="*i32", ends_ptr="*i32")  # fmt: skip
        if gemm == "gemm1":
            kernel = compile_sm90(
                moe_wna16._wna16_gemm1_kernel,
                dict(quant_ptrs, x_ptr=f"*{dtype}", out_ptr=f"*{dtype}"),
                dict(common, ACTIVATION=0, INTERLEAVED=False), cfg,
            )  # fmt: skip
        else:
            kernel = compile_sm90(
                moe_wna16._wna16_gemm2_kernel,
                dict(quant_ptrs, a_ptr=f"*{dtype}", topk_weights_ptr="*fp32", out_ptr="*fp32"),
                common, cfg,
            )  # fmt: skip
        kernels.append((kernel, cfg, quant))
    return kernels


@pytest.mark.parametrize("num_tokens", [1, 16, 64, 4096])
def test_wna16_moe_kernels_compile_for_sm90_kimi(monkeypatch, num_tokens):
    for kernel, _, quant in compile_gemms(KIMI, num_tokens, 4, 32, False, monkeypatch=monkeypatch):
        assert quant["SPLIT"]  # every default tile runs the split loop
        assert 0 < len(kernel.asm["cubin"])
        assert kernel.metadata.shared <= H100_SHARED_BYTES


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_wna16_moe_kernels_compile_for_sm90_int8_asym(monkeypatch, dtype, num_tokens):
    shape = (128, 8, 2048, 768)
    for kernel, _, _ in compile_gemms(shape, num_tokens, 8, 0, True, dtype, monkeypatch):
        assert 0 < len(kernel.asm["cubin"])
        assert kernel.metadata.shared <= H100_SHARED_BYTES


def test_wna16_decode_loads_packed_words_as_vectors(monkeypatch):
    """The decode tiles' split loop reads each column's packed words with 16-byte copies (4 words
    a thread, into the software pipeline's shared memory), not one 32-bit load per value: the
    point of loading the words once (a K mask would cap them at 8 bytes: EVEN_K)."""
    for kernel, _, quant in compile_gemms(KIMI, 16, 4, 32, False, monkeypatch=monkeypatch):
        assert quant["EVEN_K"]
        copies = re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)",
                            kernel.asm["ptx"])  # fmt: skip
        assert copies and set(copies) == {"0x10"}, copies


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(("group", "zeros"), [(32, False), (128, True)])
def test_wna16_moe_packed_compiles_for_sm90(monkeypatch, dtype, group, zeros):
    """PACKED at Kimi-K2's 16-token decode tiles: the packed unpack's PTX (byte permutes and
    packed FMAs: two of a pair's weights an instruction) in both GEMMs, no register spills."""
    fma = "fma.rn.bf16x2" if dtype == "bf16" else "fma.rn.f16x2"
    kernels = compile_gemms(KIMI, 16, 4, group, zeros, dtype, monkeypatch, packed=True)
    for kernel, _, quant in kernels:
        ptx = kernel.asm["ptx"]
        assert quant["PACKED"] and quant["SPLIT"]
        assert "prmt.b32" in ptx and fma in ptx and "ld.local" not in ptx
        assert kernel.metadata.shared <= H100_SHARED_BYTES
