"""Triton quantized GEMMs: FP8 activation quantization, a w8a8 block-FP8 GEMM, the per-channel FP8
GEMM (``torch._scaled_mm`` where the GPU has FP8) and the dequantization kernels.

M = rows of x, N = output features, K = input features. The w8a8 GEMM takes FP8 activations with
per-(row, K group) scales and an FP8 weight with per-(N group, K group) scales: each K tile lies in
one K group (BLOCK_K divides group_k), so a tile's dot is scaled once, by a_s[m] * w_s[n], and
accumulated in float32. Per-token x per-channel scaling is the same kernel with one K group.
Few rows (decode) split K across programs when the output tiles cannot fill the SMs: fp32
partials in a workspace, summed in order by a second kernel (``w8a8_gemm``, ``gemm_config``).

The e2m1 / e8m0 decoders (``e2m1_to_f32``, ``e8m0_to_f32``) are shared with the fused MoE kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.torch import quant as reference
from atom_kernels.backends.triton import fp8_skinny
from atom_kernels.backends.triton.common import (
    as_rows,
    is_interpreted,
    next_pow2,
    num_sms,
    zeroed_counters,
)

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP_QUANT_EPS = reference.GROUP_QUANT_EPS


@triton.jit
def e2m1_to_f32(code):
    """e2m1 codes (int, 0..15: sign bit 3, exponent bits 2-1, mantissa bit 0) -> float32 values
    (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives)."""
    code = code.to(tl.int32)
    exponent = (code >> 1) & 3
    mantissa = code & 1
    # exponent 0: subnormal m * 0.5; else (1 + m / 2) * 2^(e - 1) = ((2 + m) << e) / 4
    value = tl.where(
        exponent == 0,
        mantissa.to(tl.float32) * 0.5,
        ((2 + mantissa) << exponent).to(tl.float32) * 0.25,
    )
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def e8m0_to_f32(scale):
    """e8m0 bytes -> 2^(scale - 127) as float32, exactly: the byte is the float's exponent field
    (0 gives the subnormal 2^-127, 255 infinity)."""
    scale = scale.to(tl.int32)
    bits = tl.where(scale == 0, 0x00400000, scale << 23)
    return bits.to(tl.float32, bitcast=True)


# --- activation quantization ---------------------------------------------------------------------


@triton.jit
def _group_quant_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] fp8 out
    s_ptr,  # [M, G] fp32 out (dynamic) or the one-element static scale
    num_cols,
    group_size,
    stride_xm,
    stride_qm,
    stride_sm,
    eps,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, group): scale = max(|x|, eps) / 448 over the group (or the static scale),
    q = clamp(x / scale, -448, 448) in fp8 (round to nearest even)."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * group_size
    end = tl.minimum(start + group_size, num_cols)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(s_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(start, end, BLOCK):
            x = tl.load(x_row + c + offs, mask=c + offs < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        # div_rn: IEEE division, as torch's (Triton's "/" may be approximate on a GPU)
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), eps), 448.0)
        tl.store(s_ptr + row * stride_sm + group, scale)
    for c in range(start, end, BLOCK):
        mask = c + offs < end
        x = tl.load(x_row + c + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(q_ptr + row * stride_qm + c + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_quant_tiles_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] fp8 out
    s_ptr,  # [M, G] fp32 out
    num_pairs,  # M * G
    num_groups,
    num_cols,
    group_size,
    stride_xm,
    stride_qm,
    stride_sm,
    eps,
    PAIRS: tl.constexpr,
    BLOCK: tl.constexpr,  # >= group_size
):
    """Program: PAIRS consecutive (row, group) pairs, one group a tile row (a row's groups are
    adjacent in memory, so the tile streams): the numbers of ``_group_quant_kernel``, bit for
    bit (the same max, the same IEEE divisions)."""
    pairs = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
    pair_mask = pairs < num_pairs
    rows = (pairs // num_groups).to(tl.int64)
    groups = pairs % num_groups
    offs = tl.arange(0, BLOCK)
    cols = groups[:, None] * group_size + offs[None, :]  # [PAIRS, BLOCK]
    mask = pair_mask[:, None] & (offs < group_size)[None, :] & (cols < num_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, eps), 448.0)  # [PAIRS]
    tl.store(s_ptr + rows * stride_sm + groups, scale, mask=pair_mask)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


# Groups up to this wide take the tiled kernel; wider ones (per-token quant: one group a row) and
# the static scale take the per-(row, group) loop.
TILED_GROUP_MAX = 1024


def _quant_rows(x: torch.Tensor, group_size: int, static_scale: torch.Tensor | None):
    num_rows, num_cols = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_groups = triton.cdiv(num_cols, group_size) if num_cols else 0
    x_q = torch.empty((num_rows, num_cols), dtype=FP8_DTYPE, device=x.device)
    if static_scale is None:
        x_s = torch.empty((num_rows, num_groups), dtype=torch.float32, device=x.device)
    else:
        x_s = static_scale.reshape(1)
    interpreted = is_interpreted(x.device)
    if num_rows and num_groups and static_scale is None and group_size <= TILED_GROUP_MAX:
        # NOTE: one program per (row, group) with 1 warp reached 21% of the copy bandwidth
        # (H100, M = 4096, K = 7168, group 128: 642 GB/s); 4096-element tiles stream.
        block = next_pow2(group_size, 16)
        pairs = max(1, (1024 if interpreted else 4096) // block)
        num_pairs = num_rows * num_groups
        _group_quant_tiles_kernel[(triton.cdiv(num_pairs, pairs),)](
            x, x_q, x_s, num_pairs, num_groups, num_cols, group_size, x.stride(0),
            x_q.stride(0), x_s.stride(0), GROUP_QUANT_EPS, PAIRS=pairs, BLOCK=block,
            num_warps=4,
        )  # fmt: skip
    elif num_rows and num_groups:
        cap = 256 if interpreted else 2048
        block = min(next_pow2(group_size, 16), cap)
        _group_quant_kernel[(num_rows, num_groups)](
            x, x_q, x_s, num_cols, group_size, x.stride(0), x_q.stride(0),
            x_s.stride(0) if static_scale is None else 0, GROUP_QUANT_EPS,
            STATIC=static_scale is not None, BLOCK=block, num_warps=4 if block >= 1024 else 1,
        )  # fmt: skip
    return x_q, x_s


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int):
    """See ``atom_kernels.per_token_group_quant_fp8``: (x_q fp8 [M, K], x_s fp32 [M, G])."""
    return _quant_rows(x, group_size, None)


def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> clamp(x / scale, -448, 448) in fp8 with one per-tensor float32 scale."""
    return _quant_rows(x, max(1, x.shape[1]), scale)[0]


# --- the w8a8 GEMM -------------------------------------------------------------------------------


@triton.jit
def _w8a8_kernel(
    a_ptr,  # [M, K] fp8
    as_ptr,  # [M, ceil(K / group_k)] fp32 (row stride 0: one static scale)
    b_ptr,  # [N, K] fp8
    bs_ptr,  # [ceil(N / group_n), ceil(K / group_k)] fp32
    bias_ptr,  # [N] or dummy
    out_ptr,  # [M, N]
    ws_ptr,  # SPLIT: the fp32 workspace [S, M, N] (contiguous); else out_ptr again (unused)
    count_ptr,  # FUSED_REDUCE: a zeroed int32 counter per output tile; else unused
    a_desc,  # TMA: descriptor over a, blocks [BLOCK_M, BLOCK_K]; else a_ptr again (unused)
    b_desc,  # TMA: descriptor over b, blocks [BLOCK_N, BLOCK_K]; else b_ptr again (unused)
    M,
    N,
    K,
    group_n,
    group_k,
    split_len,  # K columns a split covers (a multiple of BLOCK_K); K when not split
    group_m,  # row tiles a column of the launch order walks (GROUP_M swizzle: L2 reuse of b)
    stride_am,
    stride_asm,
    stride_ask,
    stride_bn,
    stride_bsn,
    stride_bsk,
    stride_om,
    stride_os,  # SPLIT: the workspace's split stride
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # no fp8 MMA on this device: dot on exact fp16 copies
    SPLIT: tl.constexpr,  # split-K: store fp32 partials to ws_ptr
    FUSED_REDUCE: tl.constexpr,  # SPLIT: the tile's last split sums them (else the reduce kernel)
    SCALAR_BS: tl.constexpr,  # BLOCK_N divides group_n: one weight scale per tile and K group
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides group_k: a K tile has one scale per row / column
):
    """Program (tile, split): the sum over the split's K tiles of dot(a, b^T) * a_s[:, None] *
    b_s[None, :] (the scales of the tile's K group). Not split: + bias, stored in out's dtype.
    Split: the fp32 partial goes to the workspace; with FUSED_REDUCE the tile's last program to
    arrive (an acq_rel counter) sums the partials in split order (deterministic), resets the
    counter, adds the bias and stores."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = group_m * num_pid_n
    first_m = (pid // per_group) * group_m
    group_rows = tl.minimum(num_pid_m - first_m, group_m)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = split * split_len
    k_end = tl.minimum(k_start + split_len, K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]  # [BM, BK]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [BK, BN]
    a_ptrs += k_start
    b_ptrs += k_start
    as_ptrs = as_ptr + offs_m * stride_asm
    if SCALAR_BS:
        bs_ptrs = bs_ptr + ((pid_n * BLOCK_N) // group_n) * stride_bsn
    else:
        bs_ptrs = bs_ptr + (offs_n // group_n) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if TMA:  # out-of-bounds rows and columns come as zeros
            a = a_desc.load([pid_m * BLOCK_M, k0])
            b = b_desc.load([pid_n * BLOCK_N, k0]).T
        else:
            k_mask = k0 + offs_k < K  # a partial last K block reads zeros
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        group = k0 // group_k
        a_s = tl.load(as_ptrs + group * stride_ask, mask=m_mask, other=0.0)
        if SCALAR_BS:
            b_s = tl.load(bs_ptrs + group * stride_bsk)
        else:
            b_s = tl.load(bs_ptrs + group * stride_bsk, mask=n_mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float16)
            b = b.to(tl.float16)
        if SCALAR_BS:
            acc += tl.dot(a, b) * (a_s * b_s)[:, None]
        else:
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    mask = m_mask[:, None] & n_mask[None, :]
    # NOTE: no `return` under a constexpr `if` (triton 3.6 fails to compile it): the reduce
    # kernel's path writes its partial and skips the output by the last condition instead.
    if SPLIT:
        ws_tile = ws_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]  # [BM, BN]
        tl.store(ws_tile + split.to(tl.int64) * stride_os, acc, mask=mask)
        if FUSED_REDUCE:
            tl.debug_barrier()  # every thread's partial stored before the release below
            if tl.atomic_add(count_ptr + pid, 1, sem="acq_rel") != tl.num_programs(1) - 1:
                return
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for _ in range(0, tl.num_programs(1)):  # split order: the same sum on every run
                acc += tl.load(ws_tile, mask=mask, other=0.0, cache_modifier=".cg")
                ws_tile += stride_os
            tl.atomic_xchg(count_ptr + pid, 0)  # ready for the next launch (and graph replay)
    if FUSED_REDUCE or not SPLIT:  # else the reduce kernel writes the output
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr,  # [S, M * N] fp32
    bias_ptr,  # [N] or dummy
    out_ptr,  # [M * N] (contiguous)
    num_splits,
    size,  # M * N
    N,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = sum over splits in order (deterministic) (+ bias), cast."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    ws_ptrs = ws_ptr + offs
    for _ in range(0, num_splits):
        acc += tl.load(ws_ptrs, mask=mask, other=0.0)
        ws_ptrs += size  # 64-bit pointer arithmetic
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def has_fp8_mma(device: torch.device) -> bool:
    """NVIDIA GPUs of compute capability >= 8.9 (Ada, Hopper, Blackwell) multiply float8_e4m3fn in
    hardware (and ``torch._scaled_mm`` runs there); the interpreter handles fp8 dots too."""
    if device.type == "cpu":
        return True
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def block_k_for(group_k: int, interpreted: bool) -> int | None:
    """The K tile: the largest power of two <= 128 (32 interpreted) dividing group_k, at least 16
    (the dot's minimum); None when there is none (odd group sizes)."""
    block = 32 if interpreted else 128
    while block >= 16:
        if group_k % block == 0:
            return block
        block //= 2
    return None


# Split-K bounds: each split at least this many K tiles, and the fp32 workspace's traffic (written
# and read once: 8 bytes an output a split) at most a quarter of the weight's (N x K bytes).
SPLIT_MIN_K_TILES = 2
SPLIT_MAX_WORKSPACE_FRACTION = 0.25
GEMM_CONFIG_KEYS = (
    "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "SPLIT_K", "GROUP_M", "TMA", "FUSED_REDUCE"
)  # fmt: skip


def _tiles(num_rows: int, n: int, cfg: dict) -> int:
    return triton.cdiv(num_rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])


def auto_split_k(num_rows: int, n: int, k: int, block_k: int, tiles: int, sms: int) -> int:
    """Splits of K for a launch of ``tiles`` output tiles on ``sms`` SMs: 1 when the tiles fill
    the SMs; else enough for ~2 programs an SM, each split >= SPLIT_MIN_K_TILES K tiles, the
    workspace's traffic within SPLIT_MAX_WORKSPACE_FRACTION of the weight's."""
    if tiles >= sms:
        return 1
    by_sms = triton.cdiv(2 * sms, tiles)
    by_k = triton.cdiv(k, block_k) // SPLIT_MIN_K_TILES
    by_workspace = int(SPLIT_MAX_WORKSPACE_FRACTION * k / (8 * num_rows))
    return max(1, min(by_sms, by_k, by_workspace))


def gemm_config(
    num_rows: int, n: int, k: int, block_k: int, sms: int, interpreted: bool = False
) -> dict:
    """The launch of ``w8a8_gemm`` for a shape on ``sms`` SMs: tiles, warps, stages, K splits,
    GROUP_M, TMA.

    Small M (<= 64 rows) is bound by the weight's bytes: 16-row tiles (the dot's minimum), 64
    columns, K split until the programs fill the SMs. Large M is bound by the FP8 MMA: TMA loads
    (where the device has them; pointers otherwise), 128 x 128 / 8 warps / 4 stages over a long K
    (>= 4096) and N >= 1024, else 64 x 128 / 4 warps / 3 stages; GROUP_M 8.
    NOTE (benchmarks/results/quant-gemm-s9-h100.json, H100, triton 3.6, 2026-11-24, the
    ``gemm_tiles`` sweep at DeepSeek-V3's projections): at M = 4096 the TMA tiles above took
    104 / 405 / 65 / 1152 / 270 / 147 us (q_a, q_b, kv_a, o, shared gate_up, shared down:
    41-71% of the FP8 rate) against 119 / 483 / 78 / 1372 / 317 / 175 for 64 x 128 pointer
    loads; at M = 1-16, 16 x 64 with split-K was within 5% of the best launch on every shape
    (o_proj 54 us against 65 for 16 x 32 without it).
    """
    if interpreted:
        cfg = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1, GROUP_M=1, TMA=False)
    elif num_rows <= 64:
        block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
        cfg = dict(BLOCK_M=block_m, BLOCK_N=64, num_warps=4, num_stages=4, GROUP_M=1, TMA=False)
    elif k >= 4096 and n >= 1024:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, GROUP_M=8, TMA=True)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, GROUP_M=8, TMA=True)
    cfg["SPLIT_K"] = auto_split_k(num_rows, n, k, block_k, _tiles(num_rows, n, cfg), sms)
    cfg["FUSED_REDUCE"] = True
    return cfg


def tma_capable(device: torch.device) -> bool:
    """TMA loads: NVIDIA Hopper or newer (compute capability 9+) or the CPU interpreter, with
    host descriptors."""
    if TensorDescriptor is None:
        return False
    if device.type != "cuda" or torch.version.hip is not None:
        return device.type == "cpu"  # the interpreter emulates descriptors
    return torch.cuda.get_device_capability(device)[0] >= 9


def _descriptors(a: torch.Tensor, b: torch.Tensor, cfg: dict, block_k: int):
    """(descriptor over a [M, K], blocks [BLOCK_M, block_k]; over b [N, K], blocks [BLOCK_N,
    block_k]) or None where TMA cannot serve: not asked, not Hopper or newer (the interpreter
    emulates it), a row stride or a base not 16-byte aligned (TMA's rule), a non-unit column
    stride."""
    if not cfg.get("TMA") or not tma_capable(a.device):
        return None
    for t in (a, b):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or t.stride(0) * t.element_size() % 16:
            return None
    return (
        TensorDescriptor.from_tensor(a, [cfg["BLOCK_M"], block_k]),
        TensorDescriptor.from_tensor(b, [cfg["BLOCK_N"], block_k]),
    )


def w8a8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_n: int,
    group_k: int,
    block_k: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """a fp8 [M, K] (scales [M, ceil(K / group_k)]) x b fp8 [N, K]^T (scales [ceil(N / group_n),
    ceil(K / group_k)]) (+ bias) -> [M, N] in out_dtype; block_k divides group_k. ``config``
    (keys of GEMM_CONFIG_KEYS; SPLIT_K None: chosen) overrides ``gemm_config``'s launch.

    Split-K (SPLIT_K > 1): program (tile, split) writes its fp32 partial to a workspace
    [S, M, N]; the tile's last program (FUSED_REDUCE: self-resetting counters, common's
    ``zeroed_counters``) or a second kernel (no counters: FUSED_REDUCE False, or the counters
    would have to grow inside a graph capture) sums the splits in order (deterministic), adds the
    bias and casts. The grid and the workspace come from the shapes alone (CUDA-graph capturable).
    """
    num_rows, k = a.shape
    n = b.shape[0]
    out = torch.empty((num_rows, n), dtype=out_dtype, device=a.device)
    if num_rows == 0 or n == 0:
        return out
    if b.stride(-1) != 1:
        b = b.contiguous()
    if a.stride(-1) != 1:
        a = a.contiguous()
    sms = num_sms(a.device)
    cfg = gemm_config(num_rows, n, k, block_k, sms, is_interpreted(a.device))
    if config is not None:
        cfg.update(config)
        if cfg.get("SPLIT_K") is None:
            cfg["SPLIT_K"] = auto_split_k(num_rows, n, k, block_k, _tiles(num_rows, n, cfg), sms)
    k_tiles = triton.cdiv(k, block_k)
    split_len = triton.cdiv(k_tiles, max(1, min(cfg["SPLIT_K"], k_tiles))) * block_k
    num_splits = triton.cdiv(k, split_len) if k else 1
    split = num_splits > 1
    tiles = _tiles(num_rows, n, cfg)
    counters = None
    if split:
        ws = torch.empty((num_splits, num_rows, n), dtype=torch.float32, device=a.device)
        if cfg.get("FUSED_REDUCE", True):
            counters = zeroed_counters(a.device, tiles)
    else:
        ws, split_len = out, max(k, 1)
    descriptors = _descriptors(a, b, cfg, block_k)
    a_desc, b_desc = descriptors if descriptors is not None else (a, b)
    block_n = cfg["BLOCK_N"]
    _w8a8_kernel[(tiles, num_splits)](
        a, a_scale, b, b_scale, bias if bias is not None else out, out, ws,
        counters if counters is not None else out, a_desc, b_desc,
        num_rows, n, k, group_n, group_k, split_len, max(1, cfg["GROUP_M"]), a.stride(0),
        a_scale.stride(0), a_scale.stride(1), b.stride(0), b_scale.stride(0), b_scale.stride(1),
        out.stride(0), ws.stride(0) if split else 0,
        HAS_BIAS=bias is not None, UPCAST=not has_fp8_mma(a.device), SPLIT=split,
        FUSED_REDUCE=counters is not None, SCALAR_BS=group_n % block_n == 0,
        TMA=descriptors is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split and counters is None:
        size = num_rows * n
        block = 4096 if is_interpreted(a.device) else 1024
        _split_k_reduce_kernel[(triton.cdiv(size, block),)](
            ws, bias if bias is not None else out, out, num_splits, size, n,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """See ``atom_kernels.fp8_block_linear``: w8a8, x quantized per token and 1 x bk group.
    A block width with no power-of-two K tile >= 16 dividing it runs the torch reference."""
    n, k = weight.shape
    block_k = block_k_for(block[1], is_interpreted(x.device))
    if block_k is None or k == 0:
        return reference.fp8_block_linear(x, weight, scale, block, bias)
    if fp8_skinny.takes(x, weight, block):  # opt-in: one weight-only kernel at 1-8 rows
        return fp8_skinny.fp8_block_skinny_linear(x, weight, scale, block, bias)
    x2 = as_rows(x)
    x_q, x_s = per_token_group_quant_fp8(x2, block[1])
    out = w8a8_gemm(x_q, x_s, weight, scale, block[0], block[1], block_k, bias, x.dtype)
    return out.view(*x.shape[:-1], n)


def _scaled_mm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._scaled_mm with row-wise scales: an FP8 NVIDIA GPU, bf16 output, K and N multiples
    of 16, a K-contiguous weight (its transpose is the column-major operand cuBLASLt wants)."""
    n, k = weight.shape
    return (
        x.device.type == "cuda"
        and has_fp8_mma(x.device)
        and hasattr(torch, "_scaled_mm")
        and x.dtype == torch.bfloat16
        and k % 16 == 0
        and n % 16 == 0
        and weight.is_contiguous()
    )


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """See ``atom_kernels.fp8_linear``: x quantized per token (input_scale None) or with the
    static scale, then ``torch._scaled_mm`` (row-wise scales) or the Triton w8a8 GEMM."""
    n, k = weight.shape
    if k == 0:
        return reference.fp8_linear(x, weight, weight_scale, input_scale, bias)
    x2 = as_rows(x)
    num_rows = x2.shape[0]
    if input_scale is None:
        x_q, x_s = per_token_group_quant_fp8(x2, k)  # [M, K], [M, 1]
    else:
        x_q = static_quant_fp8(x2, input_scale)
        x_s = input_scale.reshape(1, 1).float().expand(num_rows, 1)
    if _scaled_mm_takes(x2, weight) and num_rows > 0:
        out = torch._scaled_mm(
            x_q, weight.t(), scale_a=x_s.contiguous(), scale_b=weight_scale.view(1, n),
            bias=bias, out_dtype=x.dtype,
        )  # fmt: skip
    else:
        block_k = 32 if is_interpreted(x.device) else 128
        group_k = triton.cdiv(k, block_k) * block_k  # one K group: per-token x per-channel
        w_s = weight_scale.view(n, 1)
        out = w8a8_gemm(x_q, x_s, weight, w_s, 1, group_k, block_k, bias, x.dtype)
    return out.view(*x.shape[:-1], n)


# --- dequantization ------------------------------------------------------------------------------


@triton.jit
def _dequant_fp8_block_kernel(
    w_ptr,  # [L, N, K] fp8
    s_ptr,  # [L, ceil(N / bn), ceil(K / bk)] fp32
    out_ptr,  # [L, N, K]
    N,
    K,
    block_n,
    block_k,
    stride_wl,
    stride_wn,
    stride_sl,
    stride_sn,
    stride_ol,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    mat = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + mat * stride_wl + rows[:, None] * stride_wn + cols[None, :], mask=mask)
    s_rows = (rows // block_n)[:, None] * stride_sn
    s = tl.load(s_ptr + mat * stride_sl + s_rows + (cols // block_k)[None, :], mask=mask, other=0.0)
    out = (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + mat * stride_ol + rows[:, None] * stride_on + cols[None, :], out, mask=mask)


def dequantize_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """See ``atom_kernels.dequantize_fp8_block``."""
    *lead, n, k = weight.shape
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    if out.numel() == 0:
        return out
    w3 = weight.reshape(-1, n, k)
    if w3.stride(-1) != 1:
        w3 = w3.contiguous()
    s3 = scale.reshape(-1, *scale.shape[-2:])
    if s3.stride(-1) != 1:
        s3 = s3.contiguous()
    o3 = out.view(-1, n, k)
    block_n, block_k = (16, 32) if is_interpreted(weight.device) else (32, 128)
    grid = (w3.shape[0], triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequant_fp8_block_kernel[grid](
        w3, s3, o3, n, k, block[0], block[1], w3.stride(0), w3.stride(1), s3.stride(0),
        s3.stride(1), o3.stride(0), o3.stride(1), BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out


@triton.jit
def _dequant_mxfp4_kernel(
    blocks_ptr,  # [R, 16] uint8
    scales_ptr,  # [R] uint8
    out_ptr,  # [R, 32]
    num_blocks,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, 32)
    mask = (rows < num_blocks)[:, None]
    rows64 = rows.to(tl.int64)
    packed = tl.load(blocks_ptr + rows64[:, None] * 16 + cols[None, :] // 2, mask=mask, other=0)
    code = (packed.to(tl.int32) >> ((cols[None, :] % 2) * 4)) & 0xF  # low nibble first
    scale = e8m0_to_f32(tl.load(scales_ptr + rows64, mask=rows < num_blocks, other=127))
    out = (e2m1_to_f32(code) * scale[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64[:, None] * 32 + cols[None, :], out, mask=mask)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """See ``atom_kernels.dequantize_mxfp4``."""
    out = torch.empty(
        (*blocks.shape[:-2], blocks.shape[-2] * 32), dtype=dtype, device=blocks.device
    )
    num_blocks = scales.numel()
    if num_blocks == 0:
        return out
    block_r = 16 if is_interpreted(blocks.device) else 64
    _dequant_mxfp4_kernel[(triton.cdiv(num_blocks, block_r),)](
        blocks.contiguous(), scales.contiguous(), out, num_blocks, BLOCK_R=block_r
    )
    return out
