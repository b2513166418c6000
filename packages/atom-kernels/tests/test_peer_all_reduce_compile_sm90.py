"""The peer all-reduce kernel (``backends/triton/peer_all_reduce.py``) compiles for a real Hopper
GPU (sm_90) without one: 16- and 32-bit rows, plain and fused with the norm, one- and two-shot,
2 to 8 ranks, with and without PDL. Its pushes and polls are 16-byte wide, the polls volatile
(re-read every time, never hoisted); a peer that never comes traps, and the phase moves on
through an atomic. The multi-GPU tests run it for real."""

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

import triton.language as tl  # noqa: E402

from atom_kernels.backends.triton import peer_all_reduce  # noqa: E402


@pytest.mark.parametrize(
    ("dtype", "world", "fuse", "use_pdl", "two_shot", "each_slot"),
    [
        ("bf16", 2, True, True, False, False),
        ("bf16", 4, False, True, False, False),
        ("fp32", 8, True, False, False, False),
        ("bf16", 4, True, True, True, False),
        ("fp32", 2, False, False, True, False),
        ("bf16", 4, True, True, False, True),
    ],
)
def test_peer_all_reduce_compiles_for_sm90(dtype, world, fuse, use_pdl, two_shot, each_slot):
    kernel = peer_all_reduce._peer_all_reduce_kernel
    wide16 = dtype == "bf16"
    constexprs = dict(
        WORLD=world,
        BLOCK_N=4096,
        FUSE_NORM=fuse,
        TWO_SHOT=two_shot,
        EACH_SLOT=each_slot,
        TRAP=True,
        SPIN_LIMIT=peer_all_reduce.SPIN_LIMIT,
        PHASES=peer_all_reduce.PHASES,
        BITS_TY=tl.int16 if wide16 else tl.int32,
        MARK=peer_all_reduce.EMPTY16 if wide16 else peer_all_reduce.EMPTY32,
        SEND_AS=0 if wide16 else -(1 << 31),
        USE_PDL=use_pdl,
    )
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "buffers":  # a tuple of WORLD pointers, 16-byte aligned
            signature[name] = (f"*{dtype}",) * world
            attrs.update({(i, r): [["tt.divisibility", 16]] for r in range(world)})
        elif name.endswith("_ptr"):
            signature[name] = "*i32" if name == "counter_ptr" else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("num_cols", "slot_elems", "stride_x", "stride_r", "stride_o"):
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name == "eps" else "i32"
    src = ASTSource(kernel, signature, constexprs, attrs)
    try:
        compiled = triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=8, num_stages=1, **({"launch_pdl": True} if use_pdl else {})),
        )
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")
    ptx = compiled.asm["ptx"]
    assert 0 < len(compiled.asm["cubin"])
    # Rows go to the peers and are polled 16 bytes at a time.
    assert "st.global.v4.b32" in ptx and "ld.volatile.global.v4.b32" in ptx
    assert "trap;" in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert ("griddepcontrol.wait" in ptx) == use_pdl
