"""The fused gate/up GEMM + SiLU-and-mul kernel (``_gated_skinny_kernel``) compiles for a real
Hopper GPU (sm_90) without one, as test_moe_compile_sm90.py does for the fused MoE: Triton's
ahead-of-time compiler down to a cubin with its bundled ptxas, at the tiles ``default_config``
picks (one row: the multiply-add path; several rows: dots), with the arguments a real launch
passes aligned. Its weight loads must stay 16-byte vector loads: a GEMV whose loads lose their
vectorization runs far slower (benchmarks/HISTORY.md, the split-K misalignment)."""

from __future__ import annotations

import os
import re

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter child: nothing to compile
    pytest.skip("compiles for a GPU target; not under TRITON_INTERPRET", allow_module_level=True)
triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - a Triton without the AOT entry points
    pytest.skip("this Triton has no ASTSource / GPUTarget", allow_module_level=True)

from atom_kernels.backends.triton import gated_linear  # noqa: E402

H100_SHARED_BYTES = 227 * 1024
# Arguments a real launch passes as multiples of 16 (Triton specializes them): the pointers,
# Qwen3-0.6B's N (3072) and K (1024), the strides.
ALIGNED = {
    "x_ptr", "w_ptr", "b_ptr", "out_ptr", "res_ptr", "norm_w_ptr", "res_out_ptr", "N", "K",
    "stride_xm", "stride_rm", "stride_wn", "stride_om", "stride_rom",
}  # fmt: skip


def _compile(
    num_rows: int,
    k: int,
    has_bias: bool,
    has_norm: bool,
    gated: bool = True,
    residual=None,
    one_pass: bool = False,
    prefetch: bool = False,
):
    kernel = gated_linear._gated_skinny_kernel
    config = gated_linear.default_config(num_rows, interpreted=False, gated=gated, k=k)
    use_dot = config.use_dot or num_rows > 1
    constexprs = dict(
        HAS_BIAS=has_bias,
        GATED=gated,
        HAS_NORM=has_norm,
        HAS_RESIDUAL=has_norm if residual is None else residual,
        USE_DOT=use_dot,
        EVEN_K=k % config.block_k == 0,
        BLOCK_M=16 if use_dot else 1,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_PDL=False,  # with it: test_pdl_compile_sm90.py
        LINE=64,
        LINES=8,
        ONE_PASS=one_pass,
        PREFETCH=prefetch,
    )
    signature = {
        name: "constexpr"
        if name in constexprs
        else "*bf16"
        if name.endswith("_ptr")
        else "fp32"
        if name == "eps"
        else "i32"
        for name in kernel.arg_names
    }
    names = kernel.arg_names
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ALIGNED}
    src = ASTSource(kernel, signature, constexprs, attrs)
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")


@pytest.mark.parametrize(
    ("num_rows", "k", "has_bias", "has_norm"),
    [
        (1, 1024, False, False),
        (1, 1024, False, True),  # the norm in front (what a batch-1 decode step runs)
        (4, 1024, False, False),  # K < 4096: 32 x 128 tiles
        (4, 4096, True, False),  # K >= 4096: 32 x 256
        (4, 4096, True, True),
    ],
)
def test_gated_skinny_kernel_compiles_for_sm90(num_rows, k, has_bias, has_norm):
    kernel = _compile(num_rows, k, has_bias, has_norm)
    assert 0 < len(kernel.asm["cubin"])
    assert kernel.metadata.shared <= H100_SHARED_BYTES
    ptx = kernel.asm["ptx"]
    if num_rows == 1:  # W straight to registers: 16-byte loads
        assert "ld.global.v4.b32" in ptx
    else:  # W pipelined through shared memory: 16-byte asynchronous copies
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("has_residual", [True, False])
def test_norm_linear_kernel_compiles_for_sm90(has_residual, one_pass):
    # The input norm + QKV projection at one row (the first layer has no residual yet).
    kernel = _compile(1, 1024, False, True, gated=False, residual=has_residual, one_pass=one_pass)
    assert 0 < len(kernel.asm["cubin"]) and "ld.global.v4.b32" in kernel.asm["ptx"]


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("gated", [True, False])
def test_one_pass_norm_compiles_for_sm90_at_hidden_4096(gated, prefetch):
    # Llama-3-8B's post-attention norm + gate/up and input norm + QKV with the norm's statistics
    # in the GEMM's loop (ATOM_NORM_ONE_PASS), at one row; W tiles loaded ahead, or not.
    kernel = _compile(1, 4096, False, True, gated=gated, one_pass=True, prefetch=prefetch)
    assert kernel.metadata.shared <= H100_SHARED_BYTES
    assert "ld.global.v4.b32" in kernel.asm["ptx"]
