"""Tiles and launch options of the Triton paged-attention kernels (``AttentionConfig``), the
defaults per head dim / dtype / GQA group (``default_config``), and which decode tile a batch
takes (``AttentionConfig.decode_tile``). The launcher is attention.py."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch
import triton.language as tl

from atom_kernels import envs
from atom_kernels.backends.triton.common import next_pow2


def _env_tile(name: str, value: str) -> tuple[int, int, int] | None:
    """Switch ``name``'s ``value`` "tokens,warps,stages" as a tile ("": None)."""
    if not value:
        return None
    try:
        block_n, num_warps, num_stages = (int(x) for x in value.split(","))
    except ValueError:
        raise ValueError(
            f"{name} must be 'tokens,warps,stages' (e.g. 64,2,3), got {value!r}"
        ) from None
    if min(block_n, num_warps, num_stages) < 1 or block_n & (block_n - 1):
        raise ValueError(f"{name}: a power-of-two tile and positive warps / stages, got {value!r}")
    return block_n, num_warps, num_stages


# ATOM_DECODE_SPLIT_TILE / _UNSPLIT_TILE / _LARGE_TILE="tokens,warps,stages": the decode tiles of
# 16-bit batches that are split / fill the GPU unsplit / have LARGE_BATCH_PROGRAMS_PER_SM
# programs an SM, in place of default_config's (A/B runs; benchmarks/decode_sweep.py times
# candidates).
DECODE_SPLIT_TILE = _env_tile("ATOM_DECODE_SPLIT_TILE", envs.ATOM_DECODE_SPLIT_TILE)
DECODE_UNSPLIT_TILE = _env_tile("ATOM_DECODE_UNSPLIT_TILE", envs.ATOM_DECODE_UNSPLIT_TILE)
DECODE_LARGE_TILE = _env_tile("ATOM_DECODE_LARGE_TILE", envs.ATOM_DECODE_LARGE_TILE)

# Programs the decode grid aims for, per SM: enough resident programs to cover memory latency.
PROGRAMS_PER_SM = 2
# From this many (sequence, kv head) programs an SM, the decode kernel takes the config's large
# tiles (see default_config's last NOTE: 5 was 8). ATOM_DECODE_LARGE_TILES_FROM overrides it
# (A/B runs).
LARGE_BATCH_PROGRAMS_PER_SM = envs.ATOM_DECODE_LARGE_TILES_FROM


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch options of the two attention kernels. The decode kernel runs with
    ``decode_block_n`` / ``decode_num_warps`` / ``decode_num_stages`` when the batch leaves SMs
    idle (splits add programs), with the ``_unsplit`` ones (None: the split ones) when the batch
    alone fills the GPU, and with the ``_large`` tiles from LARGE_BATCH_PROGRAMS_PER_SM programs
    an SM (see decode_tile)."""

    prefill_block_m: int
    prefill_block_n: int
    prefill_num_warps: int
    prefill_num_stages: int
    decode_block_n: int
    decode_num_warps: int
    decode_num_stages: int
    decode_num_warps_unsplit: int
    decode_block_n_large: int | None = None
    decode_num_warps_large: int | None = None
    decode_num_stages_large: int | None = None
    decode_block_n_unsplit: int | None = None  # None: decode_block_n
    decode_num_stages_unsplit: int | None = None  # None: decode_num_stages
    # Prefill query tiles in reverse order (heaviest causal tiles first; see attention_prefill).
    prefill_heavy_first: bool = True
    # The prefill's unmasked KV loop as tl.range(warp_specialize=True), where this Triton has it
    # and the inputs are 16-bit (see prefill_warp_specialize). Off: see the NOTE there.
    prefill_warp_specialize: bool = False
    # A register cap for the prefill kernel (Triton's maxnreg; None: the compiler's choice): at
    # 8 warps, 128 registers let two programs share an SM (see default_config's NOTE).
    prefill_maxnreg: int | None = None
    # The decode kernel compiled for the cache's page size (a power of two): a token's page and
    # slot by shift and mask, not a runtime division per token row. default_config turns it on:
    # 2.5-4% at every batch of benchmarks/decode_sweep.py (its last NOTE); off, the A/B switch
    # ATOM_DECODE_PAGE_CONSTEXPR=0, is gone. Other page sizes take the runtime division.
    decode_page_constexpr: bool = False
    # (sequence, kv head) programs an SM from which a decode batch runs unsplit (None:
    # PROGRAMS_PER_SM): fewer for large groups on 128-token tiles (see _default_tiles).
    decode_unsplit_from: float | None = None

    def unsplit_from(self) -> float:
        """Programs an SM from which decode runs unsplit (the ``_unsplit`` / ``_large`` tiles)."""
        return self.decode_unsplit_from or PROGRAMS_PER_SM

    def decode_tile(self, programs_per_sm: float) -> tuple[int, int, int]:
        """(KV tile, warps, stages) of the decode kernel for a batch of this many (sequence, kv
        head) programs an SM: below PROGRAMS_PER_SM the batch is split, from
        LARGE_BATCH_PROGRAMS_PER_SM it takes the large tiles."""
        if programs_per_sm >= LARGE_BATCH_PROGRAMS_PER_SM:
            return (
                self.decode_block_n_large or self.decode_block_n,
                self.decode_num_warps_large or self.decode_num_warps_unsplit,
                self.decode_num_stages_large or self.decode_num_stages,
            )
        if programs_per_sm >= self.unsplit_from():
            return (
                self.decode_block_n_unsplit or self.decode_block_n,
                self.decode_num_warps_unsplit,
                self.decode_num_stages_unsplit or self.decode_num_stages,
            )
        return self.decode_block_n, self.decode_num_warps, self.decode_num_stages


# Triton >= 3.4 has tl.range(warp_specialize=...); the prefill kernel only names it when asked.
HAS_WARP_SPECIALIZE = "warp_specialize" in inspect.signature(tl.range.__init__).parameters


def prefill_warp_specialize(config: AttentionConfig, dtype: torch.dtype, interpreted: bool) -> bool:
    """Whether the prefill launch warp-specializes its unmasked loop: asked for by the config,
    supported by this Triton, 16-bit inputs (triton 3.6's pass asserts on fp32 tiles), compiled.

    NOTE (sm_90 TTGIR from an AOT compile, triton 3.9, bf16 128x128 / 8 warps): the loop keeps
    its ``tt.warp_specialize`` attribute but no ``ttg.warp_specialize`` partitions are made, and
    the cubin has the plain loop's 255 registers and 160 KB shared: on Hopper, with gathered
    (cp.async, not TMA) K/V the pass does nothing. benchmarks/tune_prefill.py --compare times
    it on the GPU's own Triton.
    """
    return (
        config.prefill_warp_specialize
        and HAS_WARP_SPECIALIZE
        and not interpreted
        and dtype in (torch.float16, torch.bfloat16)
    )


def default_config(
    head_dim: int, dtype: torch.dtype, interpreted: bool, group: int = 1
) -> AttentionConfig:
    """Tiles for a head dim (padded to a power of two), the query dtype and the GQA group size.

    NOTE: registers / spills from sm_90 cubins (triton 3.9 AOT builds, read with cuobjdump):
    bf16, D=128: prefill 128x64 / 8 warps takes 222 registers, decode with a 64-token tile 134
    (179 at 2 warps), none spills; 64x64 / 4 warps prefill spills at D=128. Timings on one H200
    (triton 3.6, torch 2.11, CUDA-graph medians, Llama-3-8B heads, bf16): prefill 2K causal
    128x64/8w/3 stages 185 us vs 196 us at 2 stages and 219 us at 64x64/4w; 2K over a 6K prefix
    925 vs 1007 us. Decode B=64 x 4K (no split) 274 us at 2 warps vs 358 us at 4; B=8 x 4K
    (5 splits) 52 us at 4 warps vs 59 us at 2; B=1 x 1K 9.8 us with 128-token splits vs 13.7 us
    with 256. fp32 queries keep IEEE fp32 dots, which run on the FMA units and spill at larger
    tiles, so they get small ones (fp32 is for tests, not speed). Decode groups of >= 64 heads
    shrink the KV tile.

    NOTE (after the prefill rewrite: page ids carried one tile ahead, FMA-scaled exp2; sm_90
    cubins, bf16, D=128, no spills at triton 3.6 / 3.9): prefill 128x64/8w/3 stages 202 / 176
    registers with three K/V buffers (128 KB shared); 128x128/8w 254-255 registers, 160 KB at 2
    stages, 224 KB at 3. benchmarks/tune_prefill.py sweeps these on the GPU. On one H100 (triton
    3.6, torch 2.11, CUDA graphs, 32 / 8 heads, bf16, 2026-11-22): 4K causal 128x128/8w/2 stages
    364 TFLOP/s, 128x64/8w/3 350, 64x64/4w/3 329; 2K causal 299 / 293 / 306
    (benchmarks/results/tune-prefill-h100.json).

    NOTE (why the 8-warp tiles run one program an SM; sm_90 cubins, triton 3.9 AOT, bf16, D=128,
    read with cuobjdump): 128x128/8w/2 stages takes 255 registers and 160 KB shared, 128x64/8w/2
    194 registers, so one 256-thread program an SM, whose two warpgroups meet at a barrier every
    KV tile (the cp.async wait): softmax and MMA of the SM do not overlap. With 2 stages the K/V
    copies of tile i+1 are issued at the end of tile i and waited for at the top of i+1 (async_wait
    num=0): their latency is covered by the PV product only. 128x32/8w/3 or 4 stages fit 128
    registers (prefill_maxnreg=128) with no spill inside the KV loops (the 10 spilled registers
    are loads and stores outside them) in 80 / 96 KB shared: two programs an SM, out of step.
    128x64/8w/2 at 128 registers spills inside the loops (5 and 25 LDL/STL) at triton 3.9.

    NOTE (benchmarks/tune_prefill.py --compare, one H100, triton 3.6, torch 2.11, 32 / 8 heads,
    bf16, D=128, 2026-11-24, results/s10-h100/tune-prefill-compare.json; every launch checked
    against the reference): 128x64/8w/2 stages capped at 128 registers (two programs an SM) is
    the fastest of 12: 4K causal 406 TFLOP/s against 366 for the former default 128x128/8w/2,
    2K causal 357 / 301, 4K over a 6K prefix 428 / 392. 128x32/8w at 128 registers: 348-364
    (4K); warp specialization changes nothing (Hopper: no partitions made).

    NOTE (benchmarks/tune_decode.py --large-tiles, one H100, triton 3.6, 2026-11-22,
    results/tune-decode-large-tiles-h100.json): unsplit batches, D=128: 128-token KV tiles, 4
    warps, 2 stages (128 KB shared) against 64 / 2 warps / 3 stages: 256 Qwen3-0.6B sequences
    of 100-2048 tokens 396 vs 428 us, 256 Llama-3-8B of 512-768 241 vs 245 us, 64 Llama-3-8B of
    1024 97 vs 96 us (3 stages: 389 / 239 / 96 us, 192 KB shared); in the engine's batch-64
    decode step (contexts ~530) the 128-token tiles cost 3-4% (Qwen3 3.02 vs 2.90 ms): they run
    from LARGE_BATCH_PROGRAMS_PER_SM programs an SM (batch 256 x 8 kv heads), not at batch 64.

    NOTE (benchmarks/decode_sweep.py, one H100, triton 3.6, 2026-11-24,
    results/s12-h100/decode-sweep-call1.json; Qwen3-0.6B heads, D=128, the nano-vllm workload's
    decode steps, 4 layers a timed graph, every row checked against the reference; % of the
    copy bandwidth, 3,012 GB/s): the former defaults (split 64/4w/3, unsplit 64/2w/3, large
    128/4w/2 from 8 programs an SM) against the best rows, page size as a constant included:
    batch 256 243.8 -> 233.0 us (90 -> 94%, 128/4w/3), 192 256.3 -> 246.6, 128 232.2 -> 210.3
    (84 -> 93%, 128/4w/3: 7.8 programs an SM ran the 64-token tiles), 95 210.3 -> 178.1 (78 ->
    92%), 64 139.3 -> 128.1 (84 -> 91%, 64/4w/2), 32 83.8 -> 76.4 (77 -> 84%, 64/4w/2 split),
    16 46.4 -> 42.1 (71 -> 78%). The page-size constant alone: 2.5-4% (same config timed
    again). Splitting batches of >= 64 sequences costs 1-50%; sorting the rows longest first
    would win 3-4% at 192-256 (not done: the order is the scheduler's). Hence the 64/4w/2 split
    and unsplit tiles, 128/4w/3 large tiles from 5 programs an SM (batch >= 83 at 8 kv heads:
    64 sequences ran best on 64-token tiles, 95 on 128). (sm_90 cubins, triton 3.9 AOT, with
    the launch's 16-aligned head dim and page size: 128/4w/3 74 KB shared, 138 registers;
    64/4w/2 39 KB, 96; without that alignment the K/V loads are 2-byte LDGs, not cp.async.)
    """
    config = _default_tiles(head_dim, dtype, interpreted, group)
    if not interpreted and dtype in (torch.float16, torch.bfloat16):
        if DECODE_SPLIT_TILE:
            n, w, s = DECODE_SPLIT_TILE
            config = replace(config, decode_block_n=n, decode_num_warps=w, decode_num_stages=s)
        if DECODE_UNSPLIT_TILE:
            n, w, s = DECODE_UNSPLIT_TILE
            config = replace(
                config, decode_block_n_unsplit=n, decode_num_warps_unsplit=w,
                decode_num_stages_unsplit=s,
            )  # fmt: skip
        if DECODE_LARGE_TILE:
            n, w, s = DECODE_LARGE_TILE
            config = replace(
                config, decode_block_n_large=n, decode_num_warps_large=w, decode_num_stages_large=s
            )
    return replace(config, decode_page_constexpr=True)


def _default_tiles(
    head_dim: int, dtype: torch.dtype, interpreted: bool, group: int
) -> AttentionConfig:
    """default_config's tiles (see its NOTEs)."""
    if interpreted:  # small tiles: several KV tiles and query tiles even at test sizes
        return AttentionConfig(16, 16, 4, 1, 16, 4, 1, 4)
    block_d = next_pow2(head_dim, 16)
    if dtype == torch.float32:
        return AttentionConfig(32, 16, 4, 2, 32, 4, 2, 4)
    if block_d <= 64:
        config = AttentionConfig(64, 64, 4, 3, 64, 4, 3, 2)
    elif block_d <= 128:
        config = AttentionConfig(128, 64, 8, 2, 64, 4, 2, 4, 128, 4, 3, prefill_maxnreg=128)
    else:
        config = AttentionConfig(64, 32, 8, 2, 32, 4, 2, 4)
    block_g = next_pow2(group, 16)
    if block_g >= 64:
        decode_block_n = 16 if block_g >= 128 else 32
        config = replace(
            config,
            decode_block_n=min(config.decode_block_n, decode_block_n),
            decode_block_n_large=min(config.decode_block_n, decode_block_n),
            decode_num_warps_unsplit=4,
            decode_num_warps_large=4,
        )
    elif group == 16 and 64 < block_d <= 128:
        # NOTE (benchmarks/fi_tune.py, one H200, triton 3.6, 2026-11-28,
        # results/flashinfer/s23/fi-tune.json; 64 / 4 heads, D=128, 64 sequences = 1.94 programs
        # an SM, 6 split counts x 7 tiles, FlashInfer's decode alternating): unsplit on 128-token
        # tiles, 4 warps, 2 stages, is the fastest at every context: 512 / 4096 / 32768 tokens
        # 31.0 / 142.6 / 991.9 us against the former 4 splits on 64-token tiles 52.0 / 191.6 /
        # 1123.7 and FlashInfer's 33.0 / 139.3 / 960.5. At 32 / 8 heads (group 4) 128-token tiles
        # lose (312 against 257 us at 4096), so only group 16 (Qwen3-235B's 64 / 4) takes them.
        # Batches from one program an SM run unsplit (128 programs and below: not measured).
        config = replace(
            config, decode_block_n_unsplit=128, decode_num_warps_unsplit=4,
            decode_num_stages_unsplit=2, decode_unsplit_from=1.0,
        )  # fmt: skip
    return config
