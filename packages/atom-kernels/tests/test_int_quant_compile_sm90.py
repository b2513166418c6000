"""The integer-quantized kernels (``int_quant``: the WNA16 GEMM, its dequantization, the int8
quant and the W8A8 GEMM) compile for a real Hopper GPU (sm_90) without one, as
test_quant_compile_sm90.py does for the FP8 GEMM: the interpreter runs the numerics
(test_triton_int_quant.py) but accepts code the GPU compiler rejects (it took a plain global
float that the compiler refuses; the unpacking reshape, split-K atomics, int8 / fp64 dots). Each
launch ``wna16_config`` / ``int8_gemm_config`` picks for the Llama-3-8B projections on 132 SMs,
plus the benchmark's one-row multiply-adds; the SASS of SMALL_MAGIC's main loop is counted."""

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

from atom_kernels.backends.triton import int_quant, int_quant_frag  # noqa: E402

H100_SHARED_BYTES = 227 * 1024
H100_SMS = 132
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
# Arguments a real launch passes as multiples of 16 (Triton specializes them: aligned, vector
# loads): the pointers, the shapes' N and K, the group size, the strides.
ALIGNED = {
    "x_ptr", "q_ptr", "s_ptr", "z_ptr", "g_ptr", "b_ptr", "out_ptr", "ws_ptr",
    "count_ptr", "a_ptr", "as_ptr", "bs_ptr", "bias_ptr", "N", "K", "group_size", "stride_xm",
    "stride_qn", "stride_sn", "stride_zn", "stride_om", "stride_am", "stride_bn", "stride_qm",
}  # fmt: skip


def _compile(kernel, pointers: dict, constexprs: dict, num_warps: int, num_stages: int):
    """Compile ``kernel`` for sm_90: ``pointers`` name -> pointer type, ``constexprs`` name ->
    value, every other argument a 32-bit int."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "i32")
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if name in ALIGNED and name in signature and signature[name] != "constexpr"
    }
    src = ASTSource(kernel, signature, constexprs, attrs)
    try:
        return triton.compile(
            src, target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=num_warps, num_stages=num_stages),
        )  # fmt: skip
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")


def _wna16(cfg: dict, bits: int, zeros: bool, g_idx: bool, dtype: str = "bf16", group: int = 128):
    pointers = dict(
        x_ptr=f"*{dtype}", q_ptr="*i32", s_ptr=f"*{dtype}", z_ptr=f"*{dtype}", g_ptr="*i32",
        b_ptr=f"*{dtype}", out_ptr=f"*{dtype}", ws_ptr="*fp32", count_ptr="*i32",
    )  # fmt: skip
    split = cfg["SPLIT_K"] > 1
    per_tile = not g_idx and group % cfg["BLOCK_K"] == 0
    one_row = cfg["BLOCK_M"] == 1
    constexprs = dict(
        BITS=bits, HAS_ZEROS=zeros, HAS_G_IDX=g_idx, SCALE_PER_TILE=per_tile,
        SCALE_LATER=per_tile and 1 < cfg["BLOCK_M"] <= int_quant.SKINNY_MAX_ROWS,
        HAS_BIAS=True, ONE_ROW=one_row, PERMUTED_K=cfg.get("PERMUTED_K", False),
        SMALL_MAGIC=cfg.get("SMALL_MAGIC", False), PACKED_DOT=cfg.get("PACKED_DOT", False),
        ASM=cfg.get("PACKED_DOT", False) or cfg.get("QUAD_MMA", False) or cfg.get("ROW_MMA", False),
        QUAD_MMA=cfg.get("QUAD_MMA", False),
        GROUP_TILES=int_quant._group_tiles(group) if cfg.get("QUAD_MMA") else 0,
        STEP_TILES=cfg.get("QUAD_STEP", cfg.get("ROW_STEP", 1)), ROW_MMA=cfg.get("ROW_MMA", False),
        GROUP_WORDS=group // 8 if cfg.get("ROW_MMA") else 4,
        ROW_SCALE_AFTER=cfg.get("ROW_SCALE_AFTER", False), ROW_XSUM=cfg.get("ROW_XSUM", False),
        ROW_AHEAD=cfg.get("ROW_AHEAD", False),
        ROW_WARPS=cfg["num_warps"] if cfg.get("ROW_AHEAD") else 1,
        ROW_STRIDED=cfg.get("ROW_STRIDED", False),
        **{key: cfg.get(key, False) for key in int_quant.SMALL_MAGIC_VARIANTS},
        K_STAGES=cfg.get("k_stages", 1), IEEE=dtype == "fp32", EVEN_K=True,
        SPLIT_K=cfg["SPLIT_K"] if split else 1, GROUP_M=cfg.get("GROUP_M", 1),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
    )  # fmt: skip
    return _compile(
        int_quant._wna16_kernel, pointers, constexprs, cfg["num_warps"], cfg["num_stages"]
    )


def _wna16_launches() -> dict:
    out = {}
    for n, k in SHAPES:
        for rows in (1, 4, 16, 256, 4096):
            cfg = int_quant.wna16_config(rows, n, k, 128, True, H100_SMS)
            key = tuple(
                cfg[x] for x in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
            ) + (cfg["SPLIT_K"] > 1, cfg["PERMUTED_K"])
            out.setdefault("{}x{}x{} w{} s{} split {} permuted {}".format(*key), cfg)
            if cfg["PERMUTED_K"]:  # the interleaved loop at the same tile (benchmarks' baseline)
                old = dict(cfg, PERMUTED_K=False)
                out.setdefault("{}x{}x{} w{} s{} split {} interleaved".format(*key[:-1]), old)
    for permuted in (False, True):
        one_row = dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, SPLIT_K=4,
                       PERMUTED_K=permuted)  # fmt: skip
        out[f"one-row multiply-adds, split, permuted {permuted}"] = one_row
    for block_n, warps, stages in ((256, 4, 1), (256, 4, 2), (128, 2, 1), (128, 4, 2)):
        small_magic = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=128, num_warps=warps,
                           num_stages=stages, SPLIT_K=4, PERMUTED_K=True,
                           SMALL_MAGIC=True)  # fmt: skip
        out[f"one-row small magic {block_n} w{warps} s{stages}, split"] = small_magic
    for block_n, warps, k_stages in ((64, 4, 1), (128, 4, 2), (256, 8, 1), (64, 2, 3)):
        quad = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=128, num_warps=warps, num_stages=1,
                    k_stages=k_stages, SPLIT_K=4, PERMUTED_K=True, QUAD_MMA=True)  # fmt: skip
        out[f"one-row quad mma {block_n} w{warps} k{k_stages}, split"] = quad
    row_tiles = ((8, 4, 2, 1), (32, 8, 1, 1), (4, 4, 3, 1), (8, 4, 1, 2), (8, 4, 1, 4),
                 (16, 8, 1, 2))  # fmt: skip
    for block_n, warps, k_stages, step in row_tiles:
        row = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=1024, num_warps=warps, num_stages=1,
                   k_stages=k_stages, SPLIT_K=4, PERMUTED_K=True, ROW_MMA=True,
                   ROW_STEP=step)  # fmt: skip
        out[f"one-row row mma {block_n} w{warps} k{k_stages} step{step}, split"] = row
        if step == 1:
            after = dict(row, ROW_SCALE_AFTER=True)
            out[f"one-row row mma {block_n} w{warps} k{k_stages}, scale after, split"] = after
    out["one-row quad mma 64 w4 k2 step2, split"] = dict(
        BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, k_stages=2, SPLIT_K=4,
        PERMUTED_K=True, QUAD_MMA=True, QUAD_STEP=2,
    )  # fmt: skip
    for variant in int_quant.SMALL_MAGIC_VARIANTS:  # int_quant_small_magic's variants
        small_magic = dict(BLOCK_M=1, BLOCK_N=256, BLOCK_K=128, num_warps=4, num_stages=1,
                           SPLIT_K=4, PERMUTED_K=True, SMALL_MAGIC=True)  # fmt: skip
        small_magic[variant] = True
        out[f"one-row small magic 256 w4 s1 {variant}, split"] = small_magic
    return out


WNA16_LAUNCHES = _wna16_launches()


@pytest.mark.parametrize("name", list(WNA16_LAUNCHES))
def test_wna16_kernel_compiles_for_sm90(name):
    cfg = WNA16_LAUNCHES[name]
    kernel = _wna16(cfg, 4, False, False)
    assert 0 < len(kernel.asm["cubin"])
    assert kernel.metadata.shared <= H100_SHARED_BYTES
    ptx = kernel.asm["ptx"]
    assert "ld.local" not in ptx  # no register spills
    if cfg["BLOCK_M"] > 1:  # tensor cores, the packed words streamed through cp.async stages
        assert "mma" in ptx and "cp.async" in ptx


@pytest.mark.parametrize(
    ("bits", "zeros", "g_idx", "dtype", "group"),
    [(8, True, False, "fp16", 128), (4, True, True, "bf16", 128), (8, False, True, "fp32", 128),
     (4, True, False, "bf16", 32), (4, False, False, "fp16", 32), (8, True, False, "bf16", 32)],
)  # fmt: skip
def test_wna16_variants_compile_for_sm90(bits, zeros, g_idx, dtype, group):
    """Zeros, 8-bit, g_idx, fp32; group 32 (the permuted loop gathers a scale per word)."""
    for rows in (1, 256):
        cfg = int_quant.wna16_config(rows, 4096, 4096, group, not g_idx, H100_SMS, bits=bits)
        kernel = _wna16(cfg, bits, zeros, g_idx, dtype, group)
        assert 0 < len(kernel.asm["cubin"])
        assert kernel.metadata.shared <= H100_SHARED_BYTES
        if rows == 1 and group == 32:
            one_row = _wna16(dict(cfg, BLOCK_M=1, num_stages=1), bits, zeros, g_idx, dtype, group)
            assert "ld.local" not in one_row.asm["ptx"]
        if rows == 1 and bits == 4 and not g_idx:  # SMALL_MAGIC: zeros, fp16 x, group 32
            small_magic = dict(cfg, BLOCK_M=1, num_stages=1, SMALL_MAGIC=True)
            for variant in (None, *int_quant.SMALL_MAGIC_VARIANTS):
                launch = dict(small_magic, **{variant: True}) if variant else small_magic
                kernel = _wna16(launch, bits, zeros, g_idx, dtype, group)
                assert "ld.local" not in kernel.asm["ptx"], variant


def test_dequantize_and_int8_quant_compile_for_sm90():
    dequant = _compile(
        int_quant._dequant_wna16_kernel,
        dict(q_ptr="*i32", s_ptr="*bf16", z_ptr="*bf16", g_ptr="*i32", out_ptr="*bf16"),
        dict(BITS=4, HAS_ZEROS=True, HAS_G_IDX=False, SCALE_PER_TILE=True, EVEN_K=True,
             BLOCK_N=32, BLOCK_K=128), 4, 1,
    )  # fmt: skip
    quant = _compile(
        int_quant._int8_quant_kernel,
        dict(x_ptr="*bf16", q_ptr="*i8", s_ptr="*fp32", in_scale_ptr="*fp32"),
        dict(STATIC=False, BLOCK=4096), 8, 1,
    )  # fmt: skip
    for kernel in (dequant, quant):
        assert 0 < len(kernel.asm["cubin"])
    # the rounding trick survives compilation (not folded away): adds of +-1.5 * 2**23
    assert "0f4B400000" in quant.asm["ptx"] and "0fCB400000" in quant.asm["ptx"]


@pytest.mark.parametrize("rows", [1, 16, 256, 4096])
def test_int8_gemm_compiles_for_sm90(rows):
    cfg = int_quant.int8_gemm_config(rows, 4096, 4096, H100_SMS)
    pointers = dict(
        a_ptr="*i8", as_ptr="*fp32", b_ptr="*i8", bs_ptr="*fp32", bias_ptr="*bf16",
        out_ptr="*bf16", ws_ptr="*i32", count_ptr="*i32",
    )  # fmt: skip
    constexprs = dict(
        HAS_BIAS=True, EVEN_K=True, SPLIT_K=cfg["SPLIT_K"], GROUP_M=cfg["GROUP_M"],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
    )  # fmt: skip
    kernel = _compile(
        int_quant._int8_gemm_kernel, pointers, constexprs, cfg["num_warps"], cfg["num_stages"]
    )
    assert 0 < len(kernel.asm["cubin"])
    assert kernel.metadata.shared <= H100_SHARED_BYTES
    assert "s8" in kernel.asm["ptx"] and "mma" in kernel.asm["ptx"]  # int8 tensor-core MMA


def _sweep_candidates() -> dict:
    """benchmarks/quant_kernels.py's int_tiles candidates (WNA16_TILES), by name."""
    import importlib.util
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[3] / "benchmarks"
    sys.path.insert(0, str(benchmarks))  # it imports benchmarks/kernels.py as `kernels`
    try:
        spec = importlib.util.spec_from_file_location(
            "atom_benchmarks_quant_kernels", benchmarks / "quant_kernels.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(benchmarks))
    out = {}
    for rows, candidates in module.WNA16_TILES.items():
        for cfg in candidates:
            out.setdefault(" ".join(f"{k}={v}" for k, v in cfg.items()), (rows, cfg))
    return out


SWEEP = _sweep_candidates()


@pytest.mark.parametrize("name", list(SWEEP))
def test_int_tiles_candidates_compile_for_sm90(name):
    """Each candidate the benchmark sweeps (at o_proj, 4096 x 4096, split as it would be) builds
    within the H100's shared memory: a device call spends no time on ones that cannot."""
    rows, candidate = SWEEP[name]
    cfg = {**int_quant.wna16_config(rows, 4096, 4096, 128, True, H100_SMS), **candidate}
    if cfg["SPLIT_K"] is None:
        tiles = -(-rows // cfg["BLOCK_M"]) * -(-4096 // cfg["BLOCK_N"])
        cfg["SPLIT_K"] = int_quant.split_for(tiles, 4096 // cfg["BLOCK_K"], H100_SMS, 2)
    kernel = _wna16(cfg, 4, False, False)
    assert 0 < len(kernel.asm["cubin"])
    assert kernel.metadata.shared <= H100_SHARED_BYTES


def _cuobjdump(kernel, flag: str) -> str:
    """cuobjdump ``flag`` (Triton's bundled copy) on ``kernel``'s cubin: its output."""
    import subprocess
    import tempfile
    from pathlib import Path

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():  # pragma: no cover - a Triton without the bundled tools
        pytest.skip("no bundled cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run(
            [str(cuobjdump), flag, cubin.name], capture_output=True, text=True, check=True
        ).stdout


def _main_loop_sass(kernel) -> list[str]:
    """The instructions of ``kernel``'s one loop (from its backward branch to its target), by
    cuobjdump (Triton's bundled copy) on the cubin."""
    sass = _cuobjdump(kernel, "-sass")
    code = [
        (int(m.group(1), 16), m.group(2).strip())
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    ]
    loops = [
        (int(m.group(1), 16), addr)
        for addr, ins in code
        if (m := re.search(r"BRA[^;]*?0x([0-9a-f]+)", ins)) and int(m.group(1), 16) < addr
    ]
    assert len(loops) == 1, loops
    start, end = loops[0]
    return [ins for addr, ins in code if start <= addr <= end]


def test_small_magic_main_loop_sass():
    """SMALL_MAGIC's main loop at its benchmark launch (BLOCK_N 256, BLOCK_K 128, 4 warps): no
    subtraction a weight, and its AND-OR masks stay in registers (as constants ptxas re-created
    one with a move before each AND-OR: 4.19 instructions a weight, 0.73 of them moves). Counts
    (Triton 3.9's ptxas): 3.47 a weight, the permuted loop it varies 4.91."""
    cfg = dict(BLOCK_M=1, BLOCK_N=256, BLOCK_K=128, num_warps=4, num_stages=1, SPLIT_K=1,
               PERMUTED_K=True, SMALL_MAGIC=True)  # fmt: skip
    body = _main_loop_sass(_wna16(cfg, 4, False, False))
    weights = 256 * 128 / (32 * 4)  # a thread's, a K tile
    moves = sum(1 for ins in body if re.match(r"(@\S+\s+)?(MOV|IMAD\.MOV|HFMA2\.MMA)\b", ins))
    fadds = sum(1 for ins in body if re.match(r"(@\S+\s+)?FADD\b", ins))
    assert moves / weights < 0.1, (moves, weights)
    assert fadds / weights < 0.2, (fadds, weights)
    assert len(body) / weights < 3.8, (len(body), weights)


# (variant, instructions a weight at most, registers at most) of SMALL_MAGIC's main loop at its
# default launch, bf16 x, symmetric (Triton 3.9's ptxas; counts, not times): the default 3.47 and
# 159 registers, X_VECTOR 3.11 and 128, X_SPLIT 3.02 and 161 (x through shared memory: a
# barrier pair), PREFETCH 3.63 and 243.
SMALL_MAGIC_SASS = [
    ({}, 3.6, 168), (dict(X_VECTOR=True), 3.25, 136), (dict(X_SPLIT=True), 3.15, 168),
    (dict(PREFETCH=True), 3.8, 255),
]  # fmt: skip


def _registers(kernel) -> int:
    """Registers a thread of ``kernel`` (cuobjdump -res-usage on its cubin)."""
    return int(re.search(r"REG:(\d+)", _cuobjdump(kernel, "-res-usage")).group(1))


@pytest.mark.parametrize(("variant", "most", "most_registers"), SMALL_MAGIC_SASS, ids=str)
def test_small_magic_variants_sass(variant, most, most_registers):
    """The variants' main loops: X_VECTOR's x as eight 64-bit loads a tile (no 16-bit ones, no
    shared memory for x: the loop's one barrier pair is the scales' layout conversion)."""
    cfg = dict(BLOCK_M=1, BLOCK_N=256, BLOCK_K=128, num_warps=4, num_stages=1, SPLIT_K=1,
               PERMUTED_K=True, SMALL_MAGIC=True, **variant)  # fmt: skip
    kernel = _wna16(cfg, 4, False, False)
    body = _main_loop_sass(kernel)
    weights = 256 * 128 / (32 * 4)  # a thread's, a K tile
    assert "ld.local" not in kernel.asm["ptx"]
    assert len(body) / weights < most, (len(body), weights)
    assert _registers(kernel) <= most_registers
    if variant.get("X_VECTOR"):
        wide = sum(1 for ins in body if re.match(r"(@\S+\s+)?LDG\.E\.64\b", ins))
        narrow = sum(1 for ins in body if re.match(r"(@\S+\s+)?LDG\.E\.U16\b", ins))
        barriers = sum(1 for ins in body if ins.startswith("BAR"))
        assert wide == 8 and narrow <= 2 and barriers <= 2, (wide, narrow, barriers)


# (BLOCK_N, warps, stages) of the packed-unpack dots (PACKED_DOT, 16-row dots, BLOCK_K 128):
# wna16_config's default and benchmarks/quant_kernels.py's PACKED_DOT_TILES.
PACKED_DOT_SASS = [((128, 4, 4), 3.25), ((256, 8, 3), 3.0), ((64, 4, 4), 4.4)]


@pytest.mark.parametrize(("tile", "most"), PACKED_DOT_SASS, ids=str)
@pytest.mark.parametrize(("dtype", "zeros"), [("bf16", False), ("bf16", True), ("fp16", True)])
def test_packed_dot_main_loop_sass(tile, most, dtype, zeros):
    """The packed unpack compiles to what int_quant_packed_dot counts: per pair of words 4 byte
    permutes, 4 shifts, 8 AND-ORs and 8 packed FMAs (HFMA2 / HADD2), no fp32 unpack, the words
    streamed through cp.async into the MMA operand's layout (no register spills). Counts (Triton
    3.9's ptxas, BLOCK_N 128, 4 warps): 3.07 a weight, of them 1.5 the unpack; most of the rest is
    x's 8 [16, BLOCK_K / 8] tiles a K tile through shared memory (a barrier pair each)."""
    block_n, warps, stages = tile
    cfg = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, num_warps=warps, num_stages=stages,
               SPLIT_K=4, PERMUTED_K=True, PACKED_DOT=True)  # fmt: skip
    kernel = _wna16(cfg, 4, zeros, False, dtype)
    ptx = kernel.asm["ptx"]
    assert "ld.local" not in ptx and "cp.async" in ptx and "prmt.b32" in ptx
    assert ("fma.rn.bf16x2" if dtype == "bf16" else "fma.rn.f16x2") in ptx
    assert kernel.metadata.shared <= H100_SHARED_BYTES
    body = _main_loop_sass(kernel)
    weights = block_n * 128 / (32 * warps)  # a thread's, a K tile
    packed = sum(1 for ins in body if re.match(r"(@\S+\s+)?(HFMA2|HADD2)\b", ins))
    assert 0.5 <= packed / weights < 0.6, (packed, weights)  # HFMA2.MMA moves too
    assert not any(re.match(r"(@\S+\s+)?(I2F|F2F)", ins) for ins in body)
    assert len(body) / weights < most, (len(body), weights)


@pytest.mark.parametrize(("dtype", "zeros"), [("bf16", False), ("fp16", True)])
def test_packed_dot_x_split_main_loop_sass(dtype, zeros):
    """X_SPLIT: x's [16, BLOCK_K / 8, 8] tile streams through cp.async with the words and reaches
    the MMAs' layout from shared memory: the loop's only global loads and barriers are the tile's
    [BLOCK_N] scales (and zeros) and their layout conversion (the default x load: 16 loads of x
    and 4 barriers; Triton 3.9's ptxas: 2.85 instructions a weight, 141 registers)."""
    cfg = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4, SPLIT_K=4,
               PERMUTED_K=True, PACKED_DOT=True, X_SPLIT=True)  # fmt: skip
    kernel = _wna16(cfg, 4, zeros, False, dtype)
    assert "ld.local" not in kernel.asm["ptx"]
    body = _main_loop_sass(kernel)
    weights = 128 * 128 / (32 * 4)
    loads = [ins for ins in body if re.match(r"(@\S+\s+)?LDG\b", ins)]
    barriers = [ins for ins in body if ins.startswith("BAR")]
    assert len(loads) <= 1 + zeros and len(barriers) <= 2 + 2 * zeros, (loads, barriers)
    assert len(body) / weights < 3.0, (len(body), weights)


def test_small_magic_k_stages_pipeline_the_loads():
    """``k_stages`` 3 (tl.range's num_stages) at the one-row launch: the words and scales
    reach the loop as cp.async copies into shared memory (none with a plain range, whatever the
    launch's num_stages), two tiles of words ahead, and without spills."""
    base = dict(BLOCK_M=1, BLOCK_N=256, BLOCK_K=128, num_warps=4, num_stages=1, SPLIT_K=4,
                PERMUTED_K=True, SMALL_MAGIC=True, X_VECTOR=True)  # fmt: skip
    plain = _cuobjdump(_wna16(dict(base, num_stages=3), 4, False, False), "-sass")
    assert "LDGSTS" not in plain
    kernel = _wna16(dict(base, k_stages=3), 4, False, False)
    sass = _cuobjdump(kernel, "-sass")
    assert sass.count("LDGSTS") >= 16, sass.count("LDGSTS")
    assert "STL" not in sass and "LDL" not in sass
    assert kernel.metadata.shared >= 2 * 256 * 16 * 4  # two [BLOCK_N, BLOCK_K / 8] int32 tiles


# (BLOCK_N, warps, zeros, dtype, instructions a word at most) of QUAD_MMA's main loop (Triton
# 3.9's ptxas; counts, not times): 13 a word in the PTX (4 AND-ORs, 3 shifts, 4 packed FMAs, 2
# MMAs), x's pairs and the scales' shuffles shared by a thread's rows.
QUAD_MMA_SASS = [
    (64, 4, False, "bf16", 24), (64, 4, True, "bf16", 25), (128, 4, False, "bf16", 21),
    (128, 4, True, "fp16", 22), (256, 8, False, "bf16", 21),
]  # fmt: skip


@pytest.mark.parametrize(("block_n", "warps", "zeros", "dtype", "most"), QUAD_MMA_SASS)
def test_quad_mma_layout_and_main_loop_sass(block_n, warps, zeros, dtype, most):
    """QUAD_MMA's PTX takes the words in the layout it was written for (each thread 4 adjacent
    words of one row, a quad one row: int_quant_quad_mma.QUAD_LAYOUT), which its inline
    assembly's operands keep; its main loop has 2 MMAs a word, no shared memory, no barrier,
    no register spills, and stays within its instruction count."""
    from atom_kernels.backends.triton import int_quant_quad_mma

    cfg = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=128, num_warps=warps, num_stages=1,
               SPLIT_K=4, PERMUTED_K=True, QUAD_MMA=True)  # fmt: skip
    kernel = _wna16(cfg, 4, zeros, False, dtype=dtype)
    ttgir = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"(#blocked\d*) = #ttg.blocked<\{([^}]*)\}>", ttgir))
    asm_ops = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line]
    assert asm_ops, "no inline assembly in the kernel"
    for line in asm_ops:
        for encoding in set(re.findall(r"tensor<[^>]*?(#blocked\d*)>", line)):
            assert layouts[encoding].startswith(int_quant_quad_mma.QUAD_LAYOUT), line
            assert f"warpsPerCTA = [{warps}, 1]" in layouts[encoding], layouts[encoding]
    assert "ld.local" not in kernel.asm["ptx"]
    body = _main_loop_sass(kernel)
    words = block_n * 16 / (32 * warps)  # a thread's, a K tile
    mmas = sum(1 for ins in body if re.match(r"(@\S+\s+)?HMMA\b", ins))
    assert mmas == 2 * words, (mmas, words)
    assert not [ins for ins in body if re.match(r"(@\S+\s+)?(LDS|STS|BAR|LDSM)\b", ins)]
    assert len(body) / words <= most, (len(body), words)


# (BLOCK_N, warps, zeros, dtype, group, instructions a word at most) of ROW_MMA's main loop
# (Triton 3.9's ptxas): 21 a word in the PTX (4 AND-ORs, 3 shifts, 8 packed FMAs, 2 MMAs, 4
# byte permutes of x), a lane's x and scale loads shared by its rows.
ROW_MMA_SASS = [
    (8, 4, False, "bf16", 128, 26), (16, 4, True, "bf16", 32, 26), (32, 8, False, "fp16", 128, 24),
]  # fmt: skip


@pytest.mark.parametrize(("block_n", "warps", "zeros", "dtype", "group", "most"), ROW_MMA_SASS)
def test_row_mma_layout_and_main_loop_sass(block_n, warps, zeros, dtype, group, most):
    """ROW_MMA's PTX takes the words in the layout it was written for (lane l words 4l .. 4l + 3
    of its warp's row: int_quant_row_mma.ROW_LAYOUT), which all its inline assembly's operands
    keep (x and the scales loaded by PTX too); its main loop has 2 MMAs a word, no shared
    memory, no barrier, no register spills, and stays within its instruction count."""
    from atom_kernels.backends.triton import int_quant_row_mma

    cfg = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=1024, num_warps=warps, num_stages=1,
               SPLIT_K=4, PERMUTED_K=True, ROW_MMA=True)  # fmt: skip
    kernel = _wna16(cfg, 4, zeros, False, dtype=dtype, group=group)
    ttgir = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"(#blocked\d*) = #ttg.blocked<\{([^}]*)\}>", ttgir))
    asm_ops = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line]
    assert len(asm_ops) >= 3, asm_ops  # the MMAs, x, the scales
    for line in asm_ops:
        for encoding in set(re.findall(r"tensor<[^>]*?(#blocked\d*)>", line)):
            assert layouts[encoding].startswith(int_quant_row_mma.ROW_LAYOUT), line
            assert f"warpsPerCTA = [{warps}, 1]" in layouts[encoding], layouts[encoding]
    assert "ld.local" not in kernel.asm["ptx"]
    body = _main_loop_sass(kernel)
    words = block_n * 128 / (32 * warps)  # a lane's, a K tile
    mmas = sum(1 for ins in body if re.match(r"(@\S+\s+)?HMMA\b", ins))
    assert mmas == 2 * words, (mmas, words)
    assert not [ins for ins in body if re.match(r"(@\S+\s+)?(LDS|STS|BAR|LDSM)\b", ins)]
    assert len(body) / words <= most, (len(body), words)


@pytest.mark.parametrize(("k", "loop"), [(4096, "ROW_MMA"), (4352, "QUAD_MMA")])
def test_one_row_mma_defaults_keep_their_layouts(k, loop):
    """The launches wna16_config picks at one row (a warp a row at K of 1024, else the quads':
    k_stages, QUAD_STEP, the split) compile with every inline assembly operand in the layout
    its PTX was written for."""
    from atom_kernels.backends.triton import int_quant_quad_mma, int_quant_row_mma

    cfg = int_quant.wna16_config(1, 4096, k, 128, True, H100_SMS, quad=True)
    assert cfg.get(loop), cfg
    want = int_quant_row_mma.ROW_LAYOUT if loop == "ROW_MMA" else int_quant_quad_mma.QUAD_LAYOUT
    kernel = _wna16(cfg, 4, True, False)
    ttgir = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"(#blocked\d*) = #ttg.blocked<\{([^}]*)\}>", ttgir))
    asm_ops = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line]
    assert asm_ops
    for line in asm_ops:
        for encoding in set(re.findall(r"tensor<[^>]*?(#blocked\d*)>", line)):
            assert layouts[encoding].startswith(want), line
    assert "ld.local" not in kernel.asm["ptx"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("zeros", [False, True])
def test_row_mma_scale_after_main_loop_sass(zeros, dtype):
    """ROW_MMA's main loop at the default launch (8 rows, 4 warps) with the scale after its
    MMAs (ROW_SCALE_AFTER): the same MMAs and 4 packed float ops a word fewer (the scaling
    ones), so fewer instructions a tile (Triton 3.9's ptxas, bf16: 192 -> 164 a thread's tile
    of 8 words, 198 -> 171 with zeros)."""
    cfg = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=4,
               PERMUTED_K=True, ROW_MMA=True)  # fmt: skip
    loops = {
        after: _main_loop_sass(_wna16(dict(cfg, ROW_SCALE_AFTER=after), 4, zeros, False, dtype))
        for after in (False, True)
    }
    words = 8 * 128 / (32 * 4)  # a thread's, a K tile (2 rows of 4 words)

    def count(body, pattern):
        return sum(1 for ins in body if re.match(rf"(@\S+\s+)?{pattern}\b", ins))

    mmas = {after: count(body, "HMMA") for after, body in loops.items()}
    # the packed float ops (ptxas makes the scaling FMA with -0 an HMUL2, the zero's an HFMA2
    # or HADD2)
    fmas = {after: count(body, r"H(FMA|MUL|ADD)2(\.\w+)?") for after, body in loops.items()}
    assert mmas[False] == mmas[True] == 2 * words, mmas
    # (fp16: the scale's conversion to fp32 is an HADD2.F32, one a 4 words)
    assert fmas[False] - fmas[True] == 4 * words - (2 if dtype == "fp16" else 0), fmas
    assert len(loops[True]) < len(loops[False]) - 3 * words, {k: len(v) for k, v in loops.items()}


def _assert_row_layout(kernel) -> None:
    """Every inline assembly operand of ``kernel`` in ROW_MMA's layout (ROW_LAYOUT), no spills."""
    from atom_kernels.backends.triton import int_quant_row_mma

    ttgir = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"(#blocked\d*) = #ttg.blocked<\{([^}]*)\}>", ttgir))
    for line in (line for line in ttgir.splitlines() if "elementwise_inline_asm" in line):
        for encoding in set(re.findall(r"tensor<[^>]*?(#blocked\d*)>", line)):
            assert layouts[encoding].startswith(int_quant_row_mma.ROW_LAYOUT), line
    assert "ld.local" not in kernel.asm["ptx"]


# (BLOCK_N, warps, zeros, instructions a word at most, registers at most) of ROW_MMA's main loop
# with the zero and the scale after its MMAs (ROW_XSUM), bf16, groups of 128 (Triton 3.9's
# ptxas: 8 rows, 4 warps 17.25 a word, 19.5 with zeros, against 24.0 and 24.75 without; 16
# rows 15.44 and 15.88 at 66 and 104 registers).
ROW_XSUM_SASS = [(8, 4, False, 18.5, 72), (8, 4, True, 20.5, 72), (16, 4, False, 16.5, 80),
                 (16, 4, True, 17, 128), (32, 8, False, 16.5, 80)]  # fmt: skip


@pytest.mark.parametrize(("block_n", "warps", "zeros", "most", "most_registers"), ROW_XSUM_SASS)
def test_row_mma_xsum_main_loop_sass(block_n, warps, zeros, most, most_registers):
    """ROW_XSUM's main loop: no packed float op a weight (the unpack's AND-ORs give 128 +
    q straight to the MMAs), the row MMAs 2 a word plus 4 a thread's tile for the x-sums (one
    set for all the warp's rows: a pure PTX on the same x), every inline assembly operand in the
    words' layout, no shared memory, no spills, and fewer instructions a word than without."""

    cfg = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=1024, num_warps=warps, num_stages=1,
               SPLIT_K=4, PERMUTED_K=True, ROW_MMA=True)  # fmt: skip
    kernel = _wna16(dict(cfg, ROW_XSUM=True), 4, zeros, False)
    _assert_row_layout(kernel)
    body = _main_loop_sass(kernel)
    words = block_n * 128 / (32 * warps)  # a lane's, a K tile

    def count(pattern):
        return sum(1 for ins in body if re.match(rf"(@\S+\s+)?{pattern}\b", ins))

    assert count("HMMA") == 2 * words + 4, (count("HMMA"), words)
    # (zeros: -(128 + zero) of the loaded zeros, once a row's tile)
    assert count(r"H(FMA|MUL|ADD)2(\.\w+)?") <= (words / 2 if zeros else 0)
    assert not [ins for ins in body if re.match(r"(@\S+\s+)?(LDS|STS|BAR|LDSM)\b", ins)]
    assert len(body) / words <= most, (len(body), words)
    assert _registers(kernel) <= most_registers
    plain = _main_loop_sass(_wna16(cfg, 4, zeros, False))
    assert len(body) < len(plain), (len(body), len(plain))


@pytest.mark.parametrize("keys", [{}, dict(ROW_XSUM=True)], ids=str)
@pytest.mark.parametrize("zeros", [False, True])
def test_row_mma_ahead_loads_the_steps_weights_first(keys, zeros):
    """ROW_AHEAD at 2 tiles a step: both tiles' word loads of both of a thread's rows (plain
    128-bit loads; x's are read-only ones) before the step's first MMA (tied to them by an OR
    with a run-time zero; without it ptxas issues them after MMAs), each tile's x loaded at
    its math, every operand in the words' layout, no shared memory, no spills."""

    cfg = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=4,
               PERMUTED_K=True, ROW_MMA=True, ROW_STEP=2, **keys)  # fmt: skip
    kernel = _wna16(dict(cfg, ROW_AHEAD=True), 4, zeros, False)
    _assert_row_layout(kernel)
    body = _main_loop_sass(kernel)
    words = [i for i, ins in enumerate(body) if re.match(r"(@\S+\s+)?LDG\.E\.128(?!\.)", ins)]
    mmas = [i for i, ins in enumerate(body) if re.match(r"(@\S+\s+)?HMMA\b", ins)]
    assert len(words) == 4 and mmas, body  # a thread's 2 rows, 2 tiles
    assert max(words) < mmas[0], (words, mmas)
    # ROW_STEP 2 alone: ptxas sinks the second tile's loads to their use (after MMAs)
    plain = _main_loop_sass(_wna16(cfg, 4, zeros, False))
    first = min(i for i, ins in enumerate(plain) if re.match(r"(@\S+\s+)?HMMA\b", ins))
    late = [i for i, ins in enumerate(plain) if re.match(r"(@\S+\s+)?LDG\.E\.128(?!\.)", ins)]
    assert max(late) > first, (late, first)
    assert not [ins for ins in body if re.match(r"(@\S+\s+)?(LDS|STS|BAR)\b", ins)]


@pytest.mark.parametrize(("dtype", "zeros"), [("bf16", False), ("bf16", True), ("fp16", True)])
def test_row_mma_strided_layout_and_main_loop_sass(dtype, zeros):
    """ROW_STRIDED keeps every inline assembly operand in ROW_LAYOUT (the masked-off anchor
    load's) while its PTX loads lane l's words l + 32 i: the main loop's word loads are 32-bit
    (4 a row a thread), x's 4 16-byte loads a thread's tile, its scales one 16-bit load a word,
    2 MMAs a word, no shared memory, no spills."""
    from atom_kernels.backends.triton import int_quant_row_mma

    cfg = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=4,
               PERMUTED_K=True, ROW_MMA=True, ROW_STRIDED=True)  # fmt: skip
    kernel = _wna16(cfg, 4, zeros, False, dtype=dtype)
    ttgir = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"(#blocked\d*) = #ttg.blocked<\{([^}]*)\}>", ttgir))
    asm_ops = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line]
    assert len(asm_ops) >= 4, asm_ops  # the words, the scales, x, the MMAs
    for line in asm_ops:
        for encoding in set(re.findall(r"tensor<[^>]*?(#blocked\d*)>", line)):
            assert layouts[encoding].startswith(int_quant_row_mma.ROW_LAYOUT), line
    assert "ld.local" not in kernel.asm["ptx"]
    body = _main_loop_sass(kernel)

    def count(pattern):
        return sum(1 for ins in body if re.match(rf"(@\S+\s+)?{pattern}", ins))

    words = 8 * 128 / (32 * 4)  # a thread's, a K tile (2 rows of 4)
    assert count(r"LDG\.E\s") == words, body
    assert count(r"LDG\.E\.128\.CONSTANT") == 4
    assert count(r"LDG\.E\.U16\.CONSTANT") == words * (2 if zeros else 1)
    assert count(r"HMMA\b") == 2 * words
    assert not [ins for ins in body if re.match(r"(@\S+\s+)?(LDS|STS|BAR)\b", ins)]


# --- the fragment layout's decode kernel (int_quant_frag) ----------------------------------------


def _frag(warps, rows_per_warp, zeros, split, dtype="bf16", k_stages=1):
    rows = warps * rows_per_warp
    pointers = dict(
        x_ptr=f"*{dtype}", q_ptr="*i32",
        s_ptr=f"*{dtype}", z_ptr=f"*{dtype}", b_ptr=f"*{dtype}", out_ptr=f"*{dtype}",
        ws_ptr="*fp32", count_ptr="*i32",
    )  # fmt: skip
    constexprs = dict(HAS_ZEROS=zeros, HAS_BIAS=False, ASM=True, BF16=dtype == "bf16",
                      SPLIT_K=split, R=rows, GROUP_SHIFT=1,
                      K_STAGES=k_stages, ROTATE=True)  # fmt: skip
    return _compile(int_quant_frag._frag_kernel, pointers, constexprs, warps, 1)


# (warps, tile rows a warp, zeros, dtype, instructions a word at most, registers at most)
# Triton 3.9's ptxas: 4 warps, 2 rows a warp 20.1 a word (bf16, 48 registers); of those 15.75
# the design's (3 shifts, 4 AND-ORs, 4 packed FMAs, an MMA, the scale's FMA, the step's zeroed
# D), the rest addresses, the rotation and the x loads.
FRAG_SASS = [
    (4, 2, False, "bf16", 22.0, 64),
    (4, 2, True, "bf16", 25.0, 72),
    (4, 2, False, "fp16", 22.0, 64),
    (8, 1, True, "fp16", 28.0, 72),
    (4, 4, False, "bf16", 22.0, 96),
]


@pytest.mark.parametrize(("warps", "per_warp", "zeros", "dtype", "most", "registers"),
                         FRAG_SASS, ids=str)  # fmt: skip
def test_frag_main_loop_sass(warps, per_warp, zeros, dtype, most, registers):
    """The fragment kernel's main loop: one MMA a word, no barrier or shared memory, its PTX
    operands in the words' layout."""
    kernel = _frag(warps, per_warp, zeros, split=4, dtype=dtype)
    _assert_row_layout(kernel)
    body = _main_loop_sass(kernel)
    words = 4 * per_warp  # a thread's words an iteration
    assert sum(1 for ins in body if ins.startswith("HMMA.16816")) == words
    assert len(body) / words < most, (len(body), words)
    assert not any(ins.startswith(("BAR", "STS", "LDS")) for ins in body)
    assert _registers(kernel) <= registers
