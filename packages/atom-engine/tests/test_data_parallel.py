"""Data-parallel replicas, each an engine in a process of its own (CPU here; the same code on GPUs,
where each process sees only its replica's GPUs): `LLM(data_parallel_size=2)` gives one engine's
greedy tokens and spreads the requests, structured output and n > 1 included; a bad request is
refused through a replica; `atom serve -dp 2` with a replica killed mid-stream ends every stream
with an error, answers /health 503 and exits non-zero naming the replica, leaving no process
behind."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from transformers import LlamaConfig

from atom_engine import LLM, EngineConfig, SamplingParams, StructuredOutputsParams
from atom_engine.engine import LLMEngine
from atom_engine.testing import health, start_server

PROMPTS = [{"prompt_token_ids": [3 + i, 17, 5 * i + 1, 9]} for i in range(8)]
ENGINE = dict(device="cpu", num_kv_blocks=64, block_size=16, enforce_eager=True)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    config = LlamaConfig(
        vocab_size=49152,  # the bundled tokenizer's, saved beside the weights
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    path, _ = tiny_checkpoint(config)
    return path


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def _descendants(pid: int) -> list[int]:
    """Every live process under `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = proc.joinpath("stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(proc.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def test_an_engine_is_one_replica():
    with pytest.raises(ValueError, match="an LLMEngine is one replica"):
        LLMEngine(EngineConfig(data_parallel_size=2))


@pytest.mark.slow  # two replica processes' start-up: ~70 s on the 2-core CPU
def test_offline_replicas_give_one_engines_tokens(checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(checkpoint), **ENGINE) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(str(checkpoint), data_parallel_size=2, **ENGINE) as llm:
        replicas = llm.replicas.replicas
        pids = [r.proc.pid for r in replicas]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        for _ in range(2):
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == expected
            assert [o.request_id for o in outputs] == sorted(
                (o.request_id for o in outputs), key=int
            )
        # Both replicas served (their statistics arrive a moment after their steps).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            finished = [r.stats().finished_requests for r in replicas]
            if sum(finished) == 2 * len(PROMPTS):
                break
            time.sleep(0.1)
        assert finished == [len(PROMPTS), len(PROMPTS)]
        # A grammar is compiled again in the replica's process (compiled grammars stay where
        # they are made): the sampled text is one of the choices, and n > 1 comes back whole.
        choice = StructuredOutputsParams(choice=["red", "green", "blue"])
        sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=3, structured_outputs=choice)
        for output in llm.generate(["Pick a colour:"] * 4, sampled, use_tqdm=False):
            assert output.outputs[0].text in choice.choice, output.outputs[0]
        (pair,) = llm.generate(["Hello"], SamplingParams(max_tokens=4, n=2), use_tqdm=False)
        assert [c.index for c in pair.outputs] == [0, 1]
        # A request a replica refuses raises here, as with one engine.
        with pytest.raises(ValueError, match="token id"):
            llm.generate({"prompt_token_ids": [49152 + 7]}, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], params)] == expected[:1]
    for pid in pids:  # shut down: the replicas' processes are gone
        assert not _alive(pid)


def _stream(url: str, model: str, events: list, started: threading.Event) -> None:
    """One long streamed completion; its events go to `events` ("token", "error: ...", "done")."""
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=120)
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            events.append(f"error: HTTP {response.status}")
            return
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                events.append("done")
                return
            chunk = json.loads(data)
            if "error" in chunk:
                events.append(f"error: {chunk['error']['message']}")
            else:
                events.append("token")
                started.set()
        events.append("error: the stream ended without [DONE]")
    except (OSError, http.client.HTTPException) as e:
        events.append(f"error: {type(e).__name__}")
    finally:
        connection.close()
        started.set()


@pytest.mark.slow  # two replicas' start-up on a busy 2-core CPU
def test_a_killed_replica_fails_its_streams_and_ends_the_server(checkpoint, tmp_path):
    log = tmp_path / "server.log"
    flags = ("--device", "cpu", "--num-kv-blocks", "512", "--enforce-eager", "-dp", "2")
    server, url = start_server(checkpoint, log, *flags)
    try:
        listed = log.read_text().split("data-parallel replicas (processes ")[1].split(")")[0]
        replicas = [int(pid) for pid in listed.split(", ")]  # in replica order
        everything = _descendants(server.pid)
        assert set(replicas) <= set(everything)
        streams = []
        for _ in range(4):  # two to each replica: the front balances by load
            events, started = [], threading.Event()
            thread = threading.Thread(target=_stream, args=(url, str(checkpoint), events, started))
            thread.start()
            streams.append((thread, events, started))
        for _, events, started in streams:
            assert started.wait(120)
            assert events[0] == "token", events
        victim = replicas[1]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        answers = []
        while time.monotonic() - killed < 10 and any(t.is_alive() for t, _, _ in streams):
            answers.append(health(url))
            time.sleep(0.05)
        for thread, _, _ in streams:
            thread.join(max(0.0, 10 - (time.monotonic() - killed)))
            assert not thread.is_alive(), "a stream did not end within 10 s of the kill"
        # A stream's end: its error event (an error event is followed by [DONE]), or "done".
        ends = [
            next((e for e in events if e.startswith("error")), events[-1])
            for _, events, _ in streams
        ]
        assert sum(end.startswith("error") for end in ends) >= 2, ends
        assert all(end.startswith("error") or end == "done" for end in ends), ends
        assert "data-parallel replica" in " ".join(ends)
        server.wait(timeout=60)
        output = log.read_text()
        assert server.returncode == 1, output
        assert f"data-parallel replica 1 (pid {victim}) exited with code -9" in output, output
        # /health answered 503 after the kill, never 200 once the streams had failed.
        assert 503 in answers, answers
        assert answers[answers.index(503) :].count(200) == 0, answers
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in everything) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in everything if _alive(pid)], "processes were left behind"
