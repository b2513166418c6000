"""Triton kernels vs the torch reference (and torch SDPA for attention) at Llama-3-8B shapes.

Run on a GPU from the repo root:

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python benchmarks/kernels.py --out $OUT/kernels.json

Measures, in the same run, the roofline of the device: device-to-device copy bandwidth (read +
write of a 2 GiB buffer) and the bf16 matmul rate (8192^3). Each op is timed three ways: ``ms``,
``triton.testing.do_bench`` (eager, median, L2 flushed between calls, host launch overhead
included); and, for ops that can be captured (not the torch attention reference, which syncs),
``ms_graph`` (``do_bench_cudagraph``: GPU time alone, warm L2) and ``ms_cold`` (CUDA graph with
the L2 flushed before each call: GPU time alone, cold L2). Rates come from the cold graph time
where there is one: achieved GB/s (the bytes the op must move at least) or TFLOP/s (prefill
attention), and that as a fraction of the measured roofline. Writes JSON to --out and prints a
table last.

B = sequences, T = tokens, H / Hk = query / kv heads, D = head dim.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

# Llama-3-8B
HIDDEN, INTERMEDIATE = 4096, 14336
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK_SIZE = 16
DECODE_BATCHES = (1, 8, 64)
DECODE_CONTEXTS = (1024, 4096, 8192)
PREFILL_TOKENS = 4096  # the prefill target: 4096 tokens, causal
ELEMENTWISE_TOKENS = (64, 2048, 8192)  # the norm / rotary / activation target: 8192


@dataclass
class Result:
    op: str
    shape: str
    impl: str  # "triton" | "torch" | "sdpa"
    ms: float  # eager median, L2 flushed before each call (host launch overhead included)
    ms_graph: float | None = None  # CUDA-graph median, L2 warm (GPU time alone)
    ms_cold: float | None = None  # CUDA-graph, L2 flushed before each call (GPU time alone)
    bytes: float = 0.0
    flops: float = 0.0
    extra: dict = field(default_factory=dict)

    def best_ms(self) -> float:
        """The time rates are computed from: GPU time with a cold L2 when measured (a warm L2
        holds inputs under ~50 MB and would beat the DRAM roofline)."""
        for ms in (self.ms_cold, self.ms_graph, self.ms):
            if ms is not None:
                return ms
        raise ValueError("no time")


# --- pure helpers (tested in packages/atom-kernels/tests/test_triton_benchmark.py) -------------


def causal_pairs(q_len: int, seq_len: int, window: int | None = None) -> int:
    """(query row, key) pairs a causal (windowed) attention of q_len rows over seq_len keys
    computes: row i sits at position seq_len - q_len + i and sees keys j <= pos (pos - j < window).
    """
    total = 0
    for pos in range(seq_len - q_len, seq_len):
        visible = pos + 1
        if window is not None:
            visible = min(visible, window)
        total += visible
    return total


def attention_flops(
    q_lens: list[int], seq_lens: list[int], num_heads: int, head_dim: int, head_dim_v: int
) -> float:
    """Matmul FLOPs of causal attention: QK^T and PV over the visible pairs, per head."""
    pairs = sum(causal_pairs(q, s) for q, s in zip(q_lens, seq_lens, strict=True))
    return 2.0 * pairs * num_heads * (head_dim + head_dim_v)


def attention_bytes(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_itemsize: int,
    kv_itemsize: int,
) -> float:
    """Bytes attention must move at least: every KV entry of every sequence once, the queries
    read and the outputs written once."""
    kv = sum(seq_lens) * num_kv_heads * 2 * head_dim * kv_itemsize
    rows = sum(q_lens) * num_heads * head_dim * q_itemsize
    return float(kv + 2 * rows)


def rate(result: Result) -> tuple[str, float]:
    """("GB/s", value) for memory-bound results, ("TFLOP/s", value) when FLOPs are given."""
    seconds = result.best_ms() / 1e3
    if result.flops:
        return "TFLOP/s", result.flops / seconds / 1e12
    return "GB/s", result.bytes / seconds / 1e9


def roofline_fraction(result: Result, copy_gbps: float, matmul_tflops: float) -> float:
    unit, value = rate(result)
    return value / (matmul_tflops if unit == "TFLOP/s" else copy_gbps)


def format_table(rows: list[dict]) -> str:
    """Fixed-width text table of result rows (dicts with the same keys)."""
    if not rows:
        return ""
    keys = list(rows[0])
    cells = [[_cell(row[k]) for k in keys] for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# --- timing ----------------------------------------------------------------------------------


def _bench(fn: Callable[[], object], graph: bool) -> tuple[float, float | None, float | None]:
    """(eager ms, CUDA-graph ms with a warm L2, CUDA-graph ms with a cold L2); the graph times
    only when ``graph`` (ops that sync the host, like the torch attention reference, cannot be
    captured)."""
    from triton.testing import do_bench, do_bench_cudagraph

    eager = float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    if not graph:
        return eager, None, None
    warm = float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return eager, warm, cold_graph_ms(fn)


def against_first(expected, result, tolerance: float, what: str):
    """(expected, error): the first candidate's ``result`` becomes ``expected``; a later one
    more than ``tolerance`` (max |difference|) from it raises AssertionError naming ``what``."""
    if expected is None:
        expected = result
    err = (result - expected).abs().max().item()
    if err > tolerance:
        raise AssertionError(f"differs from {what} by {err}")
    return expected, err


def cold_graph_ms(
    fn: Callable[[], object], calls: int = 10, replays: int = 15, flush_l2: bool = True,
    flush_by: str = "write",
) -> float:  # fmt: skip
    """GPU time of ``fn`` with the L2 flushed before each call: one CUDA graph of ``calls`` x
    (flush 256 MB, fn) against one of the flushes alone, median over replays, difference / calls.
    ``flush_l2=False``: warm L2, the graph of ``calls`` x fn alone (median / calls).
    ``flush_by``: ``write`` (zero the 256 MB: L2 left holding dirty lines, whose write-back
    shares DRAM with ``fn``'s reads) or ``read`` (sum them: clean lines, as a decode step's GEMM
    meets them; session 35's load floor).
    """
    import statistics

    import torch

    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    flush_words, sink = flush.view(torch.float32), flush.new_empty((), dtype=torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    medians = [0.0, 0.0]  # with fn, flushes alone
    for i, with_fn in enumerate((True, False) if flush_l2 else (True,)):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                if flush_l2 and flush_by == "read":
                    torch.sum(flush_words, dim=0, out=sink)
                elif flush_l2:
                    flush.zero_()
                if with_fn:
                    fn()
        graph.replay()
        times = []
        for _ in range(replays):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        medians[i] = statistics.median(times)
    return max(medians[0] - medians[1], 0.0) / calls


def measure_roofline(torch) -> dict:
    """Device-to-device copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s)."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=200, return_mode="median")
    copy_gbps = 2 * src.numel() * src.element_size() / (copy_ms / 1e3) / 1e9
    src = dst = None  # free 4 GiB before the matmul
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    mm_ms = do_bench(lambda: a @ b, warmup=10, rep=200, return_mode="median")
    return {
        "copy_GBps": copy_gbps,
        "copy_ms": copy_ms,
        "matmul_TFLOPs": 2 * n**3 / (mm_ms / 1e3) / 1e12,
        "matmul_ms": mm_ms,
    }


# --- op benchmarks ---------------------------------------------------------------------------


def bench_elementwise(torch, impls) -> list[Result]:
    results = []
    dt = torch.bfloat16
    for tokens in ELEMENTWISE_TOKENS:
        x = torch.randn(tokens, HIDDEN, dtype=dt, device="cuda")
        residual, weight = torch.randn_like(x), torch.rand(HIDDEN, dtype=dt, device="cuda")
        gate_up = torch.randn(tokens, 2 * INTERMEDIATE, dtype=dt, device="cuda")
        item = x.element_size()
        cases = {
            "rms_norm": (lambda m, x=x, w=weight: m.rms_norm(x, w, 1e-5), 2 * x.numel() * item),
            "fused_add_rms_norm": (
                lambda m, x=x, r=residual, w=weight: m.fused_add_rms_norm(x, r, w, 1e-5),
                4 * x.numel() * item,
            ),
            "silu_and_mul": (
                lambda m, g=gate_up: m.silu_and_mul(g),
                1.5 * gate_up.numel() * item,
            ),
        }
        for op, (call, nbytes) in cases.items():
            for impl, module in impls.items():
                ms, ms_graph, ms_cold = _bench(
                    lambda call=call, module=module: call(module), impl == "triton"
                )
                shape = f"T={tokens} N={HIDDEN if op != 'silu_and_mul' else INTERMEDIATE}"
                results.append(Result(op, shape, impl, ms, ms_graph, ms_cold, bytes=nbytes))
    return results


def bench_rotary_and_cache(torch, impls, rope_cache) -> list[Result]:
    results = []
    dt, tokens = torch.bfloat16, ELEMENTWISE_TOKENS[-1]
    qkv = torch.randn(tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=dt, device="cuda")
    q = qkv[:, : NUM_HEADS * HEAD_DIM].view(tokens, NUM_HEADS, HEAD_DIM)
    k = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM]
    k = k.view(tokens, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dt, device="cuda")
    positions = torch.arange(tokens, device="cuda")
    rope_bytes = 2 * (q.numel() + k.numel()) * 2 + tokens * HEAD_DIM * 4
    num_blocks = 4 * tokens // BLOCK_SIZE
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:tokens]
    for impl, module in impls.items():
        ms, ms_graph, ms_cold = _bench(
            lambda module=module: module.rotary_embedding(positions, q, k, rope_cache, True),
            impl == "triton",
        )
        shape = f"T={tokens} H={NUM_HEADS} Hk={NUM_KV_HEADS} D={HEAD_DIM}"
        results.append(
            Result("rotary_embedding", shape, impl, ms, ms_graph, ms_cold, bytes=rope_bytes)
        )
        for cache_dtype, scale in ((dt, None), (torch.float8_e4m3fn, 0.05)):
            shape_c = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
            kc = torch.zeros(shape_c, dtype=cache_dtype, device="cuda")
            vc = torch.zeros_like(kc)
            nbytes = 2 * k.numel() * (2 + kc.element_size())

            def write(module=module, kc=kc, vc=vc, scale=scale):
                module.reshape_and_cache(k, v, kc, vc, slots, scale, scale)

            ms, ms_graph, ms_cold = _bench(write, impl == "triton")
            name = f"T={tokens} Hk={NUM_KV_HEADS} D={HEAD_DIM} cache={str(cache_dtype)[6:]}"
            results.append(
                Result("reshape_and_cache", name, impl, ms, ms_graph, ms_cold, bytes=nbytes)
            )
    return results


def _paged(torch, seq_lens, q_lens, kv_dtype):
    """Query, paged K/V caches (blocks in shuffled order) and metadata for a batch."""
    num_blocks_per_seq = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(num_blocks_per_seq)
    perm = torch.randperm(num_blocks, device="cuda").int()
    max_blocks = max(num_blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(num_blocks_per_seq):
        block_tables[b, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, device="cuda").to(kv_dtype)
    value_cache = torch.randn(shape, device="cuda").to(kv_dtype)
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device="cuda")
    return query, key_cache, value_cache, block_tables, seq_lens_t, qsl_t


def bench_attention(torch, impls) -> list[Result]:
    import torch.nn.functional as F

    results = []
    scale = 1 / math.sqrt(HEAD_DIM)
    cases = [("prefill", [2048], [2048], torch.bfloat16)]
    cases.append(("prefill", [PREFILL_TOKENS], [PREFILL_TOKENS], torch.bfloat16))
    cases.append(("prefill+prefix", [PREFILL_TOKENS + 6144], [PREFILL_TOKENS], torch.bfloat16))
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            cases.append((f"decode B={batch}", [context] * batch, [1] * batch, torch.bfloat16))
    cases.append(("decode B=64 fp8", [4096] * 64, [1] * 64, torch.float8_e4m3fn))
    for name, seq_lens, q_lens, kv_dtype in cases:
        query, kc, vc, bt, sl, qsl = _paged(torch, seq_lens, q_lens, kv_dtype)
        kv_scale = 1.0 if kv_dtype != torch.bfloat16 else None
        args = (query, kc, vc, bt, sl, qsl, scale, None, None, None, kv_scale, kv_scale, None)
        shape = f"{name} ctx={seq_lens[0]} q={q_lens[0]}"
        nbytes = attention_bytes(
            q_lens, seq_lens, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 2, kc.element_size()
        )
        flops = attention_flops(q_lens, seq_lens, NUM_HEADS, HEAD_DIM, HEAD_DIM)
        is_prefill = q_lens[0] > 1
        for impl, module in impls.items():
            if impl == "torch" and len(seq_lens) * max(seq_lens) > 64 * 4096:
                continue  # the per-sequence dense reference: minutes, not a peer at this size
            ms, ms_graph, ms_cold = _bench(
                lambda module=module, args=args: module.paged_attention(*args), impl == "triton"
            )
            results.append(
                Result(
                    "paged_attention", shape, impl, ms, ms_graph, ms_cold,
                    bytes=nbytes, flops=flops if is_prefill else 0.0,
                )
            )  # fmt: skip
        if kv_dtype == torch.bfloat16:  # peer: SDPA (flash) over dense, unpaged K/V
            batch = len(seq_lens)
            q = query.view(batch, q_lens[0], NUM_HEADS, HEAD_DIM).transpose(1, 2)
            k = torch.randn(
                batch, NUM_KV_HEADS, seq_lens[0], HEAD_DIM, dtype=q.dtype, device="cuda"
            )
            v = torch.randn_like(k)

            mask = None
            if is_prefill and q.shape[2] != k.shape[2]:  # a prefix: bottom-right causal mask
                rows = torch.arange(q.shape[2], device="cuda")[:, None] + k.shape[2] - q.shape[2]
                mask = torch.arange(k.shape[2], device="cuda")[None, :] <= rows

            def sdpa(q=q, k=k, v=v, mask=mask, causal=is_prefill and mask is None):
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True
                )

            ms, ms_graph, ms_cold = _bench(sdpa, True)
            results.append(
                Result(
                    "paged_attention", shape, "sdpa", ms, ms_graph, ms_cold,
                    bytes=nbytes, flops=flops if is_prefill else 0.0,
                )
            )  # fmt: skip
    return results


def bench_decode_tail(torch, impls) -> list[Result]:
    """Batch-1 / 8 projections of the Llama-3-8B shape (the skinny GEMM against cuBLAS) and
    sampling 256 rows of the Qwen3 vocabulary at temperature 1 (fused against torch)."""
    results = []
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096)}
    shapes.update({"down": (4096, 14336), "lm_head": (128256, 4096)})
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        for rows in (1, 8):
            x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            nbytes = w.numel() * 2 + (x.numel() + rows * n) * 2
            for impl, module in impls.items():
                ms, ms_graph, ms_cold = _bench(
                    lambda module=module, x=x, w=w: module.linear(x, w, None), True
                )
                shape = f"{name} M={rows} N={n} K={k}"
                results.append(Result("linear", shape, impl, ms, ms_graph, ms_cold, bytes=nbytes))
        del w
    logits = torch.randn(256, 151936, device="cuda").to(torch.bfloat16)
    temperature = torch.ones(256, device="cuda")
    for impl, module in impls.items():
        ms, ms_graph, ms_cold = _bench(
            lambda module=module: module.sample(logits, temperature, None, None, None, None, 0),
            True,
        )
        shape = "B=256 V=151936 T=1.0"
        results.append(
            Result("sample", shape, impl, ms, ms_graph, ms_cold, bytes=logits.numel() * 2)
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON results file")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated groups: elementwise,rotary_cache,attention,decode_tail",
    )
    args = parser.parse_args(argv)

    import torch
    import triton

    import atom_kernels as ak
    from atom_kernels.backends.torch import activation, attention, cache, norm, rotary
    from atom_kernels.backends.torch import linear as torch_linear
    from atom_kernels.backends.torch import sampling as torch_sampling
    from atom_kernels.backends.triton import custom_ops

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA/ROCm GPU")
    torch.manual_seed(0)

    class Reference:  # the torch backend, with the same call shapes as custom_ops
        rms_norm = staticmethod(norm.rms_norm)
        fused_add_rms_norm = staticmethod(norm.fused_add_rms_norm)
        silu_and_mul = staticmethod(activation.silu_and_mul)
        rotary_embedding = staticmethod(rotary.rotary_embedding)
        reshape_and_cache = staticmethod(cache.reshape_and_cache)
        paged_attention = staticmethod(attention.paged_attention)
        linear = staticmethod(torch_linear.linear)
        sample = staticmethod(torch_sampling.sample)

    # custom_ops under the reference's names (linear and sample are plain functions there)
    ops = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")
    ops += ("reshape_and_cache", "paged_attention")
    triton_ops = SimpleNamespace(**{op: getattr(custom_ops, op) for op in ops})
    triton_ops.linear, triton_ops.sample = custom_ops.linear_op, custom_ops.sample_op
    impls = {"triton": triton_ops, "torch": Reference}
    groups = set(filter(None, args.only.split(","))) or {
        "elementwise", "rotary_cache", "attention", "decode_tail",
    }  # fmt: skip
    roofline = measure_roofline(torch)
    results: list[Result] = []
    if "elementwise" in groups:
        results += bench_elementwise(torch, impls)
    if "rotary_cache" in groups:
        rope_cache = ak.rope_cos_sin_cache(HEAD_DIM, 8192, 500000.0).cuda()
        results += bench_rotary_and_cache(torch, impls, rope_cache)
    if "attention" in groups:
        results += bench_attention(torch, impls)
    if "decode_tail" in groups:
        results += bench_decode_tail(torch, impls)

    rows = []
    for r in results:
        unit, value = rate(r)
        fraction = roofline_fraction(r, roofline["copy_GBps"], roofline["matmul_TFLOPs"])
        r.extra = {"unit": unit, "rate": value, "roofline_fraction": fraction}
        rows.append(
            {
                "op": r.op,
                "shape": r.shape,
                "impl": r.impl,
                "ms": r.ms,
                "ms_graph": r.ms_graph,
                "ms_cold": r.ms_cold,
                "rate": f"{value:.4g} {unit}",
                "of_roofline": f"{100 * fraction:.1f}%",
            }
        )
    report = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "hip": torch.version.hip,
            "python": platform.python_version(),
        },
        "shapes": "Llama-3-8B: hidden 4096, intermediate 14336, 32 q heads, 8 kv heads, D 128, "
        f"block size {BLOCK_SIZE}, bf16",
        "roofline": roofline,
        "results": [asdict(r) for r in results],
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(
        f"{report['device']}  torch {torch.__version__}  triton {triton.__version__}\n"
        f"roofline: copy {roofline['copy_GBps']:.0f} GB/s, "
        f"bf16 matmul {roofline['matmul_TFLOPs']:.0f} TFLOP/s"
    )
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
