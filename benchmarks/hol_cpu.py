"""Head-of-line blocking on the CPU: what a long prefill does to the other requests.

One `atom serve` app (in process, real uvicorn on loopback, the bundled SmolLM2 in float32). A
stream A decodes; a long prompt B arrives; a short request C arrives just after it. Recorded: A's
inter-token gaps while B prefills, B's and C's time to first token, and how fast /health and the
400 for an over-long prompt answer during B's prefill. Each configuration (the step's token
budget and the long-prefill cap) runs in turn, alternating over rounds, on this shared machine.

    uv run python benchmarks/hol_cpu.py --rounds 2 --out benchmarks/results/hol-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time

import openai
import torch

from atom_engine import EngineConfig
from atom_engine.server.api_server import build_app
from atom_engine.server.async_engine import AsyncEngine
from atom_engine.testing import http, serve

CONFIGS = {  # name -> (max_num_batched_tokens, long_prefill_token_threshold)
    "budget-2048-no-cap": (2048, 0),
    "budget-2048-cap-512": (2048, 512),
    "budget-512-no-cap": (512, 0),
    "budget-512-cap-128": (512, 128),
}


async def _stream(
    client, prompt: str, max_tokens: int, started: asyncio.Event | None = None
) -> list[float]:
    """Arrival times of a completion's streamed tokens (the first is the time to first token)."""
    times = []
    stream = await client.completions.create(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
            if started is not None:
                started.set()
    return times


async def _probe(url: str, stop: asyncio.Event, out: dict) -> None:
    """/health and an over-long prompt's 400, timed every 0.5 s until `stop`."""
    too_long = json.dumps({"model": "m", "prompt": "hello " * 5000, "max_tokens": 1}).encode()
    while not stop.is_set():
        start = time.perf_counter()
        assert (await asyncio.to_thread(http, "GET", url + "/health")).status_code == 200
        out["health"].append(time.perf_counter() - start)
        start = time.perf_counter()
        response = await asyncio.to_thread(http, "POST", url + "/v1/completions", too_long)
        assert response.status_code == 400, response.text
        out["reject"].append(time.perf_counter() - start)
        await asyncio.sleep(0.5)


async def _scenario(url: str, long_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600)
    long_prompt = " ".join(f"w{i % 97}" for i in range(long_tokens // 2))
    decoding = asyncio.Event()
    a = asyncio.create_task(_stream(client, "Once upon a time", 64, decoding))
    await decoding.wait()
    await asyncio.sleep(1.0)  # A is decoding
    b_start = time.perf_counter()
    b = asyncio.create_task(_stream(client, long_prompt, 2))
    await asyncio.sleep(0.5)
    c_start = time.perf_counter()
    c = asyncio.create_task(_stream(client, "The capital of France is", 2))
    probes: dict = {"health": [], "reject": []}
    stop = asyncio.Event()
    prober = asyncio.create_task(_probe(url, stop, probes))
    b_times = await b
    stop.set()
    await prober
    a_times, c_times = await asyncio.gather(a, c)
    await client.close()
    b_first = b_times[0]
    during = [t1 - t0 for t0, t1 in zip(a_times, a_times[1:], strict=False) if t1 <= b_first]
    before = [t1 - t0 for t0, t1 in zip(a_times, a_times[1:], strict=False) if t1 < b_start]
    return {
        "long_prompt_ttft_s": b_first - b_start,
        "short_request_ttft_s": c_times[0] - c_start,
        "stream_gap_before_s": statistics.median(before) if before else None,
        "stream_max_gap_during_prefill_s": max(during) if during else None,
        "stream_median_gap_during_prefill_s": statistics.median(during) if during else None,
        "health_max_s": max(probes["health"]),
        "reject_max_s": max(probes["reject"]),
        "num_probes": len(probes["health"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    runs = []
    for round_ in range(args.rounds):
        for name in args.configs:
            budget, cap = CONFIGS[name]
            config = EngineConfig(
                dtype="float32", device="cpu", max_model_len=4096,
                max_num_batched_tokens=budget, long_prefill_token_threshold=cap,
            )  # fmt: skip
            engine = AsyncEngine.from_config(config)
            server = serve(build_app(engine, "m"), engine)
            try:
                result = asyncio.run(_scenario(server.url, args.long_tokens))
            finally:
                server.stop()
                engine.shutdown()
            result.update(config=name, round=round_, load_average=os.getloadavg())
            print(json.dumps(result))
            runs.append(result)
    summary = {}
    for name in args.configs:
        mine = [r for r in runs if r["config"] == name]
        summary[name] = {
            key: statistics.median(r[key] for r in mine)
            for key in mine[0]
            if key.endswith("_s") and all(r[key] is not None for r in mine)
        }
    report = {
        "benchmark": "hol_cpu",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "long_prompt_tokens": args.long_tokens,
        "runs": runs,
        "medians": summary,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
