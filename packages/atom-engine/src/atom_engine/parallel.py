"""Tensor / expert / data parallelism of the standalone engine: the checks made before any process
starts, the device of each rank, and the process group the model layers shard over.

An engine with `tensor_parallel_size` N has N ranks: rank 0 in the engine's own process (the
scheduler lives there), ranks 1..N-1 in worker processes (`atom_engine.workers`). They meet through
a TCPStore of rank 0 and build a process group of their own (NCCL on GPUs, gloo on the CPU) outside
torch.distributed's default group, so several engines (tests, a notebook's) live in one process
side by side. (Data-parallel replicas are processes of their own: `server/replica.py`.)

A group ends with `close()`: `abort()`, which never waits for the other ranks (a shutdown of the
communicator may: NCCL's finalize does, and its abort waits for every CUDA graph that captured it to
be destroyed), in a daemon thread joined at most ABORT_TIMEOUT s, so a stuck communicator can
never block an engine's shutdown. The model runner that owns the group closes it after its graphs.

On GPUs of one host that can access each other (`ATOM_ALLREDUCE=peer`, the default), the group
also maps a staging buffer of every rank into every other rank
(`atom_kernels.collectives.PeerAllReduce`): messages up to PEER_MAX_BYTES take its one-shot kernel
(each rank pushes its rows into every rank's buffer; from PEER_TWO_SHOT_BYTES its two-shot form),
larger ones NCCL, and
`all_reduce_add_rms_norm` fuses the decoder layers' post-attention residual add and RMSNorm into
it. It beat NCCL at every size it takes and in every engine case measured (benchmarks/README.md,
"Multi-GPU": Llama-3-8B batch 1 at TP=2 0.62x TP=1, at TP=4 0.44x). `ATOM_ALLREDUCE=nccl` sends
every message to NCCL. A rank that dies mid-step leaves its peers' kernels polling until rank 0's
monitor ends the engine (the server exits, as when NCCL waits on a dead rank) or, offline, until
the kernel traps (SPIN_LIMIT polls, tens of seconds; NCCL would wait COLLECTIVE_TIMEOUT).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading

import torch
import torch.distributed as dist

from atom_engine import envs
from atom_engine.config import EngineConfig
from atom_models.distributed import padded_attention_heads

logger = logging.getLogger("atom_engine")

# NOTE: a rank blocks in a collective until its peers reach it; a step is never this long, and a
# dead peer breaks the collective at once (gloo) or is caught by rank 0's monitor.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
# How long a shutdown waits for a group's abort before it leaves it to its daemon thread.
ABORT_TIMEOUT = 10.0
# The largest message (bytes) the peer kernel takes, by group size: (plain all-reduce, fused with
# the residual add + RMSNorm); larger ones go to NCCL. The sizes up to which it (one- or two-shot,
# as below) beat NCCL (+ the Triton norm) at every size in benchmarks/allreduce.py on 4 H200s
# (results/multi-gpu/peer-allreduce/s20/allreduce-4xh200.json: TP=2 at 16 MB two-shot 62 against
# NCCL's 82 us, fused 87 against 98; TP=4 at 8 MB 59 against 62, fused 63 against 74; at 16 MB
# NCCL wins); 8 ranks were not measured: NCCL.
PEER_MAX_BYTES = {2: (16 << 20, 16 << 20), 4: (8 << 20, 8 << 20)}
# Messages at least this large (bytes, by group size) go two-shot (each rank sums a share of the
# rows and sends the sums on: fewer bytes a rank). Where it overtook the one-shot form in the same
# runs: TP=2 from 2 MB (one-shot 10.7 / fused 11.9 us against 10.8 / 11.0; 4 MB: 19.3 against
# 16.5), TP=4 from 512 KB (10.1 against 9.2 us; 1 MB: 17.3 against 11.2).
PEER_TWO_SHOT_BYTES: dict[int, int] = {2: 2 << 20, 4: 512 << 10}
ALLREDUCE_CHOICES = ("nccl", "peer")


def num_experts_of(hf_config) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    for name in ("n_routed_experts", "num_experts", "num_local_experts"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 0


def check_parallel(config: EngineConfig, hf_config) -> None:
    """Raise ValueError, naming the numbers, when the model cannot be split as asked."""
    tp, dp = config.tensor_parallel_size, config.data_parallel_size

    def indivisible(what: str, value: int, hint: str = "") -> None:
        if value % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} does not divide the model's {what} {value}{hint}"
            )

    device = config.resolved_device()
    if device.type == "cuda":
        found = torch.cuda.device_count()
        first = device.index or 0
        local = config.ranks_per_node() * config.replicas_per_node()
        if first + local > found:
            where = f" on each of {config.nnodes} nodes" if config.nnodes > 1 else ""
            raise ValueError(
                f"tensor_parallel_size {tp} x data_parallel_size {dp} = {tp * dp} ranks need "
                f"{first + local} GPUs from cuda:{first}{where}, but {found} are visible"
            )
    if tp == 1 and not config.enable_expert_parallel:
        return
    heads = hf_config.num_attention_heads
    if getattr(hf_config, "kv_lora_rank", None) is not None:  # MLA: heads split, never padded
        indivisible("number of attention heads", heads)
    else:
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        # The engine's group pads heads that do not split (`EngineTPGroup.pad_attention_heads`).
        padded, padded_kv = padded_attention_heads(heads, kv_heads, tp)
        if padded != heads:
            logger.info(
                "%d attention heads / %d KV heads do not divide over %d ranks: padded to %d / %d "
                "with zero heads (%.0f%% more attention work)",
                heads,
                kv_heads,
                tp,
                padded,
                padded_kv,
                100 * (padded / heads - 1),
            )
    experts = num_experts_of(hf_config)
    if config.enable_expert_parallel:
        if not experts:
            raise ValueError(
                "enable_expert_parallel needs a mixture-of-experts model; "
                f"{getattr(hf_config, 'model_type', 'this model')} has no experts"
            )
        indivisible("number of routed experts", experts, " (each rank holds whole experts)")
    elif experts:
        size = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
        indivisible("expert intermediate size", size, " (or enable_expert_parallel)")
    dense = getattr(hf_config, "intermediate_size", None)
    if dense and (not experts or getattr(hf_config, "moe_intermediate_size", None)):
        indivisible("MLP intermediate size", dense)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank `rank`'s device: GPU first + its index on its node; the CPU for all on CPU. (A
    data-parallel replica's process sees only its own GPUs: `server.replica`.)"""
    device = config.resolved_device()
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank % config.ranks_per_node()
    return torch.device("cuda", index)


def allreduce_choice() -> str:
    """`ATOM_ALLREDUCE`: "peer" (default: the one-shot kernel up to PEER_MAX_BYTES) or "nccl"."""
    choice = envs.ATOM_ALLREDUCE
    if choice not in ALLREDUCE_CHOICES:
        raise ValueError(f"ATOM_ALLREDUCE={choice!r}: expected one of {ALLREDUCE_CHOICES}")
    return choice


def make_store(
    rank: int, size: int, port: int = 0, host: str = "127.0.0.1", timeout: float | None = None
) -> dist.TCPStore:
    """Rank 0 opens the store (on a free port when 0: read `store.port`); the others join it,
    waiting up to `timeout` s (default `ATOM_TP_CONNECT_TIMEOUT`) for it to answer. (Over several
    nodes the store is node 0's, at `dist_init_addr`: `atom_engine.nodes`.)"""
    return dist.TCPStore(
        host,
        port,
        size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout or envs.ATOM_TP_CONNECT_TIMEOUT),
        wait_for_workers=False,
    )


class EngineTPGroup:
    """The tensor-parallel group of one engine (the `TensorParallelGroup` the layers use).

    `enable_expert_parallel` tells MoE layers built over it to give each rank whole experts;
    `pad_attention_heads`: attention heads that do not split are padded with zero heads (the
    engine sizes each rank's KV cache from its attention layers' own, padded, head counts).
    """

    pad_attention_heads = True

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        device: torch.device,
        enable_expert_parallel: bool = False,
        single_host: bool = True,
    ) -> None:
        self.rank, self.size = rank, size
        self.single_host = single_host  # False: ranks on several nodes (no peer-mapped memory)
        self.device = device
        self.enable_expert_parallel = enable_expert_parallel
        prefixed = dist.PrefixStore("atom_tp", store)
        if device.type == "cuda":
            if size > 1 and allreduce_choice() == "peer":
                # NCCL sets up a connection when a collective first needs it, which can wait on
                # the device while a peer all-reduce kernel there waits for a peer still in that
                # set-up: connect everything when the communicator starts instead.
                os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
            options = dist.ProcessGroupNCCL.Options()
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, COLLECTIVE_TIMEOUT)
        self.closed = False
        self._aborted = False
        # The largest messages the peer path takes: plain all-reduce, fused with the norm.
        self.peer_max_bytes = self.peer_fused_max_bytes = 0
        self.peer = self._peer_all_reduce(dist.PrefixStore("atom_peer_ar", store))

    def _peer_all_reduce(self, store: dist.Store):
        """The one-shot all-reduce over peer-mapped buffers, or None (NCCL for everything): unless
        `ATOM_ALLREDUCE=peer`, on the CPU, with one rank, or GPUs without peer access."""
        if allreduce_choice() != "peer" or self.device.type != "cuda" or self.size == 1:
            return None
        if not self.single_host:
            logger.info("ranks on several nodes: all-reduces stay on NCCL")
            return None
        from atom_kernels.collectives import PeerAllReduce

        first = (self.device.index or 0) - self.rank
        peers = range(first, first + self.size)
        if not all(torch.cuda.can_device_access_peer(a, b) for a in peers for b in peers if a != b):
            logger.info("GPUs %s lack peer access: all-reduces stay on NCCL", list(peers))
            return None
        plain, fused = PEER_MAX_BYTES.get(self.size, (0, 0))
        override = envs.ATOM_ALLREDUCE_PEER_MAX_BYTES
        if override is not None:
            plain = fused = override
        self.peer_max_bytes, self.peer_fused_max_bytes = plain, fused
        if max(plain, fused) <= 0:
            return None

        def all_gather(blob: bytes) -> list[bytes]:
            store.set(str(self.rank), blob)
            return [store.get(str(r)) for r in range(self.size)]

        return PeerAllReduce.create(
            self.rank, self.size, self.device, max(plain, fused), all_gather
        )

    def close(self, timeout: float = ABORT_TIMEOUT) -> bool:
        """End the group without waiting for the other ranks (idempotent); later collectives
        raise. False when the abort did not finish within `timeout` s (it goes on in a daemon
        thread: the device may still run a collective, so do not free memory)."""
        if not self.closed:
            self.closed = True
            holder = [self.pg]
            self.pg = None
            self._aborted = abort_group(holder, timeout)
            if self._aborted:  # no kernel uses the buffers now: free them and the peers' maps
                self.peer = None
        return self._aborted

    def _group(self):
        if self.pg is None:
            raise RuntimeError(
                f"the tensor-parallel group of rank {self.rank} is closed (its engine was shut "
                "down)"
            )
        return self.pg

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            if self.peer is not None and x.nbytes <= self.peer_max_bytes and self.peer.fits(x):
                self._group()  # a closed group refuses, as NCCL's would
                return self.peer.all_reduce(x, self._two_shot(x))
            self._group().allreduce([x]).wait()
        return x

    def _two_shot(self, x: torch.Tensor) -> bool:
        return x.nbytes >= PEER_TWO_SHOT_BYTES.get(self.size, 1 << 62)

    @property
    def fuses_all_reduce_norm(self) -> bool:
        """Whether decoder layers should hand their post-attention all-reduce to
        `all_reduce_add_rms_norm` (only where the peer kernel fuses it)."""
        return self.peer is not None and self.peer_fused_max_bytes > 0

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`fused_add_rms_norm(all_reduce(x), residual, weight, eps)`: one kernel when the peer
        all-reduce takes `x`."""
        peer = self.peer
        if (
            peer is not None
            and x.nbytes <= self.peer_fused_max_bytes
            and peer.fits(x)
            and residual.is_contiguous()
        ):
            self._group()
            return peer.all_reduce_add_rms_norm(x, residual, weight, eps, self._two_shot(x))
        import atom_kernels

        return atom_kernels.fused_add_rms_norm(self.all_reduce(x), residual, weight, eps)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._group().allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            self._group().broadcast(x, src).wait()
        return x

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._group().allreduce([t], opts).wait()
        return int(t.item())


def abort_group(holder: list, timeout: float = ABORT_TIMEOUT) -> bool:
    """Abort the process group in `holder` (taken out of it) in a daemon thread, waiting at most
    `timeout` s; whether it finished. The thread holds the last reference, so the group's
    destructor runs there too, never on the caller's thread before the abort is done."""

    def run() -> None:
        pg = holder.pop()
        try:
            pg.abort()
        except Exception:  # a backend without abort: its destructor ends it
            logger.debug("process group abort failed", exc_info=True)

    thread = threading.Thread(target=run, name="atom-tp-abort", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        logger.warning(
            "a tensor-parallel process group did not abort within %.0f s; left to a daemon thread",
            timeout,
        )
        return False
    return True
