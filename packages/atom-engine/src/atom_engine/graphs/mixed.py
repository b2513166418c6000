"""Whole-forward CUDA graphs of the steps with a prefill (`cudagraph_mode="full"`).

The piecewise graphs (`graphs.piecewise`) leave every attention layer eager because a step with a
prefill varies in its sequences. But the Triton attention kernels size their grids from shapes
alone and route each sequence on the device (query_start_loc, seq_lens): given a fixed number of
sequence slots, a padded token count and a block table as wide as max_model_len, one graph serves
every step of that token count. So these graphs capture the whole forward, attention included, at
the piecewise ladder of token counts with `max_seqs` sequence slots: a step fills its sequences'
slots, gives the others no rows (query_start_loc stays at the step's token count, seq_lens 0) and
pads its tokens (slot -1: written nowhere; the varlen kernel zeroes rows past the last sequence).
A step is then one replay and two host-to-device copies instead of a replay per layer and the
attention launched from Python between them.

Only models whose every cache layer is a `NativeAttention` over Triton qualify: MLA reads the
step's lengths on the host (`query_lens_cpu`) to split it, which a graph cannot; those keep the
piecewise graphs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from atom_engine.graphs.decode import _aligned
from atom_engine.graphs.piecewise import MAX_CAPTURE_TOKENS, _weak, capture_sizes
from atom_engine.sampler import to_device
from atom_models import set_forward_context
from atom_models.native_host import (
    NativeAttention,
    PagedAttentionMetadata,
    cache_layers,
    fi_prefill,
)
from atom_models.progress import progress_bar

if TYPE_CHECKING:
    from atom_engine.graphs.target import GraphTarget

logger = logging.getLogger("atom_engine")

# Sequence slots of a graph at most (a step with more sequences takes the piecewise graphs).
MAX_SEQS = 512


def supports_mixed_graphs(model: torch.nn.Module) -> bool:
    """Whether every cache layer of `model` reads only device metadata (see the module doc): not
    where FlashInfer's prefill takes them (`ATOM_FLASHINFER=prefill_attention`: it plans from the
    host's lengths, so its steps keep attention eager between piecewise graphs)."""
    layers = cache_layers(model)
    if not layers or any(type(layer) is not NativeAttention for layer in layers):
        return False
    return not fi_prefill.takes_any(layers)


class MixedGraphs:
    """Whole-forward graphs of steps of up to `max_step_tokens` tokens (at most MAX_CAPTURE_TOKENS)
    and `max_seqs` sequences, at `capture_sizes` token counts."""

    def __init__(self, runner: GraphTarget, max_step_tokens: int, pool=None) -> None:
        self.runner = runner
        device = self.device = runner.device
        self.block_size = runner.block_size
        self.max_step_tokens = max_step_tokens = min(max_step_tokens, MAX_CAPTURE_TOKENS)
        self.sizes = capture_sizes(max_step_tokens)
        self.max_seqs = seqs = max(1, min(runner.config.max_num_seqs, MAX_SEQS))
        self.max_blocks = -(-runner.max_model_len // self.block_size)
        # tokens (int64): [ids | positions | slots], each section max_step_tokens long (16-byte
        # aligned); meta (int32): [seq_lens | query_start_loc | block tables]. One pinned host
        # mirror of each per turn (a step's copy may still be queued while the next is prepared).
        self._row = row = _aligned(max_step_tokens, 2)
        self._lens, self._starts = _aligned(seqs, 4), _aligned(seqs + 1, 4)
        self._tables_at = self._lens + self._starts
        meta_numel = self._tables_at + seqs * self.max_blocks
        self.tokens = torch.zeros(3 * row, dtype=torch.long, device=device)
        self.meta = torch.zeros(meta_numel, dtype=torch.int32, device=device)
        self.tokens_host = [torch.zeros(3 * row, dtype=torch.long).pin_memory() for _ in "ab"]
        self.meta_host = [torch.zeros(meta_numel, dtype=torch.int32).pin_memory() for _ in "ab"]
        self._turn = 0
        self.ids, self.positions, self.slot_mapping = (
            t[:max_step_tokens] for t in self.tokens.split(row)
        )
        lens, starts, tables = self.meta.split([self._lens, self._starts, seqs * self.max_blocks])
        self.seq_lens, self.query_start_loc = lens[:seqs], starts[: seqs + 1]
        self.block_tables = tables.view(seqs, self.max_blocks)
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # steps run through these graphs
        self._capture()

    def cuda_graphs(self) -> list[torch.cuda.CUDAGraph]:
        return [graph for graph, _ in self.graphs.values()]

    def close(self) -> None:
        """Destroy the graphs and drop their (weak) outputs, pool and runner (see
        `DecodeGraphs.close`)."""
        for graph in self.cuda_graphs():
            graph.reset()
        self.graphs.clear()
        self.pool = None
        self.runner = None

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.max_step_tokens and num_seqs <= self.max_seqs

    def _metadata(self, size: int) -> PagedAttentionMetadata:
        # max_query_len only tells the kernels whether the step is decode-only: never here.
        return PagedAttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc,
            max_query_len=max(size, 2),
            max_seq_len=self.max_blocks * self.block_size,
        )

    def _fill_warm_up(self, size: int) -> None:
        """Metadata the warm-up and capture run on: `size` new tokens over the first sequences
        (each at most a table's width), written nowhere (slot -1), reading block 0."""
        width = self.max_blocks * self.block_size
        lens = np.zeros(self.max_seqs, dtype=np.int32)
        full, rest = divmod(size, width)
        lens[:full] = width
        if rest:
            lens[full] = rest
        starts = np.zeros(self.max_seqs + 1, dtype=np.int32)
        np.cumsum(lens, out=starts[1:])
        self.seq_lens.copy_(torch.from_numpy(lens))
        self.query_start_loc.copy_(torch.from_numpy(starts))
        self.block_tables.zero_()
        self.slot_mapping.fill_(-1)
        self.ids.zero_()
        self.positions.zero_()

    @torch.no_grad()
    def _capture(self) -> None:
        model = self.runner.model
        sizes = progress_bar(  # advances between captures, never inside one
            reversed(self.sizes),
            desc="Capturing CUDA graphs (mixed prefill-decode, full)",
            total=len(self.sizes),
            enabled=self.runner.show_progress,
            unit="size",
        )
        for size in sizes:  # largest first
            self._fill_warm_up(size)
            with set_forward_context(self._metadata(size)):
                model(self.ids[:size], self.positions[:size])  # warm-up: kernels compile
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = model(self.ids[:size], self.positions[:size])
            # Weak, as the piecewise graphs' (see there): a replay writes it before the step
            # reads it, so the pool may lend its memory to the other sizes.
            self.graphs[size] = (graph, _weak(out))
            del out
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured whole-forward CUDA graphs of the steps with a prefill (%d sequence slots) "
            "for steps of %s tokens",
            self.max_seqs,
            self.sizes,
        )

    def run(
        self,
        ids: list[int],
        positions: list[int],
        seq_lens: list[int],
        query_lens: list[int],
        tables: list[list[int]],
        gathers: list[tuple[int, int]],
        sampled: torch.Tensor,
    ) -> torch.Tensor:
        """Replay the step's graph; hidden [T, hidden]. `gathers`: (row, sampled row) pairs whose
        input id is the last launch's `sampled` id."""
        num_tokens, num_seqs = len(ids), len(seq_lens)
        size = next(s for s in self.sizes if s >= num_tokens)
        block_size, row = self.block_size, self._row
        tokens_host, meta_host = self.tokens_host[self._turn], self.meta_host[self._turn]
        self._turn ^= 1
        tokens, meta = tokens_host.numpy(), meta_host.numpy()
        ids_, pos_, slots = (tokens[i * row : i * row + size] for i in range(3))
        ids_[num_tokens:] = 0  # padding rows: token 0 at position 0, written nowhere
        ids_[:num_tokens] = ids
        pos = np.asarray(positions, dtype=np.int64)
        pos_[num_tokens:] = 0
        pos_[:num_tokens] = pos
        tables_np = meta[self._tables_at :].reshape(self.max_seqs, self.max_blocks)
        for i, t in enumerate(tables):
            tables_np[i, : len(t)] = t
        seq_of = np.repeat(np.arange(num_seqs), query_lens)
        slots[num_tokens:] = -1
        slots[:num_tokens] = (
            tables_np[seq_of, pos // block_size].astype(np.int64) * block_size + pos % block_size
        )
        lens = meta[: self.max_seqs]
        lens[num_seqs:] = 0  # sequence slots left empty: no rows, no keys
        lens[:num_seqs] = seq_lens
        starts = meta[self._lens : self._lens + self.max_seqs + 1]
        starts[0] = 0
        np.cumsum(query_lens, out=starts[1 : num_seqs + 1])
        starts[num_seqs + 1 :] = num_tokens
        # Each token section up to `size`; every sequence slot's length and start, and the table
        # rows this step reads (a row's stale tail lies past its sequence's length: never read).
        for i in range(3):
            self.tokens[i * row : i * row + size].copy_(
                tokens_host[i * row : i * row + size], non_blocking=True
            )
        end = self._tables_at + num_seqs * self.max_blocks
        self.meta[:end].copy_(meta_host[:end], non_blocking=True)
        if gathers:
            rows, src = zip(*gathers, strict=True)
            rows_d = to_device(list(rows), torch.long, self.device)
            self.ids[rows_d] = sampled[to_device(list(src), torch.long, self.device)]
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out[:num_tokens]
