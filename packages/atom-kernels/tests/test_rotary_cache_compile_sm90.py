"""The fused rotary + KV-cache write kernel (``rotary_cache._rotary_cache_kernel``) compiles for a
real Hopper GPU (sm_90) without one, as test_gated_linear_compile_sm90.py does for the fused
GEMMs: Triton's ahead-of-time compiler down to a cubin with its bundled ptxas, for the shapes the
models launch it at (Qwen3 with its q/k norms, Llama without; bf16 and fp8 caches)."""

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

from atom_kernels.backends.triton import rotary_cache  # noqa: E402
from atom_kernels.backends.triton.common import next_pow2  # noqa: E402

POINTER_TYPES = {
    "positions_ptr": "*i64",
    "cos_sin_ptr": "*fp32",
    "slot_mapping_ptr": "*i64",
    "k_scale_ptr": "*fp32",
    "v_scale_ptr": "*fp32",
}
FLOATS = {"k_scale", "v_scale", "fp8_max", "eps"}


def _compile(
    num_heads, num_kv_heads, head_dim, has_norm, cache_type, scale_is_ptr=False, use_pdl=False
):
    kernel = rotary_cache._rotary_cache_kernel
    block_d = next_pow2(head_dim)
    constexprs = dict(
        IS_NEOX=True,
        Q_PARTIAL=False,
        K_PARTIAL=False,
        HAS_NORM=has_norm,
        IS_FP8=cache_type == "fp8e4nv",
        K_SCALE_IS_PTR=scale_is_ptr,
        V_SCALE_IS_PTR=scale_is_ptr,
        BLOCK_H=min(next_pow2(max(num_heads, num_kv_heads)), 4096 // block_d),
        BLOCK_HALF=head_dim // 2,
        BLOCK_DQ=block_d,
        BLOCK_DK=block_d,
        BLOCK_DV=block_d,
        USE_PDL=use_pdl,
    )
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTER_TYPES:
            signature[name] = POINTER_TYPES[name]
        elif name.endswith("cache_ptr"):
            signature[name] = "*" + cache_type
        elif name.endswith("_ptr"):
            signature[name] = "*bf16"
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    src = ASTSource(kernel, signature, constexprs, {})
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "has_norm", "cache_type", "scale_is_ptr"),
    [
        (16, 8, True, "bf16", False),  # Qwen3-0.6B
        (32, 8, False, "bf16", False),  # Llama-3-8B
        (16, 8, True, "fp8e4nv", False),  # an fp8 cache, float scales
        (32, 8, False, "fp8e4nv", True),  # tensor scales
    ],
)
def test_rotary_cache_kernel_compiles_for_sm90(
    num_heads, num_kv_heads, has_norm, cache_type, scale_is_ptr
):
    kernel = _compile(num_heads, num_kv_heads, 128, has_norm, cache_type, scale_is_ptr)
    assert 0 < len(kernel.asm["cubin"])
    ptx = kernel.asm["ptx"]
    assert "st.global" in ptx
    if cache_type == "fp8e4nv":  # x / scale rounded as IEEE (as reshape_and_cache), then to fp8
        assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx


def test_rotary_cache_kernel_with_pdl_waits_first():
    # PDL (ATOM_PDL, on by default): launched behind the QKV GEMM, it waits before its first read.
    ptx = _compile(16, 8, 128, True, "bf16", use_pdl=True).asm["ptx"]
    assert "griddepcontrol.wait" in ptx
    first_load = ptx.index("ld.global")
    assert ptx.index("griddepcontrol.wait") < first_load
