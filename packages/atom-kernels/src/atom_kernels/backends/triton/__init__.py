"""The Triton backend: fused kernels for CUDA and ROCm GPUs (and the CPU through Triton's
interpreter, ``TRITON_INTERPRET=1``, for tests).

Each op is a private ``@triton.jit`` kernel with a launcher that checks shapes and picks block sizes
(``norm``, ``rotary``, ``activation``, ``cache``, ``attention``, ``mla_cache``, ``mla_attention``,
``quant``, ``int_quant``); ``custom_ops`` (with ``mla_custom_ops`` and ``quant_custom_ops``)
wraps the launchers as torch custom ops and registers them as the ``triton`` implementations;
``spec_decode`` (rejection sampling, outside graphs) and ``argmax`` (greedy sampling) register
their launchers directly. Ops without a Triton kernel here (sampling's filters) run the torch
reference through the registry's fallback.
"""

from atom_kernels.backends.triton import (  # noqa: F401  (imported to register the ops)
    argmax,
    custom_ops,
    int_quant,
    prefetch,
    quant_custom_ops,
    spec_decode,
)
