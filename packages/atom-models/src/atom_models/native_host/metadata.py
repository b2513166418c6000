"""The per-step metadata of the native host's paged attention: where each new token's K/V goes in
the paged cache, each sequence's block table and lengths."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class PagedAttentionMetadata:
    """Per-step metadata. T = tokens in this step, B = sequences, M = max blocks per sequence."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token (-1: padding)
    block_tables: torch.Tensor  # [B, M] int32
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache after this step (prefix + new)
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative new-token counts
    max_query_len: int
    max_seq_len: int
    # The same lengths on the host, when the builder knows them (None in captured graphs): lets
    # a layer split a mixed step by sequence without reading the device.
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # The block tables on the host ([B, M] int32), when the builder has them: what a host-planned
    # kernel (FlashInfer's prefill, `native_host.fi_prefill`) schedules from.
    block_tables_cpu: np.ndarray | None = field(default=None, repr=False, compare=False)
    # What the step's layers derive from it once (the CPU's `DecodeStep` plans), by the first
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    # A decode-only step's MLA by FlashInfer, planned for this step's sequences
    # (`native_host.mla.flashinfer_mla_decode`); None: ATOM's kernel.
    mla_decode: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> PagedAttentionMetadata:
        """Metadata for sequences whose last `query_lens[b]` of `seq_lens[b]` tokens are new."""
        if not (len(seq_lens) == len(query_lens) == len(block_tables)):
            raise ValueError(
                "seq_lens, query_lens and block_tables must have one entry per sequence"
            )
        for seq_len, query_len, table in zip(seq_lens, query_lens, block_tables, strict=True):
            if not 0 < query_len <= seq_len:
                raise ValueError(f"query length {query_len} must be in 1..seq_len={seq_len}")
            if len(table) * block_size < seq_len:
                raise ValueError(
                    f"block table of {len(table)} blocks cannot hold {seq_len} tokens "
                    f"with block_size={block_size}"
                )
        width = max(len(t) for t in block_tables)
        tables = np.zeros((len(block_tables), width), dtype=np.int32)
        for row, table in zip(tables, block_tables, strict=True):
            row[: len(table)] = table
        # Every new token's slot, without a Python loop over tokens (a 2,048-token prefill).
        lens = np.asarray(query_lens, dtype=np.int64)
        starts = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=starts[1:])
        seq_of = np.repeat(np.arange(len(lens)), lens)
        pos = np.arange(starts[-1]) - starts[seq_of] + np.repeat(np.asarray(seq_lens) - lens, lens)
        slots = tables[seq_of, pos // block_size].astype(np.int64) * block_size + pos % block_size

        def tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(values).to(device=device, dtype=dtype)

        return cls(
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor(tables, torch.int32),
            seq_lens=tensor(np.asarray(seq_lens, dtype=np.int32), torch.int32),
            query_start_loc=tensor(starts.astype(np.int32), torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            block_tables_cpu=tables,
        )
