"""One-shot all-reduce pushed into buffers every rank can write, fused with residual + RMSNorm.

Every rank's staging buffer is mapped into every other rank's address space (CUDA IPC,
`atom_kernels.collectives`). A call pushes each row to every peer and reads only its own memory:

    store my row into slot `rank` of every peer's buffer (NVLink stores, never waited on)
    ->  poll my buffer's W - 1 peer slots, one after the other, until no element is the empty
    mark  ->  sum them and my own row (from x) in rank order (every rank gets the same bits)
    ->  mark the slots empty again  ->  [+ residual, RMSNorm]

(`EACH_SLOT`, the first form, kept to time against: my own row goes through my slot too.)

No flags and no barrier: the data is its own flag (as TensorRT-LLM's "Lamport" all-reduce). A
slot is empty when every element holds the mark, negative zero's bits (0x8000 in 16 bits; 32-bit
elements use 0x80008000, a denormal, so the empty buffer reads as empty in both widths); a rank
sends a -0.0 (or that denormal) as +0.0 (-0.0) and never writes the mark. The buffer has three
phases, used in turn by call (a device-side counter every rank advances alike): a rank pushes
into phase p + 1 only once it has finished call p, which needed every peer's push of call p, made
after that peer finished p - 1 and emptied its phase p - 1 slots; so a push never lands in slots
their reader has not emptied, nor while it reads them.

Two-shot (`TWO_SHOT`, for larger messages): row r belongs to rank r * W // rows. Each rank pushes
every row it does not own into slot `rank` of the owner's buffer, sums the rows it owns (its own
part from x, the others' as they land) and pushes each sum into slot `owner` of every other
rank's buffer, then takes the others' sums as they land: a rank sends 2 (W - 1) / W of the message
instead of W - 1 of it. The slots a call uses are disjoint (slot s holds s's rows for me to sum,
or s's sums of its own rows) and empty again when it ends, so the phases work as above.

At most one program per SM (all resident at once: a program polling for a peer's push never
keeps a program of its own rank from running), each over rows p, p + G, ...; the last to finish
moves the phase on (counted with an atomic; a call of one program, batch-1 decode, needs none).

With PDL (`pdl.py`) the kernel may launch during the kernel before it and waits for it before
anything else; that kernel waited for its own predecessor the same way, so the previous call of
this kernel has finished (its phase moved on) when this one reads the phase. Once every program
has passed that wait, the kernel after this one may launch and prefetch its weights while this
one polls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton import pdl
from atom_kernels.backends.triton.common import is_interpreted, next_pow2, row_num_warps

# Polls of one slot before the kernel traps (an error on the device: the process fails and its
# engine with it) instead of waiting forever on a peer that never comes: about 30 s.
SPIN_LIMIT = 1 << 26
PHASES = 3
# One-shot calls take their own row through their own slot too (the first form; benchmarks/
# allreduce.py times it against the default, which reads it from x: `peer+norm/each`).
EACH_SLOT = False
# The empty mark: a 16-bit element's bits, and a 32-bit element's (two 16-bit marks).
EMPTY16 = -(1 << 15)  # 0x8000
EMPTY32 = -(1 << 31) + (1 << 15)  # 0x80008000


@triton.jit
def _sendable(x, BITS_TY: tl.constexpr, MARK: tl.constexpr, SEND_AS: tl.constexpr):
    """`x` with the empty mark replaced by the nearest value that is not it (-0.0 -> +0.0, or
    the 32-bit mark -> -0.0)."""
    bits = x.to(BITS_TY, bitcast=True)
    bits = tl.where(bits == MARK, tl.full(bits.shape, SEND_AS, BITS_TY), bits)
    return bits.to(x.dtype, bitcast=True)


@triton.jit
def _take(slot, mask, empty, BITS_TY: tl.constexpr, MARK: tl.constexpr, TRAP: tl.constexpr,
          SPIN_LIMIT: tl.constexpr):  # fmt: skip
    """The row at `slot` once no element is the empty mark (volatile polls); the slot is left
    empty. Traps after SPIN_LIMIT polls (a peer that never comes: dead, or stuck)."""
    v = tl.load(slot, mask=mask, other=0.0, volatile=True)
    polls = 0
    while tl.sum((v.to(BITS_TY, bitcast=True) == MARK).to(tl.int32), axis=0) > 0:
        v = tl.load(slot, mask=mask, other=0.0, volatile=True)
        polls += 1
        if TRAP:
            if polls > SPIN_LIMIT:
                tl.inline_asm_elementwise(
                    "trap;", "=r,r", [polls], dtype=tl.int32, is_pure=False, pack=1
                )
    tl.store(slot, empty, mask=mask)
    return v


@triton.jit
def _finish(total, row, cols, mask, num_cols, residual_ptr, stride_r, residual_out_ptr,
            weight_ptr, out_ptr, stride_o, eps, FUSE_NORM: tl.constexpr):  # fmt: skip
    """Store a summed row: as it is, or `residual + total` and its RMSNorm."""
    if FUSE_NORM:
        res = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # As `fused_add_rms_norm`: the sum rounds before the norm; HF's rounding after it.
        h = (total.to(tl.float32) + res.to(tl.float32)).to(total.dtype)
        tl.store(residual_out_ptr + row * num_cols + cols, h, mask=mask)
        hf = h.to(tl.float32)
        variance = tl.sum(hf * hf, axis=0) / num_cols
        normed = (hf * tl.math.rsqrt(variance + eps)).to(total.dtype).to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, w * normed, mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, total, mask=mask)


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
    own_ptr,  # this rank's buffer, [PHASES, W, slot_elems] of x's dtype
    buffers,  # every rank's buffer (a tuple of WORLD pointers; its own at `rank`)
    counter_ptr,  # int32 [2]: this rank's phase (0..PHASES-1), programs done with this call
    num_rows,
    num_cols,
    slot_elems,
    rank,
    eps,
    WORLD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FUSE_NORM: tl.constexpr,
    TWO_SHOT: tl.constexpr,
    EACH_SLOT: tl.constexpr,
    TRAP: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
    PHASES: tl.constexpr,
    BITS_TY: tl.constexpr,  # the integer type of x's width
    MARK: tl.constexpr,  # the empty mark's bits
    SEND_AS: tl.constexpr,  # the bits sent for an element whose bits are the mark
    USE_PDL: tl.constexpr,
):
    # Offsets fit int32 within a slot (rows x columns <= 2**30: collectives.MAX_ROWS, MAX_COLS);
    # slot starts are int64.
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < num_cols
    dtype = x_ptr.dtype.element_ty
    if USE_PDL:  # launched early behind the previous kernel: nothing read or written before this
        pdl.wait_for_previous()
    empty = tl.full([BLOCK_N], MARK, BITS_TY).to(dtype, bitcast=True)
    phase = tl.load(counter_ptr)
    base = phase.to(tl.int64) * WORLD * slot_elems
    mine = base + rank * slot_elems  # my slot, in every rank's buffer

    if TWO_SHOT:
        # Row r belongs to rank r * W // rows. 1. each row to its owner (slot: mine); 2. the owner
        # sums its rows (its own part from x) and sends the sum to every other rank (slot: the
        # owner's); 3. the rows of the others, taken as they come.
        for row in range(pid, num_rows, grid):
            owner = (row * WORLD) // num_rows
            if owner != rank:
                x = _sendable(tl.load(x_ptr + row * stride_x + cols, mask=mask), BITS_TY, MARK,
                              SEND_AS)  # fmt: skip
                for r in tl.static_range(WORLD):
                    if r == owner:
                        tl.store(buffers[r] + mine + row * num_cols + cols, x, mask=mask)
        for row in range(pid, num_rows, grid):
            if (row * WORLD) // num_rows == rank:
                acc = tl.zeros([BLOCK_N], dtype=tl.float32)
                for r in tl.static_range(WORLD):
                    if r == rank:
                        v = _sendable(tl.load(x_ptr + row * stride_x + cols, mask=mask), BITS_TY,
                                      MARK, SEND_AS)  # fmt: skip
                    else:
                        v = _take(own_ptr + base + r * slot_elems + row * num_cols + cols, mask,
                                  empty, BITS_TY, MARK, TRAP, SPIN_LIMIT)  # fmt: skip
                    acc += v.to(tl.float32)
                # The sum rounds to the input dtype, as NCCL's all-reduce result does.
                total = acc.to(dtype)
                sent = _sendable(total, BITS_TY, MARK, SEND_AS)
                for r in tl.static_range(WORLD):
                    if r != rank:
                        tl.store(buffers[r] + mine + row * num_cols + cols, sent, mask=mask)
                _finish(sent, row, cols, mask, num_cols, residual_ptr, stride_r, residual_out_ptr,
                        weight_ptr, out_ptr, stride_o, eps, FUSE_NORM)  # fmt: skip
        for row in range(pid, num_rows, grid):
            owner = (row * WORLD) // num_rows
            if owner != rank:
                total = _take(own_ptr + base + owner * slot_elems + row * num_cols + cols, mask,
                              empty, BITS_TY, MARK, TRAP, SPIN_LIMIT)  # fmt: skip
                _finish(total, row, cols, mask, num_cols, residual_ptr, stride_r, residual_out_ptr,
                        weight_ptr, out_ptr, stride_o, eps, FUSE_NORM)  # fmt: skip
    elif EACH_SLOT:  # the first form (A/B): every rank's row through its slot, its own too
        for row in range(pid, num_rows, grid):
            x = _sendable(tl.load(x_ptr + row * stride_x + cols, mask=mask), BITS_TY, MARK,
                          SEND_AS)  # fmt: skip
            for r in tl.static_range(WORLD):
                tl.store(buffers[r] + mine + row * num_cols + cols, x, mask=mask)
        for row in range(pid, num_rows, grid):
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for r in tl.static_range(WORLD):
                slot = own_ptr + base + r * slot_elems + row * num_cols + cols
                acc += _take(slot, mask, empty, BITS_TY, MARK, TRAP, SPIN_LIMIT).to(tl.float32)
            # The sum rounds to the input dtype, as NCCL's all-reduce result does.
            _finish(acc.to(dtype), row, cols, mask, num_cols, residual_ptr, stride_r,
                    residual_out_ptr, weight_ptr, out_ptr, stride_o, eps, FUSE_NORM)  # fmt: skip
    else:
        # The row goes to the peers only: its own part is read from x, not through its slot.
        for row in range(pid, num_rows, grid):
            x = _sendable(tl.load(x_ptr + row * stride_x + cols, mask=mask), BITS_TY, MARK,
                          SEND_AS)  # fmt: skip
            for r in tl.static_range(WORLD):
                if r != rank:
                    tl.store(buffers[r] + mine + row * num_cols + cols, x, mask=mask)
        for row in range(pid, num_rows, grid):
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for r in tl.static_range(WORLD):  # in rank order: the same bits on every rank
                if r == rank:
                    v = _sendable(tl.load(x_ptr + row * stride_x + cols, mask=mask), BITS_TY,
                                  MARK, SEND_AS)  # fmt: skip
                else:
                    v = _take(own_ptr + base + r * slot_elems + row * num_cols + cols, mask,
                              empty, BITS_TY, MARK, TRAP, SPIN_LIMIT)  # fmt: skip
                acc += v.to(tl.float32)
            # The sum rounds to the input dtype, as NCCL's all-reduce result does.
            _finish(acc.to(dtype), row, cols, mask, num_cols, residual_ptr, stride_r,
                    residual_out_ptr, weight_ptr, out_ptr, stride_o, eps, FUSE_NORM)  # fmt: skip

    if grid == 1:  # no other program to wait for
        tl.store(counter_ptr, (phase + 1) % PHASES)
    else:
        done = tl.atomic_add(counter_ptr + 1, 1)
        if done == grid - 1:
            tl.store(counter_ptr, (phase + 1) % PHASES)
            tl.store(counter_ptr + 1, 0)


def launch(
    x: torch.Tensor,
    out: torch.Tensor,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    buffers: tuple[torch.Tensor, ...],
    counter: torch.Tensor,
    slot_elems: int,
    rank: int,
    world: int,
    max_programs: int,
    two_shot: bool = False,
) -> None:
    """Rows of `x` [T, N] summed over the ranks into `out`, or, given `residual` and `weight`:
    `residual_out = residual + sum` (contiguous) and `out = rms_norm(residual_out)`. Every rank
    calls it alike."""
    rows, cols = x.shape
    block = next_pow2(cols)
    fuse = residual is not None
    wide16 = x.element_size() == 2
    use_pdl = pdl.enabled(x.device)
    _peer_all_reduce_kernel[(min(rows, max_programs),)](
        x,
        x.stride(0),
        residual if fuse else x,
        residual.stride(0) if fuse else 0,
        residual_out if fuse else x,
        weight if fuse else x,
        out,
        out.stride(0),
        buffers[rank],
        buffers,
        counter,
        rows,
        cols,
        slot_elems,
        rank,
        eps,
        WORLD=world,
        BLOCK_N=block,
        FUSE_NORM=fuse,
        TWO_SHOT=two_shot,
        EACH_SLOT=EACH_SLOT,
        TRAP=not is_interpreted(x.device),
        SPIN_LIMIT=SPIN_LIMIT,
        PHASES=PHASES,
        BITS_TY=tl.int16 if wide16 else tl.int32,
        MARK=EMPTY16 if wide16 else EMPTY32,
        SEND_AS=0 if wide16 else -(1 << 31),
        USE_PDL=use_pdl,
        num_warps=row_num_warps(block),
        **({"launch_pdl": True} if use_pdl else {}),
    )
