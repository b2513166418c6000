"""ATOM's launch options against FlashInfer on the rows where FlashInfer was faster (issue 42,
item 2): every ATOM variant and FlashInfer's call alternate in one round (flashinfer_compare's
timing: cold L2, GPU time, median over rounds).

    . benchmarks/device_env.sh && export PYTHONPATH=/tmp/site:$PYTHONPATH FLASHINFER_NO_DOWNLOAD=1
    python3 benchmarks/fi_tune.py --only norm,decode --out $OUT/fi-tune.json

- ``norm``: RMSNorm and fused add + RMSNorm, T = 64 / 2048 / 8192, N = 4096 (Llama-3-8B):
  ATOM's launch (``norm._launch``'s ``config``: ROWS rows a program, num_warps) per candidate.
- ``decode``: paged decode attention, B = 64, GQA 64/4 (the rows FlashInfer won) and 32/8 (a
  guard: ATOM won there), contexts 512 / 4096 / 32768: ATOM's default against forced split
  counts and decode tiles (KV tile, warps, stages).
Each variant is checked against ATOM's default output first (a variant that disagrees or raises
records why and is not timed). Without FlashInfer the ATOM variants still run (its column says
why not). Rows: each variant's ms and its ratio to FlashInfer's (``over_fi``: above 1, FlashInfer
faster), the default's ms, the best variant.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from flashinfer_cases import BLOCK, EPS, _paged, _pages_view, fi_pages  # noqa: E402
from flashinfer_compare import _error, _versions, load_flashinfer, time_alternating  # noqa: E402
from kernels import format_table  # noqa: E402

NORM_TOKENS = (64, 2048, 8192)
HIDDEN = 4096
NORM_VARIANTS = ((1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16))  # ROWS, warps
DECODE_HEADS = ((64, 4), (32, 8))
DECODE_BATCH = 64
DECODE_CONTEXTS = (512, 4096, 32768)
HEAD_DIM = 128
DECODE_SPLITS = (None, 1, 2, 4, 8, 16)
DECODE_TILES = (None, (64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 8, 2), (32, 4, 3), (16, 4, 3))


def _check(out, ref) -> str | None:
    """None when ``out`` is within bf16 tolerance of ``ref`` (flashinfer_cases.close's), else
    why not."""
    diff = (out.float() - ref.float()).abs()
    if bool((diff <= 2e-2 + 2e-2 * ref.float().abs()).all()):
        return None
    return f"disagrees with the default: max |diff| {diff.max().item():.3g}"


def norm_rows(fi, fi_status, rounds, device):
    g = torch.Generator(device=device).manual_seed(0)
    for tokens in NORM_TOKENS:
        x = torch.randn(tokens, HIDDEN, generator=g, device=device).to(torch.bfloat16)
        res = torch.randn(tokens, HIDDEN, generator=g, device=device).to(torch.bfloat16)
        w = torch.rand(HIDDEN, generator=g, device=device).to(torch.bfloat16) + 0.5
        for fused in (True, False):
            yield _norm_row(fi, fi_status, rounds, device, x, res if fused else None, w)


def _norm_row(fi, fi_status, rounds, device, x, res, w):
    from atom_kernels.backends.triton import norm

    variants = [("default", None)] + [
        (f"rows{rows}/{warps}w", {"ROWS": rows, "num_warps": warps})
        for rows, warps in NORM_VARIANTS
    ]
    fns = [lambda c=cfg: norm._launch(x, res, w, EPS, c) for _, cfg in variants]
    # in place as FlashInfer's (its own copies of the inputs, restored before each call)
    x_ip, res_ip = x.clone(), None if res is None else res.clone()
    variants.append(("in-place", {"INPLACE": True}))
    fns.append(lambda: norm._launch(x_ip, res_ip, w, EPS, {"INPLACE": True}))

    def restore():
        x_ip.copy_(x)
        if res_ip is not None:
            res_ip.copy_(res)

    resets = [None] * (len(fns) - 1) + [restore]
    fi_fn, reset = None, None
    if fi is not None and res is not None:
        x_fi, res_fi = x.clone(), res.clone()

        def fi_fn():
            fi.fused_add_rmsnorm(x_fi, res_fi, w, EPS)

        def reset():
            x_fi.copy_(x)
            res_fi.copy_(res)
    elif fi is not None:

        def fi_fn():
            return fi.rmsnorm(x, w, EPS)

    op = "rms_norm" if res is None else "fused_add_rms_norm"
    tokens = x.shape[0]
    nbytes = x.numel() * 2 * (2 if res is None else 4)
    return _row(op, f"T={tokens} N={HIDDEN}", variants, fns, fi_fn, reset, fi_status, rounds,
                device, nbytes, resets)  # fmt: skip


def decode_rows(fi, fi_status, rounds, device):
    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16
    for heads, kv_heads in DECODE_HEADS:
        for context in DECODE_CONTEXTS:
            bt, sl, shape = _paged(DECODE_BATCH, context, kv_heads, (HEAD_DIM,), device, g)
            kc = torch.randn(shape, dtype=dt, device=device, generator=g)
            vc = torch.randn(shape, dtype=dt, device=device, generator=g)
            q = torch.randn(DECODE_BATCH, heads, HEAD_DIM, dtype=dt, device=device, generator=g)
            yield _decode_row(fi, fi_status, rounds, device, q, kc, vc, bt, sl)
            del kc, vc
            torch.cuda.empty_cache()


def _decode_variants(q, kc, vc, bt, sl):
    """(name, options) and the callable of ATOM's default and each forced split count x tile."""
    from atom_kernels.backends.triton import attention
    from atom_kernels.backends.triton.attention_config import default_config

    heads, kv_heads = q.shape[1], kc.shape[2]
    base = default_config(HEAD_DIM, q.dtype, False, heads // kv_heads)
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    variants, fns = [], []
    for splits in DECODE_SPLITS:
        for tile in DECODE_TILES:
            if splits is None and tile is not None:
                continue  # the default's own split count is timed with its own tiles
            cfg = None
            if tile is not None:
                n, w, s = tile
                cfg = replace(
                    base, decode_block_n=n, decode_num_warps=w, decode_num_stages=s,
                    decode_block_n_unsplit=n, decode_num_warps_unsplit=w,
                    decode_num_stages_unsplit=s, decode_block_n_large=n,
                    decode_num_warps_large=w, decode_num_stages_large=s,
                )  # fmt: skip
            tiles = "tiles-default" if tile is None else "{}/{}w/{}s".format(*tile)
            name = "default" if splits is None else f"splits{splits}/{tiles}"
            variants.append((name, {"num_splits": splits, "tile": tile}))
            fns.append(
                lambda splits=splits, cfg=cfg: attention.paged_attention(
                    q,
                    kc,
                    vc,
                    bt,
                    sl,
                    qsl,
                    HEAD_DIM**-0.5,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    max_query_len=1,
                    num_splits=splits,
                    config=cfg,
                )  # fmt: skip
            )
    return variants, fns


def _decode_row(fi, fi_status, rounds, device, q, kc, vc, bt, sl):
    heads, kv_heads = q.shape[1], kc.shape[2]
    batch, context = q.shape[0], int(sl[0])
    variants, fns = _decode_variants(q, kc, vc, bt, sl)
    fi_fn = None
    if fi is not None:
        m = fi_pages(bt, sl, BLOCK)
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_tensor_cores=heads // kv_heads > 4
        )
        wrapper.plan(
            m["indptr"], m["indices"], m["last_page_len"], heads, kv_heads, HEAD_DIM, BLOCK,
            q_data_type=q.dtype, kv_data_type=q.dtype, sm_scale=HEAD_DIM**-0.5,
        )  # fmt: skip
        pages = (_pages_view(kc, BLOCK), _pages_view(vc, BLOCK))

        def fi_fn():
            return wrapper.run(q, pages)

    nbytes = batch * context * kv_heads * HEAD_DIM * 2 * 2
    shape = f"H={heads}/{kv_heads} D={HEAD_DIM} B={batch} ctx={context}"
    return _row("decode_attention", shape, variants, fns, fi_fn, None, fi_status, rounds, device,
                nbytes)  # fmt: skip


def _row(op, shape, variants, fns, fi_fn, fi_reset, fi_status, rounds, device, nbytes,
         resets=None):  # fmt: skip
    """Warm and check every variant against the first (the default), then time them and
    FlashInfer alternating (``resets``: a variant's, run before each of its calls)."""
    resets = resets or [None] * len(fns)
    row = {"op": op, "shape": shape, "bytes": nbytes, "flashinfer": fi_status, "variants": []}
    ref = fns[0]()
    live = []
    for (name, cfg), fn, reset in zip(variants, fns, resets, strict=True):
        entry = {"name": name, "config": cfg}
        try:
            for _ in range(2):
                if reset is not None:
                    reset()
                out = fn()
            out = out[0] if isinstance(out, tuple) else out
            why = _check(out, ref[0] if isinstance(ref, tuple) else ref)
        except Exception as e:  # noqa: BLE001 - a launch that does not fit is a result
            why = _error(e)
        if why:
            entry["error"] = why
        live.append(None if why else fn)
        row["variants"].append(entry)
    if fi_fn is not None:
        try:
            for _ in range(2):
                if fi_reset is not None:
                    fi_reset()
                fi_fn()
        except Exception as e:  # noqa: BLE001
            row["flashinfer"], fi_fn = _error(e), None
    times = time_alternating(live + [fi_fn], list(resets) + [fi_reset], rounds, device)
    fi_ms = times[-1]
    row["flashinfer_ms"] = fi_ms
    for entry, ms in zip(row["variants"], times[:-1], strict=True):
        entry["ms"] = ms
        entry["over_fi"] = ms / fi_ms if ms and fi_ms else None
    timed = [v for v in row["variants"] if v.get("ms")]
    best = min(timed, key=lambda v: v["ms"])
    row.update(default_ms=row["variants"][0].get("ms"), best=best["name"], best_ms=best["ms"])
    row["best_over_fi"] = best["ms"] / fi_ms if fi_ms else None
    row["default_over_fi"] = row["default_ms"] / fi_ms if fi_ms and row["default_ms"] else None
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="norm,decode")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fi_tune.py needs a CUDA GPU")
    fi, fi_status = load_flashinfer("cuda")
    report = {
        "benchmark": "fi_tune",
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(fi),
        "flashinfer": fi_status,
        "rounds": args.rounds,
        "rows": [],
    }
    groups = {"norm": norm_rows, "decode": decode_rows}
    for group in args.only.split(","):
        for row in groups[group](fi, fi_status, args.rounds, "cuda"):
            report["rows"].append(row)
            print(json.dumps({k: row[k] for k in ("op", "shape", "default_ms", "best",
                                                  "best_ms", "flashinfer_ms")}))  # fmt: skip
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    print(format_table([
        {k: r[k] for k in ("op", "shape", "default_ms", "best", "best_ms", "flashinfer_ms",
                           "default_over_fi", "best_over_fi")}
        for r in report["rows"]
    ]))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
