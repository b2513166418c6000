"""One-shot all-reduce over staging buffers every rank can read, fused with residual + RMSNorm.

Each rank's staging buffer (and flag array) is mapped into every other rank's address space
(CUDA IPC, `atom_kernels.collectives`), so a program reads its peers' rows directly over NVLink:

    copy my row into my buffer  ->  raise my flag at every rank  ->  wait for every rank's flag
    ->  sum the W rows in rank order (every rank gets the same bits)  ->  [+ residual, RMSNorm]

At most one program per SM, each over rows p, p + G, ...; no multicast. The buffer alternates
between two halves by each program's own call count, and the count is the flag value, so no
second barrier is needed: a rank writes a half again only after passing the barrier of the call
in between, which every peer reaches only when done reading that half (programs of one call
finish before the next call's start: the launch is never early, i.e. not PDL). Row r is always
program r % G's, so no program reads rows another one rewrites. Flags grow monotonically and are
compared by wrapping difference, so a peer already one call ahead (flag = count + 1) passes the
wait too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton.common import is_interpreted, next_pow2, row_num_warps

# Polls of a peer's flag before the kernel traps (an error on the device, the process fails and
# its engine with it) instead of waiting forever: about 30 s, far past any step.
SPIN_LIMIT = 1 << 26


@triton.jit
def _peer_all_reduce_kernel(
    x_ptr,
    stride_x,
    residual_ptr,
    stride_r,
    residual_out_ptr,
    weight_ptr,
    out_ptr,
    stride_o,
    buffer_ptrs,  # int64 [W]: every rank's staging buffer (two halves of `half` elements)
    flag_ptrs,  # int64 [W]: every rank's int32 flags [programs, W]
    counter_ptr,  # int32 [programs]: this rank's call count per program
    num_rows,
    num_cols,
    half,
    rank,
    eps,
    WORLD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FUSE_NORM: tl.constexpr,
    TRAP: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
):
    # Program p takes rows p, p + G, ... (G programs, G <= the SMs: all resident at once, so a
    # program spinning for its peers never keeps one of theirs from starting). Row r is always
    # program r % G's (G = min(rows, SMs)), which keeps one program's state its own. Offsets fit
    # int32: rows x columns <= 2**30 (collectives.MAX_ROWS, MAX_COLS).
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < num_cols
    dtype = x_ptr.dtype.element_ty
    count = tl.load(counter_ptr + pid) + 1
    tl.store(counter_ptr + pid, count)  # this program's own slot: no other reader
    base = (count & 1).to(tl.int64) * half

    own = tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype))
    for row in range(pid, num_rows, grid):
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask)
        tl.store(own + base + row * num_cols + cols, x, mask=mask)
    tl.debug_barrier()  # every thread's store happens before the flag is raised
    for r in tl.static_range(WORLD):
        flags = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flags + pid * WORLD + rank, count, sem="release", scope="sys")
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        # Polled with volatile loads (no read-modify-write on a word the peer writes over NVLink),
        # then one acquire once it is up.
        seen = tl.load(own_flags + pid * WORLD + r, volatile=True)
        polls = 0
        while seen - count < 0:
            seen = tl.load(own_flags + pid * WORLD + r, volatile=True)
            polls += 1
            if TRAP:  # a peer that never comes (dead, or stuck): fail the kernel, never hang
                if polls > SPIN_LIMIT:
                    tl.inline_asm_elementwise(
                        "trap;", "=r,r", [seen], dtype=tl.int32, is_pure=False, pack=1
                    )
        tl.atomic_add(own_flags + pid * WORLD + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()

    for row in range(pid, num_rows, grid):
        slot = base + row * num_cols
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            buf = tl.load(buffer_ptrs + r).to(tl.pointer_type(dtype))
            acc += tl.load(buf + slot + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)
        # The sum rounds to the input dtype, as NCCL's all-reduce result does.
        total = acc.to(dtype)
        if FUSE_NORM:
            res = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
            # As `fused_add_rms_norm`: the sum rounds before the norm; HF's rounding after it.
            h = (total.to(tl.float32) + res.to(tl.float32)).to(dtype)
            tl.store(residual_out_ptr + row * num_cols + cols, h, mask=mask)
            hf = h.to(tl.float32)
            variance = tl.sum(hf * hf, axis=0) / num_cols
            normed = (hf * tl.math.rsqrt(variance + eps)).to(dtype).to(tl.float32)
            w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * stride_o + cols, w * normed, mask=mask)
        else:
            tl.store(out_ptr + row * stride_o + cols, total, mask=mask)


def launch(
    x: torch.Tensor,
    out: torch.Tensor,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    buffer_ptrs: torch.Tensor,
    flag_ptrs: torch.Tensor,
    counters: torch.Tensor,
    half: int,
    rank: int,
    world: int,
    max_programs: int,
) -> None:
    """Rows of `x` [T, N] summed over the ranks into `out`, or, given `residual` and `weight`:
    `residual_out = residual + sum` (contiguous) and `out = rms_norm(residual_out)`. Every rank
    calls it alike."""
    rows, cols = x.shape
    block = next_pow2(cols)
    fuse = residual is not None
    _peer_all_reduce_kernel[(min(rows, max_programs),)](
        x,
        x.stride(0),
        residual if fuse else x,
        residual.stride(0) if fuse else 0,
        residual_out if fuse else x,
        weight if fuse else x,
        out,
        out.stride(0),
        buffer_ptrs,
        flag_ptrs,
        counters,
        rows,
        cols,
        half,
        rank,
        eps,
        WORLD=world,
        BLOCK_N=block,
        FUSE_NORM=fuse,
        TRAP=not is_interpreted(x.device),
        SPIN_LIMIT=SPIN_LIMIT,
        num_warps=row_num_warps(block),
    )
