"""Decode attention at small batches, as the engine's decode graphs run it: the block table is as
wide as max_model_len (the split count comes from shapes alone), the contexts are shorter.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/tune_decode.py --out x.json

Times the Triton decode (kernel + split reduce) for several split counts against the launcher's
default, CUDA-graph medians (warm L2, GPU time alone), Qwen3-0.6B / Llama-3-8B heads, bf16.
Then batches that fill the GPU (Qwen3-0.6B heads x 256 sequences, contexts uniform in
[100, 2048] as in offline throughput; Llama-3-8B heads x 64 x 4096): per-sequence splits
(num_splits, min_split_len) against no split.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import torch

# Large-batch sweeps: (num_splits, min_split_len) and (KV tile, warps, stages) of unsplit decode.
LARGE_SPLITS = ((None, None), (1, None), (2, 512), (4, 256), (4, 512), (8, 256))
LARGE_TILES = (
    (64, 2, 3), (64, 4, 3), (64, 2, 4), (32, 2, 4), (128, 4, 2), (128, 4, 3), (128, 8, 2),
)  # fmt: skip


def decode_batch(num_heads, num_kv_heads, lens, width, block_size, head_dim):
    """The op's arguments for one decode row per sequence of the given context lengths over
    shuffled pages, and the torch reference's output."""
    from atom_kernels.backends.torch import attention as reference

    batch = len(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = batch * width
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
    tables = torch.randperm(num_blocks, device="cuda", generator=g).view(batch, width)
    tables = tables.to(torch.int32)
    seq_lens = lens.to(torch.int32).cuda()
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, num_heads, head_dim, generator=g, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    call = (q, k_cache, v_cache, tables, seq_lens, qsl, 1 / math.sqrt(head_dim))
    call = (*call, None, None, None, None, None, out)
    return call, reference.paged_attention(*call[:-1], None)


def time_decode(attention, call, expected, row, splits, min_split_len, config=None) -> dict:
    from triton.testing import do_bench_cudagraph

    def run():
        attention.paged_attention(
            *call, max_query_len=1, num_splits=splits, min_split_len=min_split_len, config=config
        )

    run()
    out = call[-1]
    row["max_err"] = (out.float() - expected.float()).abs().max().item()
    row["us"] = do_bench_cudagraph(run) * 1e3
    row["splits"] = splits or "default"
    row["min_split_len"] = min_split_len
    print(", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return row


def main() -> None:
    from atom_kernels.backends.triton import attention

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--default-only", action="store_true", help="small batches: the default split only"
    )
    parser.add_argument(
        "--large-tiles", action="store_true", help="large batches: tiles instead of splits"
    )
    args = parser.parse_args()
    block_size, head_dim = 16, 128
    width = args.max_model_len // block_size
    rows = []
    for heads in () if args.large_tiles else ((16, 8), (32, 8)):
        for batch in (1, 8):
            for context in (512, 1024, 2048):
                num_heads, num_kv_heads = heads
                lens = torch.full((batch,), context, dtype=torch.int32)
                call, expected = decode_batch(
                    num_heads, num_kv_heads, lens, width, block_size, head_dim
                )
                for splits in (None,) if args.default_only else (None, 4, 8, 16, 32, 64):
                    row = dict(heads=f"{num_heads}/{num_kv_heads}", batch=batch, context=context)
                    rows.append(time_decode(attention, call, expected, row, splits, None))
    g = torch.Generator().manual_seed(1)
    large = [
        ((16, 8), 256, (100 + torch.rand(256, generator=g) * 1948).int()),
        ((32, 8), 64, torch.full((64,), 4096, dtype=torch.int32)),
    ]
    if args.large_tiles:  # unsplit large batches: the KV tile, warps and stages
        large = [
            ((32, 8), 256, (512 + torch.rand(256, generator=g) * 256).int()),
            ((16, 8), 256, (100 + torch.rand(256, generator=g) * 1948).int()),
            ((32, 8), 64, torch.full((64,), 1024, dtype=torch.int32)),
        ]
    for (num_heads, num_kv_heads), batch, lens in large:
        call, expected = decode_batch(num_heads, num_kv_heads, lens, width, block_size, head_dim)
        base = attention.default_config(head_dim, torch.bfloat16, False, num_heads // num_kv_heads)
        if args.large_tiles:
            variants = [(n, w, s) for n, w, s in LARGE_TILES]
        else:
            variants = [(splits, min_len, None) for splits, min_len in LARGE_SPLITS]
        for a, b, c in variants:
            row = dict(heads=f"{num_heads}/{num_kv_heads}", batch=batch, context="varied")
            row["tokens"] = int(lens.sum())
            if args.large_tiles:
                config = replace(
                    base,
                    decode_block_n_large=a,
                    decode_num_warps_large=b,
                    decode_num_stages_large=c,
                )
                row["tile"] = f"{a} tokens, {b} warps, {c} stages"
                row = time_decode(attention, call, expected, row, None, None, config)
            else:
                row = time_decode(attention, call, expected, row, a, b)
            row["kv_GBps"] = row["tokens"] * num_kv_heads * head_dim * 2 * 2 / row["us"] / 1e3
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
