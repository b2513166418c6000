"""CUDA graphs of the steps the decode graphs do not take: those with a prefill (or with more
decodes than the largest decode graph), captured in pieces between the attention layers.

A step with a prefill varies in ways a graph cannot (how many sequences, how long each, how much
of each is cached), but only its attention reads them: everything else (embeddings, norms,
projections, rotary, MLP and MoE, collectives) depends on the step's token count alone. So the
forward is captured at a ladder of token counts (a step is padded to the next), cut at every
native attention layer (`atom_models.native_host.intercept_attention`): one graph from the
start to the first layer's attention, one between each two, one after the last. A step replays
them in turn and runs each attention layer eagerly in between, on the step's real metadata and its
real tokens (the padding rows are left out), writing into a static buffer the next piece reads.
vLLM calls these piecewise CUDA graphs; it cuts an FX graph, this cuts the forward where it runs.

Memory: every size's pieces share one pool. A piece's tensors that attention reads (q, k, v) and
the forward's output are kept as weak references (`_weak`), so the pool reuses their memory as the
eager forward would; a replay writes them before it reads them, in capture order, so that is safe.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from atom_engine.sampler import to_device
from atom_models import set_forward_context
from atom_models.native_host import (
    NativeCacheLayer,
    PagedAttentionMetadata,
    intercept_attention,
)
from atom_models.progress import progress_bar

if TYPE_CHECKING:
    from atom_engine.graphs.target import GraphTarget

logger = logging.getLogger("atom_engine")


# Steps of more tokens run eagerly: their kernels take long enough that the host keeps ahead, and
# every size is one more set of graphs to capture at start-up.
MAX_CAPTURE_TOKENS = 8192


def capture_sizes(max_step_tokens: int) -> list[int]:
    """The token counts captured: at most 25% padding up to 512 tokens (16 apart below 64), 256
    tokens apart up to 2048 and 512 beyond, and `max_step_tokens` itself (a step that fills its
    budget is not padded)."""
    small = [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    sizes = {s for s in small if s < max_step_tokens}
    sizes |= set(range(768, min(max_step_tokens, 2048), 256))
    sizes |= set(range(2560, max_step_tokens, 512))
    return sorted(sizes | {max_step_tokens})


class _ArrayInterface:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def _weak(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory that does not keep that memory allocated."""
    storage = t.untyped_storage()
    raw = torch.as_tensor(_ArrayInterface(storage.data_ptr(), storage.nbytes()), device=t.device)
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


@dataclass
class _Attention:
    """One attention call between two pieces: the layer, its arguments as captured (per-token
    tensors weak; others, such as GPT-OSS's sinks, as they are) and the buffer it writes."""

    layer: NativeCacheLayer
    args: tuple
    per_token: tuple[bool, ...]
    out: torch.Tensor

    def run(self, num_tokens: int) -> None:
        args = [a[:num_tokens] if p else a for a, p in zip(self.args, self.per_token, strict=True)]
        if getattr(self.layer, "writes_out", False):
            self.layer.attend(*args, out=self.out[:num_tokens])
        else:
            self.out[:num_tokens].copy_(self.layer.attend(*args))


@dataclass
class _Captured:
    graphs: list[torch.cuda.CUDAGraph]  # one more than attentions
    attentions: list[_Attention]
    hidden: torch.Tensor  # [size, hidden], weak


class PiecewiseGraphs:
    """The piecewise graphs of one rank's model, for steps of up to `max_step_tokens` tokens (at
    most MAX_CAPTURE_TOKENS), at `capture_sizes` of that."""

    def __init__(self, runner: GraphTarget, max_step_tokens: int, pool=None) -> None:
        self.runner = runner
        self.model: nn.Module = runner.model
        self.device = runner.device
        self.block_size = runner.block_size
        max_step_tokens = min(max_step_tokens, MAX_CAPTURE_TOKENS)
        self.sizes = capture_sizes(max_step_tokens)
        self.max_step_tokens = max_step_tokens
        self.ids = torch.zeros(max_step_tokens, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_step_tokens, dtype=torch.long, device=self.device)
        # Two pinned host mirrors used in turn (a launch's copy may still be queued).
        self._host = [torch.zeros(2, max_step_tokens, dtype=torch.long).pin_memory() for _ in "ab"]
        self._turn = 0
        self._widths: dict[int, tuple[int, torch.dtype]] = {}  # id(layer) -> its output's
        self._buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.captured: dict[int, _Captured] = {}
        self.replays = 0  # steps run through these graphs
        self._capture()

    def cuda_graphs(self) -> list[torch.cuda.CUDAGraph]:
        return [graph for captured in self.captured.values() for graph in captured.graphs]

    def close(self) -> None:
        """Destroy the pieces and drop what they captured (weak tensors over the pool's memory:
        they must not outlive it), the buffers, the pool, the model and the runner (see
        `DecodeGraphs.close`)."""
        for graph in self.cuda_graphs():
            graph.reset()
        self.captured.clear()
        self._buffers.clear()
        self.pool = None
        self.model = None
        self.runner = None

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_step_tokens

    def _buffer(self, layer: NativeCacheLayer, size: int) -> torch.Tensor:
        width, dtype = self._widths[id(layer)]
        buf = self._buffers.get((width, dtype))
        if buf is None:  # in the first (largest) warm-up, never while capturing
            buf = torch.zeros(self.max_step_tokens, width, dtype=dtype, device=self.device)
            self._buffers[width, dtype] = buf
        return buf[:size]

    def _warm_up_metadata(self, size: int) -> PagedAttentionMetadata:
        """One sequence of `size` new tokens that writes nowhere (slot -1) and reads block 0."""
        block_size = self.runner.block_size
        blocks = -(-size // block_size)

        def ints(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        return PagedAttentionMetadata(
            slot_mapping=torch.full((size,), -1, dtype=torch.long, device=self.device),
            block_tables=torch.zeros(1, blocks, dtype=torch.int32, device=self.device),
            seq_lens=ints([size], torch.int32),
            query_start_loc=ints([0, size], torch.int32),
            max_query_len=size,
            max_seq_len=size,
            query_lens_cpu=[size],
            seq_lens_cpu=[size],
        )

    def _warm_up(self, size: int) -> None:
        """Run the forward once at `size` (kernels compile and autotune before capture) and learn
        each attention layer's output width."""

        def attend(layer: NativeCacheLayer, args: tuple) -> torch.Tensor:
            out = layer.attend(*args)
            self._widths[id(layer)] = (out.shape[1], out.dtype)
            buf = self._buffer(layer, size)
            buf.copy_(out)
            return buf

        with set_forward_context(self._warm_up_metadata(size)), intercept_attention(attend):
            self.model(self.ids[:size], self.positions[:size])

    def _capture_size(self, size: int, stream: torch.cuda.Stream) -> _Captured:
        graphs: list[torch.cuda.CUDAGraph] = []
        attentions: list[_Attention] = []

        def begin() -> None:
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=self.pool)

        def cut(layer: NativeCacheLayer, args: tuple) -> torch.Tensor:
            graphs[-1].capture_end()
            per_token = tuple(
                isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter) for a in args
            )
            weak = tuple(_weak(a) if p else a for a, p in zip(args, per_token, strict=True))
            out = self._buffer(layer, size)
            attentions.append(_Attention(layer, weak, per_token, out))
            begin()
            return out

        with torch.cuda.stream(stream), intercept_attention(cut):
            begin()
            try:
                hidden = self.model(self.ids[:size], self.positions[:size])
            except BaseException:
                # End the capture before the error propagates: a stream left capturing makes
                # every later CUDA call of the process fail (the engine could not even be
                # released).
                with contextlib.suppress(Exception):
                    graphs[-1].capture_end()
                raise
            graphs[-1].capture_end()
            hidden = _weak(hidden)
        return _Captured(graphs, attentions, hidden)

    @torch.no_grad()
    def _capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        sizes = progress_bar(  # advances between captures, never inside one
            reversed(self.sizes),
            desc="Capturing CUDA graphs (piecewise, mixed prefill-decode)",
            total=len(self.sizes),
            enabled=self.runner.show_progress,
            unit="size",
        )
        for size in sizes:  # largest first: the buffers get their full size
            self._warm_up(size)
            torch.cuda.synchronize(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            self.captured[size] = self._capture_size(size, stream)
            torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        pieces = len(self.captured[self.sizes[-1]].graphs)
        logger.info(
            "captured piecewise CUDA graphs (%d pieces each) for steps of %s tokens",
            pieces,
            self.sizes,
        )

    def run(
        self,
        ids: list[int],
        positions: list[int],
        gathers: list[tuple[int, int]],
        sampled: torch.Tensor,
        md: PagedAttentionMetadata,
    ) -> torch.Tensor:
        """Replay the step's pieces, the attention layers eager in between; hidden [T, hidden].
        `gathers`: (row, sampled row) pairs whose input id is the last launch's `sampled` id."""
        num_tokens = len(ids)
        size = next(s for s in self.sizes if s >= num_tokens)
        host = self._host[self._turn]
        self._turn ^= 1
        host_np = host.numpy()
        host_np[:, :size] = 0  # padding rows: token 0 at position 0
        host_np[0, :num_tokens] = ids
        host_np[1, :num_tokens] = np.asarray(positions, dtype=np.int64)
        self.ids[:size].copy_(host[0, :size], non_blocking=True)
        self.positions[:size].copy_(host[1, :size], non_blocking=True)
        if gathers:
            rows, src = zip(*gathers, strict=True)
            rows_d = to_device(list(rows), torch.long, self.device)
            self.ids[rows_d] = sampled[to_device(list(src), torch.long, self.device)]
        captured = self.captured[size]
        self.replays += 1
        with set_forward_context(md):
            for graph, attention in zip(captured.graphs, captured.attentions, strict=False):
                graph.replay()
                attention.run(num_tokens)
            captured.graphs[-1].replay()
        return captured.hidden[:num_tokens]
