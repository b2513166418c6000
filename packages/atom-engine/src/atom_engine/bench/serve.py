"""`atom bench serve`: an async load generator for any OpenAI-compatible server.

Streams every request (`stream_options.include_usage`), timestamps each chunk that carries content,
and reports TTFT / TPOT / ITL / E2E latency like vLLM's `benchmark_serving`. Only standard request
fields are sent (`ignore_eos` only when asked); servers that send no usage chunk are measured by
tokenizing the streamed text.

The HTTP client and the SSE decoder are `bench.http_client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import time
from dataclasses import dataclass, field
from datetime import datetime

from atom_engine.bench import metrics
from atom_engine.bench.datasets import SampleRequest, count_tokens, load_tokenizer, sample_requests
from atom_engine.bench.http_client import HTTPClient, SSEDecoder

# -- one request -------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """What one streamed request measured; times are perf_counter seconds."""

    prompt_len: int
    start: float = 0.0
    success: bool = False
    error: str = ""
    generated_text: str = ""
    content_times: list[float] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int | None = None  # from the usage chunk, when the server sends one
    completion_tokens: int | None = None

    def add_event(self, data: str, now: float) -> None:
        """Account one SSE event's data (a completion or chat chunk, usage, error or [DONE])."""
        if data.strip() == "[DONE]":
            return
        chunk = json.loads(data)
        if chunk.get("error"):
            error = chunk["error"]
            raise RuntimeError(error.get("message", error) if isinstance(error, dict) else error)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = (  # reasoning models stream their thinking in a field of its own
                choice.get("text")
                or delta.get("content")
                or delta.get("reasoning_content")
                or delta.get("reasoning")
            )
            if text:
                self.generated_text += text
                self.content_times.append(now)
        if usage := chunk.get("usage"):
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)

    def record(self, tokenizer) -> metrics.RequestRecord:
        if not self.success:
            return metrics.RequestRecord(success=False)
        output_tokens = self.completion_tokens
        if output_tokens is None:
            output_tokens = count_tokens(tokenizer, self.generated_text)
        # A stream with no content (an immediate stop) has its first token at its end.
        first = self.content_times[0] if self.content_times else self.end
        return metrics.RequestRecord(
            success=True,
            input_tokens=self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len,
            output_tokens=output_tokens,
            ttft=first - self.start,
            e2e=self.end - self.start,
            itl=metrics.inter_token_latencies(self.content_times),
        )


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int, args) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": args.temperature}
    if endpoint.rstrip("/").endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


async def send_request(client: HTTPClient, endpoint: str, body: dict, prompt_len: int):
    """Stream one request; failures are recorded in the result, never raised."""
    result = RequestResult(prompt_len=prompt_len, start=time.perf_counter())
    response = None
    try:
        response = await client.request("POST", endpoint, body)
        if response.status != 200:
            text = (await response.read()).decode("utf-8", "replace")
            raise RuntimeError(f"HTTP {response.status}: {text[:500]}")
        decoder = SSEDecoder()
        async for piece in response.chunks():
            now = time.perf_counter()
            for data in decoder.feed(piece):
                result.add_event(data, now)
        result.end = time.perf_counter()
        result.success = True
    except Exception as e:  # a failed request is a measurement, not a crash
        result.error = f"{type(e).__name__}: {e}"
    finally:
        if response is not None:
            response.close()
    return result


# -- the benchmark -----------------------------------------------------------------------------


def arrival_times(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request is sent, in seconds from the start (the first at 0).

    Gaps are Gamma(shape=burstiness, mean 1/rate) as in vLLM: burstiness 1 is a Poisson process,
    lower is burstier. An infinite rate sends everything at once.
    """
    if request_rate == float("inf"):
        return [0.0] * num
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    gaps = [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(num - 1)]
    return list(itertools.accumulate(gaps))


async def run_benchmark(args, requests: list[SampleRequest], model: str, tokenizer) -> dict:
    """Send `requests` to the server as `args` say; the summary plus per-request lists."""
    from tqdm.auto import tqdm

    client = HTTPClient(args.base_url, args.api_key)
    try:
        if not args.skip_test_request:
            first = requests[0]
            body = request_body(args.endpoint, model, first.prompt, first.expected_output_len, args)
            test = await send_request(client, args.endpoint, body, first.prompt_len)
            if not test.success:
                raise RuntimeError(f"the initial test request failed: {test.error}")
        times = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc="Requests", unit="req")

        async def one(request: SampleRequest) -> RequestResult:
            body = request_body(
                args.endpoint, model, request.prompt, request.expected_output_len, args
            )
            async with limit or contextlib.nullcontext():
                result = await send_request(client, args.endpoint, body, request.prompt_len)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for request, at in zip(requests, times, strict=True):
            # Sleep to absolute times so that sleep overshoot does not accumulate.
            if (delay := start + at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    finally:
        client.close()
    records = [r.record(tokenizer) for r in results]
    summary = metrics.serve_summary(
        records, duration, args.metric_percentiles, args.percentile_metrics
    )
    return {
        **summary,
        "input_lens": [r.input_tokens for r in records],
        "output_lens": [r.output_tokens for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }


_SECTIONS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def format_report(result: dict, percentiles, selected, max_concurrency=None) -> str:
    """vLLM's result table."""

    def row(label: str, value) -> str:
        return f"{label:<40} {value:.2f}" if isinstance(value, float) else f"{label:<40} {value}"

    lines = [
        " Serving Benchmark Result ".center(50, "="),
        row("Successful requests:", result["completed"]),
        row("Failed requests:", result["failed"]),
    ]
    if max_concurrency:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    lines += [
        row("Benchmark duration (s):", float(result["duration"])),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Request throughput (req/s):", float(result["request_throughput"])),
        row("Output token throughput (tok/s):", float(result["output_throughput"])),
        row("Total Token throughput (tok/s):", float(result["total_token_throughput"])),
    ]
    for name in selected:
        short, title = _SECTIONS[name]
        lines.append(f" {title} ".center(50, "-"))
        lines.append(row(f"Mean {short} (ms):", float(result[f"mean_{name}_ms"])))
        lines.append(row(f"Median {short} (ms):", float(result[f"median_{name}_ms"])))
        for p in percentiles:
            key = metrics.percentile_key(p)
            lines.append(row(f"{key.upper()} {short} (ms):", float(result[f"{key}_{name}_ms"])))
    lines.append("=" * 50)
    return "\n".join(lines)


def main(args) -> dict:
    """Run `atom bench serve` from parsed arguments: print (and save) the result, return it."""
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    tokenizer = load_tokenizer(args.tokenizer, args.trust_remote_code)
    model = args.model or asyncio.run(_first_model(args.base_url, args.api_key))
    is_sharegpt = args.dataset_name == "sharegpt"
    requests = sample_requests(
        args.dataset_name,
        tokenizer,
        args.num_prompts,
        args.random_input_len,
        args.sharegpt_output_len if is_sharegpt else args.random_output_len,
        args.random_range_ratio,
        args.dataset_path,
        args.seed,
        as_text=True,
    )
    print(
        f"Benchmarking {model} at {args.base_url}{args.endpoint}: {len(requests)} requests, "
        f"rate {args.request_rate}, max concurrency {args.max_concurrency}"
    )
    result = asyncio.run(run_benchmark(args, requests, model, tokenizer))
    print(
        format_report(
            result, args.metric_percentiles, args.percentile_metrics, args.max_concurrency
        )
    )
    now = datetime.now()
    config = {
        "date": now.strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if "chat" in args.endpoint else "openai",
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": args.tokenizer or "bundled:SmolLM2-135M-Instruct",
        "dataset_name": args.dataset_name,
        "dataset_path": args.dataset_path,
        "num_prompts": len(requests),
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
    }
    result = {**config, **result}
    if args.save_result:
        rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = args.result_filename or (
            f"atom-{rate}qps{concurrency}-{model.split('/')[-1]}-{config['date']}.json"
        )
        path = os.path.join(args.result_dir or ".", name)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"Saved {path}")
    return result


async def _first_model(base_url: str, api_key: str | None) -> str:
    client = HTTPClient(base_url, api_key)
    try:
        models = (await client.get_json("/v1/models")).get("data") or []
    finally:
        client.close()
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]
