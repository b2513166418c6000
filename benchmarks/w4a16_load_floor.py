"""What reading the W4A16 words alone costs, at the Llama-3-8B projections (issue 40 item 4): a
Triton kernel that only loads a W4A16 weight's int32 words in ROW_MMA's pattern (a program
BLOCK_N rows, a warp's load 512 contiguous bytes of one row, K split as ``wna16_config``'s
``fill`` splits it) and XORs them, next to the same bytes in other patterns. It bounds what any
loop of that access pattern can reach: if the loads alone run at ROW_MMA's ~48% of the copy rate,
the math is not what holds it there.

Patterns, each cold L2 twice (``kernels.cold_graph_ms``): after a written flush (as
quant_kernels.py times the GEMMs) and after a read one (``flush_by="read"``), beside the GEMM:
  ``rows B wW serial``: ROW_MMA's grid and loads, one tile a warp in flight (each XOR waits);
  ``rows B wW ahead``: the same, every tile of the program's K span issued before the first XOR;
  ``flat``: each program one contiguous span of words (16 KB), 16 or 64 bytes a thread a load;
  the ``big`` shape (512 MB of words): what the same loads reach when the launch's start and
  end weigh nothing;
  ``torch copy``: ``dst.copy_(words)`` (read and write: twice the bytes).

    python3 benchmarks/w4a16_load_floor.py --out $OUT/load-floor.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import triton
import triton.language as tl

from atom_kernels.backends.triton.int_quant_quad_mma import _row_scalar
from atom_kernels.backends.triton.int_quant_row_mma import _row_x_pairs

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "big": (262144, 4096),
}  # "big": 512 MB of words, what the same loads reach at length (calls 2-6 also had qkv, o)
# (BLOCK_N, warps, programs an SM for the K split, ahead) of the row patterns
ROW_CASES = ((8, 4, 8, False), (8, 4, 8, True), (16, 4, 8, False), (32, 8, 4, False))
WORDS = 128  # a row's words a tile (512 bytes: ROW_MMA's K tile)
ROW_WORDS = tl.constexpr(WORDS)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def rows_read(q_ptr, out_ptr, N, stride_qn, tiles_per_split, BLOCK_N: tl.constexpr,
              AHEAD: tl.constexpr, TILES: tl.constexpr):  # fmt: skip
    """ROW_MMA's loads: program (n, k) reads rows n * BLOCK_N.. of split k, a tile [BLOCK_N,
    128] words at a time; AHEAD: the split's TILES tiles issued before the first XOR."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    offs_w = tl.arange(0, ROW_WORDS)
    ptrs = q_ptr + rows[:, None] * stride_qn + pid_k * tiles_per_split * ROW_WORDS + offs_w[None, :]
    acc = tl.zeros([BLOCK_N, ROW_WORDS], dtype=tl.int32)
    if AHEAD:
        for t in tl.static_range(TILES):
            acc ^= tl.load(ptrs + t * ROW_WORDS)
    else:
        for t in range(tiles_per_split):
            acc ^= tl.load(ptrs + t * ROW_WORDS)
    tl.store(out_ptr + pid_k * N + rows, tl.reduce(acc, 1, _xor))


@triton.jit
def rows_read_plus(q_ptr, x_ptr, s_ptr, out_ptr, N, stride_qn, stride_sn, tiles_per_split,
                   BLOCK_N: tl.constexpr, X: tl.constexpr, SCALES: tl.constexpr,
                   PTX: tl.constexpr):  # fmt: skip
    """rows_read (serial) with ROW_MMA's other loads of a tile: ``X`` each word's 8 x (16 bytes,
    bf16 x of the whole K: L1 hits after the first warp), ``SCALES`` each word's group scale
    (2 bytes, groups of 128: a row's 8 a tile). ``PTX``: by ROW_MMA's own PTX loads
    (``int_quant_row_mma``: x as the MMAs' pairs, the scales one 16-bit load a thread's 4
    words), no layout conversion: exactly its loads; else by tl.load (Triton lays those out its
    own way and converts them)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    offs_w = tl.arange(0, ROW_WORDS)
    w0 = pid_k * tiles_per_split * ROW_WORDS
    ptrs = q_ptr + rows[:, None] * stride_qn + w0 + offs_w[None, :]
    acc = tl.zeros([BLOCK_N, ROW_WORDS], dtype=tl.int32)
    x_words = x_ptr.to(tl.pointer_type(tl.int32))
    x_ptrs = x_ptr.to(tl.pointer_type(tl.int64)) + offs_w * 2
    for t in range(tiles_per_split):
        words = tl.load(ptrs + t * ROW_WORDS)
        acc ^= words
        if X and PTX:
            xa, xb, xc, xd = _row_x_pairs(x_ptrs + (w0 + t * ROW_WORDS) * 2, words.shape, True)
            acc ^= xa ^ xb ^ xc ^ xd
        elif X:  # a word's x: 4 int32 (8 bf16)
            xw = tl.load(x_words + ((w0 + t * ROW_WORDS + offs_w) * 4)[:, None]
                         + tl.arange(0, 4)[None, :])  # fmt: skip
            acc ^= tl.reduce(xw, 1, _xor)[None, :]
        if SCALES:
            groups = (w0 + t * ROW_WORDS + offs_w) // 16
            s_ptrs = s_ptr + rows[:, None] * stride_sn + groups[None, :]
            sc = _row_scalar(s_ptrs, True) if PTX else tl.load(s_ptrs)
            acc ^= sc.to(tl.int16, bitcast=True).to(tl.int32)
    tl.store(out_ptr + pid_k * N + rows, tl.reduce(acc, 1, _xor))


@triton.jit
def flat_read(q_ptr, out_ptr, SPAN: tl.constexpr, LOAD: tl.constexpr):
    """Program p reads words p * SPAN .. (p + 1) * SPAN - 1, LOAD words a load."""
    pid = tl.program_id(0)
    offs = tl.arange(0, LOAD)
    base = q_ptr + pid.to(tl.int64) * SPAN
    acc = tl.zeros([LOAD], dtype=tl.int32)
    for t in range(SPAN // LOAD):
        acc ^= tl.load(base + t * LOAD + offs)
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


def bench_shape(torch, name: str, n: int, k: int, roof: dict, sms: int) -> list[dict]:
    """The rows of one projection's words (random int32, [n, k / 8]): each pattern cold after
    a written flush (``cold_graph_ms``, as quant_kernels.py times the GEMMs) and after a read
    one (``flush_by="read"``); and the W4A16 GEMM itself (the default launch, and ROW_XSUM)
    on those words with bf16 scales, timed both ways."""
    from kernels import cold_graph_ms

    from atom_kernels.backends.triton import int_quant
    from atom_kernels.backends.triton.int_quant import split_for

    words = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    nbytes = words.numel() * 4
    k_tiles = k // 8 // WORDS
    results = []

    def row(impl, fn, moved=nbytes):
        for flush in ("written", "read"):
            ms = cold_graph_ms(fn, flush_by="read" if flush == "read" else "write")
            gbps = moved / ms / 1e6
            r = {"shape": name, "n": n, "k": k, "impl": impl, "flush": flush, "ms_cold": ms,
                 "bytes": moved, "GBps": gbps, "of_copy": gbps / roof["copy_GBps"]}  # fmt: skip
            results.append(r)
            print(f"{name:8s} {impl:34s} {flush:7s} {ms * 1e3:7.2f} us {gbps:6.0f} GB/s "
                  f"{r['of_copy']:5.0%} of copy", flush=True)  # fmt: skip

    if name != "big":
        scales = torch.full((n, k // 128), 0.4 * k**-0.5, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        moved = nbytes + scales.numel() * 2 + 2 * k + 2 * n
        for impl, xsum in (("w4a16 gemm (default)", False), ("w4a16 gemm ROW_XSUM", True)):

            def gemm(xsum=xsum, scales=scales, x=x):
                int_quant.ROW_XSUM_ENABLED = xsum
                try:
                    return int_quant.wna16_linear(x, words, scales, None, None, 4, None)
                finally:
                    int_quant.ROW_XSUM_ENABLED = False

            row(impl, gemm, moved)

    for block_n, warps, per_sm, ahead in ROW_CASES:
        tiles = triton.cdiv(n, block_n)
        per_split = triton.cdiv(k_tiles, split_for(tiles, k_tiles, sms, per_sm, fill=True))
        splits = triton.cdiv(k_tiles, per_split)
        if k_tiles % per_split:
            continue  # a ragged last split (the real kernel's is not)
        out = torch.empty(splits * n, dtype=torch.int32, device="cuda")

        def fn(block_n=block_n, warps=warps, ahead=ahead, tiles=tiles, splits=splits,
               per_split=per_split, out=out):  # fmt: skip
            rows_read[(tiles, splits)](words, out, n, words.stride(0), per_split,
                                       BLOCK_N=block_n, AHEAD=ahead, TILES=per_split,
                                       num_warps=warps, num_stages=1)  # fmt: skip

        row(f"rows {block_n} w{warps} fill{per_sm} split{splits} "
            f"{'ahead' if ahead else 'serial'}", fn)  # fmt: skip
    x = torch.randn(k, device="cuda").to(torch.bfloat16)
    scales = torch.randn(n, k // 128, device="cuda").to(torch.bfloat16)
    tiles = triton.cdiv(n, 8)
    per_split = triton.cdiv(k_tiles, split_for(tiles, k_tiles, sms, 8, fill=True))
    splits = triton.cdiv(k_tiles, per_split)
    out = torch.empty(splits * n, dtype=torch.int32, device="cuda")
    for x_on, s_on in ((True, False), (False, True), (True, True)):
        extra = ("+x" if x_on else "") + ("+scales" if s_on else "")
        for ptx in (False, True):

            def plus(x_on=x_on, s_on=s_on, ptx=ptx, out=out, splits=splits,
                     per_split=per_split):  # fmt: skip
                rows_read_plus[(tiles, splits)](words, x, scales, out, n, words.stride(0),
                                                scales.stride(0), per_split, BLOCK_N=8, X=x_on,
                                                SCALES=s_on, PTX=ptx, num_warps=4,
                                                num_stages=1)  # fmt: skip

            row(f"rows 8 w4 fill8 split{splits} serial {'PTX ' if ptx else ''}{extra}", plus)
    span = 4096  # 16 KB a program
    if words.numel() % span == 0:
        out = torch.empty(words.numel() // span, dtype=torch.int32, device="cuda")
        for warps, per_thread in ((4, 4), (8, 16)):  # words a thread a load

            def flat(warps=warps, per_thread=per_thread, out=out):
                flat_read[(words.numel() // span,)](words, out, SPAN=span,
                                                    LOAD=32 * per_thread * warps,
                                                    num_warps=warps)  # fmt: skip

            row(f"flat 16KB w{warps} {per_thread * 4}B a thread", flat)
    dst = torch.empty_like(words)
    row("torch copy (read + write)", lambda: dst.copy_(words), 2 * nbytes)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch
    from kernels import measure_roofline

    roof = measure_roofline(torch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for name, (n, k) in SHAPES.items():
        results += bench_shape(torch, name, n, k, roof, sms)
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps({"roofline": roof, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
