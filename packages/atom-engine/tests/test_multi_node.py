"""Tensor parallelism across nodes (`atom_engine.nodes`), on the CPU: two `atom serve` processes on
127.0.0.1 as node 0 and node 1 (gloo), one rank each. The greedy tokens of one process; a wrong
split refused before anything starts; a node that never arrives, a node refused for a different
model or flag, and a node killed mid-request each end both nodes non-zero, naming the node or
field. (The rendezvous itself, in one process: test_multi_node_rendezvous.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import LlamaConfig, Qwen3MoeConfig

from atom_engine import LLM, SamplingParams
from atom_engine.testing import free_port, http, start_server, stop_server

PROMPTS = ["Once upon a time", "def fibonacci(n):", "The capital of France is"]
SERVE = [sys.executable, "-m", "atom_engine.cli.main", "serve"]


def _llama(hidden_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint(_llama(64))[0]


def _node_flags(checkpoint, rank: int, addr: str, *extra: str) -> list[str]:
    return [
        "--model", str(checkpoint), "--device", "cpu", "--num-kv-blocks", "64", "-tp", "2",
        "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", addr, *extra,
    ]  # fmt: skip


def _start(args: list[str], log: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(
        args,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
        start_new_session=True,  # a kill of the node takes its ranks too
    )


def _exit(proc: subprocess.Popen, log: Path, timeout: float) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # not a session leader (start_server's node 0)
            proc.kill()
        proc.wait()
        tail = log.read_text()[-3000:]
        raise AssertionError(f"still running after {timeout} s:\n{tail}") from None
    return code, log.read_text()


def _addr() -> str:
    return f"127.0.0.1:{free_port(2)}"  # PORT + 1 is the step channel


def test_a_split_the_nodes_cannot_take_fails_at_startup(checkpoint, tmp_path):
    cases = {
        ("-tp", "3"): "tensor_parallel_size 3 does not split over nnodes 2",
        ("--node-rank", "2"): "node_rank must be in 0..1 (nnodes 2), got 2",
        ("--headless",): "--headless is for nodes of --node-rank > 0",
    }
    for flags, message in cases.items():
        args = [*SERVE, *_node_flags(checkpoint, 0, "127.0.0.1:29999"), *flags]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr


def test_a_node_that_never_arrives_ends_both_after_dist_timeout(checkpoint, tmp_path):
    # Node 0 waits for node 1, and (on another address) a node 1 waits for a node 0: neither comes.
    logs = tmp_path / "node0.log", tmp_path / "node1.log"
    flags = ("--dist-timeout", "4")
    node0 = _start([*SERVE, *_node_flags(checkpoint, 0, _addr(), *flags)], logs[0])
    node1 = _start([*SERVE, *_node_flags(checkpoint, 1, _addr(), *flags)], logs[1])
    code0, out0 = _exit(node0, logs[0], timeout=120)
    code1, out1 = _exit(node1, logs[1], timeout=120)
    assert code0 == 1 and "node(s) 1 of 2 did not join node 0's rendezvous" in out0, out0
    assert "within 4 s (--dist-timeout)" in out0
    assert code1 == 1 and "node 0's rendezvous at 127.0.0.1" in out1, out1
    assert "did not answer within 4 s (--dist-timeout)" in out1


@pytest.mark.parametrize(
    "node1_flags, field",
    [
        (("--max-model-len", "128"), "max_model_len is None on node 0 but 128 on node 1"),
        (("--model", "OTHER"), "model config head_dim is 16 on node 0 but 32 on node 1"),
    ],
    ids=["flag", "model"],
)
def test_a_mismatched_node_is_refused_naming_the_field(
    checkpoint, tiny_checkpoint, node1_flags, field, tmp_path
):
    if "OTHER" in node1_flags:
        node1_flags = ("--model", str(tiny_checkpoint(_llama(128))[0]))
    addr, logs = _addr(), (tmp_path / "node0.log", tmp_path / "node1.log")
    node0 = _start([*SERVE, *_node_flags(checkpoint, 0, addr, "--port", str(free_port()))], logs[0])
    node1 = _start([*SERVE, *_node_flags(checkpoint, 1, addr), *node1_flags], logs[1])
    code1, out1 = _exit(node1, logs[1], timeout=180)
    code0, out0 = _exit(node0, logs[0], timeout=60)
    assert code1 == 1 and f"node 1 refused at the rendezvous: {field}" in out1, out1
    assert code0 == 1 and f"node 1 refused at the rendezvous: {field}" in out0, out0


def _two_nodes(checkpoint, tmp_path, *extra: str):
    addr, log1 = _addr(), tmp_path / "node1.log"
    node1 = _start([*SERVE, *_node_flags(checkpoint, 1, addr, *extra)], log1)
    try:
        node0, url = start_server(
            checkpoint, tmp_path / "node0.log", *_node_flags(checkpoint, 0, addr, *extra)[2:]
        )
    except BaseException:
        os.killpg(node1.pid, signal.SIGKILL)
        raise
    return node0, url, node1, log1


@pytest.mark.slow  # two nodes' start-up: ~50 s on the 2-core CPU
def test_tensor_parallel_over_two_nodes_matches_one_process(checkpoint, tmp_path):
    import openai

    with LLM(str(checkpoint), num_kv_blocks=64) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        expected = [o.outputs[0].text for o in outputs]
    node0, url, node1, log1 = _two_nodes(checkpoint, tmp_path)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        for prompt, want in zip(PROMPTS, expected, strict=True):
            choice = client.completions.create(
                model=str(checkpoint),
                prompt=prompt,
                max_tokens=16,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            ).choices[0]
            assert choice.text == want, prompt  # 16 greedy tokens of a random model: its ids
    finally:
        stop_server(node0)
    code1, out1 = _exit(node1, log1, timeout=30)
    assert node0.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    assert code1 == 0 and "node 0 shut its ranks down" in out1, out1


# Data parallelism: one replica (tp 1) on each node; their connections need the shared secret.
DP = ("-tp", "1", "-dp", "2")


@pytest.mark.slow  # two nodes' start-up: ~70 s on the 2-core CPU
def test_data_parallel_over_two_nodes_balances_like_one_process(checkpoint, tmp_path, monkeypatch):
    import openai

    with LLM(str(checkpoint), num_kv_blocks=64) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    monkeypatch.setenv("ATOM_DIST_AUTHKEY", "a shared secret")  # both nodes inherit it
    node0, url, node1, log1 = _two_nodes(checkpoint, tmp_path, *DP)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")

        def complete(prompt: str) -> str:
            body = dict(model=str(checkpoint), prompt=prompt, max_tokens=16, temperature=0.0)
            return client.completions.create(**body, extra_body={"ignore_eos": True}).choices[0]

        with ThreadPoolExecutor(4) as pool:
            got = [c.text for c in pool.map(complete, PROMPTS * 2)]
        assert got == expected * 2
        metrics = http("GET", url + "/metrics").text.replace(".0\n", "\n")
        assert "atom:num_kv_blocks 128" in metrics  # both replicas' caches
    finally:
        stop_server(node0)
    code1, out1 = _exit(node1, log1, timeout=60)
    assert code1 == 0 and "node 0 shut its ranks down" in out1, out1


@pytest.mark.slow  # two nodes' start-up: ~50 s on the 2-core CPU
@pytest.mark.parametrize(
    "extra, who",
    [((), "node 1 (tensor-parallel rank 1 at 127.0.0.1) went away"),
     (DP, "data-parallel replica 1 on node 1 (at 127.0.0.1)")],
    ids=["tp", "dp"],
)  # fmt: skip
def test_a_node_killed_mid_request_fails_the_request_and_both_nodes(
    checkpoint, tmp_path, extra, who, monkeypatch
):
    monkeypatch.setenv("ATOM_DIST_AUTHKEY", "a shared secret")
    node0, url, node1, log1 = _two_nodes(checkpoint, tmp_path, *extra)
    body = {"model": str(checkpoint), "prompt": "Once", "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    import urllib.request

    def open_stream():
        request = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        stream = urllib.request.urlopen(request, timeout=60)
        assert stream.readline().startswith(b"data: ")  # generating now
        return stream

    def rest(stream) -> tuple[str, float]:
        with stream:
            return stream.read().decode(), time.monotonic()

    try:
        # Two requests: with data parallelism the second goes to node 1's replica (least loaded).
        streams = [open_stream(), open_stream()]
        os.killpg(node1.pid, signal.SIGKILL)
        killed = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            ends = list(pool.map(rest, streams))
    finally:
        try:
            code0, out0 = _exit(node0, tmp_path / "node0.log", timeout=60)
        finally:
            if node1.poll() is None:  # the test failed before it killed node 1
                os.killpg(node1.pid, signal.SIGKILL)
    named = [(text, end - killed) for text, end in ends if who in text]
    assert named, [text[-500:] for text, _ in ends]
    assert all('"error"' in text and after < 10 for text, after in named), named
    assert code0 == 1 and who in out0, out0[-3000:]
    assert node1.wait() != 0


def _qwen3_moe() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
    )


# NOTE: 39 s (llama) and 22 s (MoE) on the loaded 2-core CPU: no HTTP server to start.
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["llama-tp", "qwen3_moe-ep"])
def test_llm_spans_two_nodes_as_atom_serve_does(
    checkpoint, tiny_checkpoint, expert_parallel, tmp_path
):
    # Node 0: LLM(...) in this process; node 1: LLM(..., node_rank=1), which blocks until node 0
    # is done, in a process of its own. With expert parallelism each node holds 4 of 8 experts.
    model = str(tiny_checkpoint(_qwen3_moe())[0] if expert_parallel else checkpoint)
    shared = dict(device="cpu", num_kv_blocks=64, tensor_parallel_size=2, nnodes=2)
    shared.update(dist_init_addr=_addr(), enable_expert_parallel=expert_parallel)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(model, num_kv_blocks=64) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    code = f"from atom_engine import LLM; LLM({model!r}, node_rank=1, **{shared!r})"
    log = tmp_path / "node1.log"
    node1 = _start([sys.executable, "-c", code], log)
    try:
        with LLM(model, node_rank=0, **shared) as llm:
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    except BaseException:
        os.killpg(node1.pid, signal.SIGKILL)
        raise
    assert [o.outputs[0].token_ids for o in outputs] == expected
    code1, out1 = _exit(node1, log, timeout=60)
    assert code1 == 0, out1  # its ranks ended on node 0's shutdown message
