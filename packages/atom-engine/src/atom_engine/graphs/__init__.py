"""The engine's CUDA graphs: one rank's captured forwards, and which one a step replays.

What the model runner sees is `StepGraphs` (built by `capture_step_graphs`): `sampled`, the device
buffer a step's sampled ids land in (the decode graphs gather their input ids from it);
`replay(inputs, sampled)`, the step's hidden states from a graph, or None when no graph takes the
step (the runner then runs the forward eagerly); `cuda_graphs()`, the torch graphs to reset at
release; `close()`. Inside:

- `decode` (`DecodeGraphs`): steps of one token per sequence, at a ladder of batch sizes.
- `mixed` (`MixedGraphs`, `cudagraph_mode="full"`): whole-forward graphs of the other steps, for
  models whose attention reads only device metadata (`supports_mixed_graphs`).
- `pieces` (`PiecewiseGraphs`, `"full_and_piecewise"`, or `"full"` for the other models): the
  forward captured between the attention layers, attention eager in between.

All three share one memory pool. `"full_decode_only"` captures the decode graphs alone. Python's
garbage collector is off while they capture (`_no_gc`).
They read the runner only through `target.GraphTarget` (its model, device, config and cache
geometry): nothing here imports the runner.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from atom_engine.graphs.decode import DecodeGraphs
from atom_engine.graphs.mixed import MixedGraphs, supports_mixed_graphs
from atom_engine.graphs.piecewise import PiecewiseGraphs
from atom_models.native_host import PagedAttentionMetadata

if TYPE_CHECKING:
    from atom_engine.graphs.target import GraphTarget
    from atom_engine.step_inputs import StepInputs

__all__ = ["StepGraphs", "capture_step_graphs", "uses_graphs"]


def uses_graphs(device: torch.device, enforce_eager: bool, cudagraph_mode: str) -> bool:
    """Whether a runner on `device` captures CUDA graphs."""
    return device.type == "cuda" and not enforce_eager and cudagraph_mode != "none"


class StepGraphs:
    """One rank's CUDA graphs (see the module doc): the decode graphs, and at most one of the
    whole-forward (`mixed`) and piecewise (`pieces`) graphs of the steps with a prefill."""

    def __init__(
        self,
        decode: DecodeGraphs,
        mixed: MixedGraphs | None = None,
        pieces: PiecewiseGraphs | None = None,
    ) -> None:
        self.decode, self.mixed, self.pieces = decode, mixed, pieces
        self.sampled = decode.sampled  # [max_sampled] int64, in the decode graphs' token buffer

    def replay(self, inputs: StepInputs, sampled: torch.Tensor) -> torch.Tensor | None:
        """The step's hidden states [T, hidden] from the graph that takes it; None when none
        does. `sampled`: the last launch's sampled ids, which placeholder inputs gather."""
        num_tokens = len(inputs.ids)
        if self.decode.fits(num_tokens, inputs.query_lens):
            return self.decode.run(inputs.ids, inputs.seq_lens, inputs.tables, inputs.gathers)
        if self.mixed is not None and self.mixed.fits(num_tokens, len(inputs.seq_lens)):
            return self.mixed.run(
                inputs.ids,
                inputs.positions(),
                inputs.seq_lens,
                inputs.query_lens,
                inputs.tables,
                inputs.gathers,
                sampled,
            )
        if self.pieces is not None and self.pieces.fits(num_tokens):
            pieces = self.pieces
            md = PagedAttentionMetadata.build(
                inputs.seq_lens, inputs.query_lens, inputs.tables, pieces.block_size, pieces.device
            )
            return pieces.run(inputs.ids, inputs.positions(), inputs.gathers, sampled, md)
        return None

    def _owners(self) -> list:
        return [g for g in (self.decode, self.mixed, self.pieces) if g is not None]

    def cuda_graphs(self) -> list[torch.cuda.CUDAGraph]:
        return [graph for owner in self._owners() for graph in owner.cuda_graphs()]

    def close(self) -> None:
        """Destroy every graph and drop the buffers, pools and runner they hold (idempotent)."""
        for owner in self._owners():
            owner.close()
        self.mixed = self.pieces = None


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Collect now, then no collection until the block ends. A collection during a capture runs
    the finalizers of whatever became garbage (an earlier engine's tensors, streams, graphs), and
    one CUDA call among them that is not allowed while a stream captures (a synchronize, a free)
    invalidates the capture: seen on H200 (torch 2.11) as cuBLAS failing inside a piecewise
    capture in a process that had run other engines before (issue 35)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def capture_step_graphs(runner: GraphTarget, max_sampled: int) -> StepGraphs:
    """Capture a runner's graphs for its config's `cudagraph_mode` (the model, its KV cache and
    the sampled-id count `max_sampled` are fixed from here on)."""
    with _no_gc():
        return _capture(runner, max_sampled)


def _capture(runner: GraphTarget, max_sampled: int) -> StepGraphs:
    config = runner.config
    decode = DecodeGraphs(runner, max_sampled)
    mode, max_step_tokens = config.cudagraph_mode, config.max_num_batched_tokens
    if mode == "full" and supports_mixed_graphs(runner.model):
        return StepGraphs(decode, mixed=MixedGraphs(runner, max_step_tokens, decode.pool))
    if mode in ("full", "full_and_piecewise"):
        return StepGraphs(decode, pieces=PiecewiseGraphs(runner, max_step_tokens, decode.pool))
    return StepGraphs(decode)
