"""Sweep the Triton fused_moe configs at the layer shapes of benchmarks/moe.py.

Run on a GPU from the repo root (under 3 minutes in all on an H100):

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python benchmarks/tune_moe.py --out $OUT/tune_moe.json

For each shape and T = 1, 16, 256, 4096 tokens: the default config (``_configs``) first, then a
greedy coordinate search (TMA weight loads, then GEMM 1 tiles and the path, then mixed tiles
(``remainder_m``: a smaller tile for an expert's last rows), then the top-k combine and the
align mode, then GEMM 1's GROUP_M, then GEMM 2's tiles and GROUP_M, each stage starting from the
best so far). Each
config runs once against the torch reference (``BAD`` past atol = rtol = 5e-2, as the GPU test),
is timed as moe.py times it (CUDA graphs, L2 flushed before each call) and rated as
moe.py rates it (weight bytes / copy bandwidth up to 256 tokens, FLOP/s / matmul rate above). A
config that fails to compile is recorded and skipped. Each (shape, T) gets a slice of the time
budget; the target missed so far (Qwen3 at 4096 tokens) goes first and gets the largest slice.
Prints a sorted table per (shape, T) (where the best is the sorted path, with each align mode
timed alone) and, last, one line per (shape, T): default vs best, the best with and without mixed
tiles, then the best configs as ``_configs`` literals.

``--dry-run`` (no GPU) prints each (shape, T)'s candidates as the stages would build them from the
default config, to check the enumeration.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

from kernels import cold_graph_ms, measure_roofline
from moe import BANDWIDTH_TOKENS, SHAPES, expert_bytes, moe_flops

# (shape, tokens, share of the budget), in the order they run.
PLAN = (
    ("qwen3-30b-a3b", 4096, 0.30),
    ("qwen3-30b-a3b", 256, 0.12),
    ("mixtral-8x7b", 4096, 0.14),
    ("qwen3-30b-a3b", 1, 0.10),
    ("mixtral-8x7b", 1, 0.06),
    ("qwen3-30b-a3b", 16, 0.08),
    ("mixtral-8x7b", 16, 0.08),
    ("mixtral-8x7b", 256, 0.12),
)
# The per-pair path is tried up to this many pairs (past it, pairs share experts and re-read their
# weights: Mixtral T=16, 32 pairs, ran at half the sorted path's rate on an H100).
PER_PAIR_SWEEP_MAX_PAIRS = 8
TOLERANCE = 5e-2
DEVICE = "cuda"  # a CPU smoke test of the sweep's logic sets "cpu" (under TRITON_INTERPRET=1)


def _cfg(m, n, k, warps, stages, group_m=None):
    cfg = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=warps, num_stages=stages)
    if group_m is not None:
        cfg["GROUP_M"] = group_m
    return cfg


def _with(config: dict, gemm: str | None = None, **changes) -> dict:
    """A copy of ``config`` with ``changes`` to one GEMM's config (or, without ``gemm``, to the
    top-level keys: "combine", "align")."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    if gemm:
        out[gemm].update(changes)
    else:
        out.update(changes)
    return out


def stage_gemm1(default: dict, num_pairs: int, rows_per_expert: float) -> list[dict]:
    """Path and GEMM 1 tiles (BLOCK_M with them: the sorted path's GEMMs share it)."""
    cands = []
    if num_pairs <= PER_PAIR_SWEEP_MAX_PAIRS:
        g2 = _cfg(16, 32, 128, 4, 5)
        for n, k, stages in ((16, 128, 4), (32, 128, 3), (32, 128, 4), (32, 128, 5),
                             (32, 256, 4), (64, 128, 4), (16, 256, 4)):  # fmt: skip
            cands.append({"per_pair": True, "combine": "sum", "gemm1": _cfg(16, n, k, 4, stages),
                          "gemm2": g2})  # fmt: skip
    if rows_per_expert <= 64:  # bandwidth-bound sorted path
        m = 16 if rows_per_expert <= 16 else 32
        g2 = _cfg(m, 32, 128, 4, 4)
        tiles = ((32, 128, 4), (32, 128, 5), (32, 256, 3), (64, 128, 4), (16, 128, 4), (32, 64, 5))
        if num_pairs <= 8:  # T = 1: the per-pair path's turf; the old best for comparison
            tiles = tiles[:1]
            g2 = _cfg(m, 32, 128, 4, 5)
        for n, k, stages in tiles:
            cands.append({"per_pair": False, "combine": "sum", "gemm1": _cfg(m, n, k, 4, stages),
                          "gemm2": g2})  # fmt: skip
    else:  # compute-bound grouped GEMM
        for m, n, warps, stages in (
            (64, 128, 8, 4), (64, 128, 8, 3), (64, 128, 4, 4), (64, 128, 8, 5), (64, 64, 4, 4),
            (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4), (64, 256, 8, 3),
        ):  # fmt: skip
            g2 = _cfg(m, 128, 64, 4 if m == 64 else 8, 4 if m == 64 else 3, 8)
            cands.append({"per_pair": False, "combine": "sum",
                          "gemm1": _cfg(m, n, 64, warps, stages, 8), "gemm2": g2})  # fmt: skip
    return [c for c in cands if c != default]


def _with_tiles(config: dict, block_m: int, remainder_m: int) -> dict:
    """``config`` with both GEMMs on ``block_m``-row tiles and ``remainder_m`` (0: off)."""
    out = _with(_with(config, "gemm1", BLOCK_M=block_m), "gemm2", BLOCK_M=block_m)
    return _with(out, remainder_m=remainder_m)


def stage_tiles(best: dict, results: list[dict]) -> list[dict]:
    """Mixed tiles (sorted path): the best tiles with each smaller tile for an expert's last rows;
    twice the best BLOCK_M with the best BLOCK_M as that tile; and the best config measured on
    half its BLOCK_M with a quarter as that tile (64-row tiles at prefill)."""
    if best["per_pair"]:
        return []
    m = best["gemm1"]["BLOCK_M"]
    cands = [_with_tiles(best, m, r) for r in (16, 32, 64) if r < m]
    if m <= 64:
        cands.append(_with_tiles(best, 2 * m, m))
    half = [r for r in results if r["ok"] and r["ms"] and not r["config"]["per_pair"]
            and r["config"]["gemm1"]["BLOCK_M"] == m // 2]  # fmt: skip
    if m // 4 >= 16 and half:
        cands.append(_with_tiles(min(half, key=lambda r: r["ms"])["config"], m // 2, m // 4))
    return cands


def stage_options(best: dict, num_pairs: int, align_kernel_max_pairs: int) -> list[dict]:
    """The top-k combine (and, sorted path, the align mode) for the best tiles so far."""
    if best["per_pair"]:
        token_g2 = _cfg(16, 16, 256, 4, 4)  # the per-token GEMM 2's old default
        return [_with(best, combine="atomic"), _with(best, combine="sum"),
                _with(_with(best, "gemm2", **token_g2), combine="token")]  # fmt: skip
    implicit = "kernel" if num_pairs <= align_kernel_max_pairs else "sort"  # fused_moe's choice
    aligns = ["sort", "hist"]
    if num_pairs <= 4 * align_kernel_max_pairs:  # one program: slow past a few thousand pairs
        aligns.append("kernel")
    if num_pairs > align_kernel_max_pairs:
        aligns.append("onehot")  # the previous many-pair align
    # No GEMM recompiles here (the align and the sum are kernels of their own): cheap to cross.
    return [_with(best, combine=c, **({"align": a} if a != implicit else {}))
            for c in ("sum", "sum_kernel", "atomic") for a in aligns]  # fmt: skip


def stage_group1(best: dict) -> list[dict]:
    if best["per_pair"]:
        return []
    return [_with(best, "gemm1", GROUP_M=g) for g in (0, 1, 4, 16, 32)]


def stage_gemm2(best: dict, rows_per_expert: float) -> list[dict]:
    m = best["gemm1"]["BLOCK_M"]
    cands = []
    if best["per_pair"] and best.get("combine") == "token":
        for n in (16, 32):
            for k in (128, 256, 512):
                for stages in (3, 5):
                    cands.append(_with(best, "gemm2", **_cfg(16, n, k, 4, stages)))
    elif best["per_pair"]:  # one program per (pair, column tile)
        for n, k, warps, stages in ((32, 128, 4, 4), (32, 256, 4, 3), (16, 128, 4, 5),
                                    (16, 256, 4, 4), (64, 128, 4, 4), (32, 64, 4, 5),
                                    (32, 128, 2, 5), (64, 64, 4, 5)):  # fmt: skip
            cands.append(_with(best, "gemm2", **_cfg(16, n, k, warps, stages)))
    elif rows_per_expert <= 64:
        for n, k, stages in ((32, 128, 5), (32, 256, 3), (64, 128, 4), (16, 128, 4),
                             (64, 64, 5), (32, 64, 4)):  # fmt: skip
            cands.append(_with(best, "gemm2", **_cfg(m, n, k, 4, stages)))
    else:
        for n, warps, stages in ((128, 4, 4), (128, 8, 3), (128, 8, 4), (128, 4, 5),
                                 (256, 8, 3), (256, 8, 4), (64, 4, 4), (64, 4, 5)):  # fmt: skip
            cands.append(_with(best, "gemm2", **_cfg(m, n, 64, warps, stages)))
    return cands


def stage_refine(best: dict) -> list[dict]:
    """Around a tuned config (``--only``): the combine, the remainder tile, GEMM 1's K tile and
    both GEMMs' pipeline depths."""
    out = []
    for combine in ("sum_kernel", "atomic"):
        for remainder_m in (32, 64):
            for k1, s1 in ((64, 4), (64, 3), (128, 2)):
                for s2 in (4, 3):
                    config = _with(best, combine=combine, remainder_m=remainder_m)
                    config = _with(config, "gemm1", BLOCK_K=k1, num_stages=s1)
                    out.append(_with(config, "gemm2", num_stages=s2))
    return out


def stage_tma(best: dict) -> list[dict]:
    """TMA weight loads (sorted path): alone, warp-specialized, and at other pipeline depths."""
    if best["per_pair"]:
        return []
    tma = _with(best, tma=True, ws=False)
    out = [tma]
    if best["gemm1"]["BLOCK_M"] >= 64:  # fused_moe ignores "ws" on smaller tiles
        out.append(_with(best, tma=True, ws=True))
    for s1, s2 in ((3, 3), (5, 4), (4, 3), (3, 4)):
        out.append(_with(_with(tma, "gemm1", num_stages=s1), "gemm2", num_stages=s2))
    return out


def stage_group2(best: dict) -> list[dict]:
    if best["per_pair"]:
        return []
    return [_with(best, "gemm2", GROUP_M=g) for g in (0, 1, 4, 16, 32)]


def short(config: dict) -> str:
    def one(c):
        stages = c.get("num_stages", "-")
        s = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{stages}"
        return s + (f" g{c['GROUP_M']}" if "GROUP_M" in c else "")

    path = "per-pair" if config["per_pair"] else "sorted"
    opts = config.get("combine", "sum") + (
        f", align {config['align']}" if "align" in config else ""
    )
    if config.get("remainder_m"):
        opts += f", remainder {config['remainder_m']}"
    if config.get("tma"):
        opts += ", tma" + (" ws" if config.get("ws") else "")
    return f"{path} ({opts}) | {one(config['gemm1'])} | {one(config['gemm2'])}"


def tune_one(torch, moe, shape, num_tokens, roofline, budget_s, seed, refine=False) -> dict:
    from atom_kernels.backends.torch import moe as reference

    num_experts, top_k, hidden, inter = shape
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device=DEVICE) * 0.02).to(
        torch.bfloat16
    )
    w2 = (torch.randn(num_experts, hidden, inter, generator=g, device=DEVICE) * 0.02).to(
        torch.bfloat16
    )
    x = torch.randn(num_tokens, hidden, generator=g, device=DEVICE).to(torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, generator=g, device=DEVICE)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    ids = ids.int()
    args = (x, w13, w2, weights, ids, "silu", None, None, False, 1.702, 7.0)
    expected = reference.fused_moe(*args).float()
    hit = int(ids.unique().numel())
    num_pairs = num_tokens * top_k
    rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    work = hit * expert_bytes(hidden, inter) if num_tokens <= BANDWIDTH_TOKENS else None
    flops = moe_flops(num_tokens, top_k, hidden, inter)

    def fraction(ms):
        if work is not None:
            return work / (ms / 1e3) / 1e9 / roofline["copy_GBps"]
        return flops / (ms / 1e3) / 1e12 / roofline["matmul_TFLOPs"]

    deadline = time.monotonic() + budget_s
    results: list[dict] = []
    seen: set[str] = set()
    calls = [10]

    def run(config, tag=""):
        key = json.dumps(config, sort_keys=True)
        if key in seen:
            return None
        seen.add(key)
        row = {"config": config, "tag": tag, "ok": False, "ms": None, "fraction": None}
        results.append(row)
        try:
            out = moe.fused_moe(*args, config=config)
            err = (out.float() - expected).abs()
            bad = ~(err <= TOLERANCE + TOLERANCE * expected.abs())  # NaN counts as bad
            row["max_abs_err"] = float(err.nan_to_num(float("inf")).max())
            row["ok"] = not bool(bad.any())
            row["ms"] = cold_graph_ms(lambda: moe.fused_moe(*args, config=config),
                                      calls=calls[0], replays=7)  # fmt: skip
            row["fraction"] = fraction(row["ms"])
        except Exception as e:  # a config that does not compile (shared memory, registers)
            row["ok"] = False
            row["ms"] = None
            msg = str(e).strip().splitlines() or [""]
            row["error"] = f"{type(e).__name__}: {msg[0][:160]}"
            print(f"  {short(config)}: {row['error']}", flush=True)
        return row

    default = moe._configs(num_tokens, top_k, num_experts, hidden, inter, x.device)
    first = run(default, "default")
    if first and first["ms"]:
        calls[0] = 10 if first["ms"] < 0.5 else 3  # bound the timing cost at prefill sizes

    def best():
        good = [r for r in results if r["ok"] and r["ms"]]
        return min(good, key=lambda r: r["ms"])["config"] if good else default

    stages = (
        lambda: stage_tma(default),
        lambda: stage_refine(best()) if refine else [],
        lambda: [] if refine else stage_gemm1(default, num_pairs, rows_per_expert),
        lambda: stage_tiles(best(), results),
        lambda: stage_options(best(), num_pairs, moe.ALIGN_KERNEL_MAX_PAIRS),
        lambda: stage_group1(best()),
        lambda: stage_gemm2(best(), rows_per_expert),
        lambda: stage_group2(best()),
    )
    out_of_time = False
    for stage in stages:
        for config in stage():
            if time.monotonic() > deadline:
                out_of_time = True
                break
            run(config)
        if out_of_time:
            break
    align_ms = {}
    if not best()["per_pair"] and DEVICE == "cuda":  # the align step alone, for the breakdown
        block_m = best()["gemm1"]["BLOCK_M"]
        rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
        sorted_ids = torch.empty(rows + block_m, dtype=torch.int32, device=DEVICE)
        counts = torch.empty(num_experts, dtype=torch.int32, device=DEVICE)
        ends = torch.empty_like(counts)
        flat = ids.reshape(-1)
        block_e = max(16, 1 << (num_experts - 1).bit_length())
        aligns = {
            "sort": lambda: moe._align_sort(flat, num_experts, block_m, sorted_ids, counts, ends),
            "hist": lambda: moe._align_hist(flat, num_experts, block_m, sorted_ids, counts, ends),
            "onehot": lambda: moe._align_torch(
                flat.long(), num_experts, block_m, sorted_ids, counts, ends
            ),
            "kernel": lambda: moe._align_kernel[(1,)](
                flat,
                sorted_ids,
                counts,
                ends,
                num_pairs,
                num_experts,
                BLOCK_M=block_m,
                BLOCK_E=block_e,
                CHUNK=32 if block_e > 128 else 64,
                num_warps=4,
            ),  # fmt: skip
        }
        if num_pairs <= moe.ALIGN_KERNEL_MAX_PAIRS:
            del aligns["onehot"]
        if num_pairs > 4 * moe.ALIGN_KERNEL_MAX_PAIRS:
            del aligns["kernel"]
        for mode, fn in aligns.items():
            try:
                align_ms[mode] = cold_graph_ms(fn, calls=10, replays=5)
            except Exception as e:  # e.g. a capture failure: report it, keep the sweep
                print(f"  align {mode}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    torch.cuda.empty_cache()
    return {
        "tokens": num_tokens,
        "experts_hit": hit,
        "rate": "bandwidth" if work is not None else "matmul",
        "out_of_time": out_of_time,
        "align_ms": align_ms,
        "results": results,
    }


def format_table(name: str, entry: dict) -> str:
    rows = sorted(entry["results"], key=lambda r: (not r["ok"], r["ms"] or float("inf")))
    lines = [
        f"\n{name} T={entry['tokens']} ({entry['rate']} roofline"
        + (", sweep cut short by its time slice" if entry["out_of_time"] else "")
        + "".join(f", align {m} alone {v:.4f} ms" for m, v in entry["align_ms"].items())
        + ")",
        "ms | % roofline | check | path | gemm1 | gemm2",
    ]
    for r in rows:
        if r["ms"] is None:
            check = "FAIL " + r.get("error", "")
            lines.append(f"- | - | {check} | {short(r['config'])}")
            continue
        check = "ok" if r["ok"] else f"BAD (max err {r['max_abs_err']:.3g})"
        tag = f" [{r['tag']}]" if r["tag"] else ""
        lines.append(
            f"{r['ms']:.4f} | {100 * r['fraction']:.0f}% | {check} | {short(r['config'])}{tag}"
        )
    return "\n".join(lines)


def summary(entries: dict) -> str:
    """One line per (shape, T): default vs best (short form), the best with and without mixed
    tiles (sorted path); then each best as a JSON literal for ``_configs``."""

    def ms_pct(r):
        return f"{r['ms']:.4f} ms {100 * r['fraction']:.0f}%" if r and r["ms"] else "-"

    lines = ["\nshape T | default | best | best mixed tiles | best w/o | best config"]
    literals = ["\nbest configs:"]
    for key, entry in entries.items():
        good = [r for r in entry["results"] if r["ok"] and r["ms"]]
        default = next((r for r in entry["results"] if r["tag"] == "default"), None)
        if not good:
            lines.append(f"{key} | no valid config")
            continue
        b = min(good, key=lambda r: r["ms"])
        sorted_rows = [r for r in good if not r["config"]["per_pair"]]
        mixed = [r for r in sorted_rows if r["config"].get("remainder_m")]
        plain = [r for r in sorted_rows if not r["config"].get("remainder_m")]
        best_mixed = min(mixed, key=lambda r: r["ms"]) if mixed else None
        best_plain = min(plain, key=lambda r: r["ms"]) if plain else None
        lines.append(
            f"{key} | {ms_pct(default)} | {ms_pct(b)} | {ms_pct(best_mixed)} | "
            f"{ms_pct(best_plain)} | {short(b['config'])}"
        )
        literals.append(f"{key}: {json.dumps(b['config'])}")
    return "\n".join(lines + literals)


def dry_run(torch, moe) -> int:
    """Each (shape, T)'s candidates, stage by stage, built from the default config (every GEMM 1
    candidate standing in as measured for ``stage_tiles``); checks each config's shape rules.
    Returns the number of invalid configs."""
    bad = 0
    for name, num_tokens, _ in PLAN:
        num_experts, top_k, hidden, inter = SHAPES[name]
        num_pairs = num_tokens * top_k
        rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
        default = moe._configs(num_tokens, top_k, num_experts, hidden, inter, torch.device("meta"))
        gemm1 = stage_gemm1(default, num_pairs, rows_per_expert)
        measured = [{"ok": True, "ms": 1.0, "config": c} for c in [default, *gemm1]]
        stages = {
            "gemm1": gemm1,
            "tma": stage_tma(default),
            "tiles": stage_tiles(default, measured),
            "options": stage_options(default, num_pairs, moe.ALIGN_KERNEL_MAX_PAIRS),
            "group1": stage_group1(default),
            "gemm2": stage_gemm2(default, rows_per_expert),
            "group2": stage_group2(default),
        }
        total = sum(len(c) for c in stages.values())
        print(f"\n{name} T={num_tokens}: default {short(default)}; {total} candidates")
        for stage, configs in stages.items():
            for config in configs:
                m, r = config["gemm1"]["BLOCK_M"], config.get("remainder_m", 0)
                ok = config["gemm2"]["BLOCK_M"] == m and (not r or (16 <= r < m and m % r == 0))
                ok = ok and config.get("align", "sort") in moe.ALIGN_MODES
                bad += not ok
                print(f"  {stage}: {short(config)}{'' if ok else '  INVALID'}")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON results file (required unless --dry-run)")
    parser.add_argument("--budget-s", type=float, default=140.0,
                        help="seconds for all sweeps (setup and roofline come on top)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true",
                        help="print the candidate configs (no GPU needed)")  # fmt: skip
    parser.add_argument("--only", metavar="SHAPE=TOKENS",
                        help="one shape (e.g. qwen3-30b-a3b=4096), all the budget, refining its "
                        "default config")  # fmt: skip
    args = parser.parse_args(argv)
    plan = PLAN
    if args.only:
        name, tokens = args.only.split("=")
        plan = ((name, int(tokens), 1.0),)
    if not args.dry_run and not args.out:
        parser.error("--out is required")

    import torch
    import triton

    from atom_kernels.backends.triton import moe

    if args.dry_run:
        return 1 if dry_run(torch, moe) else 0

    t0 = time.monotonic()
    roofline = measure_roofline(torch)
    print(json.dumps(roofline), flush=True)
    result = {
        "benchmark": "tune_fused_moe",
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": "bfloat16",
        "roofline": roofline,
        "sweeps": {},
    }
    spent = 0.0
    share_left = sum(share for _, _, share in plan)
    for name, num_tokens, share in plan:
        # Time a slice leaves unused passes on to the slices after it.
        budget = (args.budget_s - spent) * share / share_left
        share_left -= share
        start = time.monotonic()
        entry = tune_one(
            torch, moe, SHAPES[name], num_tokens, roofline, budget, seed=num_tokens,
            refine=bool(args.only),
        )  # fmt: skip
        spent += time.monotonic() - start
        key = f"{name} T={num_tokens}"
        result["sweeps"][key] = entry
        print(format_table(name, entry), flush=True)
        with open(args.out, "w") as f:  # after each sweep: a cut-off run keeps what it measured
            json.dump(result, f, indent=2)
    print(summary(result["sweeps"]))
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
