"""The benchmarks' arithmetic: percentiles, throughputs, TPOT / ITL, summaries. Pure functions.

Definitions follow vLLM's `benchmark_serving` so numbers compare across engines:
TTFT = first content chunk - request sent; ITL = each gap between content chunks; TPOT =
(E2E - TTFT) / (output tokens - 1), defined for requests with at least two output tokens; E2EL =
last byte - request sent. Latencies are kept in seconds and reported in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

SERVE_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100), interpolated linearly like numpy's default; 0.0 if empty."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def std(values: Sequence[float]) -> float:
    """Population standard deviation (numpy's default, ddof=0); 0.0 if empty."""
    if not values:
        return 0.0
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def throughput(amount: float, seconds: float) -> float:
    """amount / seconds; 0.0 for a zero-length interval rather than a division error."""
    return amount / seconds if seconds > 0 else 0.0


def inter_token_latencies(timestamps: Sequence[float]) -> list[float]:
    """The gaps between consecutive content chunks' arrival times."""
    return [b - a for a, b in zip(timestamps, timestamps[1:], strict=False)]


def time_per_output_token(e2e: float, ttft: float, num_output_tokens: int) -> float | None:
    """Mean decode time per token after the first; None with fewer than two output tokens."""
    if num_output_tokens < 2:
        return None
    return (e2e - ttft) / (num_output_tokens - 1)


def percentile_key(p: float) -> str:
    """vLLM's key spelling: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def latency_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std and the chosen percentiles of latencies in seconds, in milliseconds."""
    stats = {
        "mean": mean(values_s) * 1e3,
        "median": percentile(values_s, 50) * 1e3,
        "std": std(values_s) * 1e3,
    }
    for p in percentiles:
        stats[percentile_key(p)] = percentile(values_s, p) * 1e3
    return stats


@dataclass
class RequestRecord:
    """What one request of a serving benchmark measured (seconds, tokens)."""

    success: bool
    input_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def serve_summary(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (90, 99),
    selected: Sequence[str] = SERVE_METRICS,
) -> dict[str, float | int]:
    """The serving benchmark's aggregate numbers, keyed like vLLM's result JSON.

    Token totals and latencies cover successful requests only; throughputs divide by the whole
    benchmark's duration.
    """
    unknown = set(selected) - set(SERVE_METRICS)
    if unknown:
        raise ValueError(f"unknown metrics {sorted(unknown)}; choose from {SERVE_METRICS}")
    ok = [r for r in records if r.success]
    total_input = sum(r.input_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    tpots = [time_per_output_token(r.e2e, r.ttft, r.output_tokens) for r in ok]
    per_metric = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for t in tpots if t is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2e for r in ok],
    }
    summary: dict[str, float | int] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": throughput(len(ok), duration_s),
        "output_throughput": throughput(total_output, duration_s),
        "total_token_throughput": throughput(total_input + total_output, duration_s),
    }
    for name in selected:
        for stat, value in latency_stats(per_metric[name], percentiles).items():
            summary[f"{stat}_{name}_ms"] = value
    return summary


def throughput_summary(
    num_requests: int, input_tokens: int, output_tokens: int, elapsed_s: float
) -> dict[str, float | int]:
    """The offline benchmark's numbers (`tokens_per_second` is the total, as vLLM names it)."""
    return {
        "elapsed_time": elapsed_s,
        "num_requests": num_requests,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": input_tokens + output_tokens,
        "requests_per_second": throughput(num_requests, elapsed_s),
        "input_tokens_per_second": throughput(input_tokens, elapsed_s),
        "output_tokens_per_second": throughput(output_tokens, elapsed_s),
        "tokens_per_second": throughput(input_tokens + output_tokens, elapsed_s),
    }
