"""MXFP4 experts in the Triton fused MoE (``moe.py`` calls these from its GEMM kernels).

A weight is e2m1 values packed two per byte along K (low nibble: the even input) with one e8m0
scale per 32 inputs: w [E, N, K / 2] uint8, scales [E, N, K / 32] uint8. Every way below gives the
numbers of the torch reference's dequantized experts (e2m1 times 2^(s - 127) is exact in the
activation dtype; the products are summed in float32, in another order).

Three ways, the kernels' QUANT constexpr (``MODES``; ``resolve_mode`` picks one per call):
- "legacy" (2): each 32-input scale group decoded by hand into the activation dtype (``_e2m1_f32``,
  about ten operations a value) and fed to two K=16 dots (even inputs against the low nibbles,
  odd against the high ones); one live row (the per-pair path): the same values as register
  multiply-adds (``_legacy_fma``).
- "bits" (3): the same structure with a cheaper decode. A nibble's sign, exponent and mantissa
  bits go straight into a float16's (``_nibble_f32``: two shifts and one masked merge, then one
  exact conversion), the scale's factor folded in once per [N] vector. One live row: the group's
  32 products summed per column first and multiplied by the group's scale once (a power of two:
  exact), so no per-value scale multiply and no rounding step.
- "words" (5): "bits" with the register path decoding two values per 32-bit operation
  (``_words_fma``: the packed bytes loaded as 32-bit words, nibbles i and i + 4 of a word
  decoded together into a float16 pair). Needs 4-byte aligned packed rows (else "bits"); the
  MMA path runs "bits".
- "scaled" (4): ``tl.dot_scaled`` (bf16 activations against the packed e2m1 and its e8m0 scales),
  Triton's own upcast and MMA for the target; one live row runs the 16-row MMA. Float16 and
  float32 activations fall back to "bits".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels import envs
from atom_kernels.backends.triton.quant import e8m0_to_f32

MODES = {"legacy": 2, "bits": 3, "scaled": 4, "words": 5}
ENV = "ATOM_MXFP4_MOE"  # a MODES name: overrides the default (A/B runs)


def default_mode(per_pair: bool) -> str:
    """The way of a call that names none (and no ``ATOM_MXFP4_MOE``).

    NOTE (H100, triton 3.6; benchmarks/results/s12-h100/call1-*, call2-*): "scaled" was the
    fastest on every measured size but one. GPT-OSS-120B layer, T=1 (per-pair): legacy 0.100 ms,
    bits 0.079, words 0.085, scaled 0.070; T=16 (sorted): legacy 1.022, bits 0.984, scaled
    0.513; T=256: 3.13 / 3.10 / 1.52; T=4096: 15.9 / 15.5 / 3.86. DeepSeek-V3 layer: T=1 legacy
    0.290, words 0.175, scaled 0.183; T=16 4.25 / 4.13 / 1.57; T=4096 65.6 / 65.4 / 13.1."""
    return "scaled"


def mxfp4_tiles(config: dict, code: int, num_pairs: int) -> dict:
    """``moe._configs``' tiles (tuned for bf16 experts) adjusted for the MXFP4 way ``code`` on
    the sorted path's 16-row tiles; others unchanged.

    NOTE (H100, triton 3.6, GPT-OSS-120B layer; s9: results/quant-moe-tiles-s9-h100.json; s12:
    results/s12-h100/call1-s12-mxfp4-tiles-scaled-t16.json, call2-s12-mxfp4-tiles-scaled.json,
    each tile change timed alone). "legacy" / "bits" below 1024 pairs: GEMM 1 in 8 warps,
    1.03 ms at T=16 against 1.42 in 4 (s9). "scaled", T=16: GEMM 1 in 4 warps 0.570 ms against
    0.764 in 8; then GEMM 2 64 columns wide 0.508; then GEMM 1 in 2 warps 0.490. T=256 (1024
    pairs, the hist-align tiles): GEMM 1 in 2 warps 1.280 ms against 1.517."""
    if config["per_pair"] or config["gemm1"]["BLOCK_M"] != 16:
        return config
    config = dict(config)
    if code == MODES["scaled"]:
        config["gemm1"] = dict(config["gemm1"], num_warps=2)
        if num_pairs < 1024:
            config["gemm2"] = dict(config["gemm2"], BLOCK_N=64)
    elif num_pairs < 1024:
        config["gemm1"] = dict(config["gemm1"], num_warps=8)
    return config


def resolve_mode(
    mode: str | None, dtype: torch.dtype, per_pair: bool, weights: tuple[torch.Tensor, ...] = ()
) -> int:
    """QUANT code of the MXFP4 path: ``mode`` (a ``MODES`` name), else the env, else the default.
    "scaled" needs bf16 activations (``tl.dot_scaled``'s operand format here), "words" packed
    ``weights`` whose rows start 4-byte aligned with contiguous bytes; others get "bits"."""
    mode = mode or envs.ATOM_MXFP4_MOE or default_mode(per_pair)
    if mode not in MODES:
        raise ValueError(f"mxfp4 mode {mode!r} (argument or {ENV}): expected one of {list(MODES)}")
    if mode == "scaled" and dtype != torch.bfloat16:
        mode = "bits"
    if mode == "words" and not all(_word_aligned(w) for w in weights):
        mode = "bits"
    return MODES[mode]


def _word_aligned(w: torch.Tensor) -> bool:
    """[E, N, K / 2] packed bytes readable as 32-bit words: contiguous along K, every row start
    and the base 4-byte aligned, K / 2 a multiple of 4 (a 32-input scale group is 4 words)."""
    return (
        w.stride(2) == 1 and w.stride(0) % 4 == 0 and w.stride(1) % 4 == 0
        and w.data_ptr() % 4 == 0 and w.shape[2] % 4 == 0
    )  # fmt: skip


# --- decoding -------------------------------------------------------------------------------------


@triton.jit
def _e2m1_f32(code):
    """e2m1 codes (uint16, 0..15) -> float32, exactly, in four integer ops and two conversions:
    the code's exponent and mantissa bits placed under a float16's exponent field give the value
    times 2^-14 (code 1, 0.5, a float16 subnormal: 2^-15), hence the multiply by 2^14. No
    float32 subnormal on the way (a GPU may flush those)."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _nibble_f32(packed, HIGH: tl.constexpr):
    """One nibble of each packed byte (uint16) -> its e2m1 value times 2^-14 as float32, exactly:
    the sign bit to a float16's bit 15, exponent and mantissa to bits 11..9 (the exponent field's
    low two bits and the mantissa's top bit; code 1, 0.5, is the float16 subnormal 2^-15)."""
    if HIGH:
        bits = ((packed << 5) & 0x0E00) | ((packed << 8) & 0x8000)
    else:
        bits = ((packed << 9) & 0x0E00) | ((packed << 12) & 0x8000)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _group_scale(s_ptrs, s_mask):
    """[N] e8m0 scales -> 2^(s - 127) * 2^14 as float32 (the 2^14 undoes ``_nibble_f32``'s)."""
    return e8m0_to_f32(tl.load(s_ptrs, mask=s_mask, other=127)) * 16384.0


# --- one 32-input scale group ---------------------------------------------------------------------


@triton.jit
def _group_dot(acc, x_even, x_odd, w_ptrs, w_mask, s_ptrs, s_mask, QUANT: tl.constexpr,
               PRECISION: tl.constexpr):  # fmt: skip
    """acc + x @ W over one scale group: ``w_ptrs`` [16, N] its packed bytes (each loaded once),
    ``x_even`` / ``x_odd`` [M, 16] the matching inputs, ``s_ptrs`` [N] the group's scales."""
    packed = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.uint16)
    if QUANT == 2:
        scale = e8m0_to_f32(tl.load(s_ptrs, mask=s_mask, other=127))[None, :]
        low = (_e2m1_f32(packed & 0xF) * scale).to(x_even.dtype)
        high = (_e2m1_f32(packed >> 4) * scale).to(x_even.dtype)
    else:
        scale = _group_scale(s_ptrs, s_mask)[None, :]
        low = (_nibble_f32(packed, False) * scale).to(x_even.dtype)
        high = (_nibble_f32(packed, True) * scale).to(x_even.dtype)
    acc = tl.dot(x_even, low, acc, input_precision=PRECISION)
    return tl.dot(x_odd, high, acc, input_precision=PRECISION)


@triton.jit
def _legacy_fma(part, x_even, x_odd, w_ptrs, w_mask, s_ptrs, s_mask):
    """The "legacy" way, one live row: ``part`` [16, N] float32 partial sums (summed over axis
    0 by the caller) + the group's values times ``x_even`` / ``x_odd`` [16] (the row's inputs),
    each value rounded to x's dtype first, as the dot's operand is."""
    packed = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.uint16)
    scale = e8m0_to_f32(tl.load(s_ptrs, mask=s_mask, other=127))[None, :]
    low = (_e2m1_f32(packed & 0xF) * scale).to(x_even.dtype).to(tl.float32)
    high = (_e2m1_f32(packed >> 4) * scale).to(x_even.dtype).to(tl.float32)
    part += low * x_even.to(tl.float32)[:, None]
    return part + high * x_odd.to(tl.float32)[:, None]


@triton.jit
def _bits_fma(part, x_even, x_odd, w_ptrs, w_mask, s_ptrs, s_mask):
    """The "bits" way, one live row: ``part`` [16, N] float32 + the group's products with
    ``x_even`` / ``x_odd`` [16] (float32; exact: 2 x 8 or 11 significant bits), an even and an
    odd product summed, then times the group's scale (a power of two) in the same multiply-add.

    NOTE: summing the group's 16 rows first (one scale multiply per column) reduced across
    warps through shared memory at every group (sm_90 PTX, triton 3.9): ``part`` is summed once,
    after the loop, as "legacy"'s."""
    packed = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.uint16)
    pair = _nibble_f32(packed, False) * x_even[:, None] + _nibble_f32(packed, True) * x_odd[:, None]
    return part + pair * _group_scale(s_ptrs, s_mask)[None, :]


@triton.jit
def _words_fma(part, x_row, stride_xk, w_rows, s_ptrs, s_mask, kg, num_k, col_valid):
    """The "words" way, one live row, one scale group: ``part`` [4, N] float32 + the group's
    products. Its 16 packed bytes per column are 4 words; word j holds inputs kg + 8j .. + 7,
    nibble i (bits 4i..4i+3) input kg + 8j + i. Nibbles i and i + 4 land in a float16 pair by
    one pair of shifts and one masked merge (sign to bit 15 / 31, exponent and mantissa to bits
    9..11 / 25..27), the 16-bit halves then converted exactly (values times 2^-14)."""
    offs_w = tl.arange(0, 4)
    k_word = kg + 8 * offs_w  # [4] first input of each word
    w_mask = (k_word < num_k)[:, None] & col_valid[None, :]
    w_ptrs = w_rows.to(tl.pointer_type(tl.uint32)) + (kg // 8 + offs_w)[:, None]  # [4, N]
    words = tl.load(w_ptrs, mask=w_mask, other=0)
    acc = tl.zeros(part.shape, dtype=tl.float32)
    for i in tl.static_range(0, 4):
        if i < 3:
            mag = (words << (9 - 4 * i)) & 0x0E000E00
        else:
            mag = (words >> 3) & 0x0E000E00
        bits = mag | ((words << (12 - 4 * i)) & 0x80008000)
        low = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        high = (bits >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        k_valid = k_word < num_k
        x_low = tl.load(x_row + (k_word + i) * stride_xk, mask=k_valid, other=0.0)
        x_high = tl.load(x_row + (k_word + i + 4) * stride_xk, mask=k_valid, other=0.0)
        acc += low * x_low.to(tl.float32)[:, None] + high * x_high.to(tl.float32)[:, None]
    return part + acc * _group_scale(s_ptrs, s_mask)[None, :]


# --- a K step and whole rows ----------------------------------------------------------------------


@triton.jit
def _scaled_dot(acc, x, w_rows, s_rows, k0, num_k, col_valid, stride_wk, stride_sk,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """acc + x [M, BLOCK_K] (bf16, inputs k0 on) @ W[k0 : k0 + BLOCK_K, cols] by
    ``tl.dot_scaled``: the [BLOCK_K / 2, N] packed bytes and [N, BLOCK_K / 32] scales as loaded."""
    kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # packed bytes
    w = tl.load(w_rows + kp[:, None] * stride_wk,
                mask=(kp < num_k // 2)[:, None] & col_valid[None, :], other=0)  # fmt: skip
    kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)  # scale groups
    s = tl.load(s_rows[:, None] + kg[None, :] * stride_sk,
                mask=col_valid[:, None] & (kg < num_k // 32)[None, :], other=127)  # fmt: skip
    # fast_math: no NaN for the e8m0 byte 255 (never a real scale; the reference's is inf).
    return tl.dot_scaled(x, None, "bf16", w, s, "e2m1", acc, fast_math=True)


@triton.jit
def mxfp4_step(
    acc, acc2, x_rows, x_valid, stride_xk, w_rows, w2_rows, s_rows, s2_rows, k0, num_k, col_valid,
    stride_wk, stride_sk, TWO: tl.constexpr, QUANT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """(acc + x[:, k0 : k0 + BLOCK_K] @ W[k0 : k0 + BLOCK_K, cols], the same for acc2 and W2 when
    ``TWO``) on the MMA, the activations loaded once for both: ``x_rows`` [M, 1] pointers to the
    activation rows (inputs ``stride_xk`` apart), ``x_valid`` [M]; ``w_rows`` [1, N] the packed
    weight rows, ``s_rows`` [N] their scale rows. num_k is a multiple of 32."""
    if QUANT == 4:
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=x_valid[:, None] & (ks < num_k)[None, :],
                    other=0.0)  # [M, BLOCK_K]  # fmt: skip
        acc = _scaled_dot(acc, x, w_rows, s_rows, k0, num_k, col_valid, stride_wk, stride_sk,
                          BLOCK_K)  # fmt: skip
        if TWO:
            acc2 = _scaled_dot(acc2, x, w2_rows, s2_rows, k0, num_k, col_valid, stride_wk,
                               stride_sk, BLOCK_K)  # fmt: skip
    else:
        offs_p = tl.arange(0, 16)
        for g in tl.static_range(0, BLOCK_K // 32):
            kg = k0 + g * 32  # first input of the scale group
            ks = kg + 2 * offs_p  # [16] its even inputs
            k_valid = ks < num_k
            x_mask = x_valid[:, None] & k_valid[None, :]
            x_even = tl.load(x_rows + ks[None, :] * stride_xk, mask=x_mask, other=0.0)
            x_odd = tl.load(x_rows + (ks + 1)[None, :] * stride_xk, mask=x_mask, other=0.0)
            wp = (kg // 2 + offs_p)[:, None] * stride_wk  # [16, 1] packed bytes
            w_mask = k_valid[:, None] & col_valid[None, :]
            s_mask = col_valid & (kg + 0 * col_valid < num_k)  # [N]
            sk = (kg // 32) * stride_sk
            acc = _group_dot(acc, x_even, x_odd, w_rows + wp, w_mask, s_rows + sk, s_mask, QUANT,
                             PRECISION)  # fmt: skip
            if TWO:
                acc2 = _group_dot(acc2, x_even, x_odd, w2_rows + wp, w_mask, s2_rows + sk, s_mask,
                                  QUANT, PRECISION)  # fmt: skip
    return acc, acc2


@triton.jit
def _row_fma(part, x_row, stride_xk, w_rows, s_rows, kg, num_k, col_valid, stride_wk, stride_sk,
             QUANT: tl.constexpr):  # fmt: skip
    """One scale group of one live row into ``part`` ([16, N]; "words": [4, N])."""
    s_mask = col_valid & (kg + 0 * col_valid < num_k)  # [N]
    s_ptrs = s_rows + (kg // 32) * stride_sk
    if QUANT == 5:
        part = _words_fma(part, x_row, stride_xk, w_rows, s_ptrs, s_mask, kg, num_k, col_valid)
    else:
        offs_p = tl.arange(0, 16)
        ks = kg + 2 * offs_p  # [16] the group's even inputs
        k_valid = ks < num_k
        x_even = tl.load(x_row + ks * stride_xk, mask=k_valid, other=0.0)
        x_odd = tl.load(x_row + (ks + 1) * stride_xk, mask=k_valid, other=0.0)
        w_ptrs = w_rows + (kg // 2 + offs_p)[:, None] * stride_wk  # [16, N]
        w_mask = k_valid[:, None] & col_valid[None, :]
        if QUANT == 2:
            part = _legacy_fma(part, x_even, x_odd, w_ptrs, w_mask, s_ptrs, s_mask)
        else:
            part = _bits_fma(part, x_even.to(tl.float32), x_odd.to(tl.float32), w_ptrs, w_mask,
                             s_ptrs, s_mask)  # fmt: skip
    return part


@triton.jit
def mxfp4_gate_up(
    acc_g, acc_u, x_row, x_rows, x_valid, stride_xk, wg_rows, wu_rows, sg_rows, su_rows,
    num_k, col_valid, stride_wk, stride_sk,
    QUANT: tl.constexpr, ONE_ROW: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """GEMM 1's K loop over both halves (gate ``wg_rows`` / ``sg_rows``, up ``wu_rows`` /
    ``su_rows``), one loop so they share the activation loads. ``ONE_ROW`` (the per-pair path,
    "legacy" and "bits"): register multiply-adds on the row ``x_row`` (a scalar pointer), added
    to every row of acc_g / acc_u [M, N] (the caller stores row 0); else the MMA over
    ``x_rows`` [M, 1] / ``x_valid`` [M]."""
    if ONE_ROW and QUANT != 4:
        part_g = tl.zeros([4 if QUANT == 5 else 16, BLOCK_N], dtype=tl.float32)
        part_u = tl.zeros([4 if QUANT == 5 else 16, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, num_k, BLOCK_K):
            for g in tl.static_range(0, BLOCK_K // 32):
                kg = k0 + g * 32
                part_g = _row_fma(part_g, x_row, stride_xk, wg_rows, sg_rows, kg, num_k,
                                  col_valid, stride_wk, stride_sk, QUANT)  # fmt: skip
                part_u = _row_fma(part_u, x_row, stride_xk, wu_rows, su_rows, kg, num_k,
                                  col_valid, stride_wk, stride_sk, QUANT)  # fmt: skip
        acc_g += tl.sum(part_g, 0)[None, :]
        acc_u += tl.sum(part_u, 0)[None, :]
    else:
        for k0 in range(0, num_k, BLOCK_K):
            acc_g, acc_u = mxfp4_step(acc_g, acc_u, x_rows, x_valid, stride_xk, wg_rows, wu_rows,
                                      sg_rows, su_rows, k0, num_k, col_valid, stride_wk,
                                      stride_sk, True, QUANT, PRECISION, BLOCK_K)  # fmt: skip
    return acc_g, acc_u


@triton.jit
def mxfp4_row(
    acc, x_row, w_rows, s_rows, num_k, col_valid, stride_wk, stride_sk,
    QUANT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """acc [M, N] + x_row[:num_k] @ W[:, cols] in register multiply-adds ("legacy", "bits"; one
    live row, contiguous inputs), added to every row of acc."""
    part = tl.zeros([4 if QUANT == 5 else 16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, num_k, BLOCK_K):
        for g in tl.static_range(0, BLOCK_K // 32):
            part = _row_fma(part, x_row, 1, w_rows, s_rows, k0 + g * 32, num_k, col_valid,
                            stride_wk, stride_sk, QUANT)  # fmt: skip
    return acc + tl.sum(part, 0)[None, :]
