"""Triton fused_moe vs the torch reference at Qwen3-30B-A3B and Mixtral-8x7B layer shapes, against
the roofline measured in the same run.

Run on a GPU from the repo root:

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python benchmarks/moe.py --out $OUT/moe.json

bf16, random weights and routing (softmax top-k of random logits), T = 1, 16, 256, 4096 tokens.
Triton is timed as CUDA graphs (``ms_cold``: L2 flushed before each call, GPU time alone, what the
rates come from; ``ms_graph``: warm L2); the torch reference syncs the host (per-expert counts),
so it is timed eagerly (``triton.testing.do_bench``, median). Rates: for few tokens, the bytes of
the selected experts' weights (distinct experts hit x bytes of one expert) over the time, as a
fraction of the measured copy bandwidth (target >= 60% at 1-16 tokens); for many, FLOP/s
(2 * T * K * 3 * H * I) as a fraction of the bf16 matmul rate (target >= 50% at 4096 tokens).

Expert parallelism (``--ep-size N``): one rank of N at DP=1. It holds experts [0, E / N) and
routes over all E, so about (N - 1) / N of the slots belong to other ranks: passed as -1
(``--ep-skip minus-one``, what ``FusedMoE`` does) or, the layout before issue 37's fix, as the
rank's expert 0 with weight 0 (``expert-zero``: computed and thrown away). Bytes and FLOPs count
the rank's own pairs only, so the two modes' rates compare directly:

    python benchmarks/moe.py --ep-size 4 --tokens 1 16 64 256 --no-reference --out $OUT/moe-ep4.json
    python benchmarks/moe.py --ep-size 4 --ep-skip expert-zero --tokens 1 16 64 256 \
        --no-reference --out $OUT/moe-ep4-expert-zero.json

INT4 experts (``--int4``, issue 40): the W4A16 fused MoE (``quant="wna16"``, group 32,
symmetric, bf16 activations) on Kimi-K2-Thinking's routed experts (E = 384, top-8, H = 7168,
I = 2048) at 1, 4, 16, 64 tokens. Its floor: the packed weights and scales of the distinct routed
experts, read once, at the copy bandwidth measured in the same run; reported as us and the
fraction of the floor reached (floor time / measured time). One EP=8 rank's share (48 local
experts, the other ranks' slots -1):

    python benchmarks/moe.py --int4 --ep-size 8 --no-reference --out $OUT/moe-int4-ep8.json

``--int4-packed`` times each token count of 4 or more twice, the default (the GEMMs' packed
unpack, ``moe_wna16``'s PACKED, since session 26) then the loop without it (``PACKED=False``),
rows named by ``impl`` (``default``, ``unpacked``).

T = tokens, E = experts, K = top-k, H = hidden size, I = expert intermediate size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

from kernels import cold_graph_ms, measure_roofline

SHAPES = {  # name: (E, K, H, I)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
TOKENS = (1, 16, 256, 4096)
INT4_SHAPES = {"kimi-k2-thinking": (384, 8, 7168, 2048)}  # routed experts, W4A16
INT4_GROUP = 32  # inputs per scale
INT4_TOKENS = (1, 4, 16, 64)
BANDWIDTH_TOKENS = 256  # up to this many tokens the rate is bytes/s, above it FLOP/s


def expert_bytes(hidden: int, inter: int, itemsize: int = 2) -> int:
    """Weights of one expert: w13 [2I, H] and w2 [H, I]."""
    return 3 * hidden * inter * itemsize


def wna16_expert_bytes(
    hidden: int, inter: int, bits: int = 4, group: int = INT4_GROUP, with_zeros: bool = False
) -> int:
    """Packed weights + bf16 scales (+ zeros) of one WNA16 expert: w13 [2I, H], w2 [H, I]."""
    values = 3 * hidden * inter
    per_group = 2 if with_zeros else 1
    return values * bits // 8 + per_group * 2 * values // group


def moe_flops(num_tokens: int, top_k: int, hidden: int, inter: int) -> float:
    return 2.0 * num_tokens * top_k * 3 * hidden * inter


EP_SKIP_MODES = ("minus-one", "expert-zero")


def ep_routing(torch, weights, ids, num_local: int, skip: str):
    """(weights, ids) as rank 0 of expert parallelism sees them: it owns experts [0, num_local);
    another rank's slot is -1 ("minus-one") or its expert 0 with weight 0 ("expert-zero")."""
    owned = ids < num_local
    if skip == "minus-one":
        return weights, torch.where(owned, ids, -1)
    return torch.where(owned, weights, 0.0), torch.where(owned, ids, 0)


def format_table(rows: list[dict]) -> str:
    head = ("shape", "T", "experts hit", "triton ms", "torch ms", "rate", "% roofline", "speedup")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        torch_ms = r.get("torch_ms")
        speedup = f"{torch_ms / r['ms_cold']:.1f}x" if torch_ms and r["ms_cold"] > 0 else "-"
        lines.append(
            " | ".join(
                (
                    r["shape"],
                    str(r["tokens"]),
                    str(r["experts_hit"]),
                    f"{r['ms_cold']:.4f}",
                    "-" if torch_ms is None else f"{torch_ms:.4f}",
                    f"{r['rate']:.1f} {r['rate_unit']}",
                    f"{100 * r['roofline_fraction']:.0f}%",
                    speedup,
                )
            )
        )
    return "\n".join(lines)


def bench_shape(
    torch,
    name: str,
    shape: tuple,
    roofline: dict,
    with_reference: bool,
    tokens: tuple[int, ...] = TOKENS,
    ep_size: int = 1,
    ep_skip: str = "minus-one",
) -> list[dict]:
    from atom_kernels.backends.triton import custom_ops

    num_experts, top_k, hidden, inter = shape
    num_local = num_experts // ep_size  # the experts this rank holds (all without EP)
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(num_local, 2 * inter, hidden, generator=g, device="cuda") * 0.02).to(
        torch.bfloat16
    )
    w2 = (torch.randn(num_local, hidden, inter, generator=g, device="cuda") * 0.02).to(
        torch.bfloat16
    )
    rows = []
    for num_tokens in tokens:
        x = torch.randn(num_tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
        logits = torch.randn(num_tokens, num_experts, generator=g, device="cuda")
        weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        ids = ids.int()
        owned = ids < num_local  # [T, K]: this rank's pairs
        if ep_size > 1:
            weights, ids = ep_routing(torch, weights, ids, num_local, ep_skip)
        args = (x, w13, w2, weights, ids, "silu", None, None, False, 1.702, 7.0)

        def triton_fn(args=args):
            return custom_ops.fused_moe(*args)

        times = _time_moe(torch, triton_fn, args, {}, with_reference, warmup=5, rep=50)
        ms_cold, ms_graph, torch_ms = times["ms_cold"], times["ms_graph"], times["torch_ms"]
        hit = int(ids[owned].unique().numel())
        weight_bytes = hit * expert_bytes(hidden, inter)
        flops = moe_flops(int(owned.sum()), 1, hidden, inter)  # the rank's own pairs
        gbps = weight_bytes / (ms_cold / 1e3) / 1e9
        tflops = flops / (ms_cold / 1e3) / 1e12
        if num_tokens <= BANDWIDTH_TOKENS:
            rate, unit, fraction = gbps, "GB/s", gbps / roofline["copy_GBps"]
        else:
            rate, unit, fraction = tflops, "TFLOP/s", tflops / roofline["matmul_TFLOPs"]
        row = {
            "shape": name,
            "experts": num_experts,
            "top_k": top_k,
            "hidden": hidden,
            "intermediate": inter,
            "tokens": num_tokens,
            "ep_size": ep_size,
            "ep_skip": ep_skip if ep_size > 1 else None,
            "experts_hit": hit,
            "weight_bytes": weight_bytes,
            "flops": flops,
            "ms_cold": ms_cold,
            "ms_graph": ms_graph,
            "torch_ms": torch_ms,
            "weights_GBps": gbps,
            "TFLOPs": tflops,
            "bandwidth_fraction": gbps / roofline["copy_GBps"],
            "matmul_fraction": tflops / roofline["matmul_TFLOPs"],
            "rate": rate,
            "rate_unit": unit,
            "roofline_fraction": fraction,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _int4_experts(torch, num_local: int, hidden: int, inter: int, g):
    """Random W4A16 experts on ``g``'s device (int32 words of random bits, bf16 scales giving
    outputs of about unit variance: 4.6 is the std of q - 8): (w13, w2, w13_scale, w2_scale)."""

    def weight(rows: int, k: int):
        words = torch.randint(-(2**31), 2**31, (num_local, rows, k // 8), generator=g,
                              device=g.device, dtype=torch.int32)  # fmt: skip
        scales = torch.rand(num_local, rows, k // INT4_GROUP, generator=g, device=g.device)
        return words, ((scales + 0.5) / (4.6 * k**0.5)).to(torch.bfloat16)

    (w13, s13), (w2, s2) = weight(2 * inter, hidden), weight(hidden, inter)
    return w13, w2, s13, s2


def bench_int4(
    torch,
    name: str,
    shape: tuple,
    roofline: dict,
    with_reference: bool,
    tokens: tuple[int, ...] = INT4_TOKENS,
    ep_size: int = 1,
    ep_skip: str = "minus-one",
    packed: bool = False,
) -> list[dict]:
    """The W4A16 fused MoE (see the module docstring) against its floor; ``packed``: each token
    count also without the GEMMs' PACKED unpack (``moe_wna16``'s default; checked against the
    default first), timed right after the default."""
    from atom_kernels.backends.triton import custom_ops, moe_wna16

    num_experts, top_k, hidden, inter = shape
    num_local = num_experts // ep_size
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, w2, s13, s2 = _int4_experts(torch, num_local, hidden, inter, g)
    quant = dict(quant="wna16", w13_scale=s13, w2_scale=s2)
    rows = []
    for num_tokens in tokens:
        x = torch.randn(num_tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
        logits = torch.randn(num_tokens, num_experts, generator=g, device="cuda")
        weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        ids = ids.int()
        owned = ids < num_local
        if ep_size > 1:
            weights, ids = ep_routing(torch, weights, ids, num_local, ep_skip)
        args = (x, w13, w2, weights, ids, "silu", None, None, False, 1.702, 7.0)

        def triton_fn(args=args):
            return custom_ops.fused_moe(*args, **quant)

        impls = [("default", triton_fn)]
        config = moe_wna16.wna16_configs(num_tokens, top_k, num_local, hidden, inter, 4, x.device)
        if packed and not config["per_pair"]:  # one token: the register loop, nothing packed
            config = dict(config, gemm1=dict(config["gemm1"], PACKED=False),
                          gemm2=dict(config["gemm2"], PACKED=False))  # fmt: skip

            def unpacked_fn(args=args, config=config):
                return moe_wna16.fused_moe_wna16(*args, s13, s2, config=config)

            error = float((unpacked_fn().float() - triton_fn().float()).abs().max())
            print(f"T={num_tokens} unpacked against the default: max |diff| {error:.3g}",
                  flush=True)  # fmt: skip
            impls.append(("unpacked", unpacked_fn))
        hit = int(ids[owned].unique().numel())
        for impl, fn in impls:
            row = _time_moe(torch, fn, args, quant, with_reference and impl == "default")
            row.update(shape=name, experts=num_experts, local_experts=num_local, top_k=top_k,
                       hidden=hidden, intermediate=inter, tokens=num_tokens, impl=impl,
                       quant=f"wna16 int4 group {INT4_GROUP} symmetric", ep_size=ep_size,
                       ep_skip=ep_skip if ep_size > 1 else None, experts_hit=hit)  # fmt: skip
            floor_bytes = hit * wna16_expert_bytes(hidden, inter)
            floor_us = floor_bytes / (roofline["copy_GBps"] * 1e9) * 1e6
            gbps = floor_bytes / (row["ms_cold"] / 1e3) / 1e9
            row.update(weight_bytes=floor_bytes, floor_us=floor_us, weights_GBps=gbps,
                       floor_fraction=floor_us / row["us_cold"], rate=gbps, rate_unit="GB/s",
                       roofline_fraction=floor_us / row["us_cold"])  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _time_moe(torch, fn, args, quant, with_reference: bool, warmup: int = 3, rep: int = 20) -> dict:
    """Times of one fused-MoE launch: cold-L2 graph, graph replays, the torch reference (``quant``
    its quantization arguments; ``warmup`` / ``rep`` its do_bench)."""
    from triton.testing import do_bench, do_bench_cudagraph

    from atom_kernels.backends.torch import moe as reference

    torch.cuda.synchronize()
    ms_cold = cold_graph_ms(fn)
    ms_graph = float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
    torch_ms = None
    if with_reference:
        torch_ms = float(
            do_bench(lambda args=args: reference.fused_moe(*args, **quant), warmup=warmup,
                     rep=rep, return_mode="median")
        )  # fmt: skip
    return {"us_cold": ms_cold * 1e3, "ms_cold": ms_cold, "ms_graph": ms_graph,
            "torch_ms": torch_ms}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--no-reference", action="store_true", help="skip the torch reference")
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=None,
        help=f"token counts to time (default {list(TOKENS)}; --int4: {list(INT4_TOKENS)})",
    )  # fmt: skip
    parser.add_argument(
        "--int4", action="store_true",
        help="the W4A16 experts on Kimi-K2's shape instead of the bf16 shapes",
    )  # fmt: skip
    parser.add_argument(
        "--int4-packed", action="store_true",
        help="--int4: each token count also without the PACKED unpack (moe_wna16), after it",
    )  # fmt: skip
    parser.add_argument(
        "--ep-size", type=int, default=1, help="time one rank of this many expert-parallel ranks"
    )
    parser.add_argument(
        "--ep-skip",
        choices=EP_SKIP_MODES,
        default="minus-one",
        help="how another rank's slots reach fused_moe (see the docstring)",
    )
    args = parser.parse_args(argv)
    shapes = INT4_SHAPES if args.int4 else SHAPES
    tokens = tuple(args.tokens or (INT4_TOKENS if args.int4 else TOKENS))
    for name, (num_experts, *_rest) in shapes.items():
        if args.ep_size < 1 or num_experts % args.ep_size:
            parser.error(f"--ep-size {args.ep_size} does not divide {name}'s {num_experts} experts")

    import torch
    import triton

    roofline = measure_roofline(torch)
    print(json.dumps(roofline), flush=True)
    result = {
        "benchmark": "fused_moe",
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": "bfloat16",
        "experts_quant": f"wna16 int4 group {INT4_GROUP} symmetric" if args.int4 else None,
        "activation": "silu",
        "ep_size": args.ep_size,
        "ep_skip": args.ep_skip if args.ep_size > 1 else None,
        "roofline": roofline,
        "results": [],
    }
    rows = result["results"]
    for name, shape in shapes.items():
        common = (torch, name, shape, roofline, not args.no_reference, tokens, args.ep_size,
                  args.ep_skip)  # fmt: skip
        if args.int4:
            rows += bench_int4(*common, packed=args.int4_packed)
        else:
            rows += bench_shape(*common)
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:  # after each shape: a cut-off run keeps what it measured
            json.dump(result, f, indent=2)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
