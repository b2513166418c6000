"""The block-FP8 GEMM (``_w8a8_kernel``, its split-K reduce) and the tiled per-token-group quant
compile for a real Hopper GPU (sm_90) without one, as test_moe_compile_sm90.py does for the fused
MoE: Triton's ahead-of-time compiler down to a cubin with its bundled ptxas. The interpreter runs
the numerics (test_triton_quant.py) but accepts code the GPU compiler rejects (fp8 dots, TMA
descriptors, atomics, shared memory); this catches those at the launches ``gemm_config`` picks for
DeepSeek-V3's projections (M = 1, 16, 4096 on 132 SMs) and the TMA tiles gemm_tiles sweeps."""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter child: nothing to compile
    pytest.skip("compiles for a GPU target; not under TRITON_INTERPRET", allow_module_level=True)
triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - a Triton without the AOT entry points
    pytest.skip("this Triton has no ASTSource / GPUTarget", allow_module_level=True)

from atom_kernels.backends.triton import quant  # noqa: E402

H100_SHARED_BYTES = 227 * 1024
H100_SMS = 132
# Arguments a real launch passes as multiples of 16 (Triton specializes them: aligned, vector
# loads, pipelined K loops): the pointers, DeepSeek-V3's N and K, the 128 blocks, the strides.
ALIGNED = {
    "a_ptr", "as_ptr", "b_ptr", "bs_ptr", "bias_ptr", "out_ptr", "ws_ptr", "count_ptr", "x_ptr",
    "q_ptr", "s_ptr", "N", "K", "group_n", "group_k", "split_len", "stride_am", "stride_bn",
    "stride_om", "stride_os", "stride_xm", "stride_qm", "num_cols", "group_size",
}  # fmt: skip


def _compile(kernel, pointers: dict, constexprs: dict, num_warps: int, num_stages: int):
    """Compile ``kernel`` for sm_90: ``pointers`` name -> pointer (or descriptor) type,
    ``constexprs`` name -> value, every other argument a 32-bit int (``eps`` fp32)."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name == "eps" else "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if name in ALIGNED and name in signature and not signature[name].startswith("tensordesc")
    }
    src = ASTSource(kernel, signature, constexprs, attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")


def _w8a8(cfg: dict, split: bool):
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tma = bool(cfg.get("TMA"))
    pointers = dict(
        a_ptr="*fp8e4nv", as_ptr="*fp32", b_ptr="*fp8e4nv", bs_ptr="*fp32", bias_ptr="*bf16",
        out_ptr="*bf16", ws_ptr="*fp32", count_ptr="*i32",
        a_desc=f"tensordesc<fp8e4nv[{bm}, 128]>" if tma else "*fp8e4nv",
        b_desc=f"tensordesc<fp8e4nv[{bn}, 128]>" if tma else "*fp8e4nv",
    )  # fmt: skip
    constexprs = dict(
        HAS_BIAS=True, UPCAST=False, SPLIT=split, FUSED_REDUCE=split and cfg["FUSED_REDUCE"],
        SCALAR_BS=128 % bn == 0, TMA=tma, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128,
    )  # fmt: skip
    return _compile(quant._w8a8_kernel, pointers, constexprs, cfg["num_warps"], cfg["num_stages"])


def _launches() -> dict:
    """name -> (config, split) of gemm_config at DeepSeek-V3's projections, one per kernel
    variant, plus the TMA tiles of the large-M sweep."""
    shapes = [(1536, 7168), (24576, 1536), (576, 7168), (7168, 16384), (4096, 7168), (7168, 2048)]
    out = {}
    for n, k in shapes:
        for rows in (1, 16, 4096):
            cfg = quant.gemm_config(rows, n, k, 128, H100_SMS)
            split = cfg["SPLIT_K"] > 1
            key = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"], split)
            out.setdefault("{}x{} w{} s{} split {}".format(*key), (cfg, split))
    for bm, bn in ((128, 128), (64, 256)):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=8, num_stages=3, TMA=True, FUSED_REDUCE=True)
        out[f"{bm}x{bn} w8 s3 tma"] = (cfg, False)
    unfused = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4, FUSED_REDUCE=False)
    out["16x64 w4 s4 split (reduce kernel)"] = (unfused, True)
    return out


LAUNCHES = _launches()


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_w8a8_kernel_compiles_for_sm90(name):
    cfg, split = LAUNCHES[name]
    kernel = _w8a8(cfg, split)
    assert 0 < len(kernel.asm["cubin"])
    assert kernel.metadata.shared <= H100_SHARED_BYTES
    if cfg["BLOCK_M"] >= 64:  # Hopper's warpgroup MMA, in FP8
        assert "wgmma" in kernel.asm["ptx"] and "e4m3" in kernel.asm["ptx"]


def test_split_k_reduce_and_group_quant_compile_for_sm90():
    reduce = _compile(
        quant._split_k_reduce_kernel, dict(ws_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16"),
        dict(HAS_BIAS=True, BLOCK=1024), 4, 1,
    )  # fmt: skip
    tiles = _compile(
        quant._group_quant_tiles_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"),
        dict(PAIRS=32, BLOCK=128), 4, 1,
    )  # fmt: skip
    for kernel in (reduce, tiles):
        assert 0 < len(kernel.asm["cubin"])
        assert kernel.metadata.shared <= H100_SHARED_BYTES
