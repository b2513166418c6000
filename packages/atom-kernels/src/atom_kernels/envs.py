"""Every ``ATOM_*`` environment variable atom-kernels reads: one table, its defaults and meanings.

Read a switch as an attribute (``envs.ATOM_PDL``) or with ``envs.get("ATOM_PDL")``: each lookup
reads ``os.environ`` at that moment (as vLLM's ``vllm/envs.py``), so a test that sets a variable
sees it. When a switch takes effect is the reader's choice, and this table does not change it:
the Triton launchers copy theirs into module constants at import (tests monkeypatch those
constants), the registry reads ``ATOM_KERNEL_BACKEND`` when it first picks a device's backend,
``ATOM_MXFP4_MOE`` is read on every MoE call. docs/architecture.md section 14 lists this table
(packages/atom-kernels/tests/test_envs.py keeps the two in step).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Switch:
    """An environment variable: ``default`` when unset, else ``parse(value)``."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    meaning: str

    def read(self) -> Any:
        value = os.environ.get(self.name)
        return self.default if value is None else self.parse(value)


def _is_one(value: str) -> bool:  # on only for exactly "1"
    return value == "1"


def _not_zero(value: str) -> bool:  # off only for exactly "0"
    return value != "0"


def _lower(value: str) -> str:
    return value.strip().lower()


def _same(value: str) -> str:
    return value


TABLE: tuple[Switch, ...] = (
    Switch(
        "ATOM_KERNEL_BACKEND", "auto", _lower,
        "`torch`, `cpu`, `triton` or `auto` (the device's best); `aiter` is reserved: it raises",
    ),
    Switch(
        "ATOM_PDL", True, _is_one,
        "programmatic dependent launch in the Triton kernels (anything but `1`: off)",
    ),
    Switch(
        "ATOM_PDL_PREFETCH_LINES", 8, int,
        "128-byte weight lines prefetched into L2 before the PDL wait",
    ),
    Switch(
        "ATOM_FP8_SKINNY", "auto", _lower,
        "weight-only block-FP8 GEMM: `auto` one row of a weight of at most 2**25 elements (where "
        "it measured faster), `1` 1-8 rows of any weight, `0` off (the w8a8 path)",
    ),
    Switch(
        "ATOM_WNA16_PACKED_DOT", True, _not_zero,
        "W4A16 decode (2-16 rows, 16-bit x) on tensor cores with the packed bf16x2 / f16x2 unpack "
        "(`0`: off: the fp32-unpack dots)",
    ),
    Switch(
        "ATOM_TRITON_ROUTING", True, _not_zero,
        "the Triton MoE routing kernels, one a token's routing (`0`: off: the torch ops)",
    ),
    Switch(
        "ATOM_SKINNY_SPLIT_K", "auto", _same,
        "split-K skinny GEMM: `auto` follows PDL, `1` on, anything else off",
    ),
    Switch(
        "ATOM_SKINNY_ONE_ROW", "", _same,
        "`block_n,block_k,num_warps[,split_k[,prefetch]]`: one-row tile of the projections (A/B)",
    ),
    Switch(
        "ATOM_WNA16_ONE_ROW", "", _same,
        "`block_n,num_warps,k_stages,per_sm[,mode]`: the one-row W4A16 launch (mode `quad`: the "
        "quads' MMAs, `int_quant_quad_mma`; `quadN`: N = 1, 2, 4, 8 K tiles a step; `row`: a "
        "warp a row, `int_quant_row_mma`; `rowN`: N = 1, 2, 4, 8 tiles a step; none: the "
        "multiply-adds), K split to about per_sm "
        "programs an SM, loads pipelined k_stages - 1 tiles ahead (A/B)",
    ),
    Switch(
        "ATOM_WNA16_QUAD", True, _not_zero,
        "one-row W4A16 decode (16-bit x) on tensor cores: a warp a row (`int_quant_row_mma`; "
        "K of 1024, groups of 32) or the quads' MMAs (`int_quant_quad_mma`; groups of 128) "
        "(`0`: off: the fp32 multiply-adds)",
    ),
    Switch(
        "ATOM_WNA16_ROW_SCALE_AFTER", False, _is_one,
        "the one-row W4A16 MMAs a warp a row with the scale applied after the MMAs, in fp32, "
        "where a group is a multiple of 128 values (`1`: on; off: each weight scaled and "
        "rounded before them, as the reference rounds it) (A/B: measured slower, session 34)",
    ),
    Switch(
        "ATOM_WNA16_ROW_XSUM", False, _is_one,
        "the one-row W4A16 MMAs a warp a row (bf16 x, groups of a multiple of 128 values) with "
        "neither the zero nor the scale applied to the weights: each MMA takes 128 + q, and "
        "(128 + zero) times the chunk's x-sum comes off its dot, then the scale, in fp32 (`1`: "
        "on; 8 packed float ops a word fewer) (A/B: measured no faster, session 35)",
    ),
    Switch(
        "ATOM_WNA16_ROW_STRIDED", False, _is_one,
        "the one-row W4A16 MMAs a warp a row with lane l on words l, 32 + l, 64 + l, 96 + l of a "
        "K tile (its x loads 512 contiguous bytes a warp, each word its own scale) (`1`: on) "
        "(A/B: measured slower, session 35)",
    ),
    Switch(
        "ATOM_WNA16_ROW_AHEAD", False, _is_one,
        "the one-row W4A16 MMAs a warp a row with only the words, scales and zeros of a step's "
        "K tiles (`ATOM_WNA16_ONE_ROW`'s `rowN`) loaded first, each tile's x at its math (`1`: "
        "on) (A/B: measured slower, session 35)",
    ),
    Switch(
        "ATOM_WNA16_FRAG", False, _is_one,
        "4-bit WNA16 linear layers (16-bit activations, no g_idx, groups of a multiple of 64) "
        "repacked at load into the fragment layout on NVIDIA GPUs (`ops/int_quant_frag.py`): "
        "decode at 1-8 rows on `int_quant_frag`'s MMAs, prefill on the interleaved loop (`1`: "
        "on) (A/B, session 36: Llama-3-8B decode 2.88 against 2.57 ms at batch 1, 3.46 against "
        "4.08 at batch 8)",
    ),
    Switch(
        "ATOM_WNA16_FRAG_LAUNCH", "", _same,
        "`num_warps,rows_per_warp,per_sm[,maxnreg[,k_stages]]`: the fragment layout's "
        "decode launch (`int_quant_frag.frag_config`; A/B)",
    ),
    Switch(
        "ATOM_FUSED_GATE_UP", True, _not_zero,
        "fused gate/up GEMM + SiLU-and-mul (`0`: off, A/B)",
    ),
    Switch(
        "ATOM_FUSED_NORM_GATE_UP", True, _not_zero,
        "residual add + RMSNorm fused into the gate/up GEMM at one row (`0`: off)",
    ),
    Switch(
        "ATOM_FUSED_NORM_QKV", True, _not_zero,
        "input RMSNorm fused into the QKV GEMM at one row (`0`: off)",
    ),
    Switch(
        "ATOM_NORM_ONE_PASS", "linear", _same,
        "norm statistics in the GEMM loop: `linear` (QKV only), `1` (both), anything else neither",
    ),
    Switch(
        "ATOM_NORM_MAX_FEATURES", 2048, int,
        "widest row the norm + gate/up fusion takes",
    ),
    Switch(
        "ATOM_NORM_LINEAR_MAX_FEATURES", 4096, int,
        "widest row the one-pass norm + QKV fusion takes",
    ),
    Switch(
        "ATOM_FUSED_DECODE_REDUCE", "0", _same,
        "merge decode splits in the decode kernel: `1` eager launches, `2` in graphs too (A/B)",
    ),
    Switch(
        "ATOM_DECODE_LARGE_SPLITS", 1, int,
        "splits per sequence for decode batches that fill the GPU (tuning knob)",
    ),
    Switch(
        "ATOM_DECODE_LARGE_SPLIT_TOKENS", 512, int,
        "least tokens per split of those batches (tuning knob)",
    ),
    Switch(
        "ATOM_DECODE_LARGE_SPLITS_BELOW", float("inf"), float,
        "split those batches only below this many programs per SM (tuning knob)",
    ),
    Switch(
        "ATOM_DECODE_SPLIT_TILE", "", _same,
        "`tokens,warps,stages`: 16-bit decode tile of split batches (tuning knob)",
    ),
    Switch(
        "ATOM_DECODE_UNSPLIT_TILE", "", _same,
        "the same for unsplit batches that fill the GPU (tuning knob)",
    ),
    Switch(
        "ATOM_DECODE_LARGE_TILE", "", _same,
        "the same for large batches (tuning knob)",
    ),
    Switch(
        "ATOM_DECODE_LARGE_TILES_FROM", 5.0, float,
        "programs per SM from which the large decode tiles apply (tuning knob)",
    ),
    Switch(
        "ATOM_SAMPLE_KERNEL", "block", _same,
        "Triton sampling draw: `block` or `gumbel` (benchmarks/sample_ab.py times both)",
    ),
    Switch(
        "ATOM_SAMPLE_FILTER", True, _not_zero,
        "top-k / top-p / min-p rows drawn by the Triton filter kernels (`0`: the torch sort, A/B)",
    ),
    Switch(
        "ATOM_SAMPLE_TOP", 64, int,
        "largest logits the filter's first pass keeps for top-k rows (`0`: every threshold "
        "searched, A/B)",
    ),
    Switch(
        "ATOM_SAMPLE_PRUNE", True, _not_zero,
        "the filter kernel skips the work a block of logits cannot change (`0`: off, A/B)",
    ),
    Switch(
        "ATOM_SAMPLE_SPLIT_BELOW", 64, int,
        "batches below this many rows draw filtered rows with a row over programs (A/B)",
    ),
    Switch(
        "ATOM_FLASHINFER", "auto", _lower,
        "FlashInfer's kernels, when installed, for ops measured faster: `auto`, `0` or op names",
    ),
    Switch(
        "ATOM_TRITON_ARGMAX", True, _is_one,
        "Triton greedy argmax (anything but `1`: `torch.argmax`)",
    ),
    Switch(
        "ATOM_MXFP4_MOE", "", _same,
        "MXFP4 fused-MoE way `legacy`, `bits`, `scaled` or `words` (unset: the tuned default)",
    ),
    # Read by atom-models' native attention (the models package has no table of its own).
    Switch(
        "ATOM_FUSED_ROPE_CACHE", True, _not_zero,
        "rotary + KV-cache write in one kernel through `forward_rope` (`0`: off, A/B)",
    ),
    Switch(
        "ATOM_L2_PREFETCH", "", _same,
        "`stage=MB,...[,last]`: a decoder layer's next weights asked of L2 ahead of their GEMM, "
        "stages `attn` (o_proj, gate_up; `qkv`: the same from before QKV), `mlp` (down), `next` "
        "(the next QKV); `last`: evict-last lines (unset: off)",
    ),
    # Read by atom-models' checkpoint reader.
    Switch(
        "ATOM_SAFETENSORS_DIRECT", "1", _lower,
        "a rank reading whole safetensors on a GPU: `1` file -> pinned memory -> GPU, `register` "
        "DMA from the registered page cache, `0` mmap",
    ),
)  # fmt: skip

SWITCHES: dict[str, Switch] = {s.name: s for s in TABLE}


def get(name: str) -> Any:
    """The value of switch ``name`` now (its default when unset)."""
    return SWITCHES[name].read()


def __getattr__(name: str) -> Any:
    if name in SWITCHES:
        return SWITCHES[name].read()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *SWITCHES])
