"""The benchmark arithmetic, checked against hand-computed numbers."""

from __future__ import annotations

import math

import pytest

from atom_engine.bench import metrics
from atom_engine.bench.metrics import RequestRecord


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert metrics.percentile(values, 0) == 1.0
    assert metrics.percentile(values, 50) == 2.5
    assert metrics.percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert metrics.percentile(values, 100) == 4.0
    assert metrics.percentile([7.0], 99) == 7.0
    assert metrics.percentile([], 99) == 0.0
    with pytest.raises(ValueError, match="percentile"):
        metrics.percentile(values, 101)


def test_mean_std_throughput():
    assert metrics.mean([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert metrics.std([1.0, 2.0, 3.0, 4.0]) == pytest.approx(math.sqrt(1.25))  # ddof = 0
    assert metrics.mean([]) == metrics.std([]) == 0.0
    assert metrics.throughput(30, 2.0) == 15.0
    assert metrics.throughput(30, 0.0) == 0.0


def test_itl_and_tpot():
    assert metrics.inter_token_latencies([0.1, 0.3, 0.35]) == pytest.approx([0.2, 0.05])
    assert metrics.inter_token_latencies([0.1]) == []
    # 5 tokens: the first at 0.2 s, the last at 1.0 s -> 4 gaps over 0.8 s.
    assert metrics.time_per_output_token(1.0, 0.2, 5) == pytest.approx(0.2)
    assert metrics.time_per_output_token(1.0, 0.2, 1) is None
    assert metrics.percentile_key(99) == "p99"
    assert metrics.percentile_key(99.9) == "p99.9"


def test_serve_summary_hand_computed():
    records = [
        RequestRecord(True, input_tokens=10, output_tokens=5, ttft=0.1, e2e=0.5, itl=[0.1] * 4),
        RequestRecord(True, input_tokens=20, output_tokens=1, ttft=0.2, e2e=0.2),
        RequestRecord(False, input_tokens=99, output_tokens=99, ttft=9.0, e2e=9.0),
    ]
    s = metrics.serve_summary(records, duration_s=2.0, percentiles=[99])
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 6)  # failures excluded
    assert s["request_throughput"] == 1.0
    assert s["output_throughput"] == 3.0
    assert s["total_token_throughput"] == 18.0
    assert s["mean_ttft_ms"] == pytest.approx(150.0)
    assert s["median_ttft_ms"] == pytest.approx(150.0)
    assert s["std_ttft_ms"] == pytest.approx(50.0)
    assert s["p99_ttft_ms"] == pytest.approx(199.0)  # 100 + 0.99 * (200 - 100)
    # TPOT only for the request with >= 2 tokens: (0.5 - 0.1) / 4.
    assert s["mean_tpot_ms"] == pytest.approx(100.0)
    assert s["p99_tpot_ms"] == pytest.approx(100.0)
    assert s["mean_itl_ms"] == pytest.approx(100.0)
    assert s["mean_e2el_ms"] == pytest.approx(350.0)
    assert s["p99_e2el_ms"] == pytest.approx(497.0)  # 200 + 0.99 * (500 - 200)


def test_serve_summary_selected_metrics_and_empty():
    s = metrics.serve_summary([RequestRecord(False)], 1.0, percentiles=[50, 90], selected=["ttft"])
    assert s["completed"] == 0 and s["failed"] == 1
    assert s["mean_ttft_ms"] == s["p50_ttft_ms"] == s["p90_ttft_ms"] == 0.0
    assert not any(key.endswith("_itl_ms") for key in s)
    with pytest.raises(ValueError, match="unknown metrics"):
        metrics.serve_summary([], 1.0, selected=["latency"])


def test_throughput_summary():
    s = metrics.throughput_summary(4, input_tokens=64, output_tokens=32, elapsed_s=2.0)
    assert s == {
        "elapsed_time": 2.0,
        "num_requests": 4,
        "total_input_tokens": 64,
        "total_output_tokens": 32,
        "total_num_tokens": 96,
        "requests_per_second": 2.0,
        "input_tokens_per_second": 32.0,
        "output_tokens_per_second": 16.0,
        "tokens_per_second": 48.0,
    }
