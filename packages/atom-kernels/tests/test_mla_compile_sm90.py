"""MLA decode (``mla_decode``) compiles for a real Hopper GPU (sm_90) without one, at DeepSeek-V3's
128-head launch (64-head blocks, 64-token tiles, 8 warps, 2 stages), and its tile loops' SASS is
counted: with EXCHANGE the logits take half the warpgroup MMAs (each warpgroup half the tile's
tokens) and the cache loads stay pipelined (cp.async). The GPU tests run both loops for real."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter child: nothing to compile
    pytest.skip("compiles for a GPU target; not under TRITON_INTERPRET", allow_module_level=True)
triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - a Triton without the AOT entry points
    pytest.skip("this Triton has no ASTSource / GPUTarget", allow_module_level=True)

from atom_kernels.backends.triton import mla_decode  # noqa: E402

POINTERS = {
    "q_latent_ptr": "*bf16", "q_pe_ptr": "*bf16", "kv_cache_ptr": "*bf16", "out_ptr": "*bf16",
    "m_part_ptr": "*fp32", "l_part_ptr": "*fp32", "acc_part_ptr": "*fp32", "count_ptr": "*i32",
    "p_scratch_ptr": "*bf16", "a_scratch_ptr": "*fp32", "block_tables_ptr": "*i32",
    "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "kv_scale_ptr": "*fp32",
    "scale": "fp32", "kv_scale": "fp32",
}  # fmt: skip
# Arguments a real launch passes as multiples of 16 (Triton specializes them): the pointers, the
# head count and dims, the strides but the block table's (not specialized on).
ALIGNED = {
    *(n for n, t in POINTERS.items() if t.startswith("*")), "num_heads", "latent_dim",
    "rope_dim", "stride_qt", "stride_qh", "stride_pt", "stride_ph", "stride_kb", "stride_ks",
    "stride_ot", "stride_oh",
}  # fmt: skip


def _compile(exchange: bool):
    kernel = mla_decode.mla_decode_kernel
    constexprs = dict(
        KV_SCALE_IS_PTR=False, SINGLE_SPLIT=False, FUSED_REDUCE=True, PRECISION="tf32",
        BLOCK_SIZE=16, BLOCK_H=64, BLOCK_N=64, BLOCK_L=512, BLOCK_R=64, EXCHANGE=exchange,
        EVEN_DIMS=True, ASM=True, stride_qd=1, stride_pd=1, stride_kd=1, stride_od=1,
    )  # fmt: skip
    signature = {
        n: "constexpr" if n in constexprs else POINTERS.get(n, "i32") for n in kernel.arg_names
    }
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(kernel.arg_names)
        if n in ALIGNED and signature[n] != "constexpr"
    }
    src = ASTSource(kernel, signature, constexprs, attrs)
    try:
        return triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=2)
        )
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")


def _tile_loops(compiled) -> list[list[str]]:
    """The instructions of each loop with warpgroup MMAs (the unmasked and the masked tile
    loop), by cuobjdump (Triton's bundled copy) on the cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):  # pragma: no cover
        pytest.skip("no bundled cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run(
            [tool, "-sass", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    code = [
        (int(m.group(1), 16), m.group(2).strip())
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    ]
    loops = [
        (int(m.group(1), 16), addr)
        for addr, ins in code
        if (m := re.search(r"BRA[^;]*?0x([0-9a-f]+)", ins)) and int(m.group(1), 16) < addr
    ]
    bodies = [[ins for addr, ins in code if start <= addr <= end] for start, end in loops]
    return [body for body in bodies if any("HGMMA" in ins for ins in body)]


def _count(body: list[str], pattern: str) -> int:
    return sum(1 for ins in body if re.search(pattern, ins))


def test_exchange_computes_the_logits_once():
    """Each 64-token tile: the logits (K = 576) and the value dot (N = 256 a warpgroup). With
    both warpgroups computing the whole [64, 64] logits tile it is 72 + 4 HGMMA a tile (Triton
    3.6 and 3.9); with EXCHANGE 40 + 4, and no fewer cp.async copies of the cache tile."""
    loops = {exchange: _tile_loops(_compile(exchange)) for exchange in (True, False)}
    assert len(loops[True]) == len(loops[False]) == 2, {k: len(v) for k, v in loops.items()}
    for exchanged, both in zip(loops[True], loops[False], strict=True):
        mmas, mmas_both = _count(exchanged, r"\bHGMMA\b"), _count(both, r"\bHGMMA\b")
        assert mmas <= 0.6 * mmas_both, (mmas, mmas_both)
        assert _count(exchanged, r"HGMMA\.64x256x16") == _count(both, r"HGMMA\.64x256x16") > 0
        copies = _count(exchanged, r"\bLDGSTS\b")
        assert copies >= _count(both, r"\bLDGSTS\b") > 0, "the cache loads must stay pipelined"
        # the named barrier of the exchange, once a tile
        assert _count(exchanged, r"BAR\.SYNC(\.DEFER_BLOCKING)? 0x1\b") == 1
        assert _count(exchanged, r"\bMUFU\.EX2\b") < _count(both, r"\bMUFU\.EX2\b")
