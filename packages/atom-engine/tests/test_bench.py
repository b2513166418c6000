"""`atom bench`: end to end on the bundled model (offline, and against the real ATOM server), plus
the serving client's stream accounting and its handling of failures."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import pytest

from atom_engine.bench import serve
from atom_engine.bench.cli import add_parser
from atom_engine.bench.datasets import SampleRequest, count_tokens, load_tokenizer
from atom_engine.bench.http_client import SSEDecoder


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="atom")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)  # cached: the serve benchmark reuses this instance


# -- offline throughput ------------------------------------------------------------------------


def test_bench_throughput_end_to_end(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    args = _parse([
        "bench", "throughput", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "32",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--no-enable-prefix-caching",
        "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
        "--output-json", str(out), "--disable-tqdm",
    ])  # fmt: skip
    assert args.func(args) == 0  # the `atom` CLI's exit status

    printed = capsys.readouterr().out
    assert "Output token throughput (tok/s):" in printed
    result = json.loads(out.read_text())
    assert result["num_requests"] == 4
    assert result["total_input_tokens"] == 4 * 16
    assert result["total_output_tokens"] == 4 * 8  # ignore_eos: exact lengths
    assert result["total_num_tokens"] == 4 * 24
    assert result["elapsed_time"] > 0
    for key in (
        "requests_per_second",
        "input_tokens_per_second",
        "output_tokens_per_second",
        "tokens_per_second",
    ):
        assert result[key] > 0, key
    assert result["output_tokens_per_second"] == pytest.approx(32 / result["elapsed_time"])
    assert result["engine_config"]["max_num_seqs"] == 4
    assert result["engine_config"]["enable_prefix_caching"] is False
    assert result["device"] == "cpu" and result["resolved_dtype"] == "float32"


# -- the serving client's accounting -----------------------------------------------------------


def test_sse_decoder_reassembles_events_split_anywhere():
    body = b'data: {"a": 1}\n\n: a comment\n\ndata: {"b": "\xc3\xa9"}\r\n\r\ndata: [DONE]\n\n'
    for cut in range(1, len(body)):
        decoder = SSEDecoder()
        events = decoder.feed(body[:cut]) + decoder.feed(body[cut:])
        assert events == ['{"a": 1}', '{"b": "\u00e9"}', "[DONE]"], cut


def test_stream_without_usage_counts_tokens_by_tokenizer(tokenizer):
    result = serve.RequestResult(prompt_len=12, start=10.0)
    events = [  # a chat stream: role-only first chunk, content, an empty delta, no usage chunk
        (10.1, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
        (10.3, {"choices": [{"delta": {"content": "Hello"}}]}),
        (10.4, {"choices": [{"delta": {}}]}),
        (10.5, {"choices": [{"delta": {"content": " world, how"}}]}),
        (10.9, {"choices": [{"delta": {"content": " are you?"}, "finish_reason": "length"}]}),
    ]
    for now, chunk in events:
        result.add_event(json.dumps(chunk), now)
    result.add_event("[DONE]", 11.0)
    result.end, result.success = 11.0, True
    record = result.record(tokenizer)
    assert record.output_tokens == count_tokens(tokenizer, "Hello world, how are you?")
    assert record.input_tokens == 12
    assert record.ttft == pytest.approx(0.3)  # the first chunk with content, not the role chunk
    assert record.itl == pytest.approx([0.2, 0.4])
    assert record.e2e == pytest.approx(1.0)

    with_usage = serve.RequestResult(prompt_len=12, start=0.0)
    with_usage.add_event(json.dumps({"choices": [{"text": "Hi"}], "usage": None}), 0.5)
    usage = {"prompt_tokens": 13, "completion_tokens": 1, "total_tokens": 14}
    with_usage.add_event(json.dumps({"choices": [], "usage": usage}), 0.6)
    with_usage.end, with_usage.success = 0.6, True
    record = with_usage.record(tokenizer)
    assert (record.input_tokens, record.output_tokens) == (13, 1)

    failed = serve.RequestResult(prompt_len=1)
    with pytest.raises(RuntimeError, match="overloaded"):
        failed.add_event(json.dumps({"error": {"message": "overloaded", "code": 503}}), 0.1)


def test_arrival_times():
    assert serve.arrival_times(3, float("inf"), 1.0, seed=0) == [0.0, 0.0, 0.0]
    times = serve.arrival_times(4001, 50.0, 1.0, seed=0)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / 4000 == pytest.approx(1 / 50, rel=0.05)  # mean gap 1 / rate
    bursty = serve.arrival_times(4001, 50.0, 0.2, seed=0)
    assert bursty[-1] / 4000 == pytest.approx(1 / 50, rel=0.1)  # same rate, burstier gaps
    assert times == serve.arrival_times(4001, 50.0, 1.0, seed=0)
    with pytest.raises(ValueError):
        serve.arrival_times(3, 0.0, 1.0, seed=0)


def test_failed_requests_are_counted_not_raised(tokenizer, unused_tcp_port):
    args = _parse([
        "bench", "serve", "--base-url", f"http://127.0.0.1:{unused_tcp_port}", "--model", "m",
        "--skip-test-request", "--disable-tqdm",
    ])  # fmt: skip
    requests = [SampleRequest([1, 2, 3], 4, "a prompt") for _ in range(3)]
    result = asyncio.run(serve.run_benchmark(args, requests, "m", tokenizer))
    assert (result["completed"], result["failed"]) == (0, 3)
    assert all("ConnectionRefusedError" in e for e in result["errors"])
    assert result["total_output_tokens"] == 0

    args.skip_test_request = False
    with pytest.raises(RuntimeError, match="initial test request failed"):
        asyncio.run(serve.run_benchmark(args, requests, "m", tokenizer))


# -- against the real ATOM server --------------------------------------------------------------


@pytest.fixture
def unused_tcp_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def atom_server(tokenizer, smollm2_engine):
    """The real ATOM OpenAI server (build_app + uvicorn) on the bundled model, in a thread (on
    the session's shared engine)."""
    import socket

    import uvicorn

    from atom_engine.server.api_server import build_app

    engine = smollm2_engine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        build_app(engine, "smollm2"), host="127.0.0.1", port=port, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


def test_bench_serve_completions_against_atom_server(atom_server, tmp_path, capsys):
    args = _parse([
        "bench", "serve", "--base-url", atom_server, "--num-prompts", "4",
        "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "serve.json",
        "--disable-tqdm",
    ])  # fmt: skip
    assert args.func(args) == 0  # the `atom` CLI's exit status

    printed = capsys.readouterr().out
    for line in (
        "Successful requests:                     4",
        "Mean TTFT (ms):",
        "P99 TPOT (ms):",
        "Median ITL (ms):",
        "P90 E2EL (ms):",
    ):
        assert line in printed, line
    result = json.loads((tmp_path / "serve.json").read_text())
    assert result["model_id"] == "smollm2"  # from GET /v1/models
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["total_output_tokens"] == 4 * 4  # from the usage chunks
    assert result["output_lens"] == [4] * 4
    assert all(abs(n - 16) <= 2 for n in result["input_lens"])
    assert all(0 < ttft < 60 for ttft in result["ttfts"])
    # Up to 4 content chunks per request (a token can decode to no text yet): up to 3 gaps each.
    assert all(len(itl) <= 3 for itl in result["itls"]) and any(result["itls"])
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["mean_tpot_ms"] > 0 and result["p99_itl_ms"] > 0
    assert result["request_rate"] == "inf" and result["endpoint"] == "/v1/completions"


def test_bench_serve_chat_with_rate_and_concurrency(atom_server, capsys):
    args = _parse([
        "bench", "serve", "--base-url", atom_server, "--endpoint", "/v1/chat/completions",
        "--model", "smollm2", "--num-prompts", "3", "--random-input-len", "8",
        "--random-output-len", "3", "--ignore-eos", "--request-rate", "20",
        "--max-concurrency", "2", "--percentile-metrics", "ttft,e2el",
        "--metric-percentiles", "50,99.9", "--disable-tqdm", "--skip-test-request",
    ])  # fmt: skip
    result = serve.main(args)  # what args.func runs; it returns the result

    printed = capsys.readouterr().out
    assert "Maximum request concurrency:             2" in printed
    assert "P99.9 E2EL (ms):" in printed and "TPOT" not in printed
    assert (result["completed"], result["failed"]) == (3, 0), result["errors"]
    assert result["total_output_tokens"] == 3 * 3
    # The server counts the chat template's tokens too.
    assert result["total_input_tokens"] > 3 * 8
    assert "p50_ttft_ms" in result and "mean_itl_ms" not in result
