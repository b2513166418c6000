"""The engine loop: schedule -> run -> postprocess.

`LLMEngine` is single-threaded: callers add requests, call `step()` until
`has_unfinished_requests()` is False, and read cumulative `RequestOutput`s from each step. The
third verb, with the book of requests it updates, is `postprocess.Postprocessor` (`self.post`).

With async scheduling (the default on CUDA) a step launches batch N+1 on the device before it
reads batch N's sampled ids: the host schedules and prepares while the device computes. A sampled
sequence holds a placeholder token until its id arrives (the device feeds the real id to the next
step itself), so each step's outputs are those of the batch launched one step earlier, and a
sequence that stops computes one token more that is thrown away. Requests with log-probs, prompt
log-probs or penalties need the host to see every step: while one is in flight, steps run
synchronously.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from atom_engine.block_manager import BlockManager
from atom_engine.config import EngineConfig
from atom_engine.detokenizer import IncrementalDetokenizer
from atom_engine.front import EngineFront
from atom_engine.intake import Request, prompt_of
from atom_engine.outputs import RequestMetrics, RequestOutput
from atom_engine.parallel import rank_device
from atom_engine.postprocess import Postprocessor
from atom_engine.sampling_params import SamplingParams
from atom_engine.scheduler import ScheduledBatch, Scheduler
from atom_engine.sequence import PLACEHOLDER, Sequence
from atom_engine.spec_decode import MtpDrafter, NgramDrafter, SpecDecodeStats
from atom_engine.startup import StartupTimes
from atom_engine.step_log import StepLog, clocks
from atom_engine.step_outputs import Launch
from atom_engine.structured_output import GrammarState
from atom_engine.workers import WorkerError, start_runner

logger = logging.getLogger("atom_engine")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    prefix_cache_hit_rate: float  # prompt tokens served from the cache / prompt tokens looked up
    num_preemptions: int
    prompt_tokens: int  # totals since start
    generation_tokens: int
    prompt_throughput: float  # tokens/s over the last `window` seconds
    generation_throughput: float
    num_kv_blocks: int
    block_size: int
    finished_requests: int = 0
    window: float = field(default=10.0, repr=False)
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding


class LLMEngine:
    """One engine: the scheduler, and the model runner of rank 0 (with its tensor-parallel
    workers): one data-parallel replica. `dp_rank` names the replica in its workers' messages
    (`server.replica` runs each replica in a process of its own, on its own devices)."""

    def __init__(self, config: EngineConfig, dp_rank: int | None = None) -> None:
        self.shut_down = False
        startup = StartupTimes()
        if dp_rank is None:
            if config.data_parallel_size > 1:
                raise ValueError(
                    f"data_parallel_size {config.data_parallel_size}: an LLMEngine is one "
                    "replica; LLM(...) and `atom serve` run data-parallel replicas"
                )
            dp_rank = 0
        self.config = config
        with startup.phase("front"):  # the model's files (Hub), its config and tokenizer
            self.front = EngineFront(config)  # checks the parallel and speculative settings first
        self.model_path = self.front.model_path
        self.hf_config = self.front.hf_config
        self.tokenizer = self.front.tokenizer
        self.eos_token_ids = self.front.eos_token_ids
        self.grammars = self.front.grammars
        self.max_model_len = self.front.max_model_len
        spec = config.resolved_speculative_config()
        torch.manual_seed(config.seed)
        device = rank_device(config, 0)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            self.runner = start_runner(
                config, self.model_path, self.hf_config, self.max_model_len, dp_rank
            )
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.front.num_kv_tokens = self.runner.num_blocks * config.block_size
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.resolved_long_prefill_token_threshold(),
        )
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.runner.device.type == "cuda"
        )
        self.drafter = None
        if spec is not None:
            if spec.method == "mtp":
                if self.runner.model.num_mtp_layers < 1:
                    self.runner.shutdown()
                    raise ValueError(
                        "speculative_config.method 'mtp': the checkpoint's config names "
                        "multi-token-prediction layers but it holds no MTP weights "
                        "(use method 'ngram')"
                    )
                self.runner.keep_hidden = True
                self.drafter = MtpDrafter(spec, self.max_model_len, self.runner, self.block_manager)
            else:
                self.drafter = NgramDrafter(spec, self.max_model_len)
            if self.async_scheduling:
                # Drafts come from the tokens just sampled: the host sees every step.
                logger.info("speculative decoding: steps run without async scheduling")
                self.async_scheduling = False
        self.post = Postprocessor(
            self.scheduler,
            self.block_manager,
            self.tokenizer,
            self.max_model_len,
            None if self.drafter is None else self.drafter.stats,
        )
        self._step_log = StepLog.from_env()  # ATOM_STEP_LOG: a line per synchronous step
        self._pending: Launch | None = None  # the launched step whose ids are not read yet
        self.profile = None  # torch.profiler between /start_profile and /stop_profile
        startup.phases.update(self.runner.startup.phases)
        logger.info(startup.line())

    @classmethod
    def from_args(cls, **kwargs) -> LLMEngine:
        return cls(EngineConfig(**kwargs))

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the tensor-parallel worker processes and release every rank's CUDA graphs, KV
        cache, model and process group (idempotent; the engine takes no step after it).
        `graceful=False` kills the workers and aborts the group, leaving the rest to the garbage
        collector (another thread may be inside a step)."""
        self.shut_down = True
        self.runner.shutdown(graceful)

    # -- requests -----------------------------------------------------------------------------

    @property
    def requests(self) -> dict[str, Request]:
        """The requests not finished yet, by id."""
        return self.post.requests

    def tokenize(self, prompt: str) -> list[int]:
        return self.front.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError when it can never run (too long, bad token ids),
        RuntimeError once the engine is shut down."""
        if self.shut_down:
            raise RuntimeError("the engine was shut down: it takes no more requests")
        if request_id in self.post.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        text, token_ids = prompt_of(prompt, None if self.tokenizer is None else self.tokenize)
        self.check_request(token_ids, params)
        params.all_stop_token_ids = set(params.stop_token_ids) | (
            set() if params.ignore_eos else self.eos_token_ids
        )
        now = time.monotonic() if arrival_time is None else arrival_time
        request = Request(request_id, text, token_ids, params, [], RequestMetrics(now))
        if (
            params.logprobs is not None
            or params.prompt_logprobs is not None
            or params.has_penalties
            or params.compiled_grammar is not None  # each mask needs the last token
            or params.thinking_budget is not None  # the forced marker reads the output so far
        ):
            self.post.host_sampled.add(request_id)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.runner.device)
                generator.manual_seed(params.seed_of(index))
            detok = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
            seq = Sequence(request_id, index, token_ids, params, detok, now, generator)
            if params.compiled_grammar is not None:
                stops = self.eos_token_ids | set(params.stop_token_ids)
                seq.grammar = GrammarState(params.compiled_grammar, stops)
            request.seqs.append(seq)
            self.post.seq_to_request[seq.seq_id] = request
            self.scheduler.add(seq)
        self.post.requests[request_id] = request

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when a request can never run (`intake.check_request`); fills
        params' per-model defaults. The server calls it from any thread."""
        self.front.check_request(token_ids, params)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; True if it was still known."""
        return self.post.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        pending = self._pending is not None and any(
            s.seq_id in self.post.seq_to_request for s in self._pending.batch.seqs
        )
        return self.scheduler.has_unfinished() or pending

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests it advanced.

        A step that raises is run again one request at a time: the request whose run fails is
        finished with an error output (`RequestOutput.error`), the others advance as usual.
        """
        if not self.async_scheduling or self.post.host_sampled:
            outputs = self._complete_pending()  # the host must see every token from here on
            return outputs + self._step_sync()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return self._complete_pending()
        self._mark_scheduled(batch)
        try:
            launch = self.runner.launch(batch, self._pending)
        except Exception as error:
            # The launch queued nothing: read the previous one, then isolate the failure.
            outputs = self._complete_pending()
            return outputs + self._run_isolated(batch, error)
        prompt_tokens = self._advance(batch)
        for seq in launch.seqs:  # ids to come: the next launch reads them on the device
            seq.token_ids.append(PLACEHOLDER)
        self.post.prompt_tokens += prompt_tokens
        outputs = self._complete_pending()
        self._pending = launch
        self._record_prompt_tokens(prompt_tokens)
        return outputs

    def _step_sync(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        self._mark_scheduled(batch)
        started, cpu = clocks() if self._step_log else (0.0, 0.0)
        try:
            result = self.runner.run(batch)
        except Exception as error:
            return self._run_isolated(batch, error)
        if self._step_log:
            now, cpu_now = clocks()
            self._step_log.record(started, now - started, cpu_now - cpu, batch.num_tokens)
        outputs = self.post.postprocess(batch, result)
        if self.drafter is not None:  # the next step's drafts, from the tokens just added
            self.drafter.propose(batch, self.scheduler.running)
        return outputs

    def _run_isolated(self, batch: ScheduledBatch, error: Exception) -> list[RequestOutput]:
        """Run a failed step's requests one by one (their blocks are allocated and nothing was
        computed); a request whose own run fails is finished with an error. A tensor-parallel
        rank's failure is the engine's, not a request's: WorkerError propagates."""
        if isinstance(error, WorkerError):
            raise error
        logger.warning(
            "a step of %d sequences failed (%s: %s); running its requests one at a time",
            len(batch.seqs),
            type(error).__name__,
            error,
        )
        groups: dict[str, ScheduledBatch] = {}
        for seq, num in zip(batch.seqs, batch.num_tokens, strict=True):
            if seq.is_finished or seq.seq_id not in self.post.seq_to_request:
                continue  # finished by the previous launch's tokens, or aborted
            group = groups.setdefault(seq.request_id, ScheduledBatch())
            group.seqs.append(seq)
            group.num_tokens.append(num)
        outputs = []
        for request_id, group in groups.items():
            try:
                outputs += self.post.postprocess(group, self.runner.run(group))
            except WorkerError:
                raise
            except Exception as e:
                request = self.post.requests.get(request_id)
                if request is not None:
                    outputs.append(self.post.fail_request(request, e))
        return outputs

    def _mark_scheduled(self, batch) -> None:
        now = time.monotonic()
        for seq in batch.seqs:
            request = self.post.seq_to_request[seq.seq_id]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now

    def _advance(self, batch) -> int:
        """Count the batch's tokens as computed; returns how many of them were prompt tokens."""
        prompt_tokens = 0
        for seq, num in zip(batch.seqs, batch.num_tokens, strict=True):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                prompt_tokens += min(num, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += num
        return prompt_tokens

    def _record_prompt_tokens(self, prompt_tokens: int) -> None:
        if prompt_tokens:
            self.post.history.append((time.monotonic(), prompt_tokens, 0))

    def _complete_pending(self) -> list[RequestOutput]:
        """Read the pending launch's sampled ids and post-process them (`complete_launch`)."""
        launch, self._pending = self._pending, None
        return [] if launch is None else self.post.complete_launch(launch)

    # -- statistics ---------------------------------------------------------------------------

    def stats(self, window: float = 10.0) -> EngineStats:
        now = time.monotonic()
        post = self.post
        post.history = history = [h for h in post.history if now - h[0] <= window]
        span = max(now - history[0][0], 1e-3) if history else 1.0
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            prefix_cache_hit_rate=self.block_manager.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=post.prompt_tokens,
            generation_tokens=post.generation_tokens,
            prompt_throughput=sum(h[1] for h in history) / span,
            generation_throughput=sum(h[2] for h in history) / span,
            num_kv_blocks=self.block_manager.num_blocks,
            block_size=self.block_manager.block_size,
            finished_requests=post.finished_requests,
            window=window,
            spec_decode=None if self.drafter is None else self.drafter.stats,
        )
