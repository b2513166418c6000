"""The multi-node start-up in one process (`atom_engine.nodes`, `node_steps`): the flags and their
checks, which ranks each node runs, the rendezvous at node 0's TCPStore and the step channel
(threads as nodes). Two real `atom serve` nodes: test_multi_node.py."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LlamaConfig

from atom_engine import EngineConfig
from atom_engine.cli.args import engine_config_from_args
from atom_engine.cli.main import build_parser
from atom_engine.config import split_host_port
from atom_engine.node_steps import RemoteRanks, StepChannel
from atom_engine.nodes import (
    NodeError,
    difference,
    fingerprint,
    join_nodes,
    meet_nodes,
    node_ranks,
    open_store,
    report_failure,
)
from atom_engine.parallel import rank_device
from atom_engine.testing import free_port


def _config(**kwargs) -> EngineConfig:
    values = dict(tensor_parallel_size=4, nnodes=2, dist_init_addr=f"127.0.0.1:{free_port(2)}")
    return EngineConfig(device="cpu", **{**values, **kwargs})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tensor_parallel_size=3), "tensor_parallel_size 3 does not split over nnodes 2"),
        (dict(node_rank=2), "node_rank must be in 0..1 (nnodes 2), got 2"),
        (dict(node_rank=-1), "node_rank must be in 0..1"),
        (dict(nnodes=0), "nnodes must be >= 1"),
        (dict(dist_init_addr=None), "nnodes 2 needs dist_init_addr"),
        (dict(dist_init_addr="node0"), "dist_init_addr must be HOST:PORT"),
        (dict(dist_init_addr="node0:99999"), "dist_init_addr must be HOST:PORT"),
        (dict(dist_timeout=0), "dist_timeout must be > 0"),
        (dict(data_parallel_size=3), "data_parallel_size 3 does not split over nnodes 2"),
    ],
)
def test_a_split_the_nodes_cannot_take_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(**kwargs)


def test_flags_take_sglang_and_vllm_spellings():
    parse = build_parser().parse_args
    sglang = ["serve", "-tp", "4", "--nnodes", "2", "--node-rank", "1"]
    config = engine_config_from_args(parse([*sglang, "--dist-init-addr", "10.0.0.1:5000"]))
    assert (config.nnodes, config.node_rank, config.dist_init_addr) == (2, 1, "10.0.0.1:5000")
    vllm = ["serve", "-tp", "4", "-n", "2", "-r", "1", "--master-addr", "10.0.0.1"]
    assert engine_config_from_args(parse(vllm)).dist_init_addr == "10.0.0.1:29501"
    ipv6 = engine_config_from_args(parse([*vllm[:-1], "fd00::1", "--master-port", "7"]))
    assert ipv6.dist_init_addr == "[fd00::1]:7"
    both = parse([*vllm, "--dist-init-addr", "10.0.0.1:5000"])
    with pytest.raises(ValueError, match="not both"):
        engine_config_from_args(both)
    assert _config(dist_timeout=None).resolved_dist_timeout() == 300.0
    assert parse([*vllm, "--headless"]).headless  # vLLM's flag for the nodes without HTTP


def test_each_node_runs_its_share_of_the_ranks():
    config = _config(tensor_parallel_size=8, nnodes=4, node_rank=2)
    assert list(node_ranks(config)) == [4, 5]
    assert list(node_ranks(config, 0)) == [0, 1]
    gpus = EngineConfig(tensor_parallel_size=8, nnodes=2, dist_init_addr="h:1", device="cuda:0")
    # Each node's ranks take its GPUs from the first: rank 5 is the second node's cuda:1.
    assert rank_device(gpus, 5) == torch.device("cuda", 1)


def test_data_parallelism_places_whole_replicas_on_each_node(monkeypatch):
    from atom_engine.server.remote_replica import authkey, node_config

    config = _config(tensor_parallel_size=3, data_parallel_size=4)  # tp need not split now
    assert (config.ranks_per_node(), config.replicas_per_node()) == (3, 2)
    here = node_config(config)
    assert (here.data_parallel_size, here.nnodes, here.dist_init_addr) == (2, 1, None)
    monkeypatch.delenv("ATOM_DIST_AUTHKEY", raising=False)
    with pytest.raises(ValueError, match="needs ATOM_DIST_AUTHKEY"):
        authkey()
    monkeypatch.setenv("ATOM_DIST_AUTHKEY", "secret")
    assert authkey() == b"secret"


def _fingerprint(config: EngineConfig, tmp_path, hidden_size: int = 64) -> dict:
    weights = tmp_path / "model.safetensors"
    if not weights.exists():
        weights.write_bytes(b"0" * 10)
    hf = LlamaConfig(hidden_size=hidden_size, num_attention_heads=4, num_hidden_layers=2)
    return fingerprint(config, str(tmp_path), hf)


def test_fingerprints_name_the_first_field_that_differs(tmp_path):
    base = _config()
    mine = _fingerprint(base, tmp_path)
    # What each node sets for itself does not count; the rest does.
    assert difference(mine, _fingerprint(_config(node_rank=1, num_threads=3), tmp_path)) is None
    assert difference(mine, _fingerprint(_config(dtype="bfloat16"), tmp_path)) == (
        "dtype",
        "auto",
        "bfloat16",
    )
    key, _, _ = difference(mine, _fingerprint(base, tmp_path, hidden_size=128))
    assert key == "model config head_dim"
    (tmp_path / "model.safetensors").write_bytes(b"0" * 11)  # other weights
    assert difference(mine, _fingerprint(base, tmp_path))[0] == "model weight files"


def _node(config: EngineConfig, mine: dict, out: dict) -> threading.Thread:
    def run() -> None:
        try:
            out["verdict"] = join_nodes(open_store(config), config, mine)
        except NodeError as e:
            out["error"] = str(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_the_rendezvous_admits_a_matching_node(tmp_path):
    host = _config(dist_timeout=20)
    store, out = open_store(host), {}
    other = _config(node_rank=1, dist_init_addr=host.dist_init_addr)
    node = _node(other, _fingerprint(other, tmp_path), out)
    token = meet_nodes(store, host, _fingerprint(host, tmp_path), max_model_len=99)
    node.join(20)
    assert out == {"verdict": {"max_model_len": 99, "token": token}}


def test_the_rendezvous_refuses_a_mismatched_node_on_both_sides(tmp_path):
    host = _config(dist_timeout=20)
    store, out = open_store(host), {}
    other = _config(node_rank=1, dist_init_addr=host.dist_init_addr, max_model_len=128)
    node = _node(other, _fingerprint(other, tmp_path), out)
    message = "node 1 refused at the rendezvous: max_model_len is None on node 0 but 128 on node 1"
    with pytest.raises(NodeError, match=message):
        meet_nodes(store, host, _fingerprint(host, tmp_path), max_model_len=99)
    node.join(20)
    assert message in out["error"]


def test_the_rendezvous_ends_on_a_missing_node_or_a_taken_rank():
    host = _config(dist_timeout=1, nnodes=4, tensor_parallel_size=4)
    store = open_store(host)
    store.set("atom_nodes/node/2", "{}")  # node 2 came; 1 and 3 did not
    with pytest.raises(NodeError, match=r"node\(s\) 1, 3 of 4 did not join .* within 1 s"):
        meet_nodes(store, host, {}, max_model_len=1)
    store.add("atom_nodes/claim/3", 1)  # a node 3 got there first
    late = _config(nnodes=4, node_rank=3, dist_init_addr=host.dist_init_addr)
    with pytest.raises(NodeError, match="node rank 3 has joined node 0 already"):
        join_nodes(open_store(late), late, {})
    alone = _config(dist_timeout=1, node_rank=1)  # nobody listens there
    with pytest.raises(NodeError, match="did not answer within 1 s"):
        open_store(alone)


def test_node_0_stops_waiting_for_the_ranks_of_a_node_that_failed():
    config = _config(tensor_parallel_size=2, dist_timeout=60)
    store, remote = open_store(config), RemoteRanks(config)
    report_failure(store, 1, "rank 1 exited with code 1")
    try:
        with pytest.raises(NodeError, match="node 1 failed to start its ranks: rank 1 exited"):
            remote.accept("token", store)
    finally:
        remote.close()


def test_the_step_channel_carries_steps_and_names_a_failing_rank():
    config = _config(tensor_parallel_size=2, dist_timeout=60)
    store, remote = open_store(config), RemoteRanks(config)
    host, port = split_host_port(config.dist_init_addr)
    made = {}
    connect = threading.Thread(
        target=lambda: made.update(channel=StepChannel(1, host, port + 1, "token", 60))
    )
    connect.start()
    remote.accept("token", store)
    connect.join(60)
    channel, deaths, closing = made["channel"], [], threading.Event()
    try:
        remote.watch(deaths.append, closing)
        remote.send(b"\x01step")
        assert channel.recv_bytes() == b"\x01step"
        channel.send(("hello", None))  # status that is not an error keeps it alive
        channel.send(("error", "Traceback (most recent call last):\nRuntimeError: boom"))
        remote._monitor.join(30)
        assert deaths == ["node 1 (tensor-parallel rank 1 at 127.0.0.1) failed: RuntimeError: boom"]
        assert remote.error == deaths[0]
    finally:
        closing.set()
        channel.close()
        remote.close()
    with pytest.raises(NodeError, match="node 0 closed the step connection"):
        channel.recv_bytes()
