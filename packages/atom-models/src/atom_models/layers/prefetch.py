"""A decoder layer's later weights asked of L2 while its attention runs (``ATOM_L2_PREFETCH_MB``).

At batch-1 decode the kernels between the QKV projection and the output projection (rotary and
K/V cache write, attention) read little from DRAM, and the GEMMs after them wait on DRAM for
every byte of their weights. ``WeightPrefetch.start`` forks a side stream as the attention
begins and launches ``atom_kernels.l2_prefetch`` there for the leading bytes of the modules it
was given (the output projection whole, then the MLP's first GEMM as far as the budget goes);
``join``, before the output projection, makes the main stream wait for that launch, which ended
microseconds earlier (a bulk prefetch does not wait for its bytes). The prefetch changes no
value: only the time of the GEMMs after it. CUDA graphs capture the fork and the join.

Off (budget 0), on CPU tensors, inside ``torch.compile`` (a host's compiled model) and in the
engine's piecewise graphs (prefill steps: a piece ends at the attention, before the join) it
does nothing.
"""

from __future__ import annotations

import torch
from torch import nn

import atom_kernels
from atom_kernels import envs
from atom_models.native_host.cache_layer import attention_intercepted

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The tensors a module's GEMM reads: its own parameters and buffers, in registration order
    (the weight, or the packed words with their scales and zeros)."""
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return [t.detach() for t in tensors if t.is_contiguous()]


class WeightPrefetch:
    """The L2 prefetch of ``modules``' tensors, in that order, up to the budget (module doc)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = list(modules)
        self._key: tuple | None = None
        self._spans: torch.Tensor | None = None
        self._pending: torch.cuda.Stream | None = None

    def spans(self, budget: int) -> torch.Tensor | None:
        """The chunk table for ``budget`` bytes, built again whenever a tensor moved (None when
        that would be inside a CUDA graph capture: the warm-up before it builds it)."""
        groups = [module_tensors(m) for m in self.modules]
        key = (budget, *(t.data_ptr() for g in groups for t in g))
        if key != self._key:
            cuda = any(t.is_cuda for g in groups for t in g)
            if cuda and torch.cuda.is_current_stream_capturing():  # no copy inside a capture
                return None
            self._spans, self._key = atom_kernels.l2_spans(groups, budget), key
        return self._spans

    def start(self, x: torch.Tensor) -> None:
        """Launch the prefetch on the side stream (after what the main stream has queued)."""
        budget = envs.ATOM_L2_PREFETCH_MB << 20
        if budget <= 0 or x.device.type != "cuda" or torch.compiler.is_compiling():
            return
        if attention_intercepted():
            return
        spans = self.spans(budget)
        if spans is None or spans.device != x.device or not spans.shape[0]:
            return
        main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            atom_kernels.l2_prefetch(spans)
        self._pending = side

    def join(self) -> None:
        """The main stream waits for the prefetch's launch (a no-op when none is pending)."""
        if self._pending is not None:
            torch.cuda.current_stream(self._pending.device).wait_stream(self._pending)
            self._pending = None
