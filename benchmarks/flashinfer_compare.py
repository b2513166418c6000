"""ATOM's kernels side by side with FlashInfer's on one GPU (issue 42, item 1).

On the device, after FlashInfer's parts are joined (benchmarks/README.md, "FlashInfer on the
device"):

    . benchmarks/device_env.sh && export PYTHONPATH=/tmp/site:$PYTHONPATH FLASHINFER_NO_DOWNLOAD=1
    python3 benchmarks/flashinfer_compare.py --only norm,silu,rope,sampling --out $OUT/fi-a.json

Rows (flashinfer_cases.py): paged decode attention (GQA 32/8 and 64/4, D 128, B 1 / 64 / 256,
contexts 512 / 4096 / 32768), causal prefill over a paged cache with and without a cached prefix
(4K and 16K new tokens), MLA decode (128 heads, latent 512 + rope 64), RMSNorm, fused add +
RMSNorm, SiLU-and-mul, rotary (neox), top-k / top-p sampling at vocab 128256 and 151936. ATOM's
side is the public op (Triton on a GPU); FlashInfer's is the API vLLM 0.33 calls (0.7.2.post1).

Timing: both sides alternate inside every round (the order flips each round); each call is
timed alone with CUDA events after a 256 MB L2 flush and a ~0.5 ms GPU spin that hides the host's
launch work: GPU time with a cold L2 (an op that syncs the host inside also counts the gaps that
makes); the row's time is the median over ``--rounds``.
FlashInfer's plan() (host work, and its JIT compile at first use) runs once per row, untimed, as
vLLM plans once per step outside the graph. Each row: both times, ``fi_speedup`` = ATOM ms /
FlashInfer ms (above 1: FlashInfer faster), and both as a fraction of the row's roofline: the
larger of its bytes over the device-to-device copy bandwidth and its FLOPs over the bf16 matmul
rate, both measured in the same run (kernels.measure_roofline). Each pair is checked for
agreement first (outputs within bf16 tolerance; sampling: each side's draws inside the top-k /
top-p set). A side that raises (a JIT compile failure, say) records ``error: ...`` in its row
and the run goes on. ``--tiny`` runs small shapes, on the CPU too, where FlashInfer cannot run:
its column then says why (``not installed`` / ``needs CUDA``).

Not done here (issue 42, item 2, once the table exists): for each row where FlashInfer is faster
by more than 5%, either ATOM's kernel is made as fast, or an optional ``atom-kernels[flashinfer]``
backend registers FlashInfer's op beside Triton (registry.register_op under a ``flashinfer``
backend, chosen per op by measurement, never required). That backend will have to own what the
wrappers need per step: a workspace buffer, plan() outside CUDA-graph capture (the decode graphs
need ``use_cuda_graph=True`` wrappers with fixed indptr / indices buffers), ATOM's block table
turned into FlashInfer's CSR pages (``flashinfer_cases.fi_pages``), and in-place norms / rotary
where ATOM's ops are functional. The fused all-reduce + RMSNorm at TP=2 (item 1's last row) is
a two-GPU run and is not in this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from flashinfer_cases import FULL, GROUPS, TINY, Case, cases  # noqa: E402
from kernels import format_table, measure_roofline  # noqa: E402

WARMUP = 3
SPIN_CYCLES = 1_000_000  # torch.cuda._sleep: ~0.5 ms at an H100's 1.98 GHz
TIMING = {
    "cuda": "GPU time of each call after a 256 MB L2 flush and a 0.5 ms spin (CUDA events), "
    "median over rounds, ATOM and FlashInfer alternating",
    "cpu": "wall time of each call, median over rounds",
}


def load_flashinfer(device: str) -> tuple[object | None, str]:
    """(module, "ok") or (None, why not): "not installed", "needs CUDA", "error: ...";
    a missing dependency (apache-tvm-ffi, say) is an error, not "not installed"."""
    os.environ.setdefault("FLASHINFER_NO_DOWNLOAD", "1")  # its cubin loader would try the network
    try:
        import flashinfer
    except ModuleNotFoundError as e:
        if e.name == "flashinfer":
            return None, "not installed"
        return None, f"error: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - any import failure is recorded, not fatal
        return None, f"error: {type(e).__name__}: {e}"
    if device != "cuda":
        return None, "needs CUDA"
    return flashinfer, "ok"


def norm_path(fi, device: str) -> str | None:
    """Which kernels FlashInfer's norms run: "cute-dsl" (its default, with nvidia-cutlass-dsl
    installed, as in vLLM's install) or "cuda-jit" (its fallback without the DSL)."""
    if fi is None:
        return None
    try:
        from flashinfer.norm import _use_cuda_norm  # private: 0.7.2's own dispatch test

        return "cuda-jit" if _use_cuda_norm(torch.device(device)) else "cute-dsl"
    except Exception as e:  # noqa: BLE001
        return _error(e)


def _error(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_alternating(fns: list, resets: list, rounds: int, device: str) -> list[float | None]:
    """Median ms of each callable (None: skipped), the callables alternating within each round,
    the order flipped every other round. CUDA: events around each call after an L2 flush."""
    samples: list[list] = [[] for _ in fns]
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if device == "cuda" else None
    for r in range(rounds):
        order = list(range(len(fns)))
        for i in order if r % 2 == 0 else order[::-1]:
            if fns[i] is None:
                continue
            if resets[i] is not None:  # before the flush: what it writes is not left in L2
                resets[i]()
            if flush is not None:
                flush.zero_()
            if device == "cuda":
                # the GPU spins (~0.5 ms) while the host enqueues the call: the events then
                # bracket GPU work alone, whatever the host's launch work (checks, plan lookups)
                torch.cuda._sleep(SPIN_CYCLES)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fns[i]()
                end.record()
                samples[i].append((start, end))
            else:
                t0 = time.perf_counter()
                fns[i]()
                samples[i].append((time.perf_counter() - t0) * 1e3)
    _sync(device)
    if device == "cuda":
        samples = [[s.elapsed_time(e) for s, e in row] for row in samples]
    return [statistics.median(row) if row else None for row in samples]


def run_case(case: Case, fi, fi_status: str, rounds: int, device: str, roofline: dict | None):
    """One row: warm both sides, check agreement, time them alternating."""
    row = {"op": case.op, "shape": case.shape, "atom": "ok", "flashinfer": fi_status}
    atom_fn, fi_fn = case.atom, None
    try:
        for _ in range(WARMUP):
            if case.atom_reset is not None:
                case.atom_reset()
            atom_out = atom_fn()
        _sync(device)
    except Exception as e:  # noqa: BLE001 - one op must not kill the table
        row["atom"], atom_fn, atom_out = _error(e), None, None
    if fi is not None:
        try:
            fi_fn = case.flashinfer(fi)  # plan (and JIT compile) here, untimed
            if hasattr(fi_fn, "backend"):
                row["flashinfer_backend"] = fi_fn.backend
            for _ in range(WARMUP):
                if case.reset is not None:
                    case.reset()
                fi_out = fi_fn()
            _sync(device)
        except Exception as e:  # noqa: BLE001
            row["flashinfer"], fi_fn = _error(e), None
    if atom_fn is not None:
        try:
            row["check"] = case.check(atom_out, fi_out if fi_fn is not None else None)
        except Exception as e:  # noqa: BLE001
            row["check"] = {"error": _error(e)}
    atom_ms, fi_ms = time_alternating(
        [atom_fn, fi_fn], [case.atom_reset, case.reset], rounds, device
    )
    row.update(atom_ms=atom_ms, flashinfer_ms=fi_ms, bytes=case.bytes, flops=case.flops)
    row["fi_speedup"] = atom_ms / fi_ms if atom_ms and fi_ms else None
    if roofline is not None:
        floor_ms = 1e3 * max(
            case.bytes / (roofline["copy_GBps"] * 1e9),
            case.flops / (roofline["matmul_TFLOPs"] * 1e12),
        )
        row["roofline_ms"] = floor_ms
        row["atom_of_roofline"] = floor_ms / atom_ms if atom_ms else None
        row["fi_of_roofline"] = floor_ms / fi_ms if fi_ms else None
    return row


def table_rows(rows: list[dict]) -> list[dict]:
    def pct(v):
        return f"{100 * v:.0f}%" if v is not None else None

    out = []
    for r in rows:
        agree = (r.get("check") or {}).get("agree")
        fi_ms = r["flashinfer_ms"] if r["flashinfer"] == "ok" else r["flashinfer"][:24]
        out.append(
            {
                "op": r["op"], "shape": r["shape"],
                "atom_ms": r["atom_ms"] if r["atom"] == "ok" else r["atom"][:24],
                "fi_ms": fi_ms, "fi_speedup": r["fi_speedup"],
                "atom_roof": pct(r.get("atom_of_roofline")),
                "fi_roof": pct(r.get("fi_of_roofline")), "agree": agree,
            }
        )  # fmt: skip
    return out


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _versions(fi) -> dict:
    import triton

    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flashinfer": getattr(fi, "__version__", None) or _dist_version("flashinfer-python"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON results file")
    parser.add_argument("--only", default="", help="comma-separated: " + ",".join(GROUPS))
    parser.add_argument("--rounds", type=int, default=30, help="timed calls of each side")
    parser.add_argument(
        "--fi-page-size", type=int, default=16, choices=(1, 16),
        help="FlashInfer's page size: 16 (vLLM's block size) or 1 (SGLang's)",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU or GPU)")
    parser.add_argument("--mla-heads", type=int, nargs="+", help="MLA decode's heads (128)")
    parser.add_argument("--mla-batches", type=int, nargs="+", help="MLA decode's batches")
    args = parser.parse_args(argv)
    groups = set(filter(None, args.only.split(","))) or set(GROUPS)
    if groups - set(GROUPS):
        parser.error(f"--only: unknown {sorted(groups - set(GROUPS))}; known: {GROUPS}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        raise SystemExit("flashinfer_compare.py: full shapes need a CUDA GPU (--tiny runs here)")
    torch.manual_seed(0)
    fi, fi_status = load_flashinfer(device)
    roofline = measure_roofline(torch) if device == "cuda" else None
    rows: list[dict] = []
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"{platform.machine()} CPU",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(fi),
        "flashinfer": fi_status,
        "flashinfer_norm_path": norm_path(fi, device),
        "fi_page_size": args.fi_page_size,
        "atom_block_size": 16,
        "rounds": args.rounds,
        "timing": TIMING[device],
        "roofline": roofline,
        "rows": rows,
    }
    sizes = TINY if args.tiny else FULL
    if args.mla_heads:
        sizes = dataclasses.replace(sizes, mla_heads=tuple(args.mla_heads))
    if args.mla_batches:
        sizes = dataclasses.replace(sizes, mla_batches=tuple(args.mla_batches))
    for case in cases(groups, sizes, device, args.fi_page_size):
        try:
            rows.append(run_case(case, fi, fi_status, args.rounds, device, roofline))
        except Exception as e:  # noqa: BLE001 - timing raised after both warmed up: keep going
            err = _error(e)
            rows.append({"op": case.op, "shape": case.shape, "atom": err, "flashinfer": err})
            rows[-1].update(atom_ms=None, flashinfer_ms=None, fi_speedup=None, check=None)
        print(json.dumps({k: rows[-1][k] for k in ("op", "shape", "atom_ms", "flashinfer_ms")}))
        with open(args.out, "w") as f:  # after every row: a call cut off at its limit keeps them
            json.dump(report, f, indent=2)
        del case
        if device == "cuda":
            torch.cuda.empty_cache()
    print(
        f"{report['device']}  flashinfer: {fi_status} (norms: {report['flashinfer_norm_path']})  "
        f"versions: {report['versions']}"
    )
    if roofline:
        print(f"roofline: copy {roofline['copy_GBps']:.0f} GB/s, "
              f"bf16 matmul {roofline['matmul_TFLOPs']:.0f} TFLOP/s")  # fmt: skip
    print(format_table(table_rows(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
