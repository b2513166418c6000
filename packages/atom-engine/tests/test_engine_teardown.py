"""Engines of several ranks end cleanly, in one process, one after another (issue 34): shut down,
every rank releases its graphs, cache, model and process group (the group is aborted: a collective
afterwards raises), and a second shutdown does nothing; an engine dropped without shutdown is
collected and its workers end; nothing is left to a finalizer that could block (a hang here fails
through the watchdog rather than hanging the run), and the engine's own stop is never logged as a
worker failure, at shutdown or at interpreter exit (`atom generate` and a script that never shuts
its engine down, run as processes).

The engine tests run on the CPU (gloo) and on 2 GPUs (NCCL, CUDA graphs that captured it).
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from atom_engine import LLM, SamplingParams
from atom_engine.testing import workers_of

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.multi_gpu(2))]
# Small batches: few CUDA graphs to capture on a GPU.
ENGINE = dict(block_size=16, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
PROMPTS = ["The quick brown fox", "1, 2, 3,"]
ATOM = str(Path(sys.executable).parent / "atom")  # the [project.scripts] entry point
# A TP=2 engine starts in ~25 s on the loaded 2-core CPU; a hang is far longer.
WATCHDOG_S = 900


@pytest.fixture
def watchdog():
    """End the whole run, with every thread's stack, if the test hangs (a finalizer blocked in
    a collective, the issue's gc.collect)."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    config = LlamaConfig(
        vocab_size=49152,  # the bundled tokenizer's, saved beside the weights
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    path, _ = tiny_checkpoint(config)
    return str(path)


def build(checkpoint: str, device: str) -> LLM:
    return LLM(checkpoint, tensor_parallel_size=2, device=device, **ENGINE)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _zombie(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def errors_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("device", DEVICES)
def test_shutdown_aborts_every_rank_and_is_idempotent(checkpoint, device, caplog, watchdog):
    with caplog.at_level(logging.WARNING, logger="atom_engine"):
        llm = build(checkpoint, device)
        assert all(len(tokens) == 6 for tokens in greedy(llm))
        runner = llm.engine.runner
        tp, procs = runner.tp, runner.workers.procs
        start = time.monotonic()
        llm.shutdown()
        took = time.monotonic() - start
        # Each worker released its runner and group and exited by itself (an error there exits
        # 1, a worker terminated for being slow -15).
        assert [p.exitcode for p in procs] == [0]
        assert runner.closed and runner.model is None and runner.graphs is None
        assert tp.closed and tp.pg is None
        with pytest.raises(RuntimeError, match="group of rank 0 is closed"):
            tp.all_reduce(torch.ones(1, device=tp.device))
        with pytest.raises(RuntimeError, match="runner of rank 0 was shut down"):
            runner.run(None)  # refused before it reads its batch
        with pytest.raises(RuntimeError, match="LLM was shut down"):
            llm.generate([[1, 2, 3]], use_tqdm=False)
        with pytest.raises(RuntimeError, match="engine was shut down"):
            llm.engine.add_request("late", [1, 2, 3])
        start = time.monotonic()
        llm.shutdown()  # a no-op
        assert time.monotonic() - start < 0.5
    assert took < 15, f"shutdown took {took:.1f} s"
    assert errors_in(caplog) == []


@pytest.mark.slow  # three TP=2 engines: 84 s on the 2-core CPU
@pytest.mark.parametrize("device", DEVICES)
def test_engines_shut_down_and_dropped_in_one_process(checkpoint, device, caplog, watchdog):
    """The issue's sequence: an engine shut down, one dropped without shutdown and collected
    (its finalizer kills the workers and aborts rank 0's group after its graphs), and a third:
    the same tokens from each, gc.collect() returns, no process is left and nothing is logged as
    a failure."""
    results = []
    with caplog.at_level(logging.WARNING, logger="atom_engine"):
        with build(checkpoint, device) as llm:
            results.append(greedy(llm))
        del llm

        llm = build(checkpoint, device)
        results.append(greedy(llm))
        runner = weakref.ref(llm.engine.runner)
        workers = weakref.ref(llm.engine.runner.workers)
        tp = llm.engine.runner.tp
        pids = [p.pid for p in llm.engine.runner.workers.procs]
        del llm
        gc.collect()
        assert runner() is None and workers() is None, "the dropped engine was not collected"
        assert tp.closed, "the dropped engine's finalizer did not end its group"
        assert wait_gone(pids) == [], "the dropped engine's workers are alive"

        with build(checkpoint, device) as llm:
            results.append(greedy(llm))
            pids = [p.pid for p in llm.engine.runner.workers.procs]
        del llm
        gc.collect()
    assert wait_gone(pids) == []
    assert results[1] == results[0] and results[2] == results[0]
    assert all(len(tokens) == 6 for tokens in results[0])
    assert errors_in(caplog) == []
    assert wait_gone(workers_of(os.getpid())) == []


def run_quietly(args: list[str], timeout: float = 600) -> str:
    """Run a command to its end; its output, after asserting exit status 0 and that nothing in
    it reports a failure."""
    done = subprocess.run(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout
    for failure in ("ERROR", "exited with code", "Traceback"):
        assert failure not in done.stdout, done.stdout
    return done.stdout


@pytest.mark.slow  # a TP=2 engine in a new process: 50 s on the 2-core CPU
def test_atom_generate_over_two_ranks_ends_quietly(checkpoint):
    out = run_quietly(
        [ATOM, "generate", "Hello", "--model", checkpoint, "--tensor-parallel-size", "2",
         "--device", "cpu", "--max-tokens", "8", "--num-kv-blocks", "64"]
    )  # fmt: skip
    assert out.strip(), "no text was printed"


SCRIPT = """
import logging, sys
from atom_engine import LLM, SamplingParams

logging.basicConfig(level=logging.WARNING)
llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", num_kv_blocks=64)
params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
print("tokens", llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids)
"""  # no shutdown: the interpreter's exit ends the engine


@pytest.mark.slow  # a TP=2 engine in a new process: 68 s on the 2-core CPU
def test_exit_without_shutdown_ends_quietly(checkpoint):
    out = run_quietly([sys.executable, "-c", SCRIPT, checkpoint])
    assert "tokens [" in out
