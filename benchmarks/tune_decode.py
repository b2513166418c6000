"""Decode attention at small batches, as the engine's decode graphs run it: the block table is as
wide as max_model_len (the split count comes from shapes alone), the contexts are shorter.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/tune_decode.py --out x.json

Times the Triton decode (kernel + split reduce) for several split counts against the launcher's
default, CUDA-graph medians (warm L2, GPU time alone), Qwen3-0.6B / Llama-3-8B heads, bf16.
"""

from __future__ import annotations

import argparse
import json
import math

import torch


def main() -> None:
    from triton.testing import do_bench_cudagraph

    from atom_kernels.backends.torch import attention as reference
    from atom_kernels.backends.triton import attention

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    block_size, head_dim = 16, 128
    width = args.max_model_len // block_size
    rows = []
    for heads in ((16, 8), (32, 8)):
        for batch in (1, 8):
            for context in (512, 1024, 2048):
                num_heads, num_kv_heads = heads
                g = torch.Generator(device="cuda").manual_seed(0)
                num_blocks = batch * width
                shape = (num_blocks, block_size, num_kv_heads, head_dim)
                k_cache = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
                v_cache = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
                tables = torch.randperm(num_blocks, device="cuda", generator=g).view(batch, width)
                tables = tables.to(torch.int32)
                seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
                qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
                q = torch.randn(batch, num_heads, head_dim, generator=g, device="cuda")
                q = q.to(torch.bfloat16)
                out = torch.empty_like(q)
                call = (q, k_cache, v_cache, tables, seq_lens, qsl, 1 / math.sqrt(head_dim))
                call = (*call, None, None, None, None, None, out)
                expected = reference.paged_attention(*call[:-1], None)
                for splits in (None, 4, 8, 16, 32, 64):

                    def run(splits=splits, call=call):
                        attention.paged_attention(*call, max_query_len=1, num_splits=splits)

                    run()
                    err = (out.float() - expected.float()).abs().max().item()
                    us = do_bench_cudagraph(run) * 1e3
                    row = dict(
                        heads=f"{num_heads}/{num_kv_heads}", batch=batch, context=context,
                        splits=splits or "default", us=us, max_err=err,
                    )  # fmt: skip
                    rows.append(row)
                    print(
                        f"H={row['heads']} B={batch} ctx={context} splits={row['splits']}: "
                        f"{us:.2f} us (err {err:.1e})",
                        flush=True,
                    )
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
