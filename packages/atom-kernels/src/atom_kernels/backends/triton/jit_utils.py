"""Small @triton.jit helpers shared by the kernels."""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    # tanh from exp2 (no libdevice): 1 - 2 / (e^{2x} + 1) saturates cleanly to +-1 (inf -> 0 in
    # the quotient) and its absolute error stays ~1e-7, which is what its users (GELU-tanh,
    # attention soft-cap) need: both add or scale it, never divide by it.
    e = tl.exp2(x * 2.8853900817779268)  # 2 * log2(e)
    return 1.0 - 2.0 / (e + 1.0)
