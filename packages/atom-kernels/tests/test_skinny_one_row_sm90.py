"""The one-row tiles ``ATOM_SKINNY_ONE_ROW`` can pick for the layers' projections: the spec's
parsing, where it applies, and that the candidate tiles compile for a real Hopper GPU (sm_90)
with 16-byte weight loads, PDL and split-K included (test_gated_linear_compile_sm90.py says why
the loads matter)."""

from __future__ import annotations

import os

import pytest

from atom_kernels.backends.triton import gated_linear, linear

CANDIDATES = ["4,1024,4", "8,2048,8", "4,1024,4,1,1", "8,2048,8,1,1", "16,512,4,2", "4,2048,4"]


def test_one_row_spec_parses_and_rejects_bad_specs():
    assert linear._one_row_override("") is None
    config = linear._one_row_override("8,1024,4")
    assert (config.block_n, config.block_k, config.num_warps, config.split_k) == (8, 1024, 4, 1)
    assert not config.use_dot
    assert linear._one_row_override("16,512,4,2").split_k == 2
    assert linear._one_row_override("16,512,4,1,1").prefetch
    assert not linear._one_row_override("16,512,4,1,0").prefetch
    for bad in ("8,1024", "8,1024,4,2,2", "8,1024,4,1,1,1", "a,b,c", "0,512,4"):
        with pytest.raises(ValueError, match="ATOM_SKINNY_ONE_ROW"):
            linear._one_row_override(bad)


def test_one_row_override_applies_to_the_projections_only(monkeypatch):
    tile = linear._one_row_override("8,1024,4,2")
    monkeypatch.setattr(linear, "ONE_ROW_OVERRIDE", tile)
    assert linear.default_config(1, 4096, 14336, 132, False, True) == tile
    assert linear.default_config(1, 128256, 4096, 132, False).block_k == 512  # an LM head
    assert linear.default_config(4, 4096, 4096, 132, False).use_dot  # more rows: unchanged
    assert linear.default_config(1, 4096, 4096, 132, True).block_k == 32  # the interpreter's
    qkv = gated_linear.default_config(1, False, gated=False, k=4096, n=6144)
    assert (qkv.block_n, qkv.block_k, qkv.split_k) == (8, 1024, 1)  # the norm kernel: no split
    assert gated_linear.default_config(1, False, gated=True, k=4096, n=14336).block_n == 4


def test_narrow_one_row_tiles_for_the_projections(monkeypatch):
    # K >= 4096 and not an LM head: 4 x 1024 / 4 warps, 8 x 2048 / 8 warps from K = 8192;
    # smaller K (Qwen3-0.6B's projections, their split-K) and more rows keep theirs.
    monkeypatch.setattr(linear, "ONE_ROW_OVERRIDE", None)

    def tile(n, k, rows=1, split=True):
        c = linear.default_config(rows, n, k, 132, False, split)
        return (c.block_n, c.block_k, c.num_warps, c.split_k, c.use_dot, c.prefetch)

    assert tile(6144, 4096) == (4, 1024, 4, 1, False, False)  # Llama-3-8B qkv
    assert tile(4096, 4096) == (4, 1024, 4, 1, False, False)  # o
    assert tile(4096, 14336) == (8, 2048, 8, 1, False, False)  # down
    assert tile(128256, 4096)[:2] == (16, 512)  # an LM head
    assert tile(1024, 3072)[:2] == (16, 512) and tile(1024, 3072)[3] > 1  # split-K kept
    assert tile(4096, 4096, rows=4)[4]  # dots at more rows
    qkv = gated_linear.default_config(1, False, gated=False, k=4096, n=6144)  # norm + QKV
    assert (qkv.block_n, qkv.block_k, qkv.num_warps) == (4, 1024, 4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for a GPU")
@pytest.mark.parametrize("spec", CANDIDATES)
def test_candidate_tiles_compile_for_sm90(spec):
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:  # pragma: no cover - a Triton without the AOT entry points
        pytest.skip("this Triton has no ASTSource / GPUTarget")
    config = linear._one_row_override(spec)
    kernel = linear._skinny_kernel
    constexprs = dict(
        HAS_BIAS=False, USE_DOT=False, EVEN_K=True, SPLIT_K=config.split_k, BLOCK_M=1,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, USE_PDL=True, LINE=64, LINES=8,
        PREFETCH=config.prefetch,
    )  # fmt: skip
    pointers = {"part_ptr": "*fp32", "count_ptr": "*i32"}
    signature = {
        n: "constexpr"
        if n in constexprs
        else pointers.get(n, "*bf16" if n.endswith("_ptr") else "i32")
        for n in kernel.arg_names
    }
    aligned = {
        "x_ptr",
        "w_ptr",
        "b_ptr",
        "out_ptr",
        "N",
        "K",
        "stride_xm",
        "stride_wn",
        "stride_om",
    }
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in aligned
    }
    options = dict(num_warps=config.num_warps, num_stages=1, launch_pdl=True)
    try:
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
            options=options,
        )  # fmt: skip
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")
    ptx = compiled.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "griddepcontrol.wait" in ptx
