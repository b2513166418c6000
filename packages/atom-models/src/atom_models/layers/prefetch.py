"""A decoder layer's next weights asked of L2 ahead of their GEMM (``ATOM_L2_PREFETCH``).

At batch-1 decode every GEMM waits on DRAM for its weights, and DRAM is far from busy: the
rotary and attention kernels between the QKV and output projections read almost nothing, and
the one-row GEMMs themselves keep only the bytes in flight their registers hold (about half of
DRAM's rate, benchmarks/README.md). A ``WeightPrefetch`` forks a side stream and launches
``atom_kernels.l2_prefetch`` there for the leading bytes of its modules' tensors: bulk
prefetches (sm_90+) that the SMs' TMA units carry out while the main stream goes on, so the GEMM
that then reads them finds them in L2. The prefetch changes no value, only when bytes move.

Four stages, each with its own budget (``ATOM_L2_PREFETCH="attn=32,mlp=24,next=12"``, MB; a
stage left out or 0 is off, unset is all off; a ``last`` in the list marks the prefetched lines
evict-last in L2, so that a GEMM streaming past them evicts its own lines first):

- ``attn``: as the attention starts (after QKV), the output projection, then the MLP's first
  GEMM (gate_up) as far as the budget goes; ``qkv``: the same from before the QKV projection
  (its GEMM leaves DRAM half idle too);
- ``mlp``: as gate_up starts, the down projection;
- ``next``: as down starts, the next layer's QKV projection.

Each start forks from the main stream where it is (the side stream waits for it), and the model
joins the side stream back once, at the end of its forward (``join``), so no GEMM waits for a
prefetch's launch and CUDA graphs capture the fork and the join. Off, on CPU tensors, inside
``torch.compile`` (a host's compiled model) and in the engine's piecewise graphs (prefill steps:
a piece ends at the attention) it does nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

import atom_kernels
from atom_kernels import envs
from atom_models.native_host.cache_layer import attention_intercepted

STAGES = ("qkv", "attn", "mlp", "next")
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_PENDING: set[torch.device] = set()  # devices whose side stream has work the main one has not


@dataclass(frozen=True)
class Plan:
    budgets: dict[str, int]  # stage -> bytes (a stage left out: off)
    evict_last: bool = False  # the prefetched lines marked evict-last in L2


@functools.cache
def parse_plan(spec: str) -> Plan:
    """``ATOM_L2_PREFETCH``'s "stage=MB,...[,last]" (a malformed spec raises)."""
    budgets: dict[str, int] = {}
    last = False
    for item in filter(None, (part.strip() for part in spec.split(","))):
        stage, _, mb = item.partition("=")
        if item == "last":
            last = True
        elif stage in STAGES and mb.strip().isdigit():
            budgets[stage] = int(mb) << 20
        else:
            raise ValueError(
                f"ATOM_L2_PREFETCH={spec!r}: expected 'stage=MB,...[,last]' with stages {STAGES}"
            )
    return Plan(budgets, last)


def plan() -> Plan:
    """What ``ATOM_L2_PREFETCH`` says now."""
    return parse_plan(envs.ATOM_L2_PREFETCH)


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


def _active(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and not torch.compiler.is_compiling()


def join(x: torch.Tensor) -> None:
    """The main stream waits for the prefetches launched on ``x``'s device (the model's end)."""
    if x.device in _PENDING and _active(x):
        torch.cuda.current_stream(x.device).wait_stream(_side_stream(x.device))
        _PENDING.discard(x.device)


class WeightPrefetch:
    """One stage's prefetch of ``modules``' tensors, in that order, up to the stage's budget;
    the list is kept, not copied (two stages may share one, and a model may extend it)."""

    def __init__(self, stage: str, modules: list[nn.Module]) -> None:
        if stage not in STAGES:
            raise ValueError(f"WeightPrefetch: stage {stage!r} is not one of {STAGES}")
        self.stage = stage
        self.modules = modules
        self._key: tuple | None = None
        self._spans: torch.Tensor | None = None

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
        """Launch the prefetch on the side stream, after what the main stream has queued."""
        if not self.modules or not _active(x) or attention_intercepted():
            return
        now = plan()
        budget = now.budgets.get(self.stage, 0)
        if budget <= 0:
            return
        spans = self.spans(budget)
        if spans is None or spans.device != x.device or not spans.shape[0]:
            return
        main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            atom_kernels.l2_prefetch(spans, evict_last=now.evict_last)
        _PENDING.add(x.device)
