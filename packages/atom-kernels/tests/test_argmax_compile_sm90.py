"""The greedy argmax kernel (``backends/triton/argmax.py``) compiles for a real Hopper GPU (sm_90)
without one, with and without programmatic dependent launch, at Llama-3-8B's vocabulary tiles;
with it, it waits on the LM head (``griddepcontrol.wait``) before its first read. Its merge is
an acquire/release atomic. The GPU tests run it for real."""

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

from atom_kernels.backends.triton import argmax  # noqa: E402

POINTERS = {
    "logits_ptr": "*bf16",
    "out_ptr": "*i64",
    "part_v_ptr": "*fp32",
    "part_i_ptr": "*i32",
    "count_ptr": "*i32",
}


@pytest.mark.parametrize("use_pdl", [True, False])
def test_argmax_kernel_compiles_for_sm90(use_pdl):
    kernel = argmax._argmax_kernel
    vocab = 128256  # Llama-3's
    constexprs = dict(
        BLOCK_V=1024, BLOCK_S=triton.next_power_of_2(triton.cdiv(vocab, 1024)), USE_PDL=use_pdl
    )
    signature = {
        name: "constexpr" if name in constexprs else POINTERS.get(name, "i32")
        for name in kernel.arg_names
    }
    aligned = {"logits_ptr", "out_ptr", "part_v_ptr", "part_i_ptr", "count_ptr", "stride_lb"}
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in aligned
    }
    options = dict(num_warps=4, num_stages=1)
    if use_pdl:
        options["launch_pdl"] = True
    src = ASTSource(kernel, signature, constexprs, attrs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")
    ptx = compiled.asm["ptx"]
    assert 0 < len(compiled.asm["cubin"])
    assert ("griddepcontrol.wait" in ptx) == use_pdl
    assert "atom.global.gpu.acq_rel.add" in ptx
