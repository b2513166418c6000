"""MLA decode on a GPU: how many splits of a sequence's context, and which tiles, at each head
count a deployment gives one rank (DeepSeek-V3 / Kimi-K2: 128 heads at TP 1 or DP attention, 32
at TP 4, 16 at TP 8) and each batch (1 to 256) and context (1K to 32K tokens).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/mla_splits.py --out x.json
    python benchmarks/mla_splits.py --smoke --out /tmp/x.json    # CPU (interpreter): checks only

Each shape times the launcher's own choice (``default``: ``choose_splits`` and
``default_config``), the same tiles at fixed split counts (1 to 64 splits a sequence, the split
length ceil(context / splits) rounded to the tile) and, for the head counts listed in
``TILES``, other tiles at those counts. Every candidate's output is checked against the default's
before it is timed (CUDA graph, L2 flushed before each call: ``kernels.cold_graph_ms``). The
roofline: the larger of the cache bytes over the copy bandwidth and the FLOPs over the bf16
matmul rate, both measured in the same run. ``--before`` times a frozen launch beside the default
(the tiles and split rule before session 26's change, ``before_launch``); ``--ab N`` times only
those two, alternated N times a shape; ``--against seqs-first`` makes that pair the default
and the same launch with the grid's sequences first (a sequence's head blocks apart: the launch
before session 27).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import torch
from tune_mla import LATENT, PAGE, ROPE, SCALE, mla_flops

HEADS = (128, 32, 16)
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (1024, 4096, 32768)
SPLITS = (1, 2, 4, 8, 16, 32, 64)
# Other (decode_block_h, decode_block_n, num_warps, num_stages) a head count tries; each compiles
# for sm_90 under Triton 3.6 without spills in its main loop (benchmarks/README.md).
TILES = {
    128: ((64, 32, 8, 3),),
    32: ((32, 64, 8, 2), (32, 32, 8, 4)),
    16: ((16, 64, 8, 2), (16, 32, 4, 3)),
}
# The launch before session 26's change: MlaConfig decode tiles and the split rule
# (num_splits = min(sms // programs, cdiv(table tokens, 512), 64), splits of >= 512 tokens).
BEFORE_MIN_SPLIT = 512


def before_launch(heads: int, batch: int, context: int, default, sms: int) -> dict:
    """The launch arguments the launcher chose before session 26 (see BEFORE_MIN_SPLIT)."""
    from atom_kernels.backends.triton.attention import MAX_SPLITS

    block_h = min(max(16, 1 << (heads - 1).bit_length()), 64)
    block_n = 64
    config = dataclasses.replace(
        default, decode_block_h=block_h, decode_block_n=block_n,
        decode_num_warps=8 if block_h >= 64 else 4, decode_num_stages=2,
    )  # fmt: skip
    programs = batch * -(-heads // block_h)
    num_splits = min(sms // programs, -(-context // BEFORE_MIN_SPLIT), MAX_SPLITS)
    if num_splits <= 1:
        return dict(config=config, num_splits=1, min_split_len=-(-context // block_n) * block_n)
    return dict(config=config, num_splits=num_splits, min_split_len=BEFORE_MIN_SPLIT)


def make_inputs(batch: int, context: int, heads: int, device: str, g: torch.Generator):
    blocks_per_seq = -(-context // PAGE)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=g, device=device).int().view(batch, -1)
    cache = torch.randn(num_blocks, PAGE, LATENT + ROPE, generator=g, device=device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(batch, heads, LATENT + ROPE, generator=g, device=device).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return cache.to(dtype), tables.contiguous(), q, lens, qsl


def candidates(
    heads: int, batch: int, context: int, default, sms: int, before: bool, ab_rounds: int = 0,
    against: str = "before",
):  # fmt: skip
    """(name, launch keyword arguments) of one shape: the default first. ``ab_rounds``: only the
    default and ``against`` (BEFORE, or ``seqs-first``: the default with the grid's sequences
    first), alternated that many times."""
    if ab_rounds:
        if against == "seqs-first":
            off = dataclasses.replace(default, decode_head_blocks_first=False)
            other = ("seqs first", dict(config=off))
        else:
            other = ("before", before_launch(heads, batch, context, default, sms))
        return [("default", {}), other] * ab_rounds
    out = [("default", {})]
    if before:
        out.append(("before", before_launch(heads, batch, context, default, sms)))
    tiles = [None, *TILES.get(heads, ())]
    for tile in tiles:
        config = default
        if tile is not None:
            config = dataclasses.replace(
                default, decode_block_h=tile[0], decode_block_n=tile[1],
                decode_num_warps=tile[2], decode_num_stages=tile[3],
            )  # fmt: skip
        for splits in SPLITS:
            if (context + splits - 1) // splits < config.decode_block_n:
                continue  # shorter than one tile
            name = f"{'default tiles' if tile is None else list(tile)} x{splits}"
            out.append((name, dict(config=config, num_splits=splits,
                                   min_split_len=config.decode_block_n)))  # fmt: skip
    return out


def run(args) -> dict:
    from kernels import against_first

    from atom_kernels.backends.triton import mla_attention
    from atom_kernels.backends.triton.common import num_sms

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    if cuda:
        from kernels import cold_graph_ms, measure_roofline

        roof = measure_roofline(torch)
        print(f"copy {roof['copy_GBps']:.0f} GB/s, bf16 matmul {roof['matmul_TFLOPs']:.0f} TFLOP/s")
    else:
        roof = None
    heads_list = args.heads or ((4, 2) if args.smoke else HEADS)
    batches = args.batches or ((1, 3) if args.smoke else BATCHES)
    contexts = args.contexts or ((40,) if args.smoke else CONTEXTS)
    g = torch.Generator(device=device).manual_seed(0)
    sms = num_sms(torch.device(device))
    rows: list[dict] = []
    end = time.monotonic() + args.budget_s
    for context in contexts:
        for batch in batches:
            if batch * context > args.max_tokens:
                continue
            for heads in heads_list:
                if time.monotonic() > end:
                    print("out of time", flush=True)
                    return dict(roofline=roof, rows=rows, complete=False)
                cache, tables, q, lens, qsl = make_inputs(batch, context, heads, device, g)
                q_latent, q_pe = q[..., :LATENT], q[..., LATENT:]
                default = mla_attention.default_config(LATENT, q.dtype, not cuda, heads)
                nbytes = cache.element_size() * batch * context * (LATENT + ROPE)
                flops = mla_flops(batch * context, heads)
                expected = None
                for name, launch in candidates(
                    heads, batch, context, default, sms, args.before, args.ab, args.against
                ):
                    config = launch.get("config")
                    out = torch.empty(batch, heads, LATENT, dtype=q.dtype, device=device)
                    fn = functools.partial(
                        mla_attention.mla_paged_attention,
                        *(q_latent, q_pe, cache, tables, lens, qsl, SCALE, out),
                        max_query_len=1, **launch,
                    )  # fmt: skip
                    row = dict(heads=heads, batch=batch, context=context, candidate=name,
                               num_splits=launch.get("num_splits"),
                               tile=None if config is None else [
                                   config.decode_block_h, config.decode_block_n,
                                   config.decode_num_warps, config.decode_num_stages],
                               head_blocks_first=None if config is None
                               else config.decode_head_blocks_first)  # fmt: skip
                    try:
                        expected, row["max_err_vs_default"] = against_first(
                            expected, fn().float(), 2e-2 if cuda else 1e-4, "the default launch"
                        )
                        if cuda:
                            ms = cold_graph_ms(fn)
                        else:
                            start = time.perf_counter()
                            fn()
                            ms = (time.perf_counter() - start) * 1e3
                    except Exception as exc:  # one candidate that fails: the others still run
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        rows.append(row)
                        print(f"H={heads} B={batch} ctx={context} {name}: {row['error']}")
                        continue
                    row["ms"] = ms
                    if roof:
                        roof_ms = max(nbytes / roof["copy_GBps"] / 1e6,
                                      flops / roof["matmul_TFLOPs"] / 1e9)  # fmt: skip
                        row["of_roofline"] = roof_ms / ms
                    rows.append(row)
                    print(
                        f"H={heads} B={batch} ctx={context} {name}: {ms * 1e3:.1f} us"
                        + (f" ({row['of_roofline']:.0%})" if roof else ""),
                        flush=True,
                    )
                del cache, tables, q
                if cuda:
                    torch.cuda.empty_cache()
    return dict(roofline=roof, rows=rows, complete=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU: the checks at tiny sizes")
    parser.add_argument("--before", action="store_true", help="time the BEFORE launch too")
    parser.add_argument(
        "--ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only the default and BEFORE, alternated ROUNDS times a shape",
    )
    parser.add_argument(
        "--against",
        choices=("before", "seqs-first"),
        default="before",
        help="what --ab alternates with the default",
    )
    parser.add_argument("--heads", type=int, nargs="*")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--contexts", type=int, nargs="*")
    parser.add_argument("--max-tokens", type=int, default=256 * 32768)
    parser.add_argument("--budget-s", type=float, default=420)
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    result = run(args)
    result.update(
        benchmark="mla_splits",
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
