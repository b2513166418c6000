"""The model runner: loads the model, owns the KV cache, runs one scheduled batch.

It sees tokens, positions and blocks, never request lifecycles: `run` returns the sampled token of
every sequence whose scheduled tokens reached its end, and the prompt log-probs it was asked for.

`launch` is the overlapped form (async scheduling): it queues the step on the device and returns at
once, the sampled ids staying on the device (`sampled`) with a copy to pinned host memory on the
way. A sequence sampled by the previous launch carries a placeholder as its last token; its input
id is gathered on the device from that launch's `sampled` row, so the host never waits for it.

With tensor parallelism every rank runs a ModelRunner over its shard of the model and its own KV
cache. Rank 0's (in the engine) turns each scheduled batch into flat `StepInputs`, hands them to the
other ranks (`workers`) and runs the same forward; the model's collectives keep the ranks in step.
Every rank computes the (gathered) logits of the same rows; only rank 0 samples, and a launch's
sampled ids are broadcast to the other ranks' `sampled` so their next placeholder gathers agree.

`release` (every rank's, at shutdown) frees what the runner owns in an order no rank can block in:
its CUDA graphs first (NCCL's abort waits for the graphs that captured its communicator), its KV
cache and model, then its process group (`EngineTPGroup.close`: an abort, bounded), then the
allocator's cache. A runner dropped without it leaves the graphs and the group to a finalizer that
does the same first two steps, so no destructor of a collected runner can hang.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from typing import TYPE_CHECKING

import torch

from atom_engine.config import EngineConfig
from atom_engine.cpu_compile import cpu_forward, pack_lm_head
from atom_engine.cpu_linear import pack_linears
from atom_engine.cpu_threads import set_cpu_threads
from atom_engine.graphs import capture_step_graphs, uses_graphs
from atom_engine.kv_cache import GiB, num_kv_blocks
from atom_engine.sampler import Sampler, to_device, warm_up_sampling
from atom_engine.scheduler import ScheduledBatch
from atom_engine.sequence import Sequence
from atom_engine.startup import StartupTimes
from atom_engine.step_inputs import OP_LAUNCH, OP_RUN, StepInputs, prepare_step
from atom_engine.step_outputs import Launch, RunOutput
from atom_engine.structured_output import apply_grammar_bitmasks
from atom_models import load_model, set_forward_context
from atom_models.native_host import NativeAttentionHost, PagedAttentionMetadata, PagedKVCache
from atom_models.native_host.mla import flashinfer_mla_decode

if TYPE_CHECKING:
    from atom_engine.parallel import EngineTPGroup
    from atom_engine.workers import WorkerGroup

logger = logging.getLogger("atom_engine")


class ModelRunner:
    """One rank's model and KV cache. `tp` is the engine's tensor-parallel group (None: one
    rank; its device is `device`, by default the config's); `workers`, on rank 0 only, carries
    each step to the other ranks."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        hf_config,
        max_model_len: int,
        tp: EngineTPGroup | None = None,
        workers: WorkerGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.tp, self.workers = tp, workers
        self.rank = tp.rank if tp is not None else 0
        self.device = tp.device if tp is not None else device or config.resolved_device()
        self.cpu_threads = None  # on the CPU: each step's torch thread count
        if self.device.type == "cpu":
            self.cpu_threads = set_cpu_threads(
                config.num_threads, config.tensor_parallel_size, self.rank
            )
        self.dtype = config.resolved_dtype()
        self.kv_cache_dtype = config.resolved_kv_cache_dtype()  # the model's, or fp8
        self.block_size = config.block_size
        spec = config.resolved_speculative_config()
        self.show_progress = config.show_progress and self.rank == 0  # start-up bars
        self.startup = StartupTimes()  # the phases' seconds, for the engine's start-up line
        with self.startup.phase("load"):
            self.model = load_model(
                model_path,
                dtype=self.dtype,
                device=self.device,
                load_format=config.load_format,
                trust_remote_code=config.trust_remote_code,
                tp=tp,
                # A checkpoint's MTP layers (and their KV cache) only when they draft.
                host=NativeAttentionHost(
                    builds_mtp_layers=spec is not None and spec.method == "mtp"
                ),
                show_progress=self.show_progress,
            )
        self.sampler = Sampler(self.device)
        self.vocab_size = hf_config.vocab_size
        self.hidden_size = hf_config.hidden_size
        with self.startup.phase("kv-cache"):
            self.kv_cache = PagedKVCache(self.model, self.block_size, self.kv_cache_dtype)
            self.num_blocks = num_kv_blocks(
                self.model, self.kv_cache, config, self.device, max_model_len
            )
            if tp is not None:  # every rank's cache holds the same blocks: the smallest fits all
                self.num_blocks = tp.min(self.num_blocks)
            self.kv_cache.bind(self.num_blocks, self.device)
        # Sampled ids of the last launch (device) and two pinned host mirrors (a launch writes one
        # while the previous launch's is read). In the graphs' token buffer when there are graphs.
        max_sampled = max(1, config.max_num_seqs)
        # FlashInfer's MLA decode for eager decode steps, where asked for (ATOM_FLASHINFER).
        self._mla_eager = flashinfer_mla_decode(self.model, self.block_size)
        self.graphs = None
        if uses_graphs(self.device, config.enforce_eager, config.cudagraph_mode):
            with self.startup.phase("graphs"):
                self.graphs = capture_step_graphs(self, max_sampled)
            self.sampled = self.graphs.sampled
        else:
            self.sampled = torch.zeros(max_sampled, dtype=torch.long, device=self.device)
        pin = self.device.type == "cuda"
        self._sampled_host = [
            torch.zeros(max_sampled, dtype=torch.long, pin_memory=pin) for _ in range(2)
        ]
        self._launches = 0
        self.keep_hidden = False  # set by an MTP drafter
        self.last_hidden: torch.Tensor | None = None
        self.step_rows: dict[int, tuple[int, int]] = {}  # seq_id -> (first row, first position)
        if self.device.type == "cuda":
            with self.startup.phase("warm-up"):
                warm_up_sampling(
                    self.model, self.hidden_size, self.dtype, self.device, config.max_num_seqs
                )
        if pack_lm_head(self.model, self.device, config.tensor_parallel_size):
            logger.info("CPU: the LM head runs on packed weights (MKL: 1 row, oneDNN: 2-16)")
        pack_linears(self.model, self.device, config.tensor_parallel_size)
        # The forward `_execute` calls: on the CPU compiled by torch.compile (`cpu_compile`).
        self.forward = cpu_forward(
            self.model,
            self.device,
            config.enforce_eager,
            config.tensor_parallel_size,
            self.block_size,
            self.cpu_threads,
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens fit, %d bytes per token, %.2f GiB, %s) "
            "on %s"
            + (f" (tensor-parallel rank {self.rank} of {tp.size})" if tp is not None else ""),
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.kv_cache.bytes_per_token,
            self.num_blocks * self.kv_cache.block_bytes / GiB,
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.device,
        )
        self.closed = False
        # Holds the torch graphs and the group, never the runner or its graph owners (they hold
        # the runner: it would never be collected).
        graphs = self.graphs.cuda_graphs() if self.graphs is not None else []
        self._finalizer = weakref.finalize(self, _release_graphs_and_group, graphs, tp)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the other ranks' processes (each releases its runner first) and release this
        one's (idempotent). Unless `graceful` (another thread may be inside a step) the workers
        are killed and the group aborted, which ends a step stuck in a collective, and the
        graphs, cache and model are left to the finalizer: that step may still read them."""
        if self.workers is not None:
            if graceful:
                self.workers.shutdown()
            else:
                self.workers.kill()
        if graceful:
            self.release()
        elif self.tp is not None:
            self.tp.close()

    def release(self) -> None:
        """Free this rank's CUDA graphs, KV cache and model, then end its process group without
        waiting for the other ranks (idempotent); every later step raises."""
        if self.closed:
            return
        self.closed = True
        if self.graphs is not None:
            self.graphs.close()
        self.graphs = None
        if self.kv_cache is not None:
            self.kv_cache.release()
        self.model = self.forward = self.kv_cache = None
        self.sampled = self.last_hidden = None
        self._sampled_host = []
        group_ended = self._finalizer() is not False
        if self.device.type == "cuda" and group_ended:
            # NOTE: after an abort that did not finish a collective may still run on the device,
            # and empty_cache's cudaFree would wait for it.
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"the model runner of rank {self.rank} was shut down")

    # -- one step ------------------------------------------------------------------------------

    def _prepare(
        self, batch: ScheduledBatch, prev: Launch | None = None
    ) -> tuple[StepInputs, list[Sequence], list[Sequence]]:
        return prepare_step(batch, prev)

    def _execute(self, inputs: StepInputs) -> torch.Tensor:
        """Queue the forward of a step; hidden states [T, hidden]."""
        if self.cpu_threads is not None:
            self.cpu_threads.apply(len(inputs.ids))
        if self.graphs is not None:
            hidden = self.graphs.replay(inputs, self.sampled)
            if hidden is not None:
                return hidden
        md = PagedAttentionMetadata.build(
            inputs.seq_lens, inputs.query_lens, inputs.tables, self.block_size, self.device
        )
        mla = self._mla_eager
        if mla is not None and md.max_query_len == 1 and mla.faster_at(len(inputs.seq_lens)):
            mla.plan(inputs.seq_lens, inputs.tables)
            md.mla_decode = mla
        input_ids = to_device(inputs.ids, torch.long, self.device)
        if inputs.gathers:
            rows, src = zip(*inputs.gathers, strict=True)
            input_ids[to_device(list(rows), torch.long, self.device)] = self.sampled[
                to_device(list(src), torch.long, self.device)
            ]
        pos = to_device(inputs.positions(), torch.long, self.device)
        with set_forward_context(md):
            return self.forward(input_ids, pos)  # [T, hidden]

    def _logits(self, hidden: torch.Tensor, inputs: StepInputs, op: int) -> list[torch.Tensor]:
        """The logits every rank computes for a step (the LM head gathers them over the ranks):
        the sampled rows' [B, V], then (for a `run`) each prompt-logprob range's [count, V]."""
        out = []
        if inputs.sample_rows:
            out.append(self._sample_logits(hidden, inputs.sample_rows))
        if op == OP_RUN:
            for row, count in inputs.prompt_rows:
                out.append(self.model.compute_logits(hidden[row : row + count]))
        return out

    def _sample_logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if rows == list(range(rows[0], rows[0] + len(rows))):  # decodes: one contiguous slice
            picked = hidden[rows[0] : rows[0] + len(rows)]
        else:
            picked = hidden[to_device(rows, torch.long, self.device)]
        return self.model.compute_logits(picked)  # [B, V] in the model's dtype

    def _hand_off(self, op: int, inputs: StepInputs) -> None:
        """Send the step to the other ranks (rank 0 of a tensor-parallel engine)."""
        if self.workers is not None:
            self.workers.send(inputs.pack(op))

    @torch.no_grad()
    def follow(self, op: int, inputs: StepInputs) -> None:
        """A rank other than 0: its part of rank 0's `run` or `launch` of these inputs (the same
        forward and logits, so the collectives meet; then the launch's sampled ids)."""
        self._check_open()
        hidden = self._execute(inputs)
        self._logits(hidden, inputs, op)
        if op == OP_LAUNCH and inputs.sample_rows:
            self.tp.broadcast(self.sampled[: len(inputs.sample_rows)], 0)

    @torch.no_grad()
    def run(self, batch: ScheduledBatch) -> RunOutput:
        """Run one step and wait for it (every sampling feature; no placeholder inputs)."""
        self._check_open()
        inputs, sample_seqs, prompt_seqs = self._prepare(batch)
        self._hand_off(OP_RUN, inputs)
        with self._in_step():
            hidden = self._execute(inputs)
            if self.keep_hidden:  # the MTP drafter reads the step's hidden states
                self.last_hidden = hidden
                rows = itertools.accumulate(inputs.query_lens, initial=0)
                self.step_rows = {
                    seq.seq_id: (row, seq_len - num)
                    for seq, row, seq_len, num in zip(
                        batch.seqs, rows, inputs.seq_lens, inputs.query_lens, strict=False
                    )
                }
            logits = self._logits(hidden, inputs, OP_RUN)  # the last collective of the step
            out = RunOutput(sampled={}, prompt_logprobs={})
            if sample_seqs:
                sample_logits = apply_grammar_bitmasks(sample_seqs, logits.pop(0).float())
                if any(s.spec_token_ids for s in sample_seqs):
                    out.sampled = self.sampler.verify(sample_seqs, sample_logits)
                else:
                    sampled = self.sampler.sample(sample_seqs, sample_logits)
                    out.sampled = {seq_id: [token] for seq_id, token in sampled.items()}
            for seq, (_, count), rows in zip(prompt_seqs, inputs.prompt_rows, logits, strict=True):
                start = seq.num_computed_tokens
                targets = seq.token_ids[start + 1 : start + 1 + count]
                out.prompt_logprobs[seq.seq_id] = self.sampler.logprobs_of(
                    rows.float(), targets, seq.params.prompt_logprobs
                )
        return out

    @torch.no_grad()
    def mtp_draft(
        self,
        inputs: StepInputs,
        hidden_rows: list[int] | None,
        step: int,
        previous: torch.Tensor | None = None,
    ) -> tuple[list[int], torch.Tensor]:
        """One pass of the model's MTP layer (speculative drafting): `inputs` are positions of
        the cache and the token following each, fed with the last step's hidden states at
        `hidden_rows` (or `previous`, the layer's own output of the previous pass); returns the
        argmax draft of each `sample_rows` row and the layer's output there."""
        md = PagedAttentionMetadata.build(
            inputs.seq_lens, inputs.query_lens, inputs.tables, self.block_size, self.device
        )
        if previous is None:
            previous = self.last_hidden[to_device(hidden_rows, torch.long, self.device)]
        ids = to_device(inputs.ids, torch.long, self.device)
        positions = to_device(inputs.positions(), torch.long, self.device)
        with set_forward_context(md):
            out = self.model.mtp_forward(ids, positions, previous, step)
        rows = out[to_device(inputs.sample_rows, torch.long, self.device)]
        logits = self.model.compute_mtp_logits(rows, step)
        return logits.argmax(dim=-1).tolist(), rows

    @torch.no_grad()
    def launch(self, batch: ScheduledBatch, prev: Launch | None) -> Launch:
        """Queue one step on the device and return without waiting for it.

        For sequences whose sampling needs nothing from the host (no log-probs, prompt log-probs
        or penalties: the engine runs those through `run`). The sampled ids land in `sampled`
        (read by the next launch's placeholder gathers) and, once `ready`, in `host`.
        """
        self._check_open()
        # No drafts here: speculative decoding turns async scheduling off (drafts are verified by
        # `run`), so no per-sequence check of that on this path.
        inputs, sample_seqs, _ = self._prepare(batch, prev)
        self._hand_off(OP_LAUNCH, inputs)
        host = self._sampled_host[self._launches % 2]
        self._launches += 1
        n = len(sample_seqs)
        ready = None
        with self._in_step():
            hidden = self._execute(inputs)
            if n:
                (logits,) = self._logits(hidden, inputs, OP_LAUNCH)
                self.sampler.sample_on_device(sample_seqs, logits, out=self.sampled[:n])
                if self.tp is not None:  # the other ranks' next placeholder gathers read them
                    self.tp.broadcast(self.sampled[:n], 0)
                host[:n].copy_(self.sampled[:n], non_blocking=True)
        if self.device.type == "cuda":  # also with nothing sampled: the input copies are done
            ready = torch.cuda.Event()
            ready.record()
        return Launch(
            batch=batch,
            seqs=sample_seqs,
            rows={s.seq_id: i for i, s in enumerate(sample_seqs)},
            host=host[:n],
            ready=ready,
        )

    @contextlib.contextmanager
    def _in_step(self):
        """Around the part of a step the other ranks run too: with tensor parallelism a failure
        there leaves the ranks out of step (a collective one side never reaches), so it is
        fatal (`WorkerError`), not one request's error."""
        if self.workers is None:
            yield
            return
        try:
            yield
        except Exception as e:
            self.workers.fail(e)
            raise self.workers.error from e


def _release_graphs_and_group(graphs: list[torch.cuda.CUDAGraph], tp: EngineTPGroup | None) -> bool:
    """The part of `ModelRunner.release` no rank can block in, in its order (also the finalizer
    of a runner dropped without shutdown); whether the group's abort finished."""
    for graph in graphs:
        graph.reset()
    return tp.close() if tp is not None else True
