"""`DataParallelEngine`: `data_parallel_size` engine replicas behind one server (or `LLM`).

Each replica is a whole engine (its scheduler, KV cache and tensor-parallel ranks, on GPUs
d * tp ... d * tp + tp - 1) in a process of its own (`server.replica`: as vLLM's data-parallel
engine cores), so the replicas' host work (scheduling, detokenizing, launching) runs in parallel
and each process owns its devices. This process keeps an `EngineFront` (tokenizer, request
checks, grammars) and no model. A new request goes to the replica with the fewest requests in
flight (running plus waiting, as seen from here: accepted and not yet finished or aborted; ties
to the lowest index), and stays there. `stats()` sums the replicas (the KV-cache usage weighted by
blocks), so `/metrics` shows the whole server. One replica's failure is the server's: `atom serve`
exits non-zero rather than serve on at a fraction of its size.

MoE replicas do not share experts (each replica's expert parallelism, if enabled, is over its own
tensor-parallel ranks).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from atom_engine.config import EngineConfig
from atom_engine.engine import EngineStats, LLMEngine
from atom_engine.front import EngineFront
from atom_engine.outputs import RequestOutput
from atom_engine.sampling_params import SamplingParams
from atom_engine.server.replica import ReplicaProcess
from atom_engine.spec_decode import SpecDecodeStats

logger = logging.getLogger("atom_engine.server")


class DataParallelEngine:
    """Several replicas (`ReplicaProcess`es) with the `AsyncEngine` interface the server uses."""

    def __init__(self, replicas: list, front: EngineFront | None = None) -> None:
        self.replicas = replicas
        # What the server reads from "the engine" (config, request checks, vocabulary, context)
        # is the same in every replica: the front's, or the first replica's.
        first = replicas[0]
        self.engine = front if front is not None else first.engine
        self.tokenizer = (front or first).tokenizer
        self.max_model_len = (front or first).max_model_len
        self.model_path = (front or first).model_path
        self._live: list[set[str]] = [set() for _ in replicas]
        self._owner: dict[str, int] = {}

    @classmethod
    def from_config(cls, config: EngineConfig) -> DataParallelEngine:
        """Start the replicas' processes together and wait for every one (a replica that fails
        to start stops the others and raises its error)."""
        front = EngineFront(config)  # checks the split before any process starts
        # The replicas load the paths the front resolved (a Hub ID is downloaded once, here).
        local = dataclasses.replace(
            config, model=front.model_path, tokenizer=front.tokenizer_path, gguf_file=None
        )
        replicas: list[ReplicaProcess] = []
        nodes = None  # over several nodes: node 0's listener for the others' replicas
        if config.nnodes > 1:
            from atom_engine.server.remote_replica import meet_replica_nodes

            local, nodes = meet_replica_nodes(local, front)
        try:
            for dp_rank in range(local.data_parallel_size):
                replicas.append(ReplicaProcess(local, dp_rank))
            if nodes is not None:
                replicas += nodes.accept()
            for replica in replicas:
                replica.wait_ready()
        except BaseException:
            for replica in replicas:
                replica.stop()
            for replica in replicas:
                replica.shutdown(timeout=10.0)
            raise
        # A request must fit every replica's cache (each sized its own).
        front.num_kv_tokens = min(r.num_kv_tokens for r in replicas)
        logger.info(
            "%d data-parallel replicas (processes %s)",
            len(replicas),
            ", ".join(str(r.proc.pid) for r in replicas),
        )
        return cls(replicas, front)

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    def load(self) -> list[int]:
        """Requests in flight per replica."""
        return [len(live) for live in self._live]

    async def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        index = min(range(len(self.replicas)), key=lambda i: (len(self._live[i]), i))
        self._live[index].add(request_id)  # counted before the await: a burst spreads out
        self._owner[request_id] = index
        try:
            stream = await self.replicas[index].add_request(request_id, prompt, params)
        except BaseException:
            self._forget(request_id)
            raise
        return self._track(request_id, stream)

    async def _track(
        self, request_id: str, stream: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[RequestOutput]:
        try:
            async for output in stream:
                yield output
        finally:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        index = self._owner.pop(request_id, None)
        if index is not None:
            self._live[index].discard(request_id)

    def abort(self, request_id: str) -> None:
        index = self._owner.get(request_id)
        if index is not None:
            self.replicas[index].abort(request_id)
            self._forget(request_id)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> list[Any]:
        """Run `fn` on every replica's engine thread (the profiler's hooks); their results."""
        return list(await asyncio.gather(*(r.call(fn) for r in self.replicas)))

    def fail_all(self, message: str) -> None:
        for replica in self.replicas:
            replica.fail_all(message)

    @property
    def fatal_error(self) -> BaseException | None:
        return next((r.fatal_error for r in self.replicas if r.fatal_error is not None), None)

    def add_fatal_hook(self, hook: Callable[[BaseException], None]) -> None:
        """`hook(error)` when any replica cannot go on (the server stops: one replica's loss
        would silently halve it)."""
        for replica in self.replicas:
            replica.add_fatal_hook(hook)

    def stats(self) -> EngineStats:
        parts = [r.stats() for r in self.replicas]
        blocks = sum(p.num_kv_blocks for p in parts)
        prompt_tokens = sum(p.prompt_tokens for p in parts)
        return EngineStats(
            num_running=sum(p.num_running for p in parts),
            num_waiting=sum(p.num_waiting for p in parts),
            kv_cache_usage=sum(p.kv_cache_usage * p.num_kv_blocks for p in parts) / blocks,
            # weighted by prompt tokens: the replicas' hit rates over their own lookups
            prefix_cache_hit_rate=(
                sum(p.prefix_cache_hit_rate * p.prompt_tokens for p in parts) / prompt_tokens
                if prompt_tokens
                else 0.0
            ),
            num_preemptions=sum(p.num_preemptions for p in parts),
            prompt_tokens=prompt_tokens,
            generation_tokens=sum(p.generation_tokens for p in parts),
            prompt_throughput=sum(p.prompt_throughput for p in parts),
            generation_throughput=sum(p.generation_throughput for p in parts),
            num_kv_blocks=blocks,
            block_size=parts[0].block_size,
            finished_requests=sum(p.finished_requests for p in parts),
            window=parts[0].window,
            spec_decode=(
                None
                if parts[0].spec_decode is None
                else SpecDecodeStats.merge([p.spec_decode for p in parts])
            ),
        )

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every replica (together), waiting up to `timeout` s each (at least 10 s: a
        replica stops its workers and releases its devices before it exits)."""
        for replica in self.replicas:
            getattr(replica, "stop", lambda: None)()
        for replica in self.replicas:
            replica.shutdown(max(timeout, 10.0))
