"""Sizing the engine's KV cache: how many blocks one rank's cache holds.

Given by the config (`num_kv_blocks`), from `cpu_kv_cache_space` on the CPU, or on a GPU from what
is left of `gpu_memory_utilization` once the weights and a peak-size forward are accounted for
(`profile_gpu_blocks`). The model's `PagedKVCache` (the layers' own cache specs) gives a block's
bytes and binds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atom_engine.sampler import to_device
from atom_models import set_forward_context
from atom_models.native_host import PagedAttentionMetadata

if TYPE_CHECKING:
    from torch import nn

    from atom_engine.config import EngineConfig
    from atom_models.native_host import PagedKVCache

GiB = 1 << 30


def profile_batch(
    num_tokens: int, max_model_len: int, block_size: int
) -> tuple[list[int], list[list[int]], list[int]]:
    """The memory profile's prefill of `num_tokens` tokens as prompts of at most `max_model_len`
    (sequence lengths, block tables over fresh blocks, positions): a position past the model's
    length would read past its rotary table (the GPU rotary+cache kernel does not check it)."""
    lens = [min(max_model_len, num_tokens - s) for s in range(0, num_tokens, max_model_len)]
    tables, first = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(list(range(first, first + count)))
        first += count
    return lens, tables, [p for n in lens for p in range(n)]


def num_kv_blocks(
    model: nn.Module,
    kv_cache: PagedKVCache,
    config: EngineConfig,
    device: torch.device,
    max_model_len: int,
) -> int:
    """The blocks of one rank's cache (before the ranks agree on the smallest)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type == "cpu":
        return max(1, int(config.cpu_kv_cache_space * GiB) // kv_cache.block_bytes)
    return profile_gpu_blocks(model, kv_cache, config, device, max_model_len)


@torch.no_grad()
def profile_gpu_blocks(
    model: nn.Module,
    kv_cache: PagedKVCache,
    config: EngineConfig,
    device: torch.device,
    max_model_len: int,
) -> int:
    """Blocks that fit in gpu_memory_utilization once the weights and a peak-size forward are
    accounted for.

    Everything already on the GPU (this model's weights, other engines in this process, other
    processes) is read from the free memory; the forward's own peak on top of it is measured.
    """
    block_size = kv_cache.block_size
    per_block = kv_cache.block_bytes
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = config.max_num_batched_tokens
    lens, tables, positions = profile_batch(num_tokens, max_model_len, block_size)
    blocks = sum(len(t) for t in tables)
    kv_cache.bind(blocks, device)
    md = PagedAttentionMetadata.build(lens, lens, tables, block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    with set_forward_context(md):
        hidden = model(ids, to_device(positions, torch.long, device))
    model.compute_logits(hidden[-config.max_num_seqs :]).float().softmax(-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    peak -= blocks * per_block  # the profile's own temporary cache
    kv_cache.release()
    del hidden
    torch.cuda.empty_cache()
    in_use = total - free
    budget = total * config.gpu_memory_utilization - in_use - peak
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise ValueError(
            f"no room for a KV cache: {in_use / GiB:.2f} GiB of {total / GiB:.2f} GiB is in "
            f"use (weights included) and a forward needs {peak / GiB:.2f} GiB more; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return num_blocks
