"""The PyTorch reference backend: plain, readable torch with the exact semantics of every op.

It runs on any device and is every test's oracle. Importing it registers its ops.
"""

from atom_kernels.backends.torch import (  # noqa: F401  (imported to register the ops)
    activation,
    attention,
    cache,
    int_quant,
    linear,
    mla,
    moe,
    norm,
    prefetch,
    quant,
    rotary,
    sampling,
    spec_decode,
)
