"""The engine loop: schedule -> run -> postprocess.

`LLMEngine` is single-threaded: callers add requests, call `step()` until
`has_unfinished_requests()` is False, and read cumulative `RequestOutput`s from each step.

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
from atom_engine.completion import check_stop, complete_launch
from atom_engine.config import EngineConfig
from atom_engine.detokenizer import IncrementalDetokenizer
from atom_engine.front import EngineFront
from atom_engine.intake import Request, prompt_of
from atom_engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from atom_engine.parallel import rank_device
from atom_engine.sampler import TopLogprobs
from atom_engine.sampling_params import SamplingParams
from atom_engine.scheduler import ScheduledBatch, Scheduler
from atom_engine.sequence import PLACEHOLDER, Sequence
from atom_engine.spec_decode import MtpDrafter, NgramDrafter, SpecDecodeStats
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
        if dp_rank is None:
            if config.data_parallel_size > 1:
                raise ValueError(
                    f"data_parallel_size {config.data_parallel_size}: an LLMEngine is one "
                    "replica; LLM(...) and `atom serve` run data-parallel replicas"
                )
            dp_rank = 0
        self.config = config
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
        self.requests: dict[str, Request] = {}
        self._seq_to_request: dict[int, Request] = {}
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished_requests = 0
        self._history: list[tuple[float, int, int]] = []  # (time, prompt tokens, output tokens)
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
        self._step_log = StepLog.from_env()  # ATOM_STEP_LOG: a line per synchronous step
        self._pending: Launch | None = None  # the launched step whose ids are not read yet
        self._host_sampled: set[str] = set()  # requests whose sampling needs the host each step
        self.profile = None  # torch.profiler between /start_profile and /stop_profile

    @classmethod
    def from_args(cls, **kwargs) -> LLMEngine:
        return cls(EngineConfig(**kwargs))

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the tensor-parallel worker processes and release every rank's CUDA graphs, KV
        cache, model and process group (idempotent; the engine takes no step after it).
        `graceful=False` kills the workers and aborts the group, leaving the rest to the garbage
        collector (another thread may be inside a step)."""
        self.runner.shutdown(graceful)

    # -- requests -----------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return self.front.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError when it can never run (too long, bad token ids)."""
        if request_id in self.requests:
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
        ):
            self._host_sampled.add(request_id)
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
            self._seq_to_request[seq.seq_id] = request
            self.scheduler.add(seq)
        self.requests[request_id] = request

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when a request can never run (`intake.check_request`); fills
        params' per-model defaults. The server calls it from any thread."""
        self.front.check_request(token_ids, params)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; True if it was still known."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self._host_sampled.discard(request_id)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
            self._seq_to_request.pop(seq.seq_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        pending = self._pending is not None and any(
            s.seq_id in self._seq_to_request for s in self._pending.batch.seqs
        )
        return self.scheduler.has_unfinished() or pending

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests it advanced.

        A step that raises is run again one request at a time: the request whose run fails is
        finished with an error output (`RequestOutput.error`), the others advance as usual.
        """
        if not self.async_scheduling or self._host_sampled:
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
        self._prompt_tokens += prompt_tokens
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
        outputs = self._postprocess(batch, result)
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
            if seq.is_finished or seq.seq_id not in self._seq_to_request:
                continue  # finished by the previous launch's tokens, or aborted
            group = groups.setdefault(seq.request_id, ScheduledBatch())
            group.seqs.append(seq)
            group.num_tokens.append(num)
        outputs = []
        for request_id, group in groups.items():
            try:
                outputs += self._postprocess(group, self.runner.run(group))
            except WorkerError:
                raise
            except Exception as e:
                request = self.requests.get(request_id)
                if request is not None:
                    outputs.append(self._fail_request(request, e))
        return outputs

    def _fail_request(self, request: Request, error: Exception) -> RequestOutput:
        """Finish a request with an error (its blocks are freed); its final output."""
        logger.error("request %s failed", request.request_id, exc_info=error)
        message = f"{type(error).__name__}: {error}"
        self.abort_request(request.request_id)
        for seq in request.seqs:
            seq.finish_reason = "error"
        request.metrics.finished_time = time.monotonic()
        output = self._output_of(request)
        output.error = message
        return output

    def _mark_scheduled(self, batch) -> None:
        now = time.monotonic()
        for seq in batch.seqs:
            request = self._seq_to_request[seq.seq_id]
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
            self._history.append((time.monotonic(), prompt_tokens, 0))

    def _complete_pending(self) -> list[RequestOutput]:
        """Read the pending launch's sampled ids and post-process them (`complete_launch`)."""
        launch, self._pending = self._pending, None
        return [] if launch is None else complete_launch(self, launch)

    def _postprocess(self, batch, result) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, Request] = {}
        failed: list[RequestOutput] = []
        prompt_tokens = generation_tokens = 0
        for seq, num in zip(batch.seqs, batch.num_tokens, strict=True):
            request = self._seq_to_request.get(seq.seq_id)
            if request is None:  # failed with another sequence of its request
                continue
            try:
                new_prompt, new_generated = self._postprocess_seq(request, seq, num, result, now)
            except Exception as e:  # one request's failure (detokenizing, ...) is its own
                touched.pop(request.request_id, None)
                failed.append(self._fail_request(request, e))
                continue
            prompt_tokens += new_prompt
            generation_tokens += new_generated
            touched[request.request_id] = request
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += generation_tokens
        self._history.append((now, prompt_tokens, generation_tokens))
        return failed + self._finish_outputs(touched, now)

    def _postprocess_seq(
        self, request: Request, seq: Sequence, num: int, result, now: float
    ) -> tuple[int, int]:
        """Advance one sequence by a step's result; (prompt tokens, generated tokens) counted."""
        prompt_tokens = generated = 0
        num_drafts = len(seq.spec_token_ids)
        num -= num_drafts  # the tokens fed besides the drafts
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            prompt_tokens = min(num, seq.num_prompt_tokens - seq.num_computed_tokens)
        if seq.seq_id in result.prompt_logprobs and seq.index == 0:
            # Positions start+1...; a recomputed (preempted) prefill repeats known ones.
            first = seq.num_computed_tokens + 1
            for i, info in enumerate(result.prompt_logprobs[seq.seq_id]):
                if first + i == len(request.prompt_logprobs):
                    request.prompt_logprobs.append(self._logprob_dict(info))
        seq.num_computed_tokens += num
        self.block_manager.cache_computed_blocks(seq)
        emitted = result.sampled.get(seq.seq_id, ())
        if num_drafts:  # emitted: the accepted drafts, then the token drawn after them
            self.drafter.stats.record(num_drafts, len(emitted) - 1)
            seq.spec_token_ids = []
        for token_id, info in emitted:
            if generated:  # the accepted draft before this token is in the cache
                seq.num_computed_tokens += 1
            self._append_token(seq, token_id, info)
            generated += 1
            if seq.is_finished:  # a stop inside the accepted run: the rest is dropped
                break
        if num_drafts and not seq.is_finished:
            self.block_manager.cache_computed_blocks(seq)
            self.block_manager.trim(seq)  # the rejected drafts' blocks
        if generated:
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
        return prompt_tokens, generated

    def _finish_outputs(self, touched: dict[str, Request], now: float) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
                self._host_sampled.discard(request.request_id)
                for seq in request.seqs:
                    self._seq_to_request.pop(seq.seq_id, None)
                self._finished_requests += 1
            elif request.params.output_kind == "final_only":
                continue
            outputs.append(self._output_of(request))
        return outputs

    def _append_token(self, seq: Sequence, token_id: int, info: TopLogprobs | None) -> None:
        seq.token_ids.append(token_id)
        if info is not None:
            seq.cumulative_logprob += info.logprob
            seq.logprobs.append(self._logprob_dict(info))
        if check_stop(seq, token_id, self.max_model_len):
            self.scheduler.finish(seq)

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _logprob_dict(self, info: TopLogprobs) -> dict[int, Logprob]:
        entry = {
            tid: Logprob(lp, rank + 1, self._decode_one(tid))
            for rank, (tid, lp) in enumerate(zip(info.top_ids, info.top_logprobs, strict=True))
        }
        if info.token_id not in entry:
            entry[info.token_id] = Logprob(info.logprob, info.rank, self._decode_one(info.token_id))
        return entry

    def _output_of(self, request: Request) -> RequestOutput:
        request.metrics.num_cached_prompt_tokens = request.seqs[0].num_cached_prompt_tokens
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=seq.output_text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in request.seqs
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            prompt_logprobs=request.prompt_logprobs,
            metrics=request.metrics,
        )

    # -- statistics ---------------------------------------------------------------------------

    def stats(self, window: float = 10.0) -> EngineStats:
        now = time.monotonic()
        self._history = [h for h in self._history if now - h[0] <= window]
        span = max(now - self._history[0][0], 1e-3) if self._history else 1.0
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            prefix_cache_hit_rate=self.block_manager.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            prompt_throughput=sum(h[1] for h in self._history) / span,
            generation_throughput=sum(h[2] for h in self._history) / span,
            num_kv_blocks=self.block_manager.num_blocks,
            block_size=self.block_manager.block_size,
            finished_requests=self._finished_requests,
            window=window,
            spec_decode=None if self.drafter is None else self.drafter.stats,
        )
