"""The WNA16 fragment layout: 4-bit weights repacked at load so that each lane of a warp loads, in
one 16-byte load, the A operands of four ``mma.sync.m16n8k16`` (the weights are the MMA's 16
rows, the tokens its 8 columns), and a warp's load is 512 contiguous bytes.

Rows layout (``ops/int_quant.py``): qweight int32 [N, K / 8], value i of word w at bits 4i,
k = 8w + i; scales (and zeros) [N, G].

Fragment layout, for N a multiple of 16 and K of 64 (a step: 64 k of 16 rows):
- qweight int32 [N / 16, K / 64, 32, 4]: lane l = 4g + c (g = l // 4, c = l % 4) of row block b,
  step s holds words j = 2 hi + jj = the rows layout's word 8s + 2c + jj of row 16b + g + 8 hi,
  its nibbles reordered so that nibble p holds value 2p (p < 4) or 2(p - 4) + 1 (p >= 4): the
  AND-OR of ``word >> 4t`` with 0x000F000F is the pair (value 2t, value 2t + 1), two adjacent k
  (x's 32-bit pairs as they are in memory).
- scales (and zeros) [N / 16, G, 8, 2]: [b, group, g, hi] is row 16b + g + 8 hi's, so a lane's two
  rows (g and g + 8) are one 32-bit load.

Each lane's k in a step are 16c .. 16c + 15, the same for the 8 lanes of one c: its x is 32
contiguous bytes per token (``backends/triton/int_quant_frag.py``). A repack is a permutation:
the same bytes, ``wna16_from_frag`` its inverse.
"""

from __future__ import annotations

import torch

from atom_kernels import envs

FRAG_ROWS = 16  # rows of a row block (the MMA's M)
FRAG_STEP = 64  # k of a step (4 MMAs of 16)
# nibble p of a fragment word holds value _NIBBLE_VALUE[p] of the rows layout's word
_NIBBLE_VALUE = (0, 2, 4, 6, 1, 3, 5, 7)


def frag_fits(n: int, k: int, group_size: int, bits: int, has_g_idx: bool) -> list[str]:
    """What keeps an [N, K] WNA16 weight out of the fragment layout (empty: it fits)."""
    why = []
    if bits != 4:
        why.append(f"4-bit weights (got {bits}-bit)")
    if n % FRAG_ROWS or k % FRAG_STEP:
        why.append(f"N a multiple of {FRAG_ROWS} and K of {FRAG_STEP} (got {n}, {k})")
    if has_g_idx:
        why.append("no g_idx")
    if group_size % FRAG_STEP:
        why.append(f"groups of a multiple of {FRAG_STEP} (got {group_size})")
    return why


def frag_preferred(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a layer on ``device`` with activations of ``dtype`` should hold a fitting weight in
    the fragment layout (``ATOM_WNA16_FRAG``): its kernels' PTX runs on NVIDIA GPUs, 16-bit x."""
    return (envs.ATOM_WNA16_FRAG and device.type == "cuda" and not torch.version.hip
            and dtype in (torch.bfloat16, torch.float16))  # fmt: skip


def is_frag(qweight: torch.Tensor) -> bool:
    """Whether ``qweight`` is in the fragment layout (4-D) rather than the rows layout (2-D)."""
    return qweight.dim() == 4


def frag_shape(qweight: torch.Tensor, bits: int = 4) -> tuple[int, int]:
    """(N, K) of a WNA16 weight in either layout."""
    if is_frag(qweight):
        return qweight.shape[0] * FRAG_ROWS, qweight.shape[1] * FRAG_STEP
    return qweight.shape[0], qweight.shape[1] * 32 // bits


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as the int32 of the same bits."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _reorder_nibbles(words: torch.Tensor, inverse: bool, rows: int = 1024) -> torch.Tensor:
    """``words`` [R, C] with each word's nibbles moved (``_NIBBLE_VALUE``), ``rows`` rows at a
    time: the int64 temporaries stay a few MB beside the one int32 copy."""
    out = torch.empty_like(words)
    for start in range(0, words.shape[0], rows):
        w = words[start : start + rows].to(torch.int64) & 0xFFFFFFFF
        part = torch.zeros_like(w)
        for p, v in enumerate(_NIBBLE_VALUE):
            src, dst = (p, v) if inverse else (v, p)
            part |= ((w >> (4 * src)) & 0xF) << (4 * dst)
        out[start : start + rows] = _to_int32(part)
    return out


def _groups_to_frag(t: torch.Tensor) -> torch.Tensor:
    n, g = t.shape
    return t.reshape(n // 16, 2, 8, g).permute(0, 3, 2, 1).contiguous()


def _groups_from_frag(t: torch.Tensor) -> torch.Tensor:
    b, g = t.shape[:2]
    return t.permute(0, 3, 2, 1).reshape(b * 16, g).contiguous()


def wna16_to_frag(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None):
    """(qweight, scales, zeros) of a 4-bit rows-layout weight in the fragment layout (module
    docstring); ``frag_fits`` says which weights fit."""
    n, kw = qweight.shape
    words = _reorder_nibbles(qweight, inverse=False)
    words = words.reshape(n // 16, 2, 8, kw // 8, 4, 2)  # b, hi, g, s, c, jj
    words = words.permute(0, 3, 2, 4, 1, 5).reshape(n // 16, kw // 8, 32, 4).contiguous()
    return words, _groups_to_frag(scales), None if zeros is None else _groups_to_frag(zeros)


def wna16_from_frag(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None):
    """The rows layout of a fragment-layout weight (``wna16_to_frag``'s inverse)."""
    b, steps = qweight.shape[:2]
    words = qweight.reshape(b, steps, 8, 4, 2, 2)  # b, s, g, c, hi, jj
    words = words.permute(0, 4, 2, 1, 3, 5).reshape(b * 16, steps * 8)
    words = _reorder_nibbles(words, inverse=True)
    return words, _groups_from_frag(scales), None if zeros is None else _groups_from_frag(zeros)
