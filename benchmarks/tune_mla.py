"""MLA attention on a GPU: prefill TFLOP/s and a decode tile sweep (issue 17, item 3).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/tune_mla.py --out x.json

DeepSeek-V3's latent cache (L 512 + R 64 a token, page 16), bf16 queries, 128 heads (one rank)
and 16 (TP 8), the cache bf16 or fp8 (per-tensor scale).
- ``prefill``: ``mla_paged_attention`` over whole prompts (causal 4096 tokens; 2048 new tokens over
  a 6144-token prefix), 128 and 16 heads, under the default tiles: TFLOP/s against the bf16
  matmul rate of the same run (the FLOPs: scores over L + R and the weighted sum over L, causal
  pairs only).
- ``decode``: batch 64 and 128 at a 4096-token context under each ``DECODE_TILES`` candidate
  (decode_block_h, decode_block_n, warps, stages), each checked against the default tiles' output
  before it is timed; the default first. The rate: the larger of cache bytes over the copy
  bandwidth and FLOPs over the bf16 matmul rate.
Every op runs as a CUDA graph with the L2 flushed before each call (``kernels.cold_graph_ms``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import torch
from kernels import against_first, cold_graph_ms, measure_roofline

LATENT, ROPE, PAGE = 512, 64, 16
SCALE = (128 + ROPE) ** -0.5  # DeepSeek-V3's qk_nope 128 + qk_rope 64
PREFILL_CASES = ((4096, 0), (2048, 6144))  # (new tokens, prefix tokens), one sequence
DECODE_CASES = ((64, 4096), (128, 4096))  # (batch, context)
HEADS = (128, 16)
# (decode_block_h, decode_block_n, num_warps, num_stages); block_h above the head count is cut
DECODE_TILES = (
    (64, 64, 8, 2),
    (64, 64, 8, 3),
    (64, 32, 4, 3),
    (64, 32, 8, 4),
    (64, 128, 8, 2),
    (32, 64, 4, 3),
    (16, 64, 4, 2),
    (16, 64, 4, 3),
    (16, 128, 4, 2),
    (16, 32, 4, 4),
    (16, 64, 8, 3),
)


def mla_flops(pairs: int, heads: int) -> float:
    return 2.0 * pairs * heads * (2 * LATENT + ROPE)


def cache_and_tables(batch: int, context: int, g: torch.Generator):
    blocks_per_seq = -(-context // PAGE)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, device="cuda", generator=g).int().view(batch, -1)
    cache = torch.randn(num_blocks, PAGE, LATENT + ROPE, generator=g, device="cuda")
    return cache.to(torch.bfloat16), tables.contiguous()


def run_prefill(roof: dict, g: torch.Generator, rows: list) -> None:
    from atom_kernels.backends.triton import mla_attention

    for new, prefix in PREFILL_CASES:
        total = new + prefix
        cache, tables = cache_and_tables(1, total, g)
        seq_lens = torch.tensor([total], dtype=torch.int32, device="cuda")
        qsl = torch.tensor([0, new], dtype=torch.int32, device="cuda")
        pairs = new * prefix + new * (new + 1) // 2
        for heads in HEADS:
            q = torch.randn(new, heads, LATENT + ROPE, generator=g, device="cuda")
            q = q.to(torch.bfloat16)
            q_latent, q_pe = q[..., :LATENT], q[..., LATENT:]
            out = torch.empty(new, heads, LATENT, dtype=torch.bfloat16, device="cuda")

            fn = functools.partial(
                mla_attention.mla_paged_attention,
                *(q_latent, q_pe, cache, tables, seq_lens, qsl, SCALE, out),
                max_query_len=new,
            )
            ms = cold_graph_ms(fn)
            tflops = mla_flops(pairs, heads) / (ms / 1e3) / 1e12
            row = dict(group="prefill", new_tokens=new, prefix=prefix, heads=heads, ms=ms,
                       tflops=tflops, of_matmul=tflops / roof["matmul_TFLOPs"])  # fmt: skip
            rows.append(row)
            print(f"prefill H={heads} {new} over {prefix}: {ms:.3f} ms {tflops:.0f} TFLOP/s "
                  f"({row['of_matmul']:.0%} of bf16 matmul)", flush=True)  # fmt: skip
        del cache, tables
        torch.cuda.empty_cache()


def run_decode(roof: dict, g: torch.Generator, rows: list, budget_end: float) -> None:
    from atom_kernels.backends.triton import mla_attention

    for batch, context in DECODE_CASES:
        cache_bf16, tables = cache_and_tables(batch, context, g)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        caches = {
            "bf16": (cache_bf16, None),
            "fp8": (cache_bf16.to(torch.float8_e4m3fn), torch.ones(1, device="cuda")),
        }
        for heads in HEADS:
            q = torch.randn(batch, heads, LATENT + ROPE, generator=g, device="cuda")
            q = q.to(torch.bfloat16)
            q_latent, q_pe = q[..., :LATENT], q[..., LATENT:]
            default = mla_attention.default_config(LATENT, torch.bfloat16, False, heads)
            tiles = [(default.decode_block_h, default.decode_block_n,
                      default.decode_num_warps, default.decode_num_stages)]  # fmt: skip
            tiles += [t for t in DECODE_TILES if t[0] <= max(heads, 16) and t not in tiles]
            for cache_name, (cache, kv_scale) in caches.items():
                nbytes = batch * context * (LATENT + ROPE) * cache.element_size()
                flops = mla_flops(batch * context, heads)
                roof_ms = max(nbytes / roof["copy_GBps"] / 1e6, flops / roof["matmul_TFLOPs"] / 1e9)
                expected = None
                for block_h, block_n, warps, stages in tiles:
                    if time.monotonic() > budget_end:
                        print("decode: out of time", flush=True)
                        return
                    config = dataclasses.replace(
                        default, decode_block_h=block_h, decode_block_n=block_n,
                        decode_num_warps=warps, decode_num_stages=stages,
                    )  # fmt: skip
                    out = torch.empty(batch, heads, LATENT, dtype=torch.bfloat16, device="cuda")

                    fn = functools.partial(
                        mla_attention.mla_paged_attention,
                        *(q_latent, q_pe, cache, tables, seq_lens, qsl, SCALE, out),
                        kv_scale=kv_scale, max_query_len=1, config=config,
                    )  # fmt: skip
                    tile = [block_h, block_n, warps, stages]
                    row = dict(group="decode", batch=batch, context=context, heads=heads,
                               cache=cache_name, tile=tile)  # fmt: skip
                    try:
                        expected, row["max_err_vs_default"] = against_first(
                            expected, fn().float(), 2e-2, "the default tiles"
                        )
                        ms = cold_graph_ms(fn)
                    except Exception as exc:  # a tile that does not fit: the rest still run
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        rows.append(row)
                        print(f"decode B={batch} H={heads} {cache_name} {row['tile']}: "
                              f"{row['error']}", flush=True)  # fmt: skip
                        continue
                    row.update(ms=ms, of_roofline=roof_ms / ms,
                               bound="bytes" if nbytes / roof["copy_GBps"] / 1e6 >= roof_ms
                               else "flops")  # fmt: skip
                    rows.append(row)
                    print(f"decode B={batch} ctx={context} H={heads} {cache_name} "
                          f"{row['tile']}: {ms * 1e3:.1f} us ({row['of_roofline']:.0%} of "
                          f"{row['bound']})", flush=True)  # fmt: skip
        del caches, cache_bf16
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", choices=("prefill", "decode"), nargs="*")
    parser.add_argument("--budget-s", type=float, default=240)
    args = parser.parse_args()
    start = time.monotonic()
    roof = measure_roofline(torch)
    print(f"copy {roof['copy_GBps']:.0f} GB/s, bf16 matmul {roof['matmul_TFLOPs']:.0f} TFLOP/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    groups = args.only or ("prefill", "decode")
    if "prefill" in groups:
        run_prefill(roof, g, rows)
    if "decode" in groups:
        run_decode(roof, g, rows, start + args.budget_s)
    with open(args.out, "w") as f:
        json.dump(
            {"benchmark": "tune_mla", "device": torch.cuda.get_device_name(),
             "torch": torch.__version__, "roofline": roof, "rows": rows},
            f, indent=1,
        )  # fmt: skip


if __name__ == "__main__":
    main()
