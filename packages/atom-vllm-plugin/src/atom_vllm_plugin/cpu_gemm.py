"""On vLLM's CPU platform, ATOM's unquantized linear layers and LM head run vLLM's CPU GEMM.
[host: vllm]

vLLM lays each CPU linear layer's weight out once, at load, for its GEMM library
(`dispatch_cpu_unquantized_gemm`: oneDNN's prepacked matmul on x86 when vLLM's build has it) and
calls that at every step; ATOM's layers call `atom_kernels.linear` (`F.linear`) on the plain weight.
NOTE: on the 2-core CI machine (AMD EPYC, AVX2, float32, 1 thread, SmolLM2-135M's shapes, load
~6) oneDNN took 26 ms against F.linear's 52 ms for the LM head at 8 rows, 13 against 16 ms at
one row, and 1.2 against 1.5 ms for gate_up at 8 rows; within noise for the small projections.
The plugin gives ATOM's layers the same GEMM after loading (the same numerics as stock vLLM's
model, too), so installing ATOM does not make vLLM's CPU GEMMs slower.
"""

from __future__ import annotations

import torch
from torch import nn

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class VllmCpuLinearMethod:
    """An ATOM linear layer's quant_method that calls the GEMM vLLM prepared for the layer."""

    def create_weights(self, layer: nn.Module) -> None:
        pass

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.cpu_linear(x, layer.weight, bias)


VLLM_CPU_LINEAR = VllmCpuLinearMethod()


def use_vllm_cpu_gemms(model: nn.Module) -> int:
    """Give every unquantized ATOM linear layer and LM head of `model` vLLM's CPU GEMM (weights
    kept: a tied LM head shares the embedding's). Returns how many layers were switched."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from atom_models.layers.embedding import ParallelLMHead
    from atom_models.layers.linear import UNQUANTIZED, LinearBase

    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            if module.quant_method is not UNQUANTIZED or module.weight.dtype not in FLOAT_DTYPES:
                continue
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            module.quant_method = VLLM_CPU_LINEAR
            count += 1
        elif isinstance(module, ParallelLMHead) and module.weight.dtype in FLOAT_DTYPES:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            module.logits_gemm = lambda x, m=module: m.cpu_linear(x, m.weight, None)
            count += 1
    return count
