"""Tensor / expert / data parallelism of the standalone engine: the checks made before any process
starts, the device of each rank, and the process group the model layers shard over.

An engine with `tensor_parallel_size` N has N ranks: rank 0 in the engine's own process (the
scheduler lives there), ranks 1..N-1 in worker processes (`atom_engine.workers`). They meet through
a TCPStore of rank 0 and build a process group of their own (NCCL on GPUs, gloo on the CPU) outside
torch.distributed's default group, so several engines (data-parallel replicas, tests) live in one
process side by side.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from atom_engine.config import EngineConfig
from atom_models.distributed import padded_attention_heads

logger = logging.getLogger("atom_engine")

# NOTE: a rank blocks in a collective until its peers reach it; a step is never this long, and a
# dead peer breaks the collective at once (gloo) or is caught by rank 0's monitor.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


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
        if first + tp * dp > found:
            raise ValueError(
                f"tensor_parallel_size {tp} x data_parallel_size {dp} = {tp * dp} ranks need "
                f"{first + tp * dp} GPUs from cuda:{first}, but {found} are visible"
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
    """Rank `rank`'s device: GPU first + rank; the CPU for all on CPU. (A data-parallel replica's
    process sees only its own GPUs: `server.replica`.)"""
    device = config.resolved_device()
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    return torch.device("cuda", index)


def make_store(rank: int, size: int, port: int = 0) -> dist.TCPStore:
    """Rank 0 opens the store (on a free port when 0: read `store.port`); the others join it."""
    return dist.TCPStore(
        "127.0.0.1",
        port,
        size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=float(os.environ.get("ATOM_TP_CONNECT_TIMEOUT", 300))),
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
    ) -> None:
        self.rank, self.size = rank, size
        self.device = device
        self.enable_expert_parallel = enable_expert_parallel
        prefixed = dist.PrefixStore("atom_tp", store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, COLLECTIVE_TIMEOUT)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            self.pg.broadcast(x, src).wait()
        return x

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())
