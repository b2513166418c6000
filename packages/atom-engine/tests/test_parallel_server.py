"""`atom serve` over several ranks and replicas: `--tensor-parallel-size 2` and
`--data-parallel-size 2` answer concurrent openai-client requests with the greedy text of one
process; the data-parallel front spreads requests by load and sums the replicas' statistics.
(Killed ranks: test_multi_gpu_serve.py and test_data_parallel.py.)"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from transformers import LlamaConfig

from atom_engine import LLM, SamplingParams
from atom_engine.engine import EngineStats
from atom_engine.server.data_parallel import DataParallelEngine
from atom_engine.testing import http, start_server, stop_server, workers_of

PROMPTS = ["Once upon a time", "def fibonacci(n):", "1, 2, 3,", "The capital of France is"]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    path, _ = tiny_checkpoint(config)
    return path


@pytest.mark.slow  # two servers' start-up on a busy 2-core CPU
@pytest.mark.parametrize("flags", [("-tp", "2"), ("--data-parallel-size", "2")], ids=["tp2", "dp2"])
def test_serve_answers_concurrent_requests_like_one_process(checkpoint, flags, tmp_path):
    with LLM(str(checkpoint), num_kv_blocks=64) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    # NOTE: a start with a worker took ~100 s at load 15 on 2 cores (start_server waits 600 s).
    flags = ("--device", "cpu", "--num-kv-blocks", "64", *flags)
    server, url = start_server(checkpoint, tmp_path / "serve.log", *flags)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")

        def complete(prompt: str) -> str:
            return (
                client.completions.create(
                    model=str(checkpoint),
                    prompt=prompt,
                    max_tokens=24,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                .choices[0]
                .text
            )

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(complete, PROMPTS * 2))
        assert got == expected * 2
        metrics = http("GET", url + "/metrics").text
        blocks = 64 * (2 if "--data-parallel-size" in flags else 1)
        assert f"atom:num_kv_blocks {blocks}" in metrics.replace(".0\n", "\n")
    finally:
        stop_server(server)
    assert workers_of(server.pid) == []


class _FakeReplica:
    """What DataParallelEngine needs of an AsyncEngine: requests end when `finish` is called."""

    def __init__(self, blocks: int) -> None:
        self.engine = self.tokenizer = None
        self.max_model_len, self.model_path = 64, "m"
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.done: dict[str, asyncio.Event] = {}
        self.blocks = blocks

    async def add_request(self, request_id, prompt, params):
        self.added.append(request_id)
        self.done[request_id] = asyncio.Event()

        async def outputs():
            await self.done[request_id].wait()
            yield request_id

        return outputs()

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.added), num_waiting=1, kv_cache_usage=0.5,
            prefix_cache_hit_rate=0.0, num_preemptions=0, prompt_tokens=0,
            generation_tokens=10, prompt_throughput=0.0, generation_throughput=1.0,
            num_kv_blocks=self.blocks, block_size=16,
        )  # fmt: skip


def test_data_parallel_front_balances_by_load_and_sums_stats():
    async def main() -> None:
        a, b = _FakeReplica(100), _FakeReplica(300)
        front = DataParallelEngine([a, b])
        streams = {i: await front.add_request(str(i), "p", None) for i in range(3)}
        assert (a.added, b.added) == (["0", "2"], ["1"])  # least loaded first, ties to replica 0
        a.done["0"].set()
        assert [x async for x in streams[0]] == ["0"]
        front.abort("2")  # aborted without being read: its slot frees too
        assert a.aborted == ["2"] and front.load() == [0, 1]
        await front.add_request("3", "p", None)
        assert a.added[-1] == "3"
        stats = front.stats()
        assert stats.num_kv_blocks == 400 and stats.num_running == 4 and stats.num_waiting == 2
        assert stats.kv_cache_usage == 0.5 and stats.generation_tokens == 20

    asyncio.run(main())
