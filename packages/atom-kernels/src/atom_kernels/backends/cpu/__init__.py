"""The CPU backend: the ops whose torch reference is slow on a CPU, written for speed there.

The automatic choice on CPU tensors. It implements what a CPU serving step spends its time on
beyond the GEMMs (attention over the paged KV cache without a per-sequence Python loop for
decodes, the KV-cache write, sampling without an exponential draw per token); every other op
runs the torch reference, which is already one or two ATen calls. The torch backend stays every
test's oracle (tests/test_cpu_backend.py, tests/test_cpu_sampling.py).
Importing it registers its ops.
"""

from atom_kernels.backends.cpu import (  # noqa: F401  (imported to register the ops)
    attention,
    cache,
    sampling,
)
