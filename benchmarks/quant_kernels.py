"""Quantized-weight kernels and the MLA decode at DeepSeek-V3 / GPT-OSS-120B shapes, against the
roofline measured in the same run (issue 17, item 3).

Run on a GPU from the repo root:

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python benchmarks/quant_kernels.py --out $OUT/quant-kernels.json

Groups (``--only``, comma-separated; this order, JSON rewritten after each so a cut-off run keeps
what it measured):

- ``gemm``: block-FP8 GEMM (``fp8_block_linear``: per-token-group activation quant + the w8a8
  Triton GEMM, 128 x 128 weight blocks; and the GEMM alone on pre-quantized activations) at the
  DeepSeek-V3 projection shapes, M = 1, 4, 16, 4096 tokens, against ``torch._scaled_mm``
  per-tensor FP8 (activations already FP8: the GEMM alone), ATOM's ``fp8_linear`` (per-token
  quant + row-wise ``_scaled_mm``) and bf16 cuBLAS (``F.linear``) on the same shapes; at M <= 8
  also ``fp8_block_skinny``, the weight-only one-kernel GEMM ``ATOM_FP8_SKINNY`` routes to
  (``fp8_block_linear`` is timed with it off: the w8a8 path).
- ``group_quant``: ``per_token_group_quant_fp8`` (group 128) alone, against the torch reference.
- ``mla``: ``mla_paged_attention`` decode over the latent cache (L 512 + R 64, page 16), 128 heads
  (one rank) and 16 (TP 8), batch 1 / 32 / 128, context 1K / 4K, bf16 and fp8 cache.
- ``moe``: ``fused_moe`` at a DeepSeek-V3 layer (256 experts, top-8, H 7168, I 2048; fp8 block
  128 x 128, fp8 per channel, bf16) and a GPT-OSS-120B layer (128 experts, top-4, H 2880, I 2880,
  swiglu_oai, interleaved gate/up, biases; MXFP4, bf16), random routing (softmax top-k of random
  logits).
- ``gemm_tiles``: the w8a8 GEMM alone under w8a8_gemm's own launch and each candidate of
  ``W8A8_TILES`` (N tiles, split-K, warps, stages, GROUP_M, TMA) at the GEMM shapes and
  M = 1, 16, 4096 (``TILE_ROWS``), each checked against the reference before it is timed; prints
  the fastest per shape and M (the JSON's ``gemm_tiles_best``): the evidence for ``gemm_config``.
- ``moe_tiles``: the quantized ``moe`` rows (T = 1, 16 unless ``--moe-tile-tokens``;
  ``--moe-formats`` filters) under the default config and one change at a time
  (``moe_tile_candidates``: GEMM 1 / GEMM 2 column tile, K tile, stages, warps; the per-pair
  combine), each checked once against the torch reference (``BAD`` past atol = rtol = 5e-2, as
  the GPU test) and timed (cold L2 only): the evidence for the quantized formats' tiles.
- ``int``: integer checkpoints (issue 40) at the Llama-3-8B projections (``INT_SHAPES``): the
  W4A16 GEMM (``wna16_linear``, group 128, symmetric) at M = 1, 4, 16, 256 (up to 16 rows the
  interleaved and the permuted K loop one after the other, and at M = 1 the permuted
  multiply-adds; ``of_copy_bandwidth`` = GB/s of the least bytes over the measured copy rate,
  printed as a table at the end of the group), the W8A8 GEMM
  (``int8_linear``: per-token int8 quant + the int8 GEMM; and the GEMM alone) at M = 1, 16, 256,
  and bf16 cuBLAS (``F.linear``) at every M, each checked against the torch reference first
  (``max_error``; ``BAD`` past atol = rtol = 5e-2). W8A8 rows meet the int8 matmul rate
  (``torch._int_mm`` 8192^3, measured when this group runs).
- ``int_tiles``: the W4A16 GEMM at M = 1 and 16 under its own launch and each candidate of
  ``WNA16_TILES`` (cold L2 only, each checked first): the evidence for ``wna16_config``.

The integer GEMMs alone: ``python benchmarks/quant_kernels.py --only int,int_tiles --out ...``;
the one-row W4A16 loops alone (a short device call):
``--only int --int-rows 1 --int-impls fma,bf16_linear``. The JSON is rewritten after every row.

The block-FP8 GEMM and group-quant work alone, in one GPU call (a few minutes):

    python benchmarks/quant_kernels.py --only gemm,group_quant,gemm_tiles --out $OUT/q.json

Timing (as benchmarks/kernels.py): every op runs as a CUDA graph, ``ms_cold`` with the L2
flushed before each call (GPU time alone; what the rates come from), ``ms_graph`` with a warm L2
(``do_bench_cudagraph`` median). The roofline of a row is the larger of its bytes over the
measured copy bandwidth and its FLOPs over the measured matmul rate of the dtype the tensor cores
multiply (FP8 for the w8a8 GEMMs and ``_scaled_mm``; bf16 for cuBLAS, the weight-only fused MoE
(it dequantizes weight tiles to bf16) and MLA); ``of_roofline`` = roofline time / measured time,
``bound`` says which term set it. Bytes are what the op must move at least: weights (the experts
hit) and their scales in their stored format, activations in and out once, the KV cache once.

M = tokens (rows of x), N = output features, K = input features, T = tokens, E = experts,
top-k = experts per token, H = hidden size, I = expert intermediate size, B = sequences.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from collections.abc import Callable

from kernels import cold_graph_ms, measure_roofline

BLOCK = (128, 128)  # DeepSeek-V3's weight block (N, K)
GEMM_SHAPES = {  # DeepSeek-V3 projections, name: (N, K)
    "q_a_proj": (1536, 7168),
    "q_b_proj": (24576, 1536),
    "kv_a_proj_with_mqa": (576, 7168),
    "o_proj": (7168, 16384),
    "shared_gate_up": (4096, 7168),
    "shared_down": (7168, 2048),
}
GEMM_ROWS = (1, 4, 16, 4096)
TILE_ROWS = (1, 16, 4096)  # gemm_tiles: the M each shape's candidates are swept at


def _tile(bm, bn, warps, stages, split=1, group_m=1, tma=False, fused=True) -> dict:
    """A w8a8_gemm launch (``quant.GEMM_CONFIG_KEYS``); split None: w8a8_gemm's own choice;
    fused False: split-K summed by the separate reduce kernel."""
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, SPLIT_K=split,
                GROUP_M=group_m, TMA=tma, FUSED_REDUCE=fused)  # fmt: skip


W8A8_TILES = {  # gemm_tiles' candidates by M (<= 64: "small"), each after w8a8_gemm's own
    "small": tuple(
        _tile(16, bn, 4, 4, split) for bn in (32, 64, 128) for split in (1, None, 2, 4, 8, 16)
    ) + (_tile(16, 64, 4, 3, None), _tile(16, 64, 2, 4, None), _tile(16, 32, 2, 6, None),
         _tile(16, 32, 4, 4, None, fused=False), _tile(16, 64, 4, 4, None, fused=False)),
    "large": (
        _tile(64, 128, 4, 3, 1, 8), _tile(64, 128, 4, 4, 1, 8), _tile(128, 128, 8, 3, 1, 8),
        _tile(128, 128, 8, 4, 1, 8), _tile(64, 256, 8, 3, 1, 8), _tile(128, 64, 4, 3, 1, 8),
        _tile(128, 256, 8, 3, 1, 8), _tile(64, 128, 4, 3, 1, 1),
        _tile(64, 128, 4, 3, 1, 8, True), _tile(128, 128, 8, 3, 1, 8, True),
        _tile(128, 128, 8, 4, 1, 8, True), _tile(64, 256, 8, 3, 1, 8, True),
    ),
}  # fmt: skip
GROUP_QUANT_SHAPES = ((1, 7168), (16, 7168), (4096, 7168), (16384, 7168), (4096, 16384))
MOE_SHAPES = {  # name: (E, top-k, H, I, formats, GPT-OSS layer: swiglu_oai, interleaved, biases)
    "deepseek-v3": (256, 8, 7168, 2048, ("fp8_block", "fp8_channel", "mxfp4", "bf16"), False),
    "gpt-oss-120b": (128, 4, 2880, 2880, ("mxfp4", "bf16"), True),
}
MOE_TOKENS = (1, 16, 64, 1024)
TOLERANCE = 5e-2  # moe_tiles: atol = rtol against the torch reference, as the GPU test
MLA_LATENT, MLA_ROPE, MLA_PAGE = 512, 64, 16
MLA_HEADS = (128, 16)
MLA_BATCHES = (1, 32, 128)
MLA_CONTEXTS = (1024, 4096)
DEVICE = "cuda"  # "cpu" under --smoke-cpu
MOE_FORMATS: tuple[str, ...] = ()  # --moe-formats: only these (empty: all)
MOE_SHAPE_NAMES: tuple[str, ...] = ()  # --moe-shapes: only these (empty: all)
# --mxfp4-modes: each names a moe_mxfp4.MODES way, timed as its own row ("mxfp4 <mode>") and
# checked against the reference first; "<mode>+pp" also forces the per-pair path (decode sizes).
MXFP4_MODES: tuple[str, ...] = ()
GROUPS = ("gemm", "group_quant", "mla", "moe", "gemm_tiles", "moe_tiles", "int", "int_tiles")
INT_SHAPES = {  # Llama-3-8B projections, name: (N, K)
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
}
INT_GROUP = 128  # W4A16's group size (GPTQ / AWQ's usual)
W4A16_ROWS = (1, 4, 8, 16, 256)
W4A16_DECODE_ROWS = 16  # int_quant.SKINNY_MAX_ROWS: up to it, both K loops are timed
W8A8_ROWS = (1, 16, 256)
INT_TILE_ROWS = (1, 16)


def _wna16_tile(bn, warps, stages, split=None, bm=16, bk=128) -> dict:
    """A wna16_linear launch (``int_quant.wna16_config``'s keys); split None: its own choice."""
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                SPLIT_K=split, SMALL_MAGIC=False, X_VECTOR=False)  # fmt: skip


# (BLOCK_N, warps, stages) of the one-row loop without a subtraction a weight (SMALL_MAGIC),
# timed in ``int`` beside the default and swept in ``int_tiles``.
SMALL_MAGIC_TILES = ((256, 4, 1), (256, 4, 2), (128, 2, 1), (128, 2, 2), (128, 4, 1))
# (BLOCK_N, warps, stages, programs an SM) of the packed-unpack dots (PACKED_DOT,
# int_quant_packed_dot; BLOCK_K 128), timed in ``int`` at every decode M beside the other loops.
PACKED_DOT_TILES = (
    (128, 4, 4, 2), (128, 4, 4, 4), (128, 4, 2, 2), (256, 8, 3, 2), (256, 8, 3, 4), (64, 4, 4, 2),
    (256, 8, 4, 8), (512, 16, 3, 4), (128, 4, 4, 8),
)  # fmt: skip
# (BLOCK_N, warps, stages, programs an SM, maxnreg) of ``fill`` launches (split_for: K split
# whatever the N tiles, to about per_sm programs an SM), timed in ``int`` at the decode M:
# the packed dots, and at M = 1 the X_VECTOR loop (``fma``; maxnreg None: the compiler's).
FILL_TILES = {
    "packed-dot": ((128, 4, 4, 4, None), (128, 4, 4, 6, None), (128, 4, 4, 8, None),
                   (64, 4, 4, 6, None), (64, 4, 3, 8, None), (128, 4, 3, 6, None)),
    "fma": ((256, 4, 1, 3, None), (256, 4, 1, 4, 128), (128, 4, 1, 6, 128), (128, 4, 1, 4, None)),
}  # fmt: skip
# (BLOCK_N, warps, stages, programs an SM) of ``fill`` packed dots reading x as one
# [16, BLOCK_K / 8, 8] load split in registers (X_SPLIT), timed in ``int`` at the decode M.
PACKED_X_SPLIT_TILES = (
    (128, 4, 4, 4),
    (128, 4, 3, 4),
    (64, 4, 4, 4),
    (256, 8, 3, 4),
    (128, 4, 4, 8),
)
# (BLOCK_N, warps, stages, programs an SM) of the one-row X_VECTOR loop (SMALL_MAGIC), timed in
# ``int`` at M = 1: the split-K target (per_sm) beside the default's 2.
X_VECTOR_TILES = ((256, 4, 1, 4), (256, 4, 1, 8), (128, 4, 1, 4), (128, 4, 1, 8), (128, 2, 1, 8))
# (BLOCK_N, warps, k_stages, programs an SM) of X_VECTOR ``fill`` launches whose loads are
# pipelined k_stages - 1 tiles ahead (``k_stages``: cp.async into shared memory), timed at M = 1.
K_STAGES_TILES = (
    (256, 4, 3, 1), (256, 4, 3, 2), (256, 4, 4, 1), (256, 4, 2, 2), (128, 4, 3, 2),
    (128, 4, 4, 2), (128, 4, 3, 4), (128, 2, 3, 4), (256, 8, 3, 1),
)  # fmt: skip
# (BLOCK_N, warps, k_stages, programs an SM) of the one-row quads' MMAs (QUAD_MMA,
# int_quant_quad_mma), ``fill`` launches timed at M = 1.
QUAD_TILES = (
    (64, 4, 1, 4), (64, 4, 1, 8), (64, 4, 2, 8), (64, 4, 3, 4), (128, 4, 1, 4), (128, 4, 2, 4),
    (128, 4, 3, 2), (128, 8, 1, 4), (256, 8, 1, 2), (256, 8, 2, 2), (32, 4, 1, 8), (64, 2, 3, 8),
)  # fmt: skip
# (BLOCK_N, warps, k_stages, programs an SM, K tiles a step) of the same with adjacent K tiles
# a step (QUAD_STEP: 64 * step contiguous bytes of a row at once).
QUAD_STEP_TILES = (
    (64, 4, 2, 8, 2), (64, 4, 3, 4, 2), (64, 4, 2, 4, 4), (64, 4, 2, 8, 4), (64, 4, 1, 8, 4),
    (64, 4, 2, 8, 8), (32, 4, 2, 8, 4), (128, 4, 2, 4, 4), (64, 4, 3, 8, 4), (64, 2, 2, 8, 4),
)  # fmt: skip
# (BLOCK_N, warps, k_stages, programs an SM) of the one-row MMAs a warp a row (ROW_MMA,
# int_quant_row_mma: 512 contiguous bytes of a row a load), ``fill``, at M = 1.
ROW_TILES = (
    (8, 4, 1, 8), (8, 4, 2, 8), (8, 4, 3, 8), (16, 4, 2, 8), (16, 8, 2, 8), (32, 8, 1, 4),
    (32, 8, 2, 4), (4, 4, 2, 16), (8, 8, 2, 8), (16, 4, 3, 4), (8, 4, 2, 16), (16, 8, 1, 8),
)  # fmt: skip
# (BLOCK_N, warps, k_stages, programs an SM) of the same with the scale after the MMAs
# (ROW_SCALE_AFTER: 4 packed float ops a word fewer), named "... scale-after".
ROW_SCALE_AFTER_TILES = ((8, 4, 1, 8), (8, 4, 2, 8), (16, 4, 2, 8), (4, 4, 2, 16), (16, 4, 1, 4))
# The same with neither the zero nor the scale
# on the weights (ROW_XSUM: each MMA takes 128 + q, the chunk's x-sum times 128 + zero comes off;
# 8 packed float ops a word fewer) and / or, at ROW_STEP tiles a step, every weight load of the
# step issued before its math and each tile's x at its math (ROW_AHEAD), as (BLOCK_N, warps,
# programs an SM, step, keys), named "... stepS xsum", "... ahead", "... xsum-ahead"; and lane l
# on words l + 32 i (ROW_STRIDED: x's loads contiguous), "... strided".
ROW_XSUM_TILES = (
    (8, 4, 8, 1, "xsum"), (16, 8, 8, 1, "xsum"), (8, 4, 8, 2, "ahead"), (8, 4, 8, 4, "ahead"),
    (8, 4, 8, 2, "xsum-ahead"), (8, 4, 8, 4, "xsum-ahead"), (4, 4, 16, 2, "xsum-ahead"),
    (4, 4, 16, 4, "xsum-ahead"), (16, 4, 8, 2, "xsum-ahead"), (8, 8, 8, 2, "xsum-ahead"),
    (8, 8, 8, 4, "xsum-ahead"), (4, 4, 8, 4, "ahead"), (8, 4, 8, 1, "strided"),
    (16, 4, 8, 1, "strided"), (4, 4, 16, 1, "strided"), (16, 8, 8, 1, "strided"),
    (32, 8, 4, 1, "strided"), (8, 2, 8, 1, "strided"),
)  # fmt: skip
# (BLOCK_N, warps, programs an SM, K splits (None: ``fill``'s), register cap (None: ptxas's))
# of the same, one tile a step: more warps an SM (a cap below the default's 64 registers) or
# more programs (a split of K = 4096, which ``fill`` leaves whole), named "... occupancy".
ROW_OCCUPANCY_TILES = (
    (8, 4, 8, None, 56), (16, 4, 8, None, None), (8, 2, 8, None, None), (8, 4, 8, 2, None),
    (4, 4, 16, 2, None), (16, 4, 8, 2, None),
)  # fmt: skip
# (BLOCK_N, warps, programs an SM, K tiles a step at most) of the same, every load of a step
# before its math (ROW_STEP), no cp.async.
ROW_STEP_TILES = (
    (8, 4, 8, 2), (8, 4, 8, 4), (16, 4, 8, 2), (16, 8, 8, 2), (8, 4, 16, 2), (8, 2, 8, 2),
    (16, 4, 4, 4), (4, 4, 16, 4),
)  # fmt: skip
# (BLOCK_N, BLOCK_K, warps, programs an SM) of X_VECTOR launches with deeper K tiles (more
# contiguous bytes of a row a step; group 128: scales gathered a word), ``fill``, at M = 1.
X_VECTOR_DEEP_TILES = ((128, 256, 4, 2), (128, 256, 4, 4), (64, 512, 4, 2), (64, 256, 4, 4))
# int_quant_small_magic's variants (SMALL_MAGIC_VARIANTS), timed in ``int`` at M = 1 beside the
# default launch (BLOCK_N 256, 4 warps, 1 stage).
SMALL_MAGIC_VARIANTS = (
    {"X_VECTOR": True}, {"X_SPLIT": True}, {"PREFETCH": True},
    {"X_VECTOR": True, "PREFETCH": True},
)  # fmt: skip
# (warps, tile rows a warp, programs an SM, k_stages, register cap) of the fragment layout's
# decode kernel (int_quant_frag: the weights repacked at load, one MMA a word, a warp's load 512
# contiguous bytes), named "w4a16_g128 frag w{warps} r{rows} p{per_sm} k{k_stages} r{cap}"
# (k_stages > 1: the words pipelined through shared memory; session 36 measured it slower, and
# ties of an iteration's loads before its math, since removed, slower still).
FRAG_TILES = (
    (4, 2, 8, 1, None), (4, 2, 8, 1, 56), (4, 4, 4, 1, None), (4, 2, 16, 1, 56),
    (2, 2, 16, 1, 56), (8, 1, 8, 1, 56), (4, 1, 16, 1, 56), (4, 2, 8, 3, 56),
)  # fmt: skip
INT_ROWS = None  # --int-rows: the M the ``int`` group runs (None: all)
INT_IMPLS = ()  # --int-impls: substrings, one of which an ``int`` impl must hold (empty: all)
_DOT_TILES = tuple(_wna16_tile(bn, w, st, split) for bn in (32, 64, 128) for w in (4, 8)
                   for st in (4,) for split in (None, 1))  # fmt: skip
WNA16_TILES = {  # int_tiles' candidates by M: 16-row dots; at M = 1 also multiply-adds (BLOCK_M 1)
    1: _DOT_TILES + tuple(_wna16_tile(bn, w, 1, split, bm=1) for bn in (16, 32, 64, 128)
                          for w in (4, 8) for split in (None, 1))
    + (_wna16_tile(256, 4, 1, bm=1), _wna16_tile(128, 2, 1, bm=1))  # permuted: 256 a thread
    + tuple(dict(_wna16_tile(bn, w, st, bm=1), SMALL_MAGIC=True)
            for bn, w, st in SMALL_MAGIC_TILES),  # int_quant_small_magic
    16: _DOT_TILES + (_wna16_tile(64, 4, 3), _wna16_tile(64, 4, 5)),
}  # fmt: skip
MOE_TILE_TOKENS = (1, 16)  # moe_tiles without --moe-tile-tokens
MOE_TILE_VARIANTS = (  # moe_tiles: (gemm, changes), each applied alone to the default
    ("gemm1", {"BLOCK_N": 16}), ("gemm1", {"BLOCK_N": 64}), ("gemm1", {"BLOCK_K": 64}),
    ("gemm1", {"num_stages": 3}), ("gemm1", {"num_warps": 8}),
    ("gemm2", {"BLOCK_N": 16}), ("gemm2", {"BLOCK_N": 64}), ("gemm2", {"BLOCK_K": 64}),
    ("gemm2", {"num_stages": 3}), ("gemm2", {"num_warps": 8}),
    ("gemm1", {"num_warps": 2}), ("gemm2", {"num_warps": 2}),
)  # fmt: skip


# --- pure helpers (no torch) ---------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gemm_bytes(rows: int, n: int, k: int, impl: str) -> float:
    """Least bytes a linear of x [rows, K] bf16 by W [N, K] moves: W in its format (+ its scales),
    x read and y [rows, N] bf16 written once (x already FP8 for the GEMM-only rows)."""
    if impl == "bf16_linear":
        weight = 2 * n * k
    elif impl.startswith("fp8_block"):
        weight = n * k + 4 * cdiv(n, BLOCK[0]) * cdiv(k, BLOCK[1])
    elif impl == "scaled_mm_tensor":  # one scale
        weight = n * k + 4
    else:  # per-channel FP8
        weight = n * k + 4 * n
    x_bytes = rows * k * (1 if impl in ("fp8_block_gemm", "scaled_mm_tensor") else 2)
    return float(weight + x_bytes + 2 * rows * n)


def int_gemm_bytes(rows: int, n: int, k: int, impl: str, group: int = INT_GROUP) -> float:
    """Least bytes of an integer-weight linear of x [rows, K] bf16: W packed (4-bit: K / 2 bytes
    a row, with bf16 scales per group; int8: K bytes a row, fp32 channel scales), x read (int8
    already for the GEMM-only row) and y [rows, N] bf16 written once."""
    if impl.startswith("w4a16"):
        weight = n * k // 2 + 2 * n * cdiv(k, group)
    elif impl.startswith("w8a8"):
        weight = n * k + 4 * n
    else:
        return gemm_bytes(rows, n, k, impl)
    x_bytes = rows * k * (1 if impl == "w8a8_gemm" else 2) + (
        4 * rows if impl == "w8a8_gemm" else 0
    )
    return float(weight + x_bytes + 2 * rows * n)


def moe_bytes(
    experts_hit: int, tokens: int, hidden: int, inter: int, fmt: str, biases: bool
) -> float:
    """Least bytes of a fused MoE: the weights of the experts hit (w13 [2I, H], w2 [H, I]) in
    their format with their scales (and bf16 biases), x [T, H] read and out [T, H] written."""
    values = 3 * hidden * inter
    if fmt == "bf16":
        weight = 2 * values
    elif fmt == "fp8_block":
        weight = values + 4 * (
            cdiv(2 * inter, BLOCK[0]) * cdiv(hidden, BLOCK[1])
            + cdiv(hidden, BLOCK[0]) * cdiv(inter, BLOCK[1])
        )
    elif fmt == "fp8_channel":
        weight = values + 4 * (2 * inter + hidden)
    elif fmt == "mxfp4":
        weight = values // 2 + values // 32  # e2m1 nibbles + one e8m0 byte per 32 values
    else:
        raise ValueError(fmt)
    if biases:
        weight += 2 * (2 * inter + hidden)
    return float(experts_hit * weight + 2 * 2 * tokens * hidden)


def moe_flops(tokens: int, top_k: int, hidden: int, inter: int) -> float:
    return 2.0 * tokens * top_k * 3 * hidden * inter


def mla_bytes(batch: int, context: int, heads: int, cache_itemsize: int) -> float:
    """The latent cache (L + R a token) read once, q [B, H, L + R] read, out [B, H, L] written."""
    cache = batch * context * (MLA_LATENT + MLA_ROPE) * cache_itemsize
    return float(cache + 2 * batch * heads * (2 * MLA_LATENT + MLA_ROPE))


def mla_flops(batch: int, context: int, heads: int) -> float:
    """Scores over L + R and the weighted sum over L, per head and cache token."""
    return 2.0 * batch * context * heads * (2 * MLA_LATENT + MLA_ROPE)


def moe_tile_candidates(default: dict) -> list[dict]:
    """The configs ``moe_tiles`` times for one (format, T): ``default`` (a ``_configs`` entry)
    first, then each MOE_TILE_VARIANTS change alone, then (per-pair path) the other GEMM 2
    combines; changes the default already has are left out."""
    out = [default]
    for gemm, changes in MOE_TILE_VARIANTS:
        if all(default[gemm].get(k) == v for k, v in changes.items()):
            continue
        out.append({**default, gemm: {**default[gemm], **changes}})
    if default["per_pair"]:
        for combine in ("token", "atomic"):
            if default.get("combine") != combine:
                out.append({**default, "combine": combine})
    return out


def short_config(config: dict) -> str:
    """One line: path, combine, then each GEMM's MxNxK, warps, stages."""
    parts = ["per-pair" if config["per_pair"] else "sorted", config.get("combine", "sum")]
    for gemm in ("gemm1", "gemm2"):
        c = config[gemm]
        parts.append(f"{gemm[-1]}:{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}"
                     f" w{c['num_warps']} s{c.get('num_stages', 2)}")  # fmt: skip
    return " ".join(parts)


def roofline(nbytes: float, flops: float, copy_gbps: float, peak_tflops: float) -> dict:
    """{"roofline_ms", "bound"}: the larger of bytes / bandwidth and FLOPs / peak rate."""
    mem_ms = nbytes / (copy_gbps * 1e9) * 1e3
    mma_ms = flops / (peak_tflops * 1e12) * 1e3
    return {"roofline_ms": max(mem_ms, mma_ms), "bound": "bytes" if mem_ms >= mma_ms else "flops"}


def format_table(rows: list[dict]) -> str:
    """Markdown table of result rows."""
    head = ("group", "shape", "impl", "ms_cold", "ms_graph", "rate", "of_roofline", "bound")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        unit_value = (
            f"{r['TFLOPs']:.1f} TFLOP/s" if r["bound"] == "flops" else f"{r['GBps']:.0f} GB/s"
        )
        lines.append(
            " | ".join(
                (
                    r["group"], r["shape"], r["impl"], f"{r['ms_cold']:.4f}",
                    "-" if r.get("ms_graph") is None else f"{r['ms_graph']:.4f}",
                    unit_value, f"{100 * r['of_roofline']:.0f}%", r["bound"],
                )
            )
        )  # fmt: skip
    return "\n".join(lines)


# --- timing and the roofline ----------------------------------------------------------------------


PEAK_KEYS = {"fp8": "fp8_matmul_TFLOPs", "int8": "int8_matmul_TOPs", "bf16": "matmul_TFLOPs"}


class Bench:
    """Times ops (CUDA graphs, cold and warm L2) and turns them into result rows."""

    # called after each row is recorded (main: rewrite the JSON, so a run cut short keeps them)
    on_row = None

    def __init__(self, torch, roofline_numbers: dict):
        self.torch = torch
        self.roof = roofline_numbers
        self.rows: list[dict] = []

    def time(self, fn: Callable[[], object], warm: bool = True) -> tuple[float, float | None]:
        from triton.testing import do_bench_cudagraph

        if DEVICE == "cpu":  # --smoke-cpu: the wiring, not a time
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3, None
        self.torch.cuda.synchronize()
        cold = cold_graph_ms(fn)
        if not warm:
            return cold, None
        return cold, float(do_bench_cudagraph(fn, rep=20, return_mode="median"))

    def add(self, group: str, shape: str, impl: str, fn, nbytes: float, flops: float,
            peak: str, warm: bool = True, **extra) -> dict:  # fmt: skip
        """Time ``fn`` and record a row; ``peak``: a PEAK_KEYS key (the matmul rate it meets);
        ``warm``: also the warm-L2 graph time."""
        try:
            ms_cold, ms_graph = self.time(fn, warm)
        except Exception as exc:  # one failing op must not lose the rest of the run
            print(f"FAILED {group} {shape} {impl}: {type(exc).__name__}: {exc}", flush=True)
            row = {"group": group, "shape": shape, "impl": impl, "error": repr(exc)[:500]}
            self.rows.append(row)
            self.saved()
            return row
        peak_tflops = self.roof[PEAK_KEYS[peak]]
        roof = roofline(nbytes, flops, self.roof["copy_GBps"], peak_tflops)
        ms = max(ms_cold, 1e-6)
        row = {
            "group": group, "shape": shape, "impl": impl, "ms_cold": ms_cold,
            "ms_graph": ms_graph, "bytes": nbytes, "flops": flops,
            "GBps": nbytes / ms / 1e6, "TFLOPs": flops / ms / 1e9, "peak": peak,
            **roof, "of_roofline": roof["roofline_ms"] / ms, **extra,
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        self.saved()
        return row

    def saved(self) -> None:
        if self.on_row is not None:
            self.on_row()


def measure_fp8_matmul(torch) -> dict:
    """torch._scaled_mm per-tensor FP8 8192^3 (bf16 out): the FP8 matmul rate."""
    from triton.testing import do_bench

    n = 8192
    a = torch.randn(n, n, device=DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=DEVICE).to(torch.float8_e4m3fn).t()  # column-major operand
    one = torch.ones((), device=DEVICE)
    ms = do_bench(
        lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        warmup=10, rep=200, return_mode="median",
    )  # fmt: skip
    return {"fp8_matmul_TFLOPs": 2 * n**3 / (ms / 1e3) / 1e12, "fp8_matmul_ms": ms}


def measure_int8_matmul(torch) -> dict:
    """torch._int_mm int8 8192^3 (int32 out): the int8 matmul rate (tera-ops/s)."""
    from triton.testing import do_bench

    n = 8192
    a = torch.randint(-128, 128, (n, n), dtype=torch.int8, device=DEVICE)
    b = torch.randint(-128, 128, (n, n), dtype=torch.int8, device=DEVICE).t()  # column-major
    ms = do_bench(lambda: torch._int_mm(a, b), warmup=10, rep=200, return_mode="median")
    return {"int8_matmul_TOPs": 2 * n**3 / (ms / 1e3) / 1e12, "int8_matmul_ms": ms}


# --- groups ---------------------------------------------------------------------------------------


def _gemm_cases(torch, x, w_bf16, w_fp8, w_block_s, w_chan_s) -> dict:
    """impl: (callable, the matmul rate it meets) for one x [M, K] and one weight [N, K]."""
    import torch.nn.functional as F

    from atom_kernels.backends.triton import fp8_skinny, quant

    x_q, x_s = quant.per_token_group_quant_fp8(x, BLOCK[1])
    x_t = x.to(torch.float8_e4m3fn)  # per-tensor, scale 1: the GEMM alone
    w_t = w_fp8.t()  # [K, N] column-major: what cuBLASLt takes
    one = torch.ones((), device=DEVICE)
    block_k = quant.block_k_for(BLOCK[1], DEVICE == "cpu")  # interpreted: 32
    bf16 = torch.bfloat16
    skinny = {  # the weight-only kernel for a few rows (ATOM_FP8_SKINNY's), called directly
        "fp8_block_skinny": (
            lambda: fp8_skinny.fp8_block_skinny_linear(x, w_fp8, w_block_s, BLOCK, None), "fp8"),
    } if x.shape[0] <= fp8_skinny.MAX_ROWS else {}  # fmt: skip
    return {
        **skinny,
        "fp8_block_linear": (
            lambda: quant.fp8_block_linear(x, w_fp8, w_block_s, BLOCK, None), "fp8"),
        "fp8_block_gemm": (
            lambda: quant.w8a8_gemm(
                x_q, x_s, w_fp8, w_block_s, BLOCK[0], BLOCK[1], block_k, None, bf16), "fp8"),
        "scaled_mm_tensor": (
            lambda: torch._scaled_mm(x_t, w_t, scale_a=one, scale_b=one, out_dtype=bf16), "fp8"),
        "fp8_linear_channel": (lambda: quant.fp8_linear(x, w_fp8, w_chan_s, None, None), "fp8"),
        "bf16_linear": (lambda: F.linear(x, w_bf16), "bf16"),
    }  # fmt: skip


def bench_gemm(torch, bench: Bench) -> None:
    from atom_kernels.backends.triton import fp8_skinny

    # fp8_block_linear's rows are the w8a8 path (quantize, then the GEMM); the weight-only kernel
    # its default takes at one row (ATOM_FP8_SKINNY=auto) has its own row, fp8_block_skinny
    fp8_skinny.MODE = "0"
    g = torch.Generator(device=DEVICE).manual_seed(0)
    for name, (n, k) in GEMM_SHAPES.items():
        w_bf16 = (torch.randn(n, k, generator=g, device=DEVICE) * k**-0.5).to(torch.bfloat16)
        w_fp8 = (w_bf16.float() * 64).to(torch.float8_e4m3fn)  # values in the normal FP8 range
        w_block_s = torch.full((cdiv(n, BLOCK[0]), cdiv(k, BLOCK[1])), 1 / 64, device=DEVICE)
        w_chan_s = torch.full((n,), 1 / 64, device=DEVICE)
        for rows in GEMM_ROWS:
            x = torch.randn(rows, k, generator=g, device=DEVICE).to(torch.bfloat16)
            cases = _gemm_cases(torch, x, w_bf16, w_fp8, w_block_s, w_chan_s)
            shape = f"{name} M={rows} N={n} K={k}"
            flops = 2.0 * rows * n * k
            for impl, (fn, peak) in cases.items():
                bench.add("gemm", shape, impl, fn, gemm_bytes(rows, n, k, impl), flops, peak)
        torch.cuda.empty_cache()


def tile_name(cfg: dict | None) -> str:
    if cfg is None:
        return "w8a8_gemm's own"
    split = "auto" if cfg["SPLIT_K"] is None else cfg["SPLIT_K"]
    return (
        f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']} "
        f"split {split}{'' if cfg['FUSED_REDUCE'] else ' (reduce kernel)'} G{cfg['GROUP_M']}"
        f"{' tma' if cfg['TMA'] else ''}"
    )


def bench_gemm_tiles(torch, bench: Bench) -> dict:
    """The w8a8 GEMM alone (FP8 activations) under w8a8_gemm's own launch and each candidate of
    W8A8_TILES, at each shape and TILE_ROWS (cold L2 only). Every candidate's output is checked
    against the float32 product of the same quantized operands before it is timed (a wrong one
    is recorded as an error). Returns and prints the fastest per (shape, M)."""
    from atom_kernels.backends.triton import quant

    block_k = quant.block_k_for(BLOCK[1], DEVICE == "cpu")
    bf16 = torch.bfloat16
    best = {}
    for name, (n, k) in GEMM_SHAPES.items():
        w = (torch.randn(n, k, device=DEVICE) * 2).to(torch.float8_e4m3fn)
        w_s = torch.rand(cdiv(n, BLOCK[0]), cdiv(k, BLOCK[1]), device=DEVICE) / 64 + 1 / 128
        w_deq = w.float() * w_s.repeat_interleave(BLOCK[0], 0)[:n].repeat_interleave(BLOCK[1], 1)
        w_deq = w_deq[:, :k]
        for rows in TILE_ROWS:
            x = torch.randn(rows, k, device=DEVICE).to(bf16)
            x_q, x_s = quant.per_token_group_quant_fp8(x, BLOCK[1])
            x_deq = x_q.float() * x_s.repeat_interleave(BLOCK[1], 1)[:, :k]
            expected = x_deq @ w_deq.T  # [M, N] float32
            shape = f"{name} M={rows} N={n} K={k}"
            nbytes = gemm_bytes(rows, n, k, "fp8_block_gemm")
            candidates = (None, *W8A8_TILES["small" if rows <= 64 else "large"])
            for cfg in candidates:

                def fn(x_q=x_q, x_s=x_s, w=w, w_s=w_s, cfg=cfg):
                    return quant.w8a8_gemm(
                        x_q, x_s, w, w_s, BLOCK[0], BLOCK[1], block_k, None, bf16, cfg
                    )

                impl = f"w8a8 {tile_name(cfg)}"
                try:
                    err = (fn().float() - expected).abs()
                    bad = int((err > 2e-2 + 1.6e-2 * expected.abs()).sum())
                except Exception as exc:  # a candidate that does not compile: keep the others
                    bad, err = -1, exc
                if bad:
                    why = f"{bad} outputs off (max {err.max().item():.4g})" if bad > 0 else err
                    print(f"FAILED gemm_tiles {shape} {impl}: {why}", flush=True)
                    bench.rows.append({"group": "gemm_tiles", "shape": shape, "impl": impl,
                                       "error": repr(why)[:500]})  # fmt: skip
                    continue
                row = bench.add("gemm_tiles", shape, impl, fn, nbytes, 2.0 * rows * n * k, "fp8",
                                warm=False, config=cfg)  # fmt: skip
                if "error" not in row and (
                    shape not in best or row["ms_cold"] < best[shape]["ms_cold"]
                ):
                    best[shape] = row
            del expected, x_deq
        del w_deq
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print("\nfastest w8a8 launch per shape (gemm_tiles):")
    for shape, row in best.items():
        print(f"  {shape}: {row['impl']}  {row['ms_cold'] * 1e3:.1f} us  "
              f"{100 * row['of_roofline']:.0f}% of roofline ({row['bound']})")  # fmt: skip
    return {shape: {k: row[k] for k in ("impl", "config", "ms_cold", "of_roofline", "bound")}
            for shape, row in best.items()}  # fmt: skip


def bench_group_quant(torch, bench: Bench) -> None:
    from atom_kernels.backends.torch import quant as reference
    from atom_kernels.backends.triton import quant

    for rows, k in GROUP_QUANT_SHAPES:
        x = torch.randn(rows, k, device=DEVICE).to(torch.bfloat16)
        groups = cdiv(k, BLOCK[1])
        nbytes = float(rows * k * (2 + 1) + 4 * rows * groups)  # x read, x_q and x_s written
        shape = f"M={rows} K={k} group={BLOCK[1]}"
        x_q, x_s = quant.per_token_group_quant_fp8(x, BLOCK[1])
        q_ref, s_ref = reference.per_token_group_quant_fp8(x, BLOCK[1])
        codes_off = int((x_q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
        scales_off = int((x_s != s_ref).sum())
        # The kernel must match the reference bit for bit (on a GPU: the bare CPU interpreter
        # rounds fp8 casts half-up, which the tests' conftest corrects and --smoke-cpu does not).
        if DEVICE == "cuda" and (codes_off or scales_off):
            print(f"FAILED group_quant {shape}: {codes_off} codes, {scales_off} scales differ "
                  "from the torch reference", flush=True)  # fmt: skip
        for impl, fn in (
            ("triton", lambda x=x: quant.per_token_group_quant_fp8(x, BLOCK[1])),
            ("torch", lambda x=x: reference.per_token_group_quant_fp8(x, BLOCK[1])),
        ):
            bench.add("group_quant", shape, impl, fn, nbytes, 0.0, "bf16")


def _moe_weights(torch, num_experts: int, hidden: int, inter: int, fmt: str, g):
    """(w13, w2, w13_scale, w2_scale) of ``fmt``, random, built expert by expert (no fp32 copy
    of the whole layer)."""
    fp8 = torch.float8_e4m3fn
    shapes = ((num_experts, 2 * inter, hidden), (num_experts, hidden, inter))
    if fmt == "bf16":
        ws = [torch.empty(s, dtype=torch.bfloat16, device=DEVICE) for s in shapes]
        for w in ws:
            w.normal_(0.0, 0.02, generator=g)
        return ws[0], ws[1], None, None
    if fmt == "mxfp4":
        blocks = [
            torch.randint(0, 256, (*s[:2], s[2] // 2), dtype=torch.uint8, device=DEVICE,
                          generator=g) for s in shapes
        ]  # fmt: skip
        scales = [
            torch.randint(118, 124, (*s[:2], s[2] // 32), dtype=torch.uint8, device=DEVICE,
                          generator=g) for s in shapes
        ]  # fmt: skip
        return blocks[0], blocks[1], scales[0], scales[1]
    ws = []
    for s in shapes:
        w = torch.empty(s, dtype=fp8, device=DEVICE)
        for e in range(num_experts):
            w[e].copy_(torch.randn(s[1:], device=DEVICE, generator=g))
        ws.append(w)
    if fmt == "fp8_block":
        scales = [
            torch.full((num_experts, cdiv(s[1], BLOCK[0]), cdiv(s[2], BLOCK[1])), 0.02,
                       device=DEVICE) for s in shapes
        ]  # fmt: skip
    else:  # fp8_channel
        scales = [torch.full(s[:2], 0.02, device=DEVICE) for s in shapes]
    return ws[0], ws[1], scales[0], scales[1]


def bench_moe(
    torch, bench: Bench, tokens_list: tuple[int, ...], max_experts: int | None, sweep: bool = False
) -> None:
    """The ``moe`` group; ``sweep``: the ``moe_tiles`` group (quantized formats only, each
    ``moe_tile_candidates`` config checked against the reference, then timed cold)."""
    from atom_kernels.backends.torch import moe as reference
    from atom_kernels.backends.triton import moe
    from atom_kernels.backends.triton import moe_mxfp4 as mxfp4

    for name, (num_experts, top_k, hidden, inter, formats, oai) in MOE_SHAPES.items():
        if MOE_SHAPE_NAMES and name not in MOE_SHAPE_NAMES:
            continue
        if max_experts is not None and num_experts > max_experts:
            print(f"{name}: {max_experts} of its {num_experts} experts (--moe-max-experts)")
            num_experts = max_experts
        g = torch.Generator(device=DEVICE).manual_seed(1)
        activation = "swiglu_oai" if oai else "silu"
        b13 = b2 = None
        if oai:
            b13 = (torch.randn(num_experts, 2 * inter, device=DEVICE) * 0.02).to(torch.bfloat16)
            b2 = (torch.randn(num_experts, hidden, device=DEVICE) * 0.02).to(torch.bfloat16)
        routing = {}
        for tokens in tokens_list:
            x = torch.randn(tokens, hidden, generator=g, device=DEVICE).to(torch.bfloat16)
            logits = torch.randn(tokens, num_experts, generator=g, device=DEVICE)
            weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
            routing[tokens] = (x, weights, ids.int(), int(ids.unique().numel()))
        for fmt in formats:
            if (MOE_FORMATS and fmt not in MOE_FORMATS) or (sweep and fmt == "bf16"):
                continue
            t0 = time.perf_counter()
            w13, w2, s13, s2 = _moe_weights(torch, num_experts, hidden, inter, fmt, g)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            print(f"{name} {fmt}: weights built in {time.perf_counter() - t0:.1f} s", flush=True)
            quant_kw = {}
            if fmt != "bf16":
                quant_kw = dict(quant=fmt, w13_scale=s13, w2_scale=s2,
                                block_size=BLOCK if fmt == "fp8_block" else None)  # fmt: skip
            for tokens, (x, weights, ids, hit) in routing.items():
                args = (x, w13, w2, weights, ids, activation, b13, b2, oai, 1.702, 7.0)

                def fn(args=args, quant_kw=quant_kw):
                    return moe.fused_moe(*args, **quant_kw)

                shape = f"{name} E={num_experts} top{top_k} H={hidden} I={inter} T={tokens}"
                nbytes = moe_bytes(hit, tokens, hidden, inter, fmt, oai)
                flops = moe_flops(tokens, top_k, hidden, inter)
                if fmt == "mxfp4" and MXFP4_MODES and not sweep:
                    bench_mxfp4_modes(bench, moe, reference, args, quant_kw, shape, nbytes, flops,
                                      hit)  # fmt: skip
                    continue
                if not sweep:
                    bench.add("moe", shape, fmt, fn, nbytes, flops, "bf16", experts_hit=hit)
                    continue
                expected = reference.fused_moe(*args, **quant_kw)
                default = moe._configs(tokens, top_k, num_experts, hidden, inter, x.device)
                if fmt == "mxfp4":  # the way's own tiles (ATOM_MXFP4_MOE or the default way)
                    code = mxfp4.resolve_mode(None, x.dtype, default["per_pair"], (w13, w2))
                    default = mxfp4.mxfp4_tiles(default, code, tokens * top_k)
                seen = set()
                for config in moe_tile_candidates(default):
                    key = repr(moe._quant_config(config, fmt, BLOCK))  # what the kernels get
                    if key in seen:
                        continue
                    seen.add(key)
                    impl = f"{fmt} {short_config(moe._quant_config(config, fmt, BLOCK))}"
                    try:
                        out = moe.fused_moe(*args, config=config, **quant_kw)
                        error = (out.float() - expected.float()).abs()
                        bad = bool((error > TOLERANCE + TOLERANCE * expected.float().abs()).any())
                    except Exception as exc:  # a config that does not compile: recorded, skipped
                        print(f"FAILED moe_tiles {shape} {impl}: {exc!r}"[:1000], flush=True)
                        bench.rows.append({"group": "moe_tiles", "shape": shape, "impl": impl,
                                           "error": repr(exc)[:500]})  # fmt: skip
                        continue

                    def fn(args=args, quant_kw=quant_kw, config=config):
                        return moe.fused_moe(*args, config=config, **quant_kw)

                    bench.add("moe_tiles", shape, ("BAD " if bad else "") + impl, fn, nbytes,
                              flops, "bf16", warm=False, experts_hit=hit, config=config,
                              max_error=float(error.max()), bad=bad)  # fmt: skip
            del w13, w2, s13, s2
            torch.cuda.empty_cache()


def bench_mla(torch, bench: Bench) -> None:
    from atom_kernels.backends.triton import mla_attention

    scale = (128 + MLA_ROPE) ** -0.5  # DeepSeek-V3's qk_nope 128 + qk_rope 64
    g = torch.Generator(device=DEVICE).manual_seed(2)
    for batch in MLA_BATCHES:
        for context in MLA_CONTEXTS:
            blocks_per_seq = cdiv(context, MLA_PAGE)
            num_blocks = batch * blocks_per_seq
            perm = torch.randperm(num_blocks, device=DEVICE, generator=g).int()
            block_tables = perm.view(batch, blocks_per_seq).contiguous()
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
            qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
            cache_bf16 = torch.randn(
                num_blocks, MLA_PAGE, MLA_LATENT + MLA_ROPE, generator=g, device=DEVICE
            ).to(torch.bfloat16)
            caches = {
                "bf16": (cache_bf16, None),
                "fp8": (cache_bf16.to(torch.float8_e4m3fn), torch.ones(1, device=DEVICE)),
            }
            for heads in MLA_HEADS:
                q = torch.randn(batch, heads, MLA_LATENT + MLA_ROPE, generator=g, device=DEVICE)
                q = q.to(torch.bfloat16)
                q_latent, q_pe = q[..., :MLA_LATENT], q[..., MLA_LATENT:]
                out = torch.empty(batch, heads, MLA_LATENT, dtype=torch.bfloat16, device=DEVICE)
                for cache_name, (cache, kv_scale) in caches.items():

                    def fn(cache=cache, kv_scale=kv_scale, q_latent=q_latent, q_pe=q_pe,
                           out=out, tables=block_tables, lens=seq_lens, qsl=qsl):  # fmt: skip
                        return mla_attention.mla_paged_attention(
                            q_latent, q_pe, cache, tables, lens, qsl, scale, out,
                            kv_scale=kv_scale, max_query_len=1,
                        )  # fmt: skip

                    shape = f"decode H={heads} B={batch} ctx={context}"
                    nbytes = mla_bytes(batch, context, heads, cache.element_size())
                    flops = mla_flops(batch, context, heads)
                    bench.add("mla", shape, f"{cache_name} cache", fn, nbytes, flops, "bf16")
            del caches, cache_bf16
            torch.cuda.empty_cache()


def _int_weights(torch, n: int, k: int, g):
    """Random W4A16 (qweight, bf16 scales [N, K / INT_GROUP]) and W8A8 (int8, fp32 scales [N])
    weights of an [N, K] layer, scaled for ~unit outputs."""
    qweight = torch.randint(-(2**31), 2**31, (n, k // 8), dtype=torch.int32, device=DEVICE,
                            generator=g)  # fmt: skip
    scales = torch.full((n, cdiv(k, INT_GROUP)), 0.4 * k**-0.5, dtype=torch.bfloat16, device=DEVICE)
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=DEVICE, generator=g)
    w8_s = torch.full((n,), 0.014 * k**-0.5, device=DEVICE)
    return qweight, scales, w8, w8_s


def _checked_add(bench: Bench, group, shape, impl, fn, expected, nbytes, flops, peak, **kw):
    """Runs ``fn`` once against ``expected`` (max_error; ``BAD`` past atol = rtol = TOLERANCE),
    then times it; a launch that fails is recorded as an error."""
    try:
        error = (fn().float() - expected).abs()
    except Exception as exc:  # a candidate that does not compile: keep the others
        print(f"FAILED {group} {shape} {impl}: {exc!r}"[:1000], flush=True)
        row = {"group": group, "shape": shape, "impl": impl, "error": repr(exc)[:500]}
        bench.rows.append(row)
        bench.saved()
        return row
    bad = bool((error > TOLERANCE + TOLERANCE * expected.abs()).any())
    return bench.add(group, shape, ("BAD " if bad else "") + impl, fn, nbytes, flops, peak,
                     max_error=float(error.max()), bad=bad, **kw)  # fmt: skip


def _w4a16_variants(rows: int) -> list:
    """(impl, config) of the W4A16 GEMM timed side by side at M = ``rows``: its own launch, and
    at decode sizes the interleaved K loop (``PERMUTED_K`` False, the launch before issue 40's
    rework) next to the permuted one (128-deep K tiles, its default: 16-word dots), plus at M = 1
    the permuted multiply-adds (BLOCK_M 1)."""
    if rows > W4A16_DECODE_ROWS:
        return [("w4a16_g128", None)]
    out = [("w4a16_g128 default", None),  # the launch wna16_linear picks
           ("w4a16_g128 interleaved", {"PERMUTED_K": False}),
           ("w4a16_g128 permuted", {"PERMUTED_K": True, "BLOCK_K": 128})]  # fmt: skip
    for block_n, warps, stages, per_sm in PACKED_DOT_TILES:
        config = dict(_wna16_tile(block_n, warps, stages), per_sm=per_sm, PERMUTED_K=True,
                      PACKED_DOT=True)  # fmt: skip
        out.append((f"w4a16_g128 packed-dot {block_n} w{warps} s{stages} p{per_sm}", config))
    for block_n, warps, stages, per_sm, maxnreg in FILL_TILES["packed-dot"]:
        config = dict(_wna16_tile(block_n, warps, stages), per_sm=per_sm, fill=True,
                      maxnreg=maxnreg, PERMUTED_K=True, PACKED_DOT=True)  # fmt: skip
        out.append((f"w4a16_g128 packed-dot {block_n} w{warps} s{stages} fill{per_sm}", config))
    for block_n, warps, stages, per_sm in PACKED_X_SPLIT_TILES:
        config = dict(_wna16_tile(block_n, warps, stages), per_sm=per_sm, fill=True,
                      PERMUTED_K=True, PACKED_DOT=True, X_SPLIT=True)  # fmt: skip
        out.append((f"w4a16_g128 packed-dot {block_n} w{warps} s{stages} fill{per_sm} x-split",
                    config))  # fmt: skip
    if rows == 1:
        fma = {"PERMUTED_K": True, "BLOCK_M": 1, "BLOCK_K": 128, "num_stages": 1}
        out.append(("w4a16_g128 permuted fma", dict(fma, SMALL_MAGIC=False, X_VECTOR=False)))
        for block_n, warps, stages in SMALL_MAGIC_TILES:
            config = _wna16_tile(block_n, warps, stages, bm=1)  # SPLIT_K None: chosen
            out.append((f"w4a16_g128 permuted fma small-magic {block_n} w{warps} s{stages}",
                        dict(config, PERMUTED_K=True, SMALL_MAGIC=True)))  # fmt: skip
        for block_n, warps, stages, per_sm in X_VECTOR_TILES:
            config = dict(_wna16_tile(block_n, warps, stages, bm=1), per_sm=per_sm,
                          PERMUTED_K=True, SMALL_MAGIC=True, X_VECTOR=True)  # fmt: skip
            out.append((f"w4a16_g128 permuted fma small-magic {block_n} w{warps} s{stages} "
                        f"x-vector p{per_sm}", config))  # fmt: skip
        for block_n, warps, stages, per_sm, maxnreg in FILL_TILES["fma"]:
            config = dict(
                _wna16_tile(block_n, warps, stages, bm=1),
                per_sm=per_sm,
                fill=True,
                maxnreg=maxnreg,
                PERMUTED_K=True,
                SMALL_MAGIC=True,
                X_VECTOR=True,
            )
            name = f"fill{per_sm}" + (f" r{maxnreg}" if maxnreg else "")
            out.append((f"w4a16_g128 permuted fma small-magic {block_n} w{warps} s{stages} "
                        f"x-vector {name}", config))  # fmt: skip
        for block_n, warps, k_stages, per_sm in K_STAGES_TILES:
            config = dict(_wna16_tile(block_n, warps, 1, bm=1), per_sm=per_sm, fill=True,
                          k_stages=k_stages, PERMUTED_K=True, SMALL_MAGIC=True,
                          X_VECTOR=True)  # fmt: skip
            out.append((f"w4a16_g128 permuted fma small-magic {block_n} w{warps} s1 "
                        f"x-vector k{k_stages} fill{per_sm}", config))  # fmt: skip
        for block_n, warps, k_stages, per_sm in QUAD_TILES:  # one K tile a step, explicitly
            config = dict(_wna16_tile(block_n, warps, 1, bm=1), per_sm=per_sm, fill=True,
                          k_stages=k_stages, PERMUTED_K=True, QUAD_MMA=True,
                          QUAD_STEP=1)  # fmt: skip
            out.append((f"w4a16_g128 quad-mma {block_n} w{warps} k{k_stages} fill{per_sm}",
                        config))  # fmt: skip
        for block_n, warps, k_stages, per_sm, step in QUAD_STEP_TILES:
            config = dict(_wna16_tile(block_n, warps, 1, bm=1), per_sm=per_sm, fill=True,
                          k_stages=k_stages, PERMUTED_K=True, QUAD_MMA=True,
                          QUAD_STEP=step)  # fmt: skip
            out.append((f"w4a16_g128 quad-mma {block_n} w{warps} k{k_stages} fill{per_sm} "
                        f"step{step}", config))  # fmt: skip
        for block_n, warps, k_stages, per_sm in ROW_TILES:
            config = dict(_wna16_tile(block_n, warps, 1, bm=1, bk=1024), per_sm=per_sm,
                          fill=True, k_stages=k_stages, PERMUTED_K=True, ROW_MMA=True)  # fmt: skip
            out.append((f"w4a16_g128 row-mma {block_n} w{warps} k{k_stages} fill{per_sm}",
                        config))  # fmt: skip
        for block_n, warps, k_stages, per_sm in ROW_SCALE_AFTER_TILES:
            config = dict(_wna16_tile(block_n, warps, 1, bm=1, bk=1024), per_sm=per_sm,
                          fill=True, k_stages=k_stages, PERMUTED_K=True, ROW_MMA=True,
                          ROW_SCALE_AFTER=True)  # fmt: skip
            out.append((f"w4a16_g128 row-mma {block_n} w{warps} k{k_stages} fill{per_sm} "
                        "scale-after", config))  # fmt: skip
        for block_n, warps, per_sm, step, keys in ROW_XSUM_TILES:
            config = dict(_wna16_tile(block_n, warps, 1, bm=1, bk=1024), per_sm=per_sm,
                          fill=True, k_stages=1, PERMUTED_K=True, ROW_MMA=True, ROW_STEP=step,
                          ROW_XSUM="xsum" in keys, ROW_AHEAD="ahead" in keys,
                          ROW_STRIDED=keys == "strided")  # fmt: skip
            out.append((f"w4a16_g128 row-mma {block_n} w{warps} k1 fill{per_sm} step{step} "
                        f"{keys}", config))  # fmt: skip
        for block_n, warps, per_sm, split, maxnreg in ROW_OCCUPANCY_TILES:
            config = dict(_wna16_tile(block_n, warps, 1, split, bm=1, bk=1024), per_sm=per_sm,
                          fill=True, k_stages=1, PERMUTED_K=True, ROW_MMA=True,
                          maxnreg=maxnreg)  # fmt: skip
            name = (f" split{split}" if split else "") + (f" r{maxnreg}" if maxnreg else "")
            out.append((f"w4a16_g128 row-mma {block_n} w{warps} k1 fill{per_sm}{name} "
                        "occupancy", config))  # fmt: skip
        for block_n, warps, per_sm, step in ROW_STEP_TILES:
            config = dict(_wna16_tile(block_n, warps, 1, bm=1, bk=1024), per_sm=per_sm,
                          fill=True, k_stages=1, PERMUTED_K=True, ROW_MMA=True,
                          ROW_STEP=step)  # fmt: skip
            out.append((f"w4a16_g128 row-mma {block_n} w{warps} k1 fill{per_sm} step{step}",
                        config))  # fmt: skip
        for block_n, block_k, warps, per_sm in X_VECTOR_DEEP_TILES:
            config = dict(_wna16_tile(block_n, warps, 1, bm=1, bk=block_k), per_sm=per_sm,
                          fill=True, PERMUTED_K=True, SMALL_MAGIC=True, X_VECTOR=True)  # fmt: skip
            out.append((f"w4a16_g128 permuted fma small-magic {block_n} w{warps} s1 x-vector "
                        f"bk{block_k} fill{per_sm}", config))  # fmt: skip
        default = dict(_wna16_tile(256, 4, 1, bm=1), PERMUTED_K=True, SMALL_MAGIC=True)
        for variant in SMALL_MAGIC_VARIANTS:
            name = "+".join(k.lower().replace("_", "-") for k in variant)
            out.append((f"w4a16_g128 permuted fma small-magic 256 w4 s1 {name}",
                        dict(default, **variant)))  # fmt: skip
    return out


def _int_cases(torch, x, rows, weights) -> list:
    """(impl, callable, the matmul rate it meets) for one x [M, K] of the ``int`` group."""
    import torch.nn.functional as F

    from atom_kernels.backends.triton import int_quant

    qweight, scales, w8, w8_s, w_bf16, frag = weights
    cases = [("bf16_linear", lambda: F.linear(x, w_bf16), "bf16")]
    if rows <= 8 and x.shape[1] % 64 == 0:
        for warps, per_warp, per_sm, k_stages, maxnreg in FRAG_TILES:
            config = dict(num_warps=warps, ROWS_PER_WARP=per_warp, per_sm=per_sm,
                          k_stages=k_stages, maxnreg=maxnreg)  # fmt: skip
            name = (f"w4a16_g128 frag w{warps} r{per_warp} p{per_sm} k{k_stages}"
                    + (f" r{maxnreg}" if maxnreg else ""))  # fmt: skip
            cases.append((name, lambda config=config: int_quant.wna16_linear(
                x, *frag, None, None, 4, None, config), "bf16"))  # fmt: skip
    if rows in W4A16_ROWS:
        for impl, config in _w4a16_variants(rows):
            if config and config.get("ROW_MMA") and x.shape[1] % 1024:
                continue  # its K tile is 1024 deep (--smoke-cpu's K is 256)
            if config and config.get("QUAD_MMA") and x.shape[1] % (128 * config["QUAD_STEP"]):
                continue  # its step is deeper than K
            cases.append((impl, lambda config=config: int_quant.wna16_linear(
                x, qweight, scales, None, None, 4, None, config), "bf16"))  # fmt: skip
    if rows in W8A8_ROWS:
        x_q, x_s = int_quant.quantize_int8(x, None)
        cases += [
            ("w8a8_linear", lambda: int_quant.int8_linear(x, w8, w8_s, None, None), "int8"),
            ("w8a8_gemm", lambda: int_quant.int8_gemm(x_q, x_s, w8, w8_s, None, x.dtype), "int8"),
        ]
    return cases


def bench_int(torch, bench: Bench) -> None:
    """W4A16 and W8A8 GEMMs against bf16 cuBLAS at the Llama-3-8B projections (``int``)."""
    import torch.nn.functional as F

    from atom_kernels.backends.torch import int_quant as reference
    from atom_kernels.ops.int_quant_frag import wna16_to_frag

    g = torch.Generator(device=DEVICE).manual_seed(0)
    for name, (n, k) in INT_SHAPES.items():
        qweight, scales, w8, w8_s = _int_weights(torch, n, k, g)
        w_bf16 = reference.dequantize_wna16(qweight, scales, None, None, 4, torch.bfloat16)
        frag = wna16_to_frag(qweight, scales, None)[:2]
        weights = (qweight, scales, w8, w8_s, w_bf16, frag)
        for rows in sorted(set(W4A16_ROWS) | set(W8A8_ROWS)):
            if INT_ROWS is not None and rows not in INT_ROWS:
                continue
            x = torch.randn(rows, k, generator=g, device=DEVICE).to(torch.bfloat16)
            shape = f"{name} M={rows} N={n} K={k}"
            for impl, fn, peak in _int_cases(torch, x, rows, weights):
                if INT_IMPLS and not any(part in impl for part in INT_IMPLS):
                    continue
                if impl.startswith("w8a8"):
                    expected = reference.int8_linear(x, w8, w8_s, None, None).float()
                else:
                    expected = F.linear(x, w_bf16).float()
                nbytes = int_gemm_bytes(rows, n, k, impl)
                row = _checked_add(bench, "int", shape, impl, fn, expected, nbytes,
                                   2.0 * rows * n * k, peak)  # fmt: skip
                if "GBps" in row:
                    row["of_copy_bandwidth"] = row["GBps"] / bench.roof["copy_GBps"]
        weights = w_bf16 = frag = None
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print("\nw4a16 (issue 40: >= 70% of the copy bandwidth at decode):")
    for row in bench.rows:
        if row["group"] == "int" and "w4a16" in row["impl"] and "GBps" in row:
            share = 100 * row["of_copy_bandwidth"]
            print(f"  {row['shape']:<34} {row['impl']:<26} {row['ms_cold'] * 1e3:7.1f} us "
                  f"{row['GBps']:7.0f} GB/s {share:5.1f}% of copy")  # fmt: skip


def bench_int_tiles(torch, bench: Bench) -> dict:
    """The W4A16 GEMM under its own launch and each WNA16_TILES candidate (``int_tiles``, cold L2
    only); returns and prints the fastest per (shape, M)."""
    from atom_kernels.backends.torch import int_quant as reference
    from atom_kernels.backends.triton import int_quant

    g = torch.Generator(device=DEVICE).manual_seed(1)
    best = {}
    for name, (n, k) in INT_SHAPES.items():
        qweight, scales, _, _ = _int_weights(torch, n, k, g)
        for rows in INT_TILE_ROWS:
            x = torch.randn(rows, k, generator=g, device=DEVICE).to(torch.bfloat16)
            expected = reference.wna16_linear(x, qweight, scales, None, None, 4, None).float()
            shape = f"{name} M={rows} N={n} K={k}"
            nbytes = int_gemm_bytes(rows, n, k, "w4a16_g128")
            for cfg in (None, *WNA16_TILES[rows]):

                def fn(x=x, cfg=cfg, qweight=qweight, scales=scales):
                    return int_quant.wna16_linear(x, qweight, scales, None, None, 4, None, cfg)

                impl = "w4a16 " + ("own" if cfg is None else " ".join(
                    f"{key}={value}" for key, value in cfg.items()))  # fmt: skip
                row = _checked_add(bench, "int_tiles", shape, impl, fn, expected, nbytes,
                                   2.0 * rows * n * k, "bf16", warm=False, config=cfg)  # fmt: skip
                if (
                    "error" not in row
                    and not row["bad"]
                    and (shape not in best or row["ms_cold"] < best[shape]["ms_cold"])
                ):
                    best[shape] = row
    print("\nfastest w4a16 launch per shape (int_tiles):")
    for shape, row in best.items():
        print(f"  {shape}: {row['impl']}  {row['ms_cold'] * 1e3:.1f} us  "
              f"{100 * row['of_roofline']:.0f}% of roofline ({row['bound']})")  # fmt: skip
    return {shape: {k: row[k] for k in ("impl", "config", "ms_cold", "of_roofline", "bound")}
            for shape, row in best.items()}  # fmt: skip


def _shrink_for_smoke() -> None:
    """Tiny shapes on the CPU (the interpreter), same code paths."""
    global DEVICE, GEMM_SHAPES, GEMM_ROWS, GROUP_QUANT_SHAPES, MOE_SHAPES, MOE_TOKENS, W8A8_TILES
    global TILE_ROWS
    global MLA_HEADS, MLA_BATCHES, MLA_CONTEXTS, MOE_TILE_TOKENS
    global INT_SHAPES, W4A16_ROWS, W8A8_ROWS, INT_TILE_ROWS, WNA16_TILES
    DEVICE = "cpu"
    INT_SHAPES = {"tiny": (48, 256)}
    W4A16_ROWS, W8A8_ROWS, INT_TILE_ROWS = (1, 5), (1, 20), (1, 16)
    WNA16_TILES = {1: (_wna16_tile(16, 4, 1, 2, bm=1, bk=32),),
                   16: (_wna16_tile(32, 4, 1, None, bk=64),)}  # fmt: skip
    MOE_TILE_TOKENS = (1, 5)
    GEMM_SHAPES = {"tiny": (192, 256), "tiny_edge": (64, 384)}
    GEMM_ROWS = (1, 5, 17)
    GROUP_QUANT_SHAPES = ((3, 256),)
    MOE_SHAPES = {
        "deepseek-tiny": (8, 2, 256, 128, ("fp8_block", "fp8_channel", "bf16"), False),
        "gpt-oss-tiny": (8, 2, 64, 64, ("mxfp4", "bf16"), True),
    }
    MOE_TOKENS = (1, 5)
    TILE_ROWS = (1, 70)
    W8A8_TILES = {
        "small": (_tile(16, 32, 4, 1, 2), _tile(16, 64, 4, 1, None, fused=False)),
        "large": (_tile(16, 64, 4, 1, 1, 2), _tile(16, 32, 4, 1, 1, 2, True)),
    }
    MLA_HEADS, MLA_BATCHES, MLA_CONTEXTS = (16,), (2,), (40,)


# --- main -----------------------------------------------------------------------------------------


PER_PAIR_CONFIG = {  # "<mode>+pp": the per-pair path's T = 1 tiles at any decode size
    "per_pair": True, "combine": "sum",
    "gemm1": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
    "gemm2": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=5),
}  # fmt: skip


def bench_mxfp4_modes(bench: Bench, moe, reference, args, quant_kw, shape, nbytes, flops, hit):
    """One ``moe`` row per --mxfp4-modes entry, each checked against the torch reference first
    (max_error, bad: atol = rtol = TOLERANCE) so a wrong way is never reported as a fast one."""
    expected = reference.fused_moe(*args, **quant_kw).float()
    for variant in MXFP4_MODES:
        mode, _, extra = variant.partition("+")
        config = PER_PAIR_CONFIG if extra == "pp" else None
        pairs = args[0].shape[0] * args[4].shape[1]
        if config is not None and not moe.PER_PAIR_MAX_PAIRS < pairs <= 64:
            continue  # per-pair already (the default tiles), or past decode sizes
        kw = dict(quant_kw, mxfp4_mode=mode, config=config)
        impl = f"mxfp4 {variant}"
        try:
            error = (moe.fused_moe(*args, **kw).float() - expected).abs()
        except Exception as exc:  # a way that does not compile here: recorded, skipped
            print(f"FAILED moe {shape} {impl}: {exc!r}"[:1000], flush=True)
            bench.rows.append({"group": "moe", "shape": shape, "impl": impl,
                               "error": repr(exc)[:500]})  # fmt: skip
            continue
        bad = bool((error > TOLERANCE + TOLERANCE * expected.abs()).any())

        def fn(args=args, kw=kw):
            return moe.fused_moe(*args, **kw)

        bench.add("moe", shape, ("BAD " if bad else "") + impl, fn, nbytes, flops, "bf16",
                  experts_hit=hit, max_error=float(error.max()), bad=bad,
                  ref_absmax=float(expected.abs().max()))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON results file")
    parser.add_argument(
        "--only", default="", help=f"comma-separated, of {','.join(GROUPS)} (default: all)"
    )
    parser.add_argument(
        "--moe-tokens", default="", help=f"comma-separated T (default {MOE_TOKENS})"
    )
    parser.add_argument(
        "--moe-max-experts", type=int, default=None,
        help="fewer experts of the same shape (memory / time); the JSON says so",
    )  # fmt: skip
    parser.add_argument(
        "--smoke-cpu", action="store_true",
        help="tiny shapes on the CPU under TRITON_INTERPRET=1, each op run once: checks the "
        "script's wiring, measures nothing (the bare interpreter multiplies bf16 dots wrong: "
        "bf16 rows through tl.dot read BAD there; the tests' conftest corrects it)",
    )  # fmt: skip
    parser.add_argument("--moe-formats", default="", help="comma-separated MoE formats only")
    parser.add_argument("--moe-shapes", default="", help=f"comma-separated, of {list(MOE_SHAPES)}")
    parser.add_argument(
        "--mxfp4-modes", default="",
        help="comma-separated MXFP4 ways (legacy, bits, words, scaled; '+pp': forced "
        "per-pair), each a row checked against the reference (default: the kernel's choice)",
    )  # fmt: skip
    parser.add_argument(
        "--moe-tile-tokens", default="", help=f"moe_tiles: comma-separated T (default "
        f"{MOE_TILE_TOKENS})",
    )  # fmt: skip
    parser.add_argument(
        "--int-rows", default="",
        help=f"int: comma-separated M only (of {sorted(set(W4A16_ROWS) | set(W8A8_ROWS))})",
    )  # fmt: skip
    parser.add_argument(
        "--int-impls", default="",
        help="int: comma-separated substrings; an impl runs if it holds one (e.g. small-magic)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    global MOE_FORMATS, MOE_SHAPE_NAMES, MXFP4_MODES, INT_ROWS, INT_IMPLS
    INT_ROWS = tuple(int(m) for m in args.int_rows.split(",") if m) or None
    INT_IMPLS = tuple(part for part in args.int_impls.split(",") if part)
    MOE_FORMATS = tuple(f for f in args.moe_formats.split(",") if f)
    MOE_SHAPE_NAMES = tuple(f for f in args.moe_shapes.split(",") if f)
    MXFP4_MODES = tuple(f for f in args.mxfp4_modes.split(",") if f)
    groups = [g for g in args.only.split(",") if g] or list(GROUPS)
    unknown = set(groups) - set(GROUPS)
    if unknown:
        parser.error(f"unknown groups {sorted(unknown)}")

    if args.smoke_cpu:
        _shrink_for_smoke()
    import torch

    if args.smoke_cpu:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke-cpu needs TRITON_INTERPRET=1 in the environment")
    elif not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/quant_kernels.py needs a CUDA GPU (FP8 tensor cores: compute capability "
            ">= 8.9); none is visible here (--smoke-cpu checks the wiring on the CPU)"
        )
    elif torch.cuda.get_device_capability() < (8, 9) or torch.version.hip is not None:
        raise SystemExit("benchmarks/quant_kernels.py needs an NVIDIA GPU with FP8 (sm_89+)")
    import triton

    torch.manual_seed(0)
    if args.smoke_cpu:
        roof = {"copy_GBps": 1.0, "matmul_TFLOPs": 1.0, "fp8_matmul_TFLOPs": 1.0,
                "int8_matmul_TOPs": 1.0}  # fmt: skip
    else:
        roof = measure_roofline(torch)
        roof.update(measure_fp8_matmul(torch))
        if "int" in groups:
            roof.update(measure_int8_matmul(torch))
    print(json.dumps(roof), flush=True)
    bench = Bench(torch, roof)
    report = {
        "benchmark": "quant_kernels",
        "device": "cpu (smoke)" if args.smoke_cpu else torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },  # fmt: skip
        "roofline": roof,
        "notes": {
            "timing": "CUDA graphs; ms_cold: L2 flushed before each call (rates use it); "
            "ms_graph: warm L2",
            "roofline": "max(bytes / copy_GBps, flops / matmul rate of the dtype multiplied: "
            "fp8_matmul_TFLOPs for w8a8 / _scaled_mm, matmul_TFLOPs (bf16) otherwise)",
            "moe_max_experts": args.moe_max_experts,
        },
        "results": bench.rows,
    }

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    bench.on_row = save
    moe_tokens = tuple(int(t) for t in args.moe_tokens.split(",") if t) or MOE_TOKENS
    tile_tokens = tuple(int(t) for t in args.moe_tile_tokens.split(",") if t) or MOE_TILE_TOKENS
    runners = {
        "gemm": lambda: bench_gemm(torch, bench),
        "group_quant": lambda: bench_group_quant(torch, bench),
        "mla": lambda: bench_mla(torch, bench),
        "moe": lambda: bench_moe(torch, bench, moe_tokens, args.moe_max_experts),
        "moe_tiles": lambda: bench_moe(torch, bench, tile_tokens, args.moe_max_experts, sweep=True),
        "gemm_tiles": lambda: bench_gemm_tiles(torch, bench),
        "int": lambda: bench_int(torch, bench),
        "int_tiles": lambda: bench_int_tiles(torch, bench),
    }
    for group in groups:
        t0 = time.perf_counter()
        try:
            best = runners[group]()
            if best:
                report[f"{group}_best"] = best
        except Exception as exc:  # keep the other groups
            print(f"FAILED group {group}: {type(exc).__name__}: {exc}", flush=True)
            report.setdefault("errors", {})[group] = repr(exc)[:1000]
        report.setdefault("group_seconds", {})[group] = round(time.perf_counter() - t0, 1)
        save()
    print(
        f"{report['device']}  torch {torch.__version__}  triton {triton.__version__}\n"
        f"roofline: copy {roof['copy_GBps']:.0f} GB/s, bf16 matmul {roof['matmul_TFLOPs']:.0f} "
        f"TFLOP/s, fp8 matmul {roof['fp8_matmul_TFLOPs']:.0f} TFLOP/s"
    )
    print(format_table([r for r in bench.rows if "error" not in r]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
