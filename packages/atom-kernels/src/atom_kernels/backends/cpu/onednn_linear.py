"""CPU: float32 linear layers on oneDNN-prepacked weights at the few-row counts of batched decode.

NOTE: SmolLM2-135M's four decoder projections (960x576, 576x576, 3072x576, 576x1536) x 30 layers,
1 thread, this 2-core AMD EPYC (AVX2, no AVX-512), torch 2.15, load 1.2-2.1 (issue 21, session
10): `F.linear` 61-82 ms at 8 rows, the weights oneDNN-packed for 8 rows
(`mkldnn._reorder_linear_weight` + `mkldnn._linear_pointwise`, what Inductor's freezing emits and
what vLLM's CPU GEMM does) 47-55 ms; at 2 rows 45 -> 38 ms, at 9 rows 66 -> 43 ms, at 16 rows
equal (74-75 ms); at 1 row and at 136 rows (a prefill) within noise of `F.linear` either way
(19-38 ms, 398-430 ms). So the packed copy serves `MIN_ROWS`..`MAX_ROWS` rows and every other
count keeps `F.linear` on the plain weight (which the layer keeps: two copies of each weight).

NOTE: at 1 row (a decode step of one sequence) neither packed copy beat `F.linear`, but a plain
transposed copy did for the projections whose K <= N: `x @ wt` with `wt` the weight as a
contiguous [K, N] matrix (MKL's non-transposed GEMM, which streams it at 18-21 GB/s against
`F.linear`'s 13.6-14.6 on these shapes). Same machine, 1 thread, 30 distinct weights each, load
~1.8 (issue 21, session 11): 960x576 4.81 -> 3.56 ms, 576x576 2.78 -> 2.38, 3072x576 15.25 ->
10.29; 576x1536 (K > N) 5.71 -> 7.10, so it keeps `F.linear`. The 30 layers' four projections
28.5 -> 21.9 ms, where this machine reads memory at ~21 GB/s on one thread (`sum` of 256 MB: 12.7
ms), a floor of ~20 ms for SmolLM2's 425 MB of decoder weights. `pack_one_row` makes that copy
(a third copy of those weights: 318 MB for SmolLM2-135M).

The GEMM is one opaque op, `atom::cpu_packed_linear`, so that a compiled graph (`torch.compile`
of the engine's forward) calls it like `aten::mm`: the packed weight (an MKLDNN tensor, which
graphs cannot take as an input) is looked up by the layer's key. The op is registered through
`torch.library.Library` with a plain CPU kernel: a call costs a few microseconds, against ~50 us
for a `torch.library.custom_op` (issue 21's fourth pass measured that for `atom::native_attention`).
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F

MIN_ROWS = 2
MAX_ROWS = 16
PACKED_FOR_ROWS = 8  # the row count oneDNN lays the weight out for

# key -> the MKLDNN-packed weight, held by its owner (a layer): freed with it
_PACKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_KEYS = itertools.count()
# key -> the weight as a contiguous [K, N] matrix for 1-row calls, held by its owner likewise
_ONE_ROW: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

_lib = torch.library.Library("atom", "FRAGMENT")
_lib.define("cpu_packed_linear(Tensor x, Tensor weight, Tensor? bias, int key) -> Tensor")


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN can pack `weight` here (a float32 CPU matrix, a build with oneDNN)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
    )


def pack(weight: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Pack `weight` [N, K] for oneDNN: (the key `packed_linear` takes, the packed weight). The
    caller keeps the packed weight alive as long as it uses the key."""
    if not can_pack(weight):
        raise ValueError("oneDNN packing needs a float32 CPU weight and torch built with oneDNN")
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)
    key = next(_KEYS)
    _PACKED[key] = packed
    return key, packed


def pack_one_row(key: int, weight: torch.Tensor) -> torch.Tensor | None:
    """For a weight [N, K] packed under `key` with K <= N, a contiguous [K, N] copy that 1-row
    calls of `packed_linear` multiply by (the caller keeps it alive as long as it uses the key);
    None, and no copy, where K > N (`F.linear` was faster there: the module NOTE)."""
    if key not in _PACKED:
        raise ValueError(f"no weight packed under key {key}: call pack() first")
    if weight.dim() != 2 or weight.shape[1] > weight.shape[0]:
        return None
    transposed = weight.detach().t().contiguous()
    _ONE_ROW[key] = transposed
    return transposed


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int
) -> torch.Tensor:
    """x [M, K] -> F.linear(x, weight, bias) [M, N]; on the packed copy `key` of `weight` when
    MIN_ROWS <= M <= MAX_ROWS and x is float32, on its 1-row copy (`pack_one_row`) when M is 1,
    else `F.linear`."""
    return torch.ops.atom.cpu_packed_linear(x, weight, bias, key)


def _cpu_packed_linear(x, weight, bias, key):
    rows = x.shape[0]
    if rows == 1 and x.dim() == 2 and x.dtype == torch.float32:
        transposed = _ONE_ROW.get(key)
        if transposed is not None:
            return torch.mm(x, transposed) if bias is None else torch.addmm(bias, x, transposed)
        return F.linear(x, weight, bias)
    if x.dim() != 2 or x.dtype != torch.float32 or not MIN_ROWS <= rows <= MAX_ROWS:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _PACKED[key], bias, "none", [], "")


def _fake(x, weight, bias, key):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_lib.impl("cpu_packed_linear", _cpu_packed_linear, "CPU")
torch.library.register_fake("atom::cpu_packed_linear", _fake, lib=_lib)
