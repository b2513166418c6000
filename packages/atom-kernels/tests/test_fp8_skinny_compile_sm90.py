"""The weight-only block-FP8 GEMM (``backends/triton/fp8_skinny.py``) compiles for a real Hopper
GPU (sm_90) without one: one row (multiply-adds over several scale groups a tile) and 2-8 rows
(dots), with PDL; its weight loads stay vectorized."""

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

from atom_kernels.backends.triton import fp8_skinny, pdl  # noqa: E402


@pytest.mark.parametrize(("use_dot", "groups", "block_n"), [(False, 8, 8), (True, 1, 16)])
def test_fp8_skinny_compiles_for_sm90(use_dot, groups, block_n):
    kernel = fp8_skinny._fp8_skinny_kernel
    constexprs = dict(
        HAS_BIAS=True, USE_DOT=use_dot, GROUP_K=128, GROUPS=groups, BLOCK_K=groups * 128,
        BLOCK_M=16 if use_dot else 1, BLOCK_N=block_n, USE_PDL=True, LINE=128,
        LINES=pdl.PREFETCH_LINES,
    )  # fmt: skip
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "w_ptr":
            signature[name] = "*fp8e4nv"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "ws_ptr":
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("K", "stride_xm", "stride_wn", "stride_om"):
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
    try:
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=4, launch_pdl=True),
        )
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")
    ptx = compiled.asm["ptx"]
    assert 0 < len(compiled.asm["cubin"])
    assert "griddepcontrol.wait" in ptx
    # The fp8 weight stream: wide loads into registers (one row) or asynchronous copies into
    # shared memory (the dots' pipeline), not one byte at a time.
    assert "ld.global.v4.b32" in ptx or "cp.async" in ptx
