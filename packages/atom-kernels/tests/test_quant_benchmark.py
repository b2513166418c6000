"""The pure helpers of benchmarks/quant_kernels.py (the benchmark itself needs a GPU): the bytes
and FLOPs each row is held to, and the roofline's bound."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
PATH = BENCHMARKS / "quant_kernels.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))  # it imports benchmarks/kernels.py as `kernels`
    spec = importlib.util.spec_from_file_location("atom_benchmarks_quant_kernels", PATH)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_gemm_bytes(bench):
    # kv_a_proj_with_mqa: 576 x 7168, a partial last N block (576 = 4.5 x 128)
    n, k = 576, 7168
    scales = 4 * 5 * 56
    assert bench.gemm_bytes(1, n, k, "fp8_block_linear") == n * k + scales + 2 * k + 2 * n
    assert bench.gemm_bytes(16, n, k, "fp8_block_gemm") == n * k + scales + 16 * k + 32 * n
    assert bench.gemm_bytes(1, n, k, "bf16_linear") == 2 * n * k + 2 * k + 2 * n
    assert bench.gemm_bytes(1, n, k, "scaled_mm_tensor") == n * k + 4 + k + 2 * n
    assert bench.gemm_bytes(1, n, k, "fp8_linear_channel") == n * k + 4 * n + 2 * k + 2 * n


def test_moe_bytes_and_flops(bench):
    h, i = 2880, 2880
    values = 3 * h * i
    mxfp4 = values // 2 + values // 32 + 2 * (2 * i + h)  # nibbles, e8m0 scales, bf16 biases
    assert bench.moe_bytes(3, 1, h, i, "mxfp4", True) == 3 * mxfp4 + 4 * h
    assert bench.moe_bytes(2, 4, h, i, "bf16", False) == 2 * 2 * values + 16 * h
    # DeepSeek-V3 fp8 block: w13 [4096, 7168] -> 32 x 56 scales, w2 [7168, 2048] -> 56 x 16
    fp8 = 3 * 7168 * 2048 + 4 * (32 * 56 + 56 * 16)
    assert bench.moe_bytes(1, 1, 7168, 2048, "fp8_block", False) == fp8 + 4 * 7168
    assert bench.moe_flops(2, 8, 7168, 2048) == 2 * 2 * 8 * 3 * 7168 * 2048
    with pytest.raises(ValueError):
        bench.moe_bytes(1, 1, h, i, "int4", False)


def test_roofline_takes_the_larger_term(bench):
    # 3 GB at 3000 GB/s = 1 ms against 100 TFLOP at 1000 TFLOP/s = 100 ms
    assert bench.roofline(3e9, 1e14, 3000.0, 1000.0) == {"roofline_ms": 100.0, "bound": "flops"}
    assert bench.roofline(3e9, 1e11, 3000.0, 1000.0) == {"roofline_ms": 1.0, "bound": "bytes"}
    assert bench.mla_bytes(2, 10, 16, 1) == 2 * 10 * 576 + 2 * 2 * 16 * (1024 + 64)


def test_refuses_without_a_gpu_clearly():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    out = subprocess.run(
        [sys.executable, str(PATH), "--out", "/dev/null"], capture_output=True, text=True
    )
    assert out.returncode == 1
    assert "needs a CUDA GPU" in out.stderr


def test_moe_tile_candidates_change_one_thing_at_a_time(bench):
    g1 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    g2 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=5)
    default = {"per_pair": True, "combine": "sum", "gemm1": g1, "gemm2": g2}
    out = bench.moe_tile_candidates(default)
    assert out[0] is default
    for config in out[1:]:
        changed = [k for k in ("combine", "gemm1", "gemm2") if config[k] != default[k]]
        assert len(changed) == 1, config
        if changed[0] != "combine":
            diff = {k for k in g1 if config[changed[0]][k] != default[changed[0]][k]}
            assert len(diff) == 1, config
    # every variant differs from the default, none twice; the per-pair combines are tried
    assert len({repr(c) for c in out}) == len(out)
    assert {c["combine"] for c in out} == {"sum", "token", "atomic"}
    # a variant the default already has (gemm1 BLOCK_N 16) is left out; no combines when sorted
    sorted_default = {**default, "per_pair": False, "gemm1": {**g1, "BLOCK_N": 16}}
    sorted_out = bench.moe_tile_candidates(sorted_default)
    assert len(sorted_out) == len(out) - 1 - 2
    assert all(c["combine"] == "sum" for c in sorted_out)
    assert "1:16x16x128 w4 s4" in bench.short_config(sorted_out[0])


def test_gemm_tile_candidates_are_launchable(bench):
    """Every gemm_tiles candidate is a full w8a8_gemm config: power-of-two tiles the dot takes
    (>= 16), at most 256 wide, a split count or None (auto), and names that tell them apart."""
    pytest.importorskip("triton")
    from atom_kernels.backends.triton.quant import GEMM_CONFIG_KEYS

    names = set()
    for size, candidates in bench.W8A8_TILES.items():
        for cfg in candidates:
            assert set(cfg) == set(GEMM_CONFIG_KEYS), cfg
            for key in ("BLOCK_M", "BLOCK_N"):
                assert 16 <= cfg[key] <= 256 and cfg[key] & (cfg[key] - 1) == 0, cfg
            assert cfg["SPLIT_K"] is None or cfg["SPLIT_K"] >= 1
            assert size == "large" or cfg["BLOCK_M"] == 16  # M <= 64 rows: 16-row tiles
            names.add(bench.tile_name(cfg))
    assert len(names) == sum(len(c) for c in bench.W8A8_TILES.values())
    assert bench.tile_name(None) == "w8a8_gemm's own"


def test_int_gemm_bytes(bench):
    # Llama-3-8B o_proj, W4A16 group 128: K / 2 bytes a row and 32 bf16 scales a row
    n, k = 4096, 4096
    assert bench.int_gemm_bytes(1, n, k, "w4a16_g128") == n * k / 2 + 2 * n * 32 + 2 * k + 2 * n
    assert bench.int_gemm_bytes(16, n, k, "w8a8_linear") == n * k + 4 * n + 32 * k + 32 * n
    # the GEMM alone reads x as int8 with its fp32 row scales
    assert bench.int_gemm_bytes(16, n, k, "w8a8_gemm") == n * k + 4 * n + 16 * (k + 4) + 32 * n
    assert bench.int_gemm_bytes(4, n, k, "bf16_linear") == bench.gemm_bytes(4, n, k, "bf16_linear")


def test_wna16_tile_candidates_are_launchable(bench):
    """Every int_tiles candidate is a full wna16_linear config: 16-row dots, or at one row
    multiply-adds (BLOCK_M 1) too; BLOCK_K a multiple of the 4-bit word (8) dividing the group
    (128, the tile-wide scale path); all distinct."""
    pytest.importorskip("triton")
    keys = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K"}
    loops = {"SMALL_MAGIC", "X_VECTOR"}  # the one-row loop named explicitly (not the default's)
    for rows, candidates in bench.WNA16_TILES.items():
        assert len({repr(c) for c in candidates}) == len(candidates)
        for cfg in candidates:
            assert set(cfg) == keys | loops, cfg
            assert cfg["BLOCK_M"] in ((1, 16) if rows == 1 else (16,)), cfg
            assert cfg["BLOCK_K"] % 8 == 0 and bench.INT_GROUP % cfg["BLOCK_K"] == 0, cfg


def test_w4a16_variants(bench):
    """Decode sizes time the interleaved K loop against the permuted one (and at one row the
    permuted multiply-adds); prefill its own launch alone."""
    one = dict(bench._w4a16_variants(1))
    assert one["w4a16_g128 interleaved"] == {"PERMUTED_K": False}
    assert one["w4a16_g128 permuted"] == {"PERMUTED_K": True, "BLOCK_K": 128}
    assert one["w4a16_g128 permuted fma"]["BLOCK_M"] == 1
    packed = [f"w4a16_g128 packed-dot {n} w{w} s{s} p{p}" for n, w, s, p in bench.PACKED_DOT_TILES]
    packed += [f"w4a16_g128 packed-dot {n} w{w} s{s} fill{p}"
               for n, w, s, p, _ in bench.FILL_TILES["packed-dot"]]  # fmt: skip
    packed += [f"w4a16_g128 packed-dot {n} w{w} s{s} fill{p} x-split"
               for n, w, s, p in bench.PACKED_X_SPLIT_TILES]  # fmt: skip
    assert [impl for impl, _ in bench._w4a16_variants(16)] == [
        "w4a16_g128 default", "w4a16_g128 interleaved", "w4a16_g128 permuted",
        *packed]  # fmt: skip
    assert one["w4a16_g128 default"] is None  # wna16_linear's own pick
    for _, config in bench._w4a16_variants(16)[3:]:  # named explicitly, BLOCK_K 128
        assert config["PACKED_DOT"] and config["BLOCK_M"] == 16 and config["BLOCK_K"] == 128
    assert bench._w4a16_variants(256) == [("w4a16_g128", None)]


def test_int_groups_smoke_on_the_interpreter(tmp_path, bench):
    """``--smoke-cpu --only int,int_tiles`` runs every impl on tiny shapes in the interpreter;
    rows not through a bf16 dot (W8A8, one-row W4A16) agree with the reference there."""
    pytest.importorskip("triton")
    import json
    import os

    out = tmp_path / "int.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, str(PATH), "--smoke-cpu", "--only", "int,int_tiles", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert not [r for r in rows if "error" in r], run.stdout[-3000:]
    impls = {r["impl"].removeprefix("BAD ") for r in rows if r["group"] == "int"}
    small_magic = (
        {
            f"w4a16_g128 permuted fma small-magic {n} w{w} s{s}"
            for n, w, s in bench.SMALL_MAGIC_TILES
        }
        | {
            f"w4a16_g128 permuted fma small-magic {n} w{w} s{s} x-vector p{p}"
            for n, w, s, p in bench.X_VECTOR_TILES
        }
        | {
            "w4a16_g128 permuted fma small-magic 256 w4 s1 "
            + "+".join(k.lower().replace("_", "-") for k in variant)
            for variant in bench.SMALL_MAGIC_VARIANTS
        }
    )
    packed = {f"w4a16_g128 packed-dot {n} w{w} s{s} p{p}" for n, w, s, p in bench.PACKED_DOT_TILES}
    packed |= {f"w4a16_g128 packed-dot {n} w{w} s{s} fill{p}"
               for n, w, s, p, _ in bench.FILL_TILES["packed-dot"]}  # fmt: skip
    packed |= {f"w4a16_g128 packed-dot {n} w{w} s{s} fill{p} x-split"
               for n, w, s, p in bench.PACKED_X_SPLIT_TILES}  # fmt: skip
    packed |= {f"w4a16_g128 permuted fma small-magic {n} w{w} s{s} x-vector fill{p}"
               + (f" r{r}" if r else "") for n, w, s, p, r in bench.FILL_TILES["fma"]}  # fmt: skip
    packed |= {f"w4a16_g128 permuted fma small-magic {n} w{w} s1 x-vector k{k} fill{p}"
               for n, w, k, p in bench.K_STAGES_TILES}  # fmt: skip
    packed |= {f"w4a16_g128 quad-mma {n} w{w} k{k} fill{p}"
               for n, w, k, p in bench.QUAD_TILES}  # fmt: skip
    packed |= {f"w4a16_g128 quad-mma {n} w{w} k{k} fill{p} step{t}"
               for n, w, k, p, t in bench.QUAD_STEP_TILES if 256 % (128 * t) == 0}  # fmt: skip
    # (not row-mma: its K tile is 1024 deep, the smoke's K 256; nor quad-mma steps past K)
    packed |= {f"w4a16_g128 permuted fma small-magic {n} w{w} s1 x-vector bk{k} fill{p}"
               for n, k, w, p in bench.X_VECTOR_DEEP_TILES}  # fmt: skip
    frag = {f"w4a16_g128 frag w{w} r{r} p{p} k{k}" + (f" r{cap}" if cap else "")
            for w, r, p, k, cap in bench.FRAG_TILES}  # fmt: skip
    assert impls == {
        "bf16_linear", "w4a16_g128 default", "w4a16_g128 interleaved", "w4a16_g128 permuted",
        "w4a16_g128 permuted fma", "w8a8_linear", "w8a8_gemm", *small_magic, *packed, *frag,
    }  # fmt: skip
    w4a16 = [r for r in rows if r["group"] == "int" and "w4a16" in r["impl"]]
    assert all(r["of_copy_bandwidth"] > 0 for r in w4a16), w4a16
    # (the interpreter outside the tests' conftest multiplies bf16 dot operands as raw bits)
    exact = [r for r in rows if "w8a8" in r["impl"]
             or (" M=1 " in r["shape"] and "packed-dot" not in r["impl"])]  # fmt: skip
    assert exact and not [r for r in exact if r.get("bad")], exact
