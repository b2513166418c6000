"""`atom bench serve`: an async load generator for any OpenAI-compatible server.

Streams every request (`stream_options.include_usage`), timestamps each chunk that carries content,
and reports TTFT / TPOT / ITL / E2E latency like vLLM's `benchmark_serving`. Only standard request
fields are sent (`ignore_eos` only when asked); servers that send no usage chunk are measured by
tokenizing the streamed text.

The HTTP client is a small HTTP/1.1 one over asyncio streams with keep-alive pooling: atom-engine
depends on neither aiohttp nor httpx, and a load generator wants little between it and the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlsplit

from atom_engine.bench import metrics
from atom_engine.bench.datasets import SampleRequest, count_tokens, load_tokenizer, sample_requests

# -- HTTP/1.1 over asyncio streams -------------------------------------------------------------


class HTTPResponse:
    def __init__(self, client: HTTPClient, status: int, headers: dict[str, str], conn) -> None:
        self.client, self.status, self.headers = client, status, headers
        self._reader, self._writer = conn
        self._done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked, sized or until close); pools the connection after."""
        reader = self._reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                if not size_line:
                    raise ConnectionError("connection closed mid-body")
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    break
                yield await reader.readexactly(size)
                await reader.readexactly(2)  # the CRLF after each chunk
            while (await reader.readline()).strip():  # trailers, up to the blank line
                pass
        elif "content-length" in self.headers:
            remaining = int(self.headers["content-length"])
            while remaining > 0:
                piece = await reader.read(min(remaining, 1 << 16))
                if not piece:
                    raise ConnectionError("connection closed mid-body")
                remaining -= len(piece)
                yield piece
        else:
            self.headers["connection"] = "close"
            while piece := await reader.read(1 << 16):
                yield piece
        self._done = True
        self.close()

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    def close(self) -> None:
        """Return the connection to the pool if the body was read and it may be reused."""
        if self._writer is None:
            return
        if self._done and self.headers.get("connection", "").lower() != "close":
            self.client._idle.append((self._reader, self._writer))
        else:
            self._writer.close()
        self._writer = None


class HTTPClient:
    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base URL must look like http://host:port, got {base_url!r}")
        self.host, self.netloc = url.hostname, url.netloc
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.prefix = url.path.rstrip("/")
        self.api_key = api_key
        self._idle: list = []

    async def request(self, method: str, path: str, body: dict | None = None) -> HTTPResponse:
        payload = json.dumps(body).encode() if body is not None else b""
        head = [
            f"{method} {self.prefix}{path} HTTP/1.1",
            f"Host: {self.netloc}",
            "User-Agent: atom-bench",
            "Accept-Encoding: identity",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
        ]
        if self.api_key:
            head.append(f"Authorization: Bearer {self.api_key}")
        message = ("\r\n".join(head) + "\r\n\r\n").encode() + payload
        while True:
            reused = bool(self._idle)
            if reused:
                reader, writer = self._idle.pop()
            else:
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, ssl=self.ssl, limit=1 << 20
                )
            try:
                writer.write(message)
                await writer.drain()
                status_line = await reader.readline()
                if not status_line:
                    raise ConnectionResetError("the server closed the connection")
                break
            except OSError:
                writer.close()
                if not reused:  # a pooled connection may have timed out: retry on a fresh one
                    raise
        headers = {}
        while (line := await reader.readline()).strip():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        version, status, *_ = status_line.decode("latin-1").split()
        if version == "HTTP/1.0":
            headers["connection"] = "close"
        return HTTPResponse(self, int(status), headers, (reader, writer))

    async def get_json(self, path: str) -> dict:
        response = await self.request("GET", path)
        body = await response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {response.status}: {body[:500].decode()}")
        return json.loads(body)

    def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()


class SSEDecoder:
    """Server-sent events -> the data of each event, from body pieces split anywhere."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, piece: bytes) -> list[str]:
        *lines, self._buffer = (self._buffer + piece).split(b"\n")
        events = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[6:] if line.startswith("data: ") else line[5:])
        return events


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
    tokenizer = load_tokenizer(args.tokenizer)
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
