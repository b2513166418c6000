"""CUDA graphs of the decode forward, one set per rank (each rank captures its own, collectives
included)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from atom_models import set_forward_context
from atom_models.native_host import PagedAttentionMetadata, flashinfer_mla_decode
from atom_models.progress import progress_bar

if TYPE_CHECKING:
    from atom_engine.graphs.target import GraphTarget

logger = logging.getLogger("atom_engine")


def _aligned(count: int, per_16_bytes: int) -> int:
    """count rounded up to a whole number of 16-byte lines (of per_16_bytes elements)."""
    return -(-count // per_16_bytes) * per_16_bytes


class DecodeGraphs:
    """CUDA graphs of the decode forward at a ladder of batch sizes (padded to the next size).

    Inputs live in one static buffer the graphs read; a step writes its batch into a pinned host
    mirror, copies it over in one transfer and replays the smallest graph that holds the batch.
    Padding rows write nowhere (slot -1) and attend one key. The token buffer starts with the
    runner's `sampled` ids, so a graph's first kernel gathers every row's input id from it or from
    the ids the host sent (`src`): a placeholder's id never goes through the host.
    """

    def __init__(self, runner: GraphTarget, max_sampled: int) -> None:
        self.runner = runner
        device = runner.device
        max_bs = max(1, min(runner.config.max_num_seqs, 512))
        self.sizes = sorted(
            {b for b in (1, 2, 4, 8, *range(16, max_bs + 1, 16)) if b <= max_bs} | {max_bs}
        )
        self.max_seq_len = runner.max_model_len
        self.max_bs = max_bs
        self.max_blocks = -(-self.max_seq_len // runner.block_size)
        # Two static buffers (int64 token data; int32 lengths and block tables, the dtypes of the
        # eager path), each with two pinned host mirrors used in turn (with launches overlapped,
        # a step's copy may still be queued while the host prepares the next): a step is two
        # host-to-device copies. tokens: [sampled | ids | src | positions | slots] (the host sends
        # all but `sampled`); meta: [seq_lens | query_start_loc | block tables]
        # Every section starts 16-byte aligned, as the eager path's fresh tensors do: Triton
        # compiles a kernel variant per pointer alignment, and a misaligned block table made the
        # first eager decode of a large batch compile one mid-run (0.7 s on an H100).
        self.num_sampled = _aligned(max_sampled, 2)  # int64: 2 per 16 bytes
        row = self._row = _aligned(max_bs, 2)
        self._lens, self._starts = _aligned(max_bs, 4), _aligned(max_bs + 1, 4)  # int32
        self._tables_at = self._lens + self._starts
        self.tokens = torch.zeros(self.num_sampled + 4 * row, dtype=torch.long, device=device)
        meta_numel = self._tables_at + max_bs * self.max_blocks
        self.meta = torch.zeros(meta_numel, dtype=torch.int32, device=device)
        self.tokens_host = [torch.zeros(4 * row, dtype=torch.long).pin_memory() for _ in "ab"]
        self.meta_host = [torch.zeros(meta_numel, dtype=torch.int32).pin_memory() for _ in "ab"]
        self._turn = 0
        head, sent = self.tokens.split([self.num_sampled, 4 * row])
        self.sampled = head[:max_sampled]
        self.input_ids, self.src, self.positions, self.slot_mapping = (
            t[:max_bs] for t in sent.split(row)
        )
        lens, starts, tables = self.meta.split([self._lens, self._starts, max_bs * self.max_blocks])
        self.seq_lens, self.query_start_loc = lens[:max_bs], starts[: max_bs + 1]
        self.block_tables = tables.view(max_bs, self.max_blocks)
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.src.copy_(torch.arange(self.num_sampled, self.num_sampled + max_bs, device=device))
        self.query_start_loc.copy_(torch.arange(max_bs + 1, device=device))
        for host in self.meta_host:
            host.numpy()[self._lens : self._lens + max_bs + 1] = np.arange(max_bs + 1)
        self._src_default = self.num_sampled + np.arange(max_bs)
        # Per host mirror and table row: (the block table list it holds, entries written).
        self._written = [[(None, 0)] * max_bs for _ in "ab"]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # FlashInfer's MLA decode, per batch size where it is asked for and measured faster:
        # planned before each replay from the step's host lengths and tables.
        self.mla = {
            bs: planned
            for bs in self.sizes
            if (
                planned := flashinfer_mla_decode(
                    runner.model, runner.block_size, graph_seqs=bs, max_blocks=self.max_blocks
                )
            )
            is not None
        }
        if self.mla:
            logger.info("MLA decode by FlashInfer in the graphs of batches %s", sorted(self.mla))
        self._capture()

    def _metadata(self, bs: int) -> PagedAttentionMetadata:
        return PagedAttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            mla_decode=self.mla.get(bs),
        )

    def _forward(self, bs: int) -> torch.Tensor:
        ids = self.tokens[self.src[:bs]]  # the host's ids, or the last launch's sampled ones
        return self.runner.model(ids, self.positions[:bs])

    @torch.no_grad()
    def _capture(self) -> None:
        pool = None
        # The bar advances between captures, never inside one.
        sizes = progress_bar(
            reversed(self.sizes),
            desc="Capturing CUDA graphs (decode)",
            total=len(self.sizes),
            enabled=self.runner.show_progress,
            unit="size",
        )
        for bs in sizes:  # largest first: smaller graphs reuse its memory pool
            if bs in self.mla:  # what the graph's static buffers hold: one key of block 0
                self.mla[bs].plan([1] * bs, np.zeros((bs, 1), dtype=np.int32))
            with set_forward_context(self._metadata(bs)):
                self._forward(bs)  # warm-up (autotune, allocs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
        self.pool = pool  # the piecewise graphs share it
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def cuda_graphs(self) -> list[torch.cuda.CUDAGraph]:
        return [graph for graph, _ in self.graphs.values()]

    def close(self) -> None:
        """Destroy the graphs (before the process group their collectives captured: NCCL's abort
        waits for them) and drop their outputs, pool and runner, so their memory goes back to the
        allocator and no reference cycle is left for the garbage collector."""
        for graph in self.cuda_graphs():
            graph.reset()
        self.graphs.clear()
        self.mla.clear()
        self.pool = None
        self.runner = None

    def fits(self, num_tokens: int, query_lens: list[int]) -> bool:
        """A decode step: one token per sequence (lengths are >= 1), at most the largest graph."""
        n = len(query_lens)
        return 0 < n <= self.sizes[-1] and num_tokens == n and max(query_lens) == 1

    def _stage_tables(self, turn: int, tables: list[list[int]], size: int) -> np.ndarray:
        """Write the step's block tables into host mirror `turn`; the mirror's table rows.

        A mirror's row keeps the table list it last held and how much of it was written: a block
        table list only ever grows (the block manager replaces it, never cuts it), so a row is
        written only past that length, a block at a time instead of a row per sequence per step.
        Entries past a row's length are stale and unread (attention reads its seq_len's blocks).
        """
        meta = self.meta_host[turn].numpy()
        rows = meta[self._tables_at :].reshape(self.max_bs, self.max_blocks)
        written = self._written[turn]
        for i, table in enumerate(tables):
            held, length = written[i]
            n = len(table)
            if held is table:
                if n == length:
                    continue
                if n > length:
                    rows[i, length:n] = table[length:]
                    written[i] = (table, n)
                    continue
            rows[i, :n] = table
            written[i] = (table, n)
        bs = len(tables)
        if size > bs:  # padding rows attend one key of block 0
            rows[bs:size, 0] = 0
            for i in range(bs, size):
                written[i] = (None, 0)
        return rows

    def run(
        self, ids: list[int], seq_lens: list[int], tables, gathers: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Replay the graph of a decode step: ids [B], tokens in the cache after it [B] (each
        sequence's position is its length - 1), block tables [B], placeholder gathers."""
        bs = len(ids)
        size = next(b for b in self.sizes if b >= bs)
        block_size = self.runner.block_size
        turn = self._turn
        self._turn ^= 1
        tokens_host, meta_host = self.tokens_host[turn], self.meta_host[turn]
        tokens, meta = tokens_host.numpy(), meta_host.numpy()
        rows = self._stage_tables(turn, tables, size)
        row = self._row
        ids_, src, pos_, slots = (tokens[i * row : i * row + size] for i in range(4))
        lens = meta[:size]
        lens[bs:] = 1  # padding rows attend one key
        lens[:bs] = seq_lens
        pos = lens[:bs] - 1
        ids_[bs:] = 0
        ids_[:bs] = ids
        src[:] = self._src_default[:size]  # row i reads ids[i] ...
        if gathers:  # ... or a sampled id
            at, sampled_rows = zip(*gathers, strict=True)
            src[list(at)] = sampled_rows
        pos_[bs:] = 0
        pos_[:bs] = pos
        slots[bs:] = -1  # padding rows write nowhere
        blocks = rows[np.arange(bs), pos // block_size]
        slots[:bs] = blocks * block_size + pos % block_size
        # The vectors, and only the table rows this step reads.
        self.tokens[self.num_sampled :].copy_(tokens_host, non_blocking=True)
        end = self._tables_at + size * self.max_blocks
        self.meta[:end].copy_(meta_host[:end], non_blocking=True)
        planned = self.mla.get(size)
        if planned is not None:
            planned.plan(lens, rows)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:bs]
