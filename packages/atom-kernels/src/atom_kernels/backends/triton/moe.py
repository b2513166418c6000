"""Triton fused MoE, two paths chosen by ``_configs`` from the shape:

- sorted (most batches): (token, slot) pairs sorted by expert and padded per expert to BLOCK_M
  (the align step: a single-program Triton kernel for few pairs, a stable radix sort for many,
  or per-chunk histograms), two grouped GEMMs over the padded rows (the gated activation fused
  into the first, the bias and the routing weight into the second; optionally a smaller tile for
  an expert's last rows), then the per-token sum of its top-k rows: a torch sum over [T, K, H]
  ("sum"; "sum_kernel": a Triton one), or fp32 atomics in GEMM 2's epilogue plus one cast
  ("atomic").
- per-pair (decode, a handful of pairs): no align step. GEMM 1 runs one program row per pair (its
  expert read from ``topk_ids``) and folds the routing weight into the activation; GEMM 2 runs one
  program per (pair, column tile) and writes fp32 pair rows summed by one small kernel ("sum") or
  adds them into an fp32 [T, H] buffer with atomics ("atomic"); or ("token") one program per
  (token, column tile) walks its K experts in one reduction loop (fewer, longer programs).

T = tokens, K = experts per token, N = T * K pairs, E = experts, H = hidden size, I = expert
intermediate size, P = padded rows (an upper bound from shapes alone: N + min(E, N) * (BLOCK_M - 1),
so grids never depend on the routing and the op captures in CUDA graphs without a host sync).

The align step writes, per expert, its pair count and the end of its padded segment; a GEMM
program owns one BLOCK_M row block, finds its expert from those ends and returns at once when the
block lies past the last used segment: experts that receive no token have no block and cost nothing
(their weights are never read). GEMM programs form a 1-D grid ordered in groups of GROUP_M row
blocks (row blocks fastest within a group) so a group's A rows and expert weights stay in L2.

Pairs with expert id -1 (expert parallelism: another rank's expert) get no GEMM rows and read no
expert weights: the align step leaves them out of every segment, the per-pair kernels return or
mask their loads at once, and every combine counts them as zero (the sum kernel skips their
rows; rows a combine reads unconditionally, top-1's output and torch's sum, are zeroed first).

Mixed tiles (a config's "remainder_m" > 0): the layout stays padded to BLOCK_M, but an expert's
last row block with at most REMAINDER_M pairs left runs a REMAINDER_M-row tile (the rest of the
block is never read nor written), so e.g. 260 pairs cost 128 + 128 + 32 rows of MMA work, not
3 x 128. Both GEMMs take the same branch for a block (same counts), so GEMM 2 reads exactly the
rows GEMM 1 wrote. The program order is unchanged: the small tile runs beside its expert's full
tiles and reads the expert's weights from L2.

TMA (a config's "tma", prefill configs on Hopper and newer): both GEMMs load their weight tiles
through host-built tensor descriptors instead of pointer arithmetic, and (optional, "ws", tiles of
64 rows or more) Triton warp-specializes the K loop (producer warps issue the copies, consumer
warps the MMAs). The
activations stay pointer loads (GEMM 1 gathers token rows). Interleaved gate/up weights (GPT-OSS)
and weights that break TMA's alignment rules fall back to pointer loads.

Quantized experts (``quant``: "fp8_block", "fp8_channel", "mxfp4"; "wna16" has its own kernels
in ``moe_wna16.py``, on this module's align step and sum kernel): every GEMM dequantizes its
weight tiles in the K loop, then multiplies in the activation dtype: weight-only, the numbers of
the torch reference's dequantized experts (each value times its scale in float32, one rounding).
The scales are loaded per (column tile, K step), never per element: FP8 (``_fp8_tile``) reads a
[BLOCK_K, BLOCK_N] tile and one [BLOCK_N] scale vector (BLOCK_K divides the block's K, so a K tile
lies in one scale column; per channel the same vector every step). MXFP4 lives in
``moe_mxfp4.py``: three ways (QUANT 2 to 4: a hand decode into two K=16 dots per 32-input scale
group, a cheaper decode, ``tl.dot_scaled``), register multiply-adds for one live row. No TMA for
quantized experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton.common import is_interpreted, next_pow2, num_sms
from atom_kernels.backends.triton.moe_mxfp4 import (
    mxfp4_gate_up,
    mxfp4_row,
    mxfp4_step,
    mxfp4_tiles,
    resolve_mode,
)

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: the pointer loads only
    TensorDescriptor = None

_ACTIVATIONS = {"silu": 0, "gelu": 1, "swiglu_oai": 2}
# Quantized experts: the kernels' QUANT constexpr (fp8_block and fp8_channel share the FP8 path:
# a per-channel scale is a block scale with 1-row blocks and a K stride of 0).
_QUANT = {None: 0, "fp8_block": 1, "fp8_channel": 1, "mxfp4": 2}
# Up to this many pairs the align step is one single-program Triton kernel (one launch: decode);
# above it, a stable radix sort and one kernel (``_align_sort``), a few launches, noise next to
# the GEMMs. A config's "align" key overrides ("kernel", "sort", "hist": per-chunk histograms
# then a placement kernel, two launches and no sort, or "onehot": the older one-hot/cumsum torch
# version, kept so the sweep can compare).
ALIGN_KERNEL_MAX_PAIRS = 4096
ALIGN_MODES = ("kernel", "sort", "hist", "onehot")
# How a token's K expert outputs are summed (a config's "combine" key):
# - "sum": GEMM 2 writes one row per pair, then one reduction over K (deterministic): torch's sum
#   over [T, K, H] on the sorted path.
# - "sum_kernel": as "sum", the reduction a Triton kernel (``_sum_topk_kernel``) on both paths.
# - "atomic": GEMM 2's epilogue adds each weighted row into an fp32 [T, H] buffer (zeroed first)
#   with fp32 atomics, then one cast: no [N, H] round trip, but the fp32 summation order varies
#   from run to run (not bitwise reproducible).
# - "token" (per-pair path only): one GEMM 2 program per (token, column tile) walks the token's K
#   experts in one loop; no extra kernel, but only T * H / BLOCK_N programs.
COMBINE_MODES = ("sum", "sum_kernel", "atomic", "token")
# Up to this many pairs the per-pair path runs (no align, no combine kernel). At T = 1 every pair
# has its own expert; with more pairs, pairs that share an expert read its weights again.
PER_PAIR_MAX_PAIRS = 8


@triton.jit(do_not_specialize=["num_pairs"])
def _align_kernel(
    ids_ptr,  # [N] expert of each pair
    sorted_ptr,  # [P] out: pair index at each padded row (padding rows left unwritten)
    counts_ptr,  # [E] out: pairs per expert
    ends_ptr,  # [E] out: end of each expert's padded segment (inclusive scan)
    num_pairs,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    earlier = lanes[:, None] > lanes[None, :]  # [C, C]
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + start + lanes, mask=start + lanes < num_pairs, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [C, E]
        counts += tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(counts_ptr + experts, counts, mask=experts < num_experts)
    tl.store(ends_ptr + experts, ends, mask=experts < num_experts)
    # Second pass: each pair's row = its expert's segment start + pairs of that expert before it
    # (stable: pairs keep their order within an expert).
    seen = ends - padded  # [E] next free row of each expert
    for start in range(0, num_pairs, CHUNK):
        valid = start + lanes < num_pairs
        ids = tl.load(ids_ptr + start + lanes, mask=valid, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [C, E]
        same = (ids[:, None] == ids[None, :]) & earlier  # [C, C]
        rank = tl.sum(same.to(tl.int32), axis=1)
        row = tl.sum(onehot * seen[None, :], axis=1) + rank
        tl.store(sorted_ptr + row, start + lanes, mask=valid & (ids >= 0))  # -1: no segment
        seen += tl.sum(onehot, axis=0)


def _align_torch(ids: torch.Tensor, num_experts: int, block_m: int, sorted_ids, counts, ends):
    """The align step as torch ops, for many pairs: no sort and no host sync (a pair's rank within
    its expert is a running count over a one-hot [E, N], a few MB at prefill sizes)."""
    num_pairs = ids.numel()
    experts = torch.arange(num_experts, device=ids.device, dtype=ids.dtype)
    onehot = (experts[:, None] == ids[None, :]).to(torch.int32)  # [E, N]
    # NOTE: the scan runs along the last (contiguous) dim. Along dim 0 of an [N, E] one-hot torch
    # scans each of the E columns serially: Qwen3-30B-A3B at 4096 tokens (N = 32768, E = 128)
    # took 7.8 ms for the whole fused_moe on an H100 (6% of the matmul rate) with it.
    running = torch.cumsum(onehot, dim=1, dtype=torch.int32)  # [E, N]
    counts.copy_(running[:, -1])
    padded = (counts + block_m - 1) // block_m * block_m
    torch.cumsum(padded, 0, dtype=torch.int32, out=ends)
    pairs = torch.arange(num_pairs, device=ids.device)
    owned = ids >= 0  # -1: a pair not computed here, in no expert's segment
    expert = ids.clamp(min=0)
    rank = running[expert, pairs] - 1  # [N]
    rows = (ends - padded)[expert] + rank
    # NOTE: a -1 pair goes to the last row instead (no host sync to drop it): with N' < N pairs
    # owned, the used segments end by N' + min(E, N') * (BLOCK_M - 1) < P, so that row is past
    # every segment and never read.
    rows = torch.where(owned, rows, sorted_ids.numel() - 1)
    sorted_ids.scatter_(0, rows.long(), pairs.to(torch.int32))


@triton.jit(do_not_specialize=["num_pairs", "num_steps"])
def _align_sorted_kernel(
    keys_ptr,  # [N] expert ids, sorted ascending (stable)
    order_ptr,  # [N] pair index at each sorted position
    sorted_ptr,  # [P] out: pair index at each padded row (padding rows left unwritten)
    counts_ptr,  # [E] out (program 0)
    ends_ptr,  # [E] out (program 0)
    num_pairs,
    num_experts,
    num_steps,  # binary-search steps: num_pairs.bit_length() + 1
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Each program finds every expert's segment in the sorted ids (a binary search per expert
    lane, ~log2(N) gathers of E values, cheaper than a second launch), then moves its BLOCK sorted
    positions to their padded rows: row = position + (padded start - unpadded start) of its
    expert. Pairs with id -1 (sorted first) are in no segment and left out."""
    experts = tl.arange(0, BLOCK_E)
    lo = tl.zeros([BLOCK_E], dtype=tl.int32)  # lower bound of expert e
    hi = tl.zeros([BLOCK_E], dtype=tl.int32) + num_pairs
    lo1 = tl.zeros([BLOCK_E], dtype=tl.int32)  # lower bound of expert e + 1
    hi1 = tl.zeros([BLOCK_E], dtype=tl.int32) + num_pairs
    for _ in range(0, num_steps):
        mid = (lo + hi) // 2
        key = tl.load(keys_ptr + mid, mask=mid < num_pairs, other=0).to(tl.int32)
        right = (lo < hi) & (key < experts)
        lo, hi = tl.where(right, mid + 1, lo), tl.where(right | (lo >= hi), hi, mid)
        mid1 = (lo1 + hi1) // 2
        key1 = tl.load(keys_ptr + mid1, mask=mid1 < num_pairs, other=0).to(tl.int32)
        right1 = (lo1 < hi1) & (key1 < experts + 1)
        lo1, hi1 = tl.where(right1, mid1 + 1, lo1), tl.where(right1 | (lo1 >= hi1), hi1, mid1)
    counts = tl.where(experts < num_experts, lo1 - lo, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    shift = ends - padded - lo  # [E]
    if tl.program_id(0) == 0:
        tl.store(counts_ptr + experts, counts, mask=experts < num_experts)
        tl.store(ends_ptr + experts, ends, mask=experts < num_experts)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < num_pairs
    keys = tl.load(keys_ptr + offs, mask=valid, other=-1).to(tl.int32)
    onehot = keys[:, None] == experts[None, :]  # [BLOCK, E]
    rows = offs + tl.sum(tl.where(onehot, shift[None, :], 0), axis=1)
    pairs = tl.load(order_ptr + offs, mask=valid, other=0).to(tl.int32)
    tl.store(sorted_ptr + rows, pairs, mask=valid & (keys >= 0))


def _align_sort(ids: torch.Tensor, num_experts: int, block_m: int, sorted_ids, counts, ends):
    """The align step for many pairs: a stable radix sort of the expert ids (pairs keep their order
    within an expert), then one kernel placing the sorted pairs at their padded rows; O(N + E)
    memory, no host sync (``torch.bincount`` would read the max id back to the host)."""
    num_pairs = ids.numel()
    keys, order = torch.sort(ids, stable=True)  # [N] expert ids ascending, pair indices
    block = 256
    _align_sorted_kernel[(triton.cdiv(num_pairs, block),)](
        keys, order, sorted_ids, counts, ends, num_pairs, num_experts,
        num_pairs.bit_length() + 1, BLOCK_M=block_m, BLOCK_E=next_pow2(num_experts + 1, 16),
        BLOCK=block, num_warps=4,
    )  # fmt: skip


# NOTE: the pair and chunk counts vary with every batch: unspecialized, one compile serves all.
@triton.jit(do_not_specialize=["num_pairs"])
def _expert_histogram_kernel(
    ids_ptr,  # [N] expert of each pair
    hist_ptr,  # [C, BLOCK_E] out: pairs per expert in each chunk of CHUNK pairs
    num_pairs,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, SUB)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for sub in tl.static_range(0, CHUNK, SUB):
        offs = tl.program_id(0) * CHUNK + sub + lanes
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)  # [E]
    tl.store(hist_ptr + tl.program_id(0) * BLOCK_E + experts, counts)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks"])
def _align_place_kernel(
    ids_ptr,  # [N] expert of each pair
    hist_ptr,  # [C, BLOCK_E] per-chunk expert counts (``_expert_histogram_kernel``)
    sorted_ptr,  # [P] out: pair index at each padded row (padding rows left unwritten)
    counts_ptr,  # [E] out (program 0)
    ends_ptr,  # [E] out (program 0)
    num_pairs,
    num_experts,
    num_chunks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
):
    """Program c places the pairs of chunk c: row = its expert's padded segment start + pairs of
    that expert in earlier chunks + pairs of it earlier in this chunk (stable, as the sort)."""
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    chunks = tl.arange(0, BLOCK_C)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs of each expert in earlier chunks
    for c0 in range(0, num_chunks, BLOCK_C):
        idx = c0 + chunks
        hist = tl.load(
            hist_ptr + idx[:, None] * BLOCK_E + experts[None, :],
            mask=(idx < num_chunks)[:, None], other=0,
        )  # [C, E]  # fmt: skip
        counts += tl.sum(hist, axis=0)
        before += tl.sum(tl.where((idx < chunk)[:, None], hist, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    if chunk == 0:
        tl.store(counts_ptr + experts, counts, mask=experts < num_experts)
        tl.store(ends_ptr + experts, ends, mask=experts < num_experts)
    seen = ends - padded + before  # [E] next free row of each expert
    lanes = tl.arange(0, SUB)
    earlier = lanes[:, None] > lanes[None, :]  # [S, S]
    for sub in tl.static_range(0, CHUNK, SUB):
        offs = chunk * CHUNK + sub + lanes
        valid = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=valid, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [S, E]
        same = (ids[:, None] == ids[None, :]) & earlier  # [S, S]
        rank = tl.sum(same.to(tl.int32), axis=1)
        row = tl.sum(onehot * seen[None, :], axis=1) + rank
        tl.store(sorted_ptr + row, offs, mask=valid & (ids >= 0))  # -1: no segment
        seen += tl.sum(onehot, axis=0)


def _align_hist(ids: torch.Tensor, num_experts: int, block_m: int, sorted_ids, counts, ends):
    """The align step in two launches and no sort: per-chunk expert histograms, then each chunk
    places its pairs from the histograms of the chunks before it (the same rows as the sort)."""
    num_pairs = ids.numel()
    chunk, sub = 256, 64
    num_chunks = triton.cdiv(num_pairs, chunk)
    block_e = next_pow2(num_experts, 16)
    hist = torch.empty((num_chunks, block_e), dtype=torch.int32, device=ids.device)
    _expert_histogram_kernel[(num_chunks,)](
        ids, hist, num_pairs, BLOCK_E=block_e, CHUNK=chunk, SUB=sub, num_warps=4
    )
    _align_place_kernel[(num_chunks,)](
        ids, hist, sorted_ids, counts, ends, num_pairs, num_experts, num_chunks,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_C=64, CHUNK=chunk, SUB=sub, num_warps=4,
    )  # fmt: skip


@triton.jit
def _tile(pid, num_m, num_n, group_m):
    """(row block, column tile) of program ``pid`` in a 1-D grid: ``group_m`` row blocks sweep the
    column tiles together, row blocks fastest (``group_m`` >= ``num_m``: column tile by column
    tile over all row blocks)."""
    group_size = group_m * num_n
    first_m = (pid // group_size) * group_m
    rows_in_group = tl.minimum(num_m - first_m, group_m)
    in_group = pid % group_size
    return first_m + in_group % rows_in_group, in_group // rows_in_group


@triton.jit
def _block_expert(
    pid_m, ends_ptr, counts_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr
):
    """(expert, first row of this block within the expert's pairs, pairs of the expert) of the
    row block ``pid_m``; expert == num_experts past the last used segment."""
    row0 = pid_m * BLOCK_M
    experts = tl.arange(0, BLOCK_E)
    ends = tl.load(ends_ptr + experts, mask=experts < num_experts, other=2147483647)
    expert = tl.sum((ends <= row0).to(tl.int32), axis=0)
    safe = tl.minimum(expert, num_experts - 1)
    count = tl.load(counts_ptr + safe)
    end = tl.load(ends_ptr + safe)
    start = end - (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    return expert, row0 - start, count


@triton.jit
def _fp8_tile(w_ptrs, s_rows, k0, mask, col_valid, stride_sk, group_k, dtype):
    """A [K, N] FP8 weight tile (``w_ptrs``) dequantized to ``dtype`` as the torch reference does
    (value times scale in float32, one rounding). The K tile lies in one scale column (the
    launcher picks BLOCK_K dividing group_k), so its scales are one [N] vector:
    ``s_rows`` [N] (row // group_n's scale row) at column k0 // group_k (per channel: stride 0)."""
    scale = tl.load(s_rows + (k0 // group_k) * stride_sk, mask=col_valid, other=0.0)
    w = tl.load(w_ptrs, mask=mask, other=0.0)
    return (w.to(tl.float32) * scale[None, :]).to(dtype)


@triton.jit
def _quant_dot(
    acc, a_rows, a_valid, w_rows, s_rows, k0, num_k, col_valid, stride_wk, stride_sk, group_k,
    QUANT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc + a[:, k0 : k0 + BLOCK_K] @ W[k0 : k0 + BLOCK_K, cols] for a quantized W (GEMM 2's
    kernels): ``a_rows`` [M, 1] pointers to the activation rows (K contiguous), ``a_valid`` [M];
    ``w_rows`` [1, N] the expert's weight rows; ``s_rows`` [N] their scale rows (FP8: row //
    group_n). FP8: one [BLOCK_K, N] tile (``_fp8_tile``); MXFP4: BLOCK_K / 32 scale groups of
    16 packed bytes per row (``moe_mxfp4``)."""
    if QUANT >= 2:
        acc, _ = mxfp4_step(acc, acc, a_rows, a_valid, 1, w_rows, w_rows, s_rows, s_rows, k0,
                            num_k, col_valid, stride_wk, stride_sk, False, QUANT, PRECISION,
                            BLOCK_K)  # fmt: skip
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < num_k
        a = tl.load(a_rows + ks[None, :], mask=a_valid[:, None] & k_valid[None, :], other=0.0)
        w = _fp8_tile(w_rows + ks[:, None] * stride_wk, s_rows, k0,
                      k_valid[:, None] & col_valid[None, :], col_valid, stride_sk, group_k,
                      a.dtype)  # fmt: skip
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gemm1_tile(
    x_ptr, w_ptr, w_desc, bias_ptr, out_ptr, sorted_ptr, topk_weights_ptr,
    expert, row0, first, count, pid_n,
    hidden_size, inter_size, top_k,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_be, stride_bn, stride_om,
    stride_tw, alpha, limit,
    s_ptr, stride_se, stride_sn, stride_sk, group_n, group_k,
    ACTIVATION: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr, PER_PAIR: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] output tile of GEMM 1: rows ``row0`` on (sorted: ``first`` of the
    expert's ``count`` pairs; per-pair: the pair ``row0`` alone, in row 0 of the tile).

    TMA: the weight tiles come through ``w_desc`` (a descriptor over W13 as [E * 2I, H], blocks
    [BLOCK_N, BLOCK_K], gate and up halves not interleaved): a column tile past I reads the up
    half or the next expert (finite, never stored), past the last expert TMA fills zeros. WS asks
    Triton to warp-specialize the loop (loads and MMAs in separate warps). QUANT > 0: the weight
    tiles are dequantized in the loop (``_fp8_tile``, ``moe_mxfp4``; no TMA)."""
    offs_m = tl.arange(0, BLOCK_M)
    if PER_PAIR:
        row_valid = offs_m == 0
        rows = row0 + offs_m * 0  # output row = pair
        pairs = rows
    else:
        row_valid = first + offs_m < count
        rows = row0 + offs_m  # padded rows
        pairs = tl.load(sorted_ptr + rows, mask=row_valid, other=0)
    tokens = (pairs // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of the output [P, I]
    col_valid = cols < inter_size
    if INTERLEAVED:
        gate_rows, up_rows = 2 * cols, 2 * cols + 1
    else:
        gate_rows, up_rows = cols, cols + inter_size
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [M, K]
    w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wh
    wg_ptrs = w_base + gate_rows[None, :].to(tl.int64) * stride_wn  # [K, N]
    wu_ptrs = w_base + up_rows[None, :].to(tl.int64) * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:
        gate_row = expert * (2 * inter_size) + pid_n * BLOCK_N
        for k0 in tl.range(0, hidden_size, BLOCK_K, warp_specialize=WS):
            k_valid = k0 + offs_k < hidden_size
            x = tl.load(x_ptrs + k0 * stride_xh, mask=row_valid[:, None] & k_valid[None, :],
                        other=0.0)  # fmt: skip
            wg = w_desc.load([gate_row, k0])  # [N, K]
            wu = w_desc.load([gate_row + inter_size, k0])
            acc_g = tl.dot(x, wg.T, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, wu.T, acc_u, input_precision=PRECISION)
    elif QUANT >= 2:  # MXFP4 (moe_mxfp4.py): w [E, 2I, H / 2] along H, scales [E, 2I, H / 32]
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc_g, acc_u = mxfp4_gate_up(
            acc_g, acc_u, x_ptr + (row0 // top_k).to(tl.int64) * stride_xt,
            x_ptr + tokens[:, None] * stride_xt, row_valid, stride_xh,
            w_base + gate_rows[None, :].to(tl.int64) * stride_wn,
            w_base + up_rows[None, :].to(tl.int64) * stride_wn,
            s_base + gate_rows.to(tl.int64) * stride_sn, s_base + up_rows.to(tl.int64) * stride_sn,
            hidden_size, col_valid, stride_wh, stride_sk, QUANT, PER_PAIR, PRECISION, BLOCK_K,
            BLOCK_N,
        )  # fmt: skip
    else:
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        sg_rows = s_base + (gate_rows // group_n).to(tl.int64) * stride_sn  # [N] (FP8)
        su_rows = s_base + (up_rows // group_n).to(tl.int64) * stride_sn
        for k0 in range(0, hidden_size, BLOCK_K):
            k_valid = k0 + offs_k < hidden_size
            x = tl.load(x_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w_mask = k_valid[:, None] & col_valid[None, :]
            if QUANT == 0:
                wg = tl.load(wg_ptrs, mask=w_mask, other=0.0)
                wu = tl.load(wu_ptrs, mask=w_mask, other=0.0)
            else:
                wg = _fp8_tile(wg_ptrs, sg_rows, k0, w_mask, col_valid, stride_sk, group_k,
                               x.dtype)  # fmt: skip
                wu = _fp8_tile(wu_ptrs, su_rows, k0, w_mask, col_valid, stride_sk, group_k,
                               x.dtype)  # fmt: skip
            acc_g = tl.dot(x, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, wu, acc_u, input_precision=PRECISION)
            x_ptrs += BLOCK_K * stride_xh
            wg_ptrs += BLOCK_K * stride_wh
            wu_ptrs += BLOCK_K * stride_wh
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        acc_g += tl.load(b_base + gate_rows * stride_bn, mask=col_valid, other=0.0).to(tl.float32)
        acc_u += tl.load(b_base + up_rows * stride_bn, mask=col_valid, other=0.0).to(tl.float32)
    # The reference's projection comes out of a GEMM in the input dtype: round as it does.
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    if ACTIVATION == 0:
        act = gate / (1.0 + tl.exp(-gate)) * up
    elif ACTIVATION == 1:
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    if PER_PAIR:  # w * (a @ W2) == (w * a) @ W2: GEMM 2 then sums a token's pairs in one loop
        weight = tl.load(topk_weights_ptr + pairs * stride_tw, mask=row_valid, other=0.0)
        act *= weight.to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=row_valid[:, None] & col_valid[None, :])


# NOTE: the row-block count and GROUP_M vary with the batch and the config; left unspecialized
# they compile once instead of once per divisibility class (a recompile mid-serving, and per
# GROUP_M in a sweep).
@triton.jit(do_not_specialize=["num_row_blocks", "group_m"])
def _gemm1_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]
    w_desc,  # TMA: descriptor over w as [E * 2I, H]; else w_ptr again (unused)
    bias_ptr,  # [E, 2I] or dummy
    out_ptr,  # [P, I] (per-pair: [N, I])
    sorted_ptr,  # [P] pair at each padded row (sorted path)
    counts_ptr,
    ends_ptr,
    ids_ptr,  # [N] expert of each pair (per-pair path)
    topk_weights_ptr,  # [N] routing weights (per-pair path: folded into the output)
    num_row_blocks,  # sorted: padded row blocks; per-pair: pairs
    group_m,
    num_experts,
    hidden_size,
    inter_size,
    top_k,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wh,
    stride_be,
    stride_bn,
    stride_om,
    stride_tw,
    alpha,
    limit,
    s_ptr,  # weight scales (QUANT > 0; see _fp8_tile, moe_mxfp4) or dummy
    stride_se,
    stride_sn,
    stride_sk,
    group_n,
    group_k,
    ACTIVATION: tl.constexpr,  # 0 silu, 1 gelu (erf), 2 swiglu_oai
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    PER_PAIR: tl.constexpr,
    TMA: tl.constexpr,
    WS: tl.constexpr,
    QUANT: tl.constexpr,  # 0 none, 1 FP8, 2 MXFP4
    BLOCK_M: tl.constexpr,
    REMAINDER_M: tl.constexpr,  # 0, or the rows of an expert's last tile when they fit it
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), num_row_blocks, tl.cdiv(inter_size, BLOCK_N), group_m)
    if PER_PAIR:  # one pair per program row block
        expert = tl.load(ids_ptr + pid_m).to(tl.int32)
        first, count, row0 = 0, 1, pid_m
    else:
        expert, first, count = _block_expert(
            pid_m, ends_ptr, counts_ptr, num_experts, BLOCK_M, BLOCK_E
        )
        row0 = pid_m * BLOCK_M
    if (expert < 0) | (expert >= num_experts):  # per-pair -1: not computed here
        return
    args = (
        x_ptr, w_ptr, w_desc, bias_ptr, out_ptr, sorted_ptr, topk_weights_ptr,
        expert, row0, first, count, pid_n, hidden_size, inter_size, top_k,
        stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_be, stride_bn, stride_om,
        stride_tw, alpha, limit, s_ptr, stride_se, stride_sn, stride_sk, group_n, group_k,
    )  # fmt: skip
    # An expert's last block with at most REMAINDER_M pairs left runs a REMAINDER_M-row tile
    # (Triton compiles both branches); its padding rows past REMAINDER_M are never touched.
    if REMAINDER_M > 0 and count - first <= REMAINDER_M:
        _gemm1_tile(*args, ACTIVATION, INTERLEAVED, HAS_BIAS, PRECISION, PER_PAIR, TMA, WS,
                    QUANT, REMAINDER_M, BLOCK_N, BLOCK_K)  # fmt: skip
    else:
        _gemm1_tile(*args, ACTIVATION, INTERLEAVED, HAS_BIAS, PRECISION, PER_PAIR, TMA, WS,
                    QUANT, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip


@triton.jit
def _gemm2_tile(
    a_ptr, w_ptr, w_desc, bias_ptr, topk_weights_ptr, out_ptr, sorted_ptr,
    expert, row0, first, count, pid_n, hidden_size, inter_size, top_k,
    stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_tw, stride_om,
    s_ptr, stride_se, stride_sn, stride_sk, group_n, group_k,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, ATOMIC: tl.constexpr,
    TMA: tl.constexpr, WS: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of GEMM 2 over the padded rows ``row0`` on, weighted by each
    pair's routing weight, stored per pair (or added into its token's fp32 row: ATOMIC). TMA: the
    weight tiles through ``w_desc`` (W2 as [E * H, I], blocks [BLOCK_N, BLOCK_K]), as GEMM 1's."""
    offs_m = tl.arange(0, BLOCK_M)
    row_valid = first + offs_m < count
    rows = (row0 + offs_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + rows, mask=row_valid, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of the output [N, H]
    col_valid = cols < hidden_size
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]  # [M, K]
    w_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + offs_k[:, None] * stride_wk
        + cols[None, :].to(tl.int64) * stride_wn
    )  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:
        w_row = expert * hidden_size + pid_n * BLOCK_N
        for k0 in tl.range(0, inter_size, BLOCK_K, warp_specialize=WS):
            k_valid = k0 + offs_k < inter_size
            a = tl.load(a_ptrs + k0, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w = w_desc.load([w_row, k0])  # [N, K]
            acc = tl.dot(a, w.T, acc, input_precision=PRECISION)
    elif QUANT > 0:
        a_rows = a_ptr + rows[:, None] * stride_am  # [M, 1]
        e = expert.to(tl.int64)
        w_rows = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn  # [1, N]
        s_rows = s_ptr + e * stride_se + (cols // group_n).to(tl.int64) * stride_sn  # [N]
        for k0 in range(0, inter_size, BLOCK_K):
            acc = _quant_dot(acc, a_rows, row_valid, w_rows, s_rows, k0, inter_size, col_valid,
                             stride_wk, stride_sk, group_k, QUANT, PRECISION, BLOCK_K)  # fmt: skip
    else:
        for k0 in range(0, inter_size, BLOCK_K):
            k_valid = k0 + offs_k < inter_size
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(b_base + cols * stride_bn, mask=col_valid).to(tl.float32)[None, :]
    weight = tl.load(topk_weights_ptr + pairs * stride_tw, mask=row_valid, other=0.0)
    if ATOMIC:  # the input dtype of the projection (as the reference), then fp32 to the end
        y = acc.to(a_ptr.dtype.element_ty).to(tl.float32) * weight.to(tl.float32)[:, None]
        out_ptrs = out_ptr + (pairs // top_k)[:, None] * stride_om + cols[None, :]
        tl.atomic_add(out_ptrs, y, mask=row_valid[:, None] & col_valid[None, :], sem="relaxed")
    else:
        y = acc.to(dtype).to(tl.float32) * weight.to(tl.float32)[:, None]
        out_ptrs = out_ptr + pairs[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, y.to(dtype), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit(do_not_specialize=["num_row_blocks", "group_m"])
def _gemm2_kernel(
    a_ptr,  # [P, I] activations
    w_ptr,  # [E, H, I]
    w_desc,  # TMA: descriptor over w as [E * H, I]; else w_ptr again (unused)
    bias_ptr,  # [E, H] or dummy
    topk_weights_ptr,  # [N] (flattened [T, K])
    out_ptr,  # [N, H]: each pair's weighted expert output (ATOMIC: fp32 [T, H], summed into)
    sorted_ptr,
    counts_ptr,
    ends_ptr,
    num_row_blocks,
    group_m,
    num_experts,
    hidden_size,
    inter_size,
    top_k,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_tw,
    stride_om,
    s_ptr,  # weight scales (QUANT > 0; see _fp8_tile, moe_mxfp4) or dummy
    stride_se,
    stride_sn,
    stride_sk,
    group_n,
    group_k,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    ATOMIC: tl.constexpr,
    TMA: tl.constexpr,
    WS: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    REMAINDER_M: tl.constexpr,  # as GEMM 1's (both walk the same tiles)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), num_row_blocks, tl.cdiv(hidden_size, BLOCK_N), group_m)
    expert, first, count = _block_expert(pid_m, ends_ptr, counts_ptr, num_experts, BLOCK_M, BLOCK_E)
    if expert >= num_experts:
        return
    args = (
        a_ptr, w_ptr, w_desc, bias_ptr, topk_weights_ptr, out_ptr, sorted_ptr,
        expert, pid_m * BLOCK_M, first, count, pid_n, hidden_size, inter_size, top_k,
        stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_tw, stride_om,
        s_ptr, stride_se, stride_sn, stride_sk, group_n, group_k,
    )  # fmt: skip
    if REMAINDER_M > 0 and count - first <= REMAINDER_M:
        _gemm2_tile(*args, HAS_BIAS, PRECISION, ATOMIC, TMA, WS, QUANT, REMAINDER_M, BLOCK_N,
                    BLOCK_K)  # fmt: skip
    else:
        _gemm2_tile(*args, HAS_BIAS, PRECISION, ATOMIC, TMA, WS, QUANT, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _gemm2_token_kernel(
    a_ptr,  # [N, I] weighted activations (per-pair GEMM 1)
    w_ptr,  # [E, H, I]
    bias_ptr,  # [E, H] or dummy
    ids_ptr,  # [N] expert of each pair
    topk_weights_ptr,  # [N]
    out_ptr,  # [T, H]
    hidden_size,
    inter_size,
    top_k,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_tw,
    stride_ot,
    s_ptr,  # weight scales (QUANT > 0; see _fp8_tile, moe_mxfp4) or dummy
    stride_se,
    stride_sn,
    stride_sk,
    group_n,
    group_k,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[t, cols] = sum over the token's K pairs of a[pair] @ W2[expert]^T: one flat loop over
    K x ceil(I / BLOCK_K) blocks, so the software pipeline runs across expert boundaries. The dot
    needs 16 rows; only row 0 (the token) is live. A slot with id -1 loads nothing (masked)."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < hidden_size
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    k_blocks = tl.cdiv(inter_size, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j in range(0, top_k * k_blocks):
        slot = j // k_blocks
        k0 = (j - slot * k_blocks) * BLOCK_K
        ks = k0 + offs_k
        k_valid = ks < inter_size
        pair = (token * top_k + slot).to(tl.int64)
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        # -1: every load of the slot masked off (no weight read). tl.where: see _sum_topk_kernel.
        live = expert >= 0
        expert = tl.maximum(expert, 0)
        w_rows = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn  # [1, N]
        row_live = tl.where(live, offs_m == 0, False)  # [M]
        col_live = tl.where(live, col_valid, False)  # [N]
        if QUANT == 0:
            a_ptrs = a_ptr + pair * stride_am + ks[None, :] + offs_m[:, None] * 0
            a = tl.load(a_ptrs, mask=row_live[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(w_rows + ks[:, None] * stride_wk,
                        mask=k_valid[:, None] & col_live[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        else:
            a_rows = a_ptr + pair * stride_am + offs_m[:, None] * 0  # [M, 1]
            s_rows = s_ptr + expert * stride_se + (cols // group_n).to(tl.int64) * stride_sn
            acc = _quant_dot(acc, a_rows, row_live, w_rows, s_rows, k0, inter_size, col_live,
                             stride_wk, stride_sk, group_k, QUANT, PRECISION, BLOCK_K)  # fmt: skip
    if HAS_BIAS:  # sum_k w_k * b2[e_k]
        for slot in range(0, top_k):
            pair = token * top_k + slot
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            col_live = tl.where(expert >= 0, col_valid, False)
            weight = tl.load(topk_weights_ptr + pair * stride_tw).to(tl.float32)
            weight = tl.where(expert >= 0, weight, 0.0)  # a -1 slot's weight is ignored
            bias = tl.load(bias_ptr + tl.maximum(expert, 0) * stride_be + cols * stride_bn,
                           mask=col_live, other=0.0)  # fmt: skip
            acc += weight * bias.to(tl.float32)[None, :]
    out_ptrs = out_ptr + token.to(tl.int64) * stride_ot + cols[None, :] + offs_m[:, None] * 0
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] == 0) & col_valid)


@triton.jit
def _gemm2_pair_kernel(
    a_ptr,  # [N, I] weighted activations (per-pair GEMM 1)
    w_ptr,  # [E, H, I]
    bias_ptr,  # [E, H] or dummy
    ids_ptr,  # [N] expert of each pair
    topk_weights_ptr,  # [N]
    out_ptr,  # fp32: [N, H] per pair, or (ATOMIC) [T, H] summed into
    hidden_size,
    inter_size,
    top_k,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_tw,
    stride_om,
    s_ptr,  # weight scales (QUANT > 0; see _fp8_tile, moe_mxfp4) or dummy
    stride_se,
    stride_sn,
    stride_sk,
    group_n,
    group_k,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    ATOMIC: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[pair or its token, cols] (+)= a[pair] @ W2[expert]^T (+ w * b2[expert]): one program
    per (pair, column tile), N * H / BLOCK_N programs, each streaming one expert's slice. The dot
    needs 16 rows; only row 0 (the pair) is live. A pair with id -1 writes nothing (the sum
    kernel skips its row)."""
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < hidden_size
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + pair * stride_am + offs_k[None, :] + offs_m[:, None] * 0  # [M, K]
    w_ptrs = (
        w_ptr + expert * stride_we + offs_k[:, None] * stride_wk
        + cols[None, :].to(tl.int64) * stride_wn
    )  # fmt: skip
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if QUANT == 2 or QUANT == 3 or QUANT == 5:  # MXFP4 one live row: register multiply-adds
        acc = mxfp4_row(acc, a_ptr + pair * stride_am,
                        w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn,
                        s_ptr + expert * stride_se + cols.to(tl.int64) * stride_sn, inter_size,
                        col_valid, stride_wk, stride_sk, QUANT, BLOCK_K, BLOCK_N)  # fmt: skip
    elif QUANT > 0:
        a_rows = a_ptr + pair * stride_am + offs_m[:, None] * 0  # [M, 1]
        w_rows = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
        s_rows = s_ptr + expert * stride_se + (cols // group_n).to(tl.int64) * stride_sn
        for k0 in range(0, inter_size, BLOCK_K):
            acc = _quant_dot(acc, a_rows, offs_m == 0, w_rows, s_rows, k0, inter_size, col_valid,
                             stride_wk, stride_sk, group_k, QUANT, PRECISION, BLOCK_K)  # fmt: skip
    else:
        for k0 in range(0, inter_size, BLOCK_K):
            k_valid = k0 + offs_k < inter_size
            a = tl.load(a_ptrs, mask=(offs_m[:, None] == 0) & k_valid[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        weight = tl.load(topk_weights_ptr + pair * stride_tw).to(tl.float32)
        bias = tl.load(bias_ptr + expert * stride_be + cols * stride_bn, mask=col_valid)
        acc += weight * bias.to(tl.float32)[None, :]
    mask = (offs_m[:, None] == 0) & col_valid[None, :]
    if ATOMIC:
        out_ptrs = out_ptr + (pair // top_k) * stride_om + cols[None, :] + offs_m[:, None] * 0
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")
    else:
        out_ptrs = out_ptr + pair * stride_om + cols[None, :] + offs_m[:, None] * 0
        tl.store(out_ptrs, acc, mask=mask)


@triton.jit
def _sum_topk_kernel(
    x_ptr,  # [T * K, H] fp32 or the output dtype
    ids_ptr,  # [T * K] expert of each pair: the rows of -1 pairs are skipped (never written)
    out_ptr,  # [T, H]
    hidden_size,
    top_k,
    stride_xm,
    stride_ot,
    BLOCK_N: tl.constexpr,
):
    """out[t] = sum_k x[t * K + k] over the pairs with an expert (id >= 0), cast to the output
    dtype (one launch for sum + cast)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = cols < hidden_size
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(0, top_k):
        pair = token * top_k + k
        # NOTE: tl.where, not valid & live: Triton's interpreter (3.9) rejects a mask made of a
        # scalar and a block ("mask has unsupported dtype").
        live = tl.where(tl.load(ids_ptr + pair) >= 0, valid, False)
        acc += tl.load(x_ptr + pair * stride_xm + cols, mask=live, other=0.0)
    tl.store(out_ptr + token * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=valid)


def _configs(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden_size: int,
    inter_size: int,
    device: torch.device,
) -> dict:
    """{"per_pair": path, "combine": COMBINE_MODES entry, "gemm1": kernel config, "gemm2": kernel
    config} for this shape, plus (sorted path, optional) "align": an ALIGN_MODES entry and
    "remainder_m": the rows of the smaller tile for an expert's last rows (0 or absent: off; else
    a power of two, 16 <= remainder_m < BLOCK_M).

    A kernel config holds BLOCK_M/N/K, num_warps, num_stages and (sorted path) GROUP_M; the
    sorted path's two GEMMs share BLOCK_M. ``benchmarks/tune_moe.py`` sweeps these; pass one to
    ``fused_moe(config=...)`` to override.
    """
    num_pairs = num_tokens * top_k
    per_pair = num_pairs <= PER_PAIR_MAX_PAIRS
    if is_interpreted(device):  # small tiles: the interpreter's cost grows with tile size
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, GROUP_M=4)
        return {"per_pair": per_pair, "combine": "sum", "gemm1": cfg, "gemm2": cfg}
    if per_pair:
        # Bandwidth-bound: enough programs for every SM (>= ~2 waves of small tiles) and deep
        # pipelines (bytes in flight per SM). GEMM 2 runs one program per (pair, column tile), as
        # many as the sorted path's GEMM 2 at T = 1 with the same tiles (its best on an H100:
        # 16x32x128 w4 s5), without the align launch; fp32 pair rows + one sum/cast kernel.
        sms = num_sms(device)
        n1 = 32 if num_pairs * triton.cdiv(inter_size, 32) >= 2 * sms else 16
        gemm1 = dict(BLOCK_M=16, BLOCK_N=n1, BLOCK_K=128, num_warps=4, num_stages=4)
        gemm2 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=5)
        return {"per_pair": True, "combine": "sum", "gemm1": gemm1, "gemm2": gemm2}
    rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    # NOTE: tiles from benchmarks/tune_moe.py on an H100 (bf16, CUDA graphs, L2 flushed;
    # results/tune-moe-h100.json, 2026-11-22, triton 3.6).
    if rows_per_expert <= 16 and num_pairs >= 1024:
        # Qwen3-30B-A3B T=256 (16 rows per expert): 0.443 ms, 90% of copy bandwidth, against
        # 0.554 ms with the decode tiles below and the single-program align.
        gemm1 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=5)
        gemm2 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
        return {
            "per_pair": False, "combine": "sum_kernel", "align": "hist",
            "gemm1": gemm1, "gemm2": gemm2,
        }  # fmt: skip
    if rows_per_expert <= 16:  # decode: bandwidth-bound, many narrow column tiles
        # Qwen3-30B-A3B T=16 90%, Mixtral T=16 99% of copy bandwidth.
        gemm1 = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
        gemm2 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)
        return {"per_pair": False, "combine": "sum", "gemm1": gemm1, "gemm2": gemm2}
    if rows_per_expert <= 64:
        # Mixtral T=256: 1.052 ms (89%) with mixed tiles and the hist align, 1.234 ms with
        # 32-row tiles, the sort align and torch's sum.
        gemm1 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
        gemm2 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, GROUP_M=16)
        return {
            "per_pair": False, "combine": "sum_kernel", "align": "hist", "remainder_m": 32,
            "gemm1": gemm1, "gemm2": gemm2,
        }  # fmt: skip
    tma = _tma_capable(device)
    if rows_per_expert <= 512:
        # Many small GEMMs (Qwen3-30B-A3B prefill: ~256 +- 16 rows per expert). 128-row tiles,
        # an expert's last <= 32 rows in a 32-row tile (padding to 128 wasted ~25% of the MMA
        # work), the hist align, GEMM 2 256 columns wide in groups of 4 row blocks. T=4096:
        # 0.755-0.770 ms (53-55% of the matmul rate) with TMA weight loads, 0.821 ms without,
        # 0.907 ms in session 2 (no mixed tiles, sort align, GEMM 2 128x128 / 3 stages / groups
        # of 8). A warp-specialized loop ("ws") measured within +-1% of it.
        gemm1 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, GROUP_M=1)
        gemm2 = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, GROUP_M=4)
        return {
            "per_pair": False, "combine": "sum_kernel", "align": "hist", "remainder_m": 32,
            "tma": tma, "gemm1": gemm1, "gemm2": gemm2,
        }  # fmt: skip
    # Prefill over few large experts. Mixtral T=4096: 4.98 ms (84% of the matmul rate) with TMA
    # weight loads, 16-row remainders and the Triton sum; 6.01 ms (70%) without (torch's sum, no
    # mixed tiles). fp32 atomics instead of the sum measured up to 4% faster, but the result is
    # not bitwise reproducible.
    if not tma:
        gemm1 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, GROUP_M=8)
        gemm2 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, GROUP_M=8)
        return {"per_pair": False, "combine": "sum", "gemm1": gemm1, "gemm2": gemm2}
    gemm1 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, GROUP_M=8)
    gemm2 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, GROUP_M=8)
    return {
        "per_pair": False, "combine": "sum_kernel", "align": "hist", "remainder_m": 16,
        "tma": True, "gemm1": gemm1, "gemm2": gemm2,
    }  # fmt: skip


def _tma_capable(device: torch.device) -> bool:
    """TMA weight loads: NVIDIA Hopper or newer (compute capability 9+), with host descriptors."""
    if TensorDescriptor is None or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _weight_descriptors(config: dict, w13: torch.Tensor, w2: torch.Tensor, interleaved: bool):
    """(descriptor over W13 as [E * 2I, H], over W2 as [E * H, I]) for a config asking for TMA
    weight loads ("tma": True, sorted path), or None where TMA cannot serve: interleaved gate/up
    columns, weights not contiguous or not 16-byte aligned (TMA's rule for the base and the
    row stride), a Triton without host descriptors."""
    if not config.get("tma") or config["per_pair"] or interleaved:
        return None
    if TensorDescriptor is None or not (w13.is_contiguous() and w2.is_contiguous()):
        return None
    if any(t.data_ptr() % 16 or t.shape[-1] * t.element_size() % 16 for t in (w13, w2)):
        return None
    g1, g2 = config["gemm1"], config["gemm2"]
    return (
        TensorDescriptor.from_tensor(w13.view(-1, w13.shape[-1]), [g1["BLOCK_N"], g1["BLOCK_K"]]),
        TensorDescriptor.from_tensor(w2.view(-1, w2.shape[-1]), [g2["BLOCK_N"], g2["BLOCK_K"]]),
    )


def _quant_config(config: dict, quant: str, block_size: tuple[int, int] | None) -> dict:
    """``config`` with the K tiles the dequantizing loops need: FP8 blocks, a BLOCK_K dividing
    the block's K (a K tile reads one [N] vector of scales, ``_fp8_tile``); MXFP4, 32 to 128
    (whole 32-input scale groups, ``moe_mxfp4``). Deep pipelines only for 16/32-row tiles.

    NOTE (H100, triton 3.6, 2026-11-23): the earlier loop pipelined a float32 scale per weight
    element through shared memory (252 KB asked at 128x256x64 / 4 stages: OutOfResources). The
    scales are now [N] vectors; compiled ahead of time for sm_90 (triton 3.9, no GPU;
    tests/test_moe_compile_sm90.py) the kernels ask for 51 KB at 128x256x64 / 3 stages (FP8),
    40 KB at 16x64x128 / 4 and 2 KB for MXFP4 (its loads stay in registers). The caps below
    (64-row tiles and up: BLOCK_K <= 64, 3 stages) are kept conservative until measured."""
    config = dict(config)
    for gemm in ("gemm1", "gemm2"):
        cfg = dict(config[gemm])
        block_k = cfg["BLOCK_K"]
        if quant == "fp8_block":
            group_k = block_size[1]
            block_k = min(block_k, group_k & -group_k)  # the largest power of two dividing it
            if block_k < 16:
                raise ValueError(f"fp8_block block_size {tuple(block_size)}: the K block must "
                                 "be a multiple of 16")  # fmt: skip
        elif quant == "mxfp4":
            block_k = min(max(block_k, 32), 128)
        if cfg["BLOCK_M"] >= 64:
            block_k = min(block_k, 64)
            cfg["num_stages"] = min(cfg.get("num_stages", 2), 3)
        else:
            cfg["num_stages"] = min(cfg.get("num_stages", 2), 4)
        cfg["BLOCK_K"] = block_k
        config[gemm] = cfg
    return config


def _scale_args(
    quant: str | None,
    scale: torch.Tensor | None,
    block_size: tuple[int, int] | None,
    weight: torch.Tensor,
) -> tuple:
    """A weight's scale as kernel arguments (pointer, strides over expert / row / K group,
    group_n, group_k; see ``_fp8_tile``, ``moe_mxfp4``); the weight itself and zeros when not
    quantized."""
    if quant is None:
        return (weight, 0, 0, 0, 1, 1)
    if quant == "fp8_block":
        return (scale, *scale.stride(), *block_size)
    if quant == "fp8_channel":  # [E, N]: 1-row blocks, one K group (K stride 0)
        return (scale, scale.stride(0), scale.stride(1), 0, 1, 1)
    return (scale, *scale.stride(), 1, 32)  # mxfp4: [E, N, K / 32]


def _split_group(cfg: dict, num_row_blocks: int) -> tuple[dict, int]:
    """(launch config, group_m): GROUP_M travels as a runtime argument (no recompile per value);
    without one, all row blocks form one group (column tile by column tile)."""
    cfg = dict(cfg)
    group_m = cfg.pop("GROUP_M", 0)
    return cfg, group_m if group_m > 0 else max(1, num_row_blocks)


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    gate_up_interleaved: bool,
    swiglu_alpha: float,
    swiglu_limit: float,
    align_kernel_max_pairs: int = ALIGN_KERNEL_MAX_PAIRS,
    config: dict | None = None,
    *,
    quant: str | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    mxfp4_mode: str | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """See ``atom_kernels.fused_moe``. hidden_states [T, H] -> [T, H] in its dtype. ``config``
    overrides ``_configs`` (tuning, tests). Quantized experts (``quant``) are dequantized tile by
    tile in the GEMMs' K loops (weight-only: the activations stay in hidden_states' dtype).
    ``mxfp4_mode``: a ``moe_mxfp4.MODES`` name (default: ``ATOM_MXFP4_MOE`` or the tuned one).
    quant="wna16" runs ``moe_wna16`` (its own GEMM kernels and configs; ``config`` there is a
    ``moe_wna16.wna16_configs`` dict)."""
    if quant == "wna16":
        # Imported here: moe_wna16 builds on this module's align and sum kernels.
        from atom_kernels.backends.triton.moe_wna16 import fused_moe_wna16

        return fused_moe_wna16(
            hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
            gate_up_interleaved, swiglu_alpha, swiglu_limit, w13_scale, w2_scale, w13_zeros,
            w2_zeros, config=config,
        )  # fmt: skip
    num_tokens, hidden_size = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_experts, inter_size = w13.shape[0], w13.shape[1] // 2
    device, dtype = hidden_states.device, hidden_states.dtype
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or hidden_size == 0:
        return torch.zeros((num_tokens, hidden_size), dtype=dtype, device=device)
    tuned = config is None
    if tuned:
        config = _configs(num_tokens, top_k, num_experts, hidden_size, inter_size, device)
        if dtype.itemsize > 2:  # the tiles are tuned for 16-bit weights: same bytes per stage,
            # and no warp specialization (float32 dots run on FMA units, not the tensor cores)
            for gemm in ("gemm1", "gemm2"):
                config[gemm] = dict(config[gemm], BLOCK_K=max(16, config[gemm]["BLOCK_K"] // 2))
            config["ws"] = False
    quant_code = _QUANT[quant]
    if quant == "mxfp4":
        quant_code = resolve_mode(mxfp4_mode, dtype, config["per_pair"], (w13, w2))
        if tuned:
            config = mxfp4_tiles(config, quant_code, num_pairs)
    if quant is not None:
        config = _quant_config(config, quant, block_size)
    # [N], dense: the kernels index it without a stride (reshape keeps a [T, 1] slice of a wider
    # [T, K] as a view with stride K).
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    b13 = w13_bias if w13_bias is not None else w13
    bias13_strides = (w13_bias.stride(0), w13_bias.stride(1)) if w13_bias is not None else (0, 0)
    b2 = w2_bias if w2_bias is not None else w2
    bias2_strides = (w2_bias.stride(0), w2_bias.stride(1)) if w2_bias is not None else (0, 0)
    block_e = next_pow2(num_experts, 16)
    per_pair = config["per_pair"]
    combine = config.get("combine", "sum")
    if combine not in COMBINE_MODES or (combine == "token" and not per_pair):
        raise ValueError(f"combine={combine!r}: expected one of {COMBINE_MODES} ('token' needs "
                         "the per-pair path)")  # fmt: skip
    remainder_m = 0 if per_pair else config.get("remainder_m", 0)
    s13_args = _scale_args(quant, w13_scale, block_size, w13)
    s2_args = _scale_args(quant, w2_scale, block_size, w2)
    descriptors = None if quant else _weight_descriptors(config, w13, w2, gate_up_interleaved)
    tma = descriptors is not None
    w13_desc, w2_desc = descriptors if tma else (w13, w2)
    # NOTE: Triton 3.6's warp specialization fails to compile ("PassManager::run failed") on
    # 16-row tiles (no warpgroup MMA below 64 rows): honoured from 64-row tiles on.
    # NOTE (H100, triton 3.6): the warp-specialization pass fails to compile 16-row tiles and
    # float32 weights (an assertion in NVGPUWarpSpecialization, 2026-11-24): honoured from 64-row
    # tiles of 16-bit weights only.
    warp_specialize = (
        tma and bool(config.get("ws")) and config["gemm1"]["BLOCK_M"] >= 64 and dtype.itemsize == 2
    )

    if per_pair:
        gemm1, group1 = _split_group(config["gemm1"], num_pairs)
        gemm2, _ = _split_group(config["gemm2"], num_pairs)
        num_row_blocks = num_pairs
        sorted_ids = counts = ends = ids  # unused by the per-pair kernels
        activated = torch.empty((num_pairs, inter_size), dtype=dtype, device=device)  # [N, I]
    else:
        # Both GEMMs walk the same padded rows, so they share BLOCK_M (and REMAINDER_M).
        block_m = config["gemm1"]["BLOCK_M"]
        assert config["gemm2"]["BLOCK_M"] == block_m
        if remainder_m and not (16 <= remainder_m < block_m and block_m % remainder_m == 0):
            raise ValueError(f"remainder_m={remainder_m}: expected 0 or a power of two from 16 "
                             f"to BLOCK_M / 2 = {block_m // 2}")  # fmt: skip
        max_rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
        num_row_blocks = triton.cdiv(max_rows, block_m)
        gemm1, group1 = _split_group(config["gemm1"], num_row_blocks)
        gemm2, group2 = _split_group(config["gemm2"], num_row_blocks)

        # --- align: sort the pairs by expert, pad each expert's segment to BLOCK_M ---
        sorted_ids = torch.empty(num_row_blocks * block_m, dtype=torch.int32, device=device)
        counts = torch.empty(num_experts, dtype=torch.int32, device=device)
        ends = torch.empty(num_experts, dtype=torch.int32, device=device)
        align = config.get("align") or ("kernel" if num_pairs <= align_kernel_max_pairs else "sort")
        if align == "kernel":
            _align_kernel[(1,)](
                ids, sorted_ids, counts, ends, num_pairs, num_experts,
                BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=32 if block_e > 128 else 64,
                num_warps=4,
            )  # fmt: skip
        elif align == "sort":
            _align_sort(ids, num_experts, block_m, sorted_ids, counts, ends)
        elif align == "hist":
            _align_hist(ids, num_experts, block_m, sorted_ids, counts, ends)
        elif align == "onehot":
            _align_torch(ids.long(), num_experts, block_m, sorted_ids, counts, ends)
        else:
            raise ValueError(f"align={align!r}: expected one of {ALIGN_MODES}")
        activated = torch.empty((num_row_blocks * block_m, inter_size), dtype=dtype, device=device)

    grid1 = (num_row_blocks * triton.cdiv(inter_size, gemm1["BLOCK_N"]),)
    _gemm1_kernel[grid1](
        hidden_states, w13, w13_desc, b13, activated, sorted_ids, counts, ends, ids, weights,
        num_row_blocks, group1, num_experts, hidden_size, inter_size, top_k,
        hidden_states.stride(0), hidden_states.stride(1),
        w13.stride(0), w13.stride(1), w13.stride(2), *bias13_strides, activated.stride(0),
        weights.stride(0), float(swiglu_alpha), float(swiglu_limit), *s13_args,
        ACTIVATION=_ACTIVATIONS[activation], INTERLEAVED=bool(gate_up_interleaved),
        HAS_BIAS=w13_bias is not None, PRECISION=precision, PER_PAIR=per_pair, TMA=tma,
        WS=warp_specialize, QUANT=quant_code, REMAINDER_M=remainder_m, BLOCK_E=block_e,
        **gemm1,
    )  # fmt: skip

    out = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)  # [T, H]
    if combine == "atomic" and (per_pair or top_k > 1):  # fp32 [T, H] the atomics add into
        summed = torch.zeros((num_tokens, hidden_size), dtype=torch.float32, device=device)
    if per_pair and combine == "token":
        _gemm2_token_kernel[(num_tokens, triton.cdiv(hidden_size, gemm2["BLOCK_N"]))](
            activated, w2, b2, ids, weights, out, hidden_size, inter_size, top_k,
            activated.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), *bias2_strides,
            weights.stride(0), out.stride(0), *s2_args,
            HAS_BIAS=w2_bias is not None, PRECISION=precision, QUANT=quant_code, **gemm2,
        )  # fmt: skip
        return out
    if per_pair:
        # "sum": fp32 rows per pair ([N, H], N <= a few): the K-way sum and the cast in one kernel.
        if combine == "atomic":
            dest = summed
        else:
            dest = torch.empty((num_pairs, hidden_size), dtype=torch.float32, device=device)
        _gemm2_pair_kernel[(num_pairs, triton.cdiv(hidden_size, gemm2["BLOCK_N"]))](
            activated, w2, b2, ids, weights, dest, hidden_size, inter_size, top_k,
            activated.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), *bias2_strides,
            weights.stride(0), dest.stride(0), *s2_args,
            HAS_BIAS=w2_bias is not None, PRECISION=precision, ATOMIC=combine == "atomic",
            QUANT=quant_code, **gemm2,
        )  # fmt: skip
        if combine == "atomic":
            return out.copy_(summed)
        block_n = min(1024, next_pow2(hidden_size, 16))
        _sum_topk_kernel[(num_tokens, triton.cdiv(hidden_size, block_n))](
            dest, ids, out, hidden_size, top_k, dest.stride(0), out.stride(0), BLOCK_N=block_n,
        )  # fmt: skip
        return out

    # NOTE: each pair's weighted output is stored in the input dtype (as vLLM does): half the
    # traffic of fp32 at prefill; the K-way sum below is still done in fp32.
    # The rows of -1 pairs (in no segment) are never written: zeroed where they are read as they
    # are (top-1: the output itself; torch's sum), skipped by the sum kernel, absent from atomics.
    atomic = combine == "atomic" and top_k > 1
    if atomic:
        dest = summed
    elif top_k == 1:
        dest = out.zero_()  # pair == token
    elif combine == "sum":
        dest = torch.zeros((num_pairs, hidden_size), dtype=dtype, device=device)  # [N, H]
    else:
        dest = torch.empty((num_pairs, hidden_size), dtype=dtype, device=device)  # [N, H]
    grid2 = (num_row_blocks * triton.cdiv(hidden_size, gemm2["BLOCK_N"]),)
    _gemm2_kernel[grid2](
        activated, w2, w2_desc, b2, weights, dest, sorted_ids, counts, ends,
        num_row_blocks, group2, num_experts, hidden_size, inter_size, top_k,
        activated.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), *bias2_strides,
        weights.stride(0), dest.stride(0), *s2_args,
        HAS_BIAS=w2_bias is not None, PRECISION=precision, ATOMIC=atomic, TMA=tma,
        WS=warp_specialize, QUANT=quant_code, REMAINDER_M=remainder_m, BLOCK_E=block_e,
        **gemm2,
    )  # fmt: skip
    if atomic:
        return out.copy_(summed)
    if top_k == 1:
        return out
    if combine == "sum_kernel":
        block_n = min(1024, next_pow2(hidden_size, 16))
        _sum_topk_kernel[(num_tokens, triton.cdiv(hidden_size, block_n))](
            dest, ids, out, hidden_size, top_k, dest.stride(0), out.stride(0), BLOCK_N=block_n,
        )  # fmt: skip
        return out
    # One reduction kernel; torch accumulates a bf16/fp16 sum in fp32.
    return torch.sum(dest.view(num_tokens, top_k, hidden_size), dim=1, out=out)  # [T, H]
