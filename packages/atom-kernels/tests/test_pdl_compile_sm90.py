"""The kernels that take programmatic dependent launch (``backends/triton/pdl.py``) compile for a
real Hopper GPU (sm_90) without one, with and without it: with it, each waits on the previous
kernel (``griddepcontrol.wait``) and releases the next; the GEMMs ask L2 for their first weight
lines before the wait, and their weight loads stay 16-byte vector loads (see
test_gated_linear_compile_sm90.py for why that matters). The GPU tests run them for real."""

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

from atom_kernels.backends.triton import gated_linear, linear, norm  # noqa: E402

SCALARS = {"eps": "fp32"}


def _compile(kernel, constexprs: dict, aligned: set[str], num_warps: int, num_stages: int):
    names = kernel.arg_names
    signature = {
        name: "constexpr"
        if name in constexprs
        else "*bf16"
        if name.endswith("_ptr")
        else SCALARS.get(name, "i32")
        for name in names
    }
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    src = ASTSource(kernel, signature, constexprs, attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if constexprs.get("USE_PDL"):
        options["launch_pdl"] = True
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")


def _check(ptx: str, use_pdl: bool) -> None:
    for instruction in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
        assert (instruction in ptx) == use_pdl, instruction
    assert ("prefetch.global.L2" in ptx) == use_pdl


GEMM_ALIGNED = {"x_ptr", "w_ptr", "b_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn"}
GEMM_ALIGNED |= {"stride_om"}


@pytest.mark.parametrize("use_pdl", [True, False])
@pytest.mark.parametrize(("num_rows", "prefetch"), [(1, False), (1, True), (4, False)])
def test_skinny_kernel(use_pdl, num_rows, prefetch):
    # Llama-3-8B's down projection (4096 x 14336) at the tiles default_config picks (one row:
    # with the next W tile loaded ahead, or not).
    config = linear.default_config(num_rows, 4096, 14336, 132, interpreted=False)
    use_dot = config.use_dot or num_rows > 1
    constexprs = dict(
        HAS_BIAS=False, USE_DOT=use_dot, EVEN_K=True, SPLIT_K=1, BLOCK_M=16 if use_dot else 1,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_PDL=use_pdl, LINE=64, LINES=8,
        PREFETCH=prefetch,
    )  # fmt: skip
    kernel = _compile(
        linear._skinny_kernel, constexprs, GEMM_ALIGNED, config.num_warps, config.num_stages
    )
    ptx = kernel.asm["ptx"]
    _check(ptx, use_pdl)
    if num_rows == 1:
        assert "ld.global.v4.b32" in ptx
    else:
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)


@pytest.mark.parametrize("use_pdl", [True, False])
@pytest.mark.parametrize(("has_norm", "one_pass"), [(True, False), (True, True), (False, False)])
def test_gated_skinny_kernel(use_pdl, has_norm, one_pass):
    # Qwen3-0.6B's gate/up at one row (with the post-attention norm in front, two passes or one,
    # or not).
    config = gated_linear.default_config(1, interpreted=False, gated=True, k=1024)
    constexprs = dict(
        GATED=True, HAS_BIAS=False, HAS_NORM=has_norm, HAS_RESIDUAL=has_norm, USE_DOT=False,
        EVEN_K=True, BLOCK_M=1, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        USE_PDL=use_pdl, LINE=64, LINES=8, ONE_PASS=one_pass, PREFETCH=False,
    )  # fmt: skip
    aligned = GEMM_ALIGNED | {"res_ptr", "norm_w_ptr", "res_out_ptr", "stride_rm", "stride_rom"}
    kernel = _compile(
        gated_linear._gated_skinny_kernel, constexprs, aligned, config.num_warps, config.num_stages
    )
    _check(kernel.asm["ptx"], use_pdl)
    assert "ld.global.v4.b32" in kernel.asm["ptx"]


@pytest.mark.parametrize("use_pdl", [True, False])
def test_rms_norm_kernel(use_pdl):
    constexprs = dict(HAS_RESIDUAL=True, BLOCK_N=4096, ROWS=1, USE_PDL=use_pdl)
    kernel = _compile(norm._rms_norm_kernel, constexprs, set(), 8, 1)
    ptx = kernel.asm["ptx"]
    for instruction in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
        assert (instruction in ptx) == use_pdl, instruction
