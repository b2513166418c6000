"""Tensor parallelism across nodes: the rendezvous at node 0's TCPStore (the step channel that
follows it: `node_steps`).

`atom serve --nnodes N --node-rank R --dist-init-addr HOST:PORT -tp T` (SGLang's flags) splits
the T ranks over N nodes, T / N each: node R runs ranks R*T/N .. (R+1)*T/N - 1. Node 0 is the
engine as on one node (rank 0 in its process, its other ranks in spawned workers) and the only
node that serves HTTP and schedules; the others run `node_agent.run_node`: their ranks' workers.

Start-up, every wait bounded by `dist_timeout` (`NodeError` naming what did not come):
  1. node 0 opens the TCPStore on PORT (the ranks' process group meets there, as on one node)
     and the step listener on PORT+1;
  2. node R joins the store, claims its rank (a second node with the same rank is refused) and
     posts its fingerprint: every config field the nodes must share, the model's config and its
     weight files' sizes, the atom-engine and torch versions;
  3. node 0 waits for every node's fingerprint and posts a verdict per node: the first field that
     differs from its own (the node and node 0 both stop, naming it), or the max_model_len every
     rank sizes by and the token its ranks present on PORT+1;
  4. node R spawns its ranks; each connects to PORT+1 and builds its shard over the process
     group (gloo on the CPU, NCCL on GPUs), meeting the others through the same store.

Steps: rank 0 sends each step's packed `StepInputs` over one TCP connection per remote rank
(`multiprocessing.connection` framing, raw bytes and JSON: nothing from the network is
unpickled); a remote rank sends back only status: hello, a heartbeat every HEARTBEAT_S, its error.

Failure: rank 0's monitor thread (`RemoteRanks`) reads every remote connection; an error, a
closed connection (the process or its node died) or no heartbeat for HEARTBEAT_TIMEOUT_S (a node
gone without closing its sockets) is that rank's death, handled as a local worker's
(`WorkerGroup`: the requests in flight fail, `atom serve` exits 1). A remote rank exits 1 when
node 0 closes its connection without a shutdown message; its node exits 1 when any rank does.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import logging
import secrets
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from atom_engine.config import EngineConfig, split_host_port
from atom_engine.parallel import make_store

logger = logging.getLogger("atom_engine")

STORE_PREFIX = "atom_nodes"
# Fields each node may set for itself; every other EngineConfig field must match node 0's. (The
# model is compared by its config and weight files, not by the path it was given.)
PER_NODE_FIELDS = frozenset(
    {
        "model", "revision", "download_dir", "gguf_file", "tokenizer", "skip_tokenizer_init",
        "show_progress", "num_threads", "device", "node_rank", "dist_init_addr", "dist_timeout",
    }
)  # fmt: skip
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


class NodeError(RuntimeError):
    """A node did not arrive, was refused at the rendezvous, or went away."""


def node_ranks(config: EngineConfig, node_rank: int | None = None) -> range:
    """The tensor-parallel ranks of node `node_rank` (default: this node)."""
    node = config.node_rank if node_rank is None else node_rank
    per_node = config.ranks_per_node()
    return range(node * per_node, (node + 1) * per_node)


def node_of(config: EngineConfig, rank: int) -> int:
    return rank // config.ranks_per_node()


# -- the rendezvous -------------------------------------------------------------------------


def fingerprint(config: EngineConfig, model_path: str, hf_config) -> dict[str, Any]:
    """What every node must share, as JSON values: {field: value}."""
    out: dict[str, Any] = {
        f.name: getattr(config, f.name)
        for f in fields(EngineConfig)
        if f.name not in PER_NODE_FIELDS
    }
    out["device"] = config.resolved_device().type
    for key, value in hf_config.to_dict().items():
        if key not in ("_name_or_path", "transformers_version"):
            out[f"model config {key}"] = value
    out["model weight files"] = _weight_files(model_path)
    out["atom-engine version"] = importlib.metadata.version("atom-engine")
    out["torch version"] = torch.__version__
    return json.loads(json.dumps(out, default=str, sort_keys=True))


def _weight_files(model_path: str) -> list[list]:
    path = Path(model_path)
    files = [path] if path.is_file() else sorted(path.iterdir()) if path.is_dir() else []
    return [[f.name, f.stat().st_size] for f in files if f.name.endswith(WEIGHT_SUFFIXES)]


def difference(mine: dict, theirs: dict) -> tuple[str, Any, Any] | None:
    """The first field (sorted) whose values differ: (field, mine, theirs), or None."""
    for key in sorted(mine.keys() | theirs.keys()):
        if mine.get(key) != theirs.get(key):
            return key, mine.get(key), theirs.get(key)
    return None


def open_store(config: EngineConfig) -> dist.TCPStore:
    """Node 0 opens the rendezvous store at dist_init_addr; the other nodes join it."""
    host, port = split_host_port(config.dist_init_addr)
    timeout = config.resolved_dist_timeout()
    is_host = config.node_rank == 0
    try:
        return make_store(0 if is_host else 1, config.tensor_parallel_size, port, host, timeout)
    except (RuntimeError, OSError) as e:
        if is_host:
            raise NodeError(f"node 0 cannot open its rendezvous on port {port}: {e}") from None
        raise NodeError(
            f"node {config.node_rank}: node 0's rendezvous at {config.dist_init_addr} did not "
            f"answer within {timeout:g} s (--dist-timeout); is node 0 started with the same "
            f"--dist-init-addr, and reachable from here? ({_first_line(e)})"
        ) from None


def meet_nodes(store: dist.Store, config: EngineConfig, mine: dict, max_model_len: int) -> str:
    """Node 0: wait for every other node's fingerprint and post each one's verdict; the token
    the remote ranks present. Raises NodeError when a node is missing or refused."""
    ns = dist.PrefixStore(STORE_PREFIX, store)
    others = range(1, config.nnodes)
    timeout = config.resolved_dist_timeout()
    logger.info(
        "waiting up to %g s for node(s) %s at %s", timeout, list(others), config.dist_init_addr
    )
    try:
        ns.wait([f"node/{r}" for r in others], datetime.timedelta(seconds=timeout))
    except RuntimeError:
        missing = [r for r in others if not ns.check([f"node/{r}"])]
        raise NodeError(
            f"node(s) {', '.join(map(str, missing))} of {config.nnodes} did not join node 0's "
            f"rendezvous at {config.dist_init_addr} within {timeout:g} s (--dist-timeout): start "
            "`atom serve --node-rank R` with the same flags on each"
        ) from None
    token = secrets.token_hex(16)
    refused = []
    for r in others:
        diff = difference(mine, json.loads(ns.get(f"node/{r}")))
        if diff is None:
            verdict = {"max_model_len": max_model_len, "token": token}
        else:
            key, ours, theirs = diff
            verdict = {
                "error": f"node {r} refused at the rendezvous: {key} is {ours!r} on node 0 but "
                f"{theirs!r} on node {r} (every node needs the same model and engine flags)"
            }
            refused.append(verdict["error"])
        ns.set(f"verdict/{r}", json.dumps(verdict))
    if refused:
        try:  # the store ends with this process: let the refused nodes read why first
            ns.wait([f"read/{r}" for r in others], datetime.timedelta(seconds=10))
        except RuntimeError:
            pass
        raise NodeError("; ".join(refused))
    return token


def join_nodes(store: dist.Store, config: EngineConfig, mine: dict) -> dict:
    """Node R > 0: claim the rank, post the fingerprint, return node 0's verdict
    ({"max_model_len", "token"}); NodeError when refused or node 0 does not answer."""
    ns = dist.PrefixStore(STORE_PREFIX, store)
    r, timeout = config.node_rank, config.resolved_dist_timeout()
    if ns.add(f"claim/{r}", 1) > 1:
        raise NodeError(
            f"node rank {r} has joined node 0 already: give each node its own --node-rank"
        )
    ns.set(f"node/{r}", json.dumps(mine))
    start = time.monotonic()
    try:
        ns.wait([f"verdict/{r}"], datetime.timedelta(seconds=timeout))
        verdict = json.loads(ns.get(f"verdict/{r}"))
        ns.set(f"read/{r}", "1")
    except RuntimeError as e:
        if time.monotonic() - start < timeout:
            raise NodeError(
                f"node 0 stopped before it answered node {r} (its log says why): {_first_line(e)}"
            ) from None
        raise NodeError(
            f"node 0 did not answer node {r} within {timeout:g} s (--dist-timeout)"
        ) from None
    if "error" in verdict:
        raise NodeError(verdict["error"])
    return verdict


def report_failure(store: dist.Store, node: int, text: str) -> None:
    """Node `node` tells node 0 that a rank of its failed (node 0 may be waiting for it)."""
    try:
        dist.PrefixStore(STORE_PREFIX, store).set(f"failed/{node}", text)
    except RuntimeError:  # node 0 is gone
        pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
