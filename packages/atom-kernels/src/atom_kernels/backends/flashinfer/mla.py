"""MLA decode by FlashInfer's planned kernel (``BatchMLAPagedAttentionWrapper``, FA3 on Hopper).

The same attention as ``atom_kernels.mla_paged_attention`` for a decode-only step (one query row
per sequence) over ATOM's latent cache ``[num_blocks, block_size, L + R]`` (latent c then rope key
k_pe; an fp8 e4m3 cache with one per-tensor scale). FlashInfer splits the work across the SMs in
a host-side *plan* made from the step's lengths, so the op is two calls: ``plan`` once per step
(from host lists, before the forward or before a CUDA graph's replay) and ``__call__`` in every
layer (captured in a graph or not). A graph's instance is planned for one batch size; a replan
rewrites its device buffers in place, so the captured kernel reads the new step.

Only imported where FlashInfer is installed (``backends.flashinfer.installed()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # numpy is imported where used: atom-kernels does not depend on it
    import numpy as np

# FlashInfer's float workspace (partial outputs of split sequences): one per device, shared by
# every planned instance (their runs are ordered on one stream).
_WORKSPACE_BYTES = 128 << 20
_workspaces: dict[torch.device, torch.Tensor] = {}

# FA3's MLA kernels: latent 512 (also 128 / 256) with rope 64; taken here for bf16 queries over
# a bf16 or an fp8 e4m3 cache (Hopper).
LATENT_DIMS = (128, 256, 512)
ROPE_DIMS = (64,)


def supports(
    latent_dim: int, rope_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, device
) -> bool:
    """Whether FlashInfer's FA3 MLA decode takes this cache: dims, dtypes, an sm_90 device."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip:
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    if latent_dim not in LATENT_DIMS or rope_dim not in ROPE_DIMS:
        return False
    if q_dtype != torch.bfloat16:  # FlashInfer takes fp16 too: not tested here
        return False
    if kv_dtype == torch.float8_e4m3fn:
        return latent_dim == 512
    return kv_dtype == q_dtype


# Under ATOM_FLASHINFER=auto: only where the engine step measured faster (backends/flashinfer's
# MEASURED_FASTER): 64 heads or more, from 64 sequences.
AUTO_MIN_HEADS = 64
AUTO_MIN_SEQS = 64


def faster(num_heads: int, num_seqs: int, named: bool | None = None) -> bool:
    """Whether FlashInfer's decode measured faster than ATOM's at this shape: in the engine step
    (``auto``, AUTO_MIN_HEADS / AUTO_MIN_SEQS), or, where ``ATOM_FLASHINFER`` names
    ``mla_decode`` (``named``; None: read it), the kernel alone.

    NOTE (one H200, FlashInfer 0.7.2.post1, triton 3.6, bf16, L 512 + R 64, page 16, 4K / 32K
    contexts, ATOM's time over FlashInfer's; benchmarks/results/mla/s26/fi-mla-h200.json and
    results/flashinfer/s27/): 128 heads 1.14-1.41x at batch 1, 2.2-2.7x at 16-256; 16 heads
    0.72 / 0.87x at batch 1 (ATOM faster), 1.11-1.30x at 16-64, 1.03x at 256.
    """
    if named is None:
        from atom_kernels.backends import flashinfer

        named = flashinfer.named("mla_decode")
    if not named:
        return num_heads >= AUTO_MIN_HEADS and num_seqs >= AUTO_MIN_SEQS
    return num_heads >= 64 or num_seqs >= 16


def csr_pages(
    seq_lens: Sequence[int], tables: Sequence[Sequence[int]] | np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's CSR page lists of a step: (kv_indptr [B + 1], kv_indices [pages], kv_lens
    [B]), int32; sequence b reads the first ceil(seq_lens[b] / block_size) blocks of its table."""
    import numpy as np

    lens = np.array(seq_lens, dtype=np.int32)  # a copy: the plan may read it after the caller
    pages = -(-lens // block_size)
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    if not isinstance(tables, np.ndarray):  # lists: their pages into one padded array
        if len(tables) != len(lens):
            raise ValueError(f"{len(tables)} block tables for {len(lens)} sequences")
        rows = np.zeros((len(lens), int(pages.max()) if len(lens) else 0), dtype=np.int32)
        for row, n, table in zip(rows, pages.tolist(), tables, strict=True):
            if n > len(table):
                raise ValueError(f"a table of {len(table)} blocks cannot hold {n} blocks")
            row[:n] = table[:n]
        tables = rows
    width = tables.shape[1] if tables.ndim == 2 else 0
    if len(lens) and int(pages.max()) > width:
        raise ValueError(f"a table of {width} blocks cannot hold {int(pages.max())} blocks")
    # Row b's first pages[b] entries, in order: a mask over the table, read row by row.
    mask = np.arange(width)[None, :] < pages[:, None]
    indices = tables[: len(lens)][mask].astype(np.int32, copy=False)
    return indptr, indices, lens


class MlaDecode:
    """FlashInfer's MLA decode for one layer shape (every MLA layer of a model shares it).

    ``graph_seqs``: plan for exactly that many sequences, in buffers a CUDA graph can capture
    (``max_blocks`` blocks per sequence at most); None: eager, any batch each plan.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        latent_dim: int,
        rope_dim: int,
        block_size: int,
        scale: float,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device | str,
        graph_seqs: int | None = None,
        max_blocks: int = 0,
    ) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self.device = torch.device(device)
        if not supports(latent_dim, rope_dim, q_dtype, kv_dtype, self.device):
            raise ValueError(
                f"FlashInfer's MLA decode does not take latent {latent_dim} + rope {rope_dim}, "
                f"q {q_dtype}, cache {kv_dtype} on {self.device}"
            )
        self.num_heads, self.latent_dim, self.rope_dim = num_heads, latent_dim, rope_dim
        self.block_size, self.scale = block_size, float(scale)
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype
        self.graph_seqs = graph_seqs
        workspace = _workspaces.get(self.device)
        if workspace is None:
            workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            _workspaces[self.device] = workspace
        buffers = {}
        if graph_seqs is not None:
            if max_blocks < 1:
                raise ValueError("a graph's MLA decode needs max_blocks >= 1")

            def i32(n: int) -> torch.Tensor:
                return torch.zeros(n, dtype=torch.int32, device=self.device)

            buffers = dict(
                qo_indptr=i32(graph_seqs + 1),
                kv_indptr=i32(graph_seqs + 1),
                kv_indices=i32(graph_seqs * max_blocks),
                kv_len_arr=i32(graph_seqs),
            )
        self._wrapper = BatchMLAPagedAttentionWrapper(
            workspace, use_cuda_graph=graph_seqs is not None, backend="auto", **buffers
        )
        # The plan stages its schedule through one pinned host buffer, copied to the device on the
        # stream: the next plan waits until that copy has run (a step may be queued behind the
        # one the host is planning).
        self._staged = torch.cuda.Event()
        self._planned = False
        self.num_seqs = 0
        self.plans = 0  # steps planned (tests read it)

    def faster_at(self, num_seqs: int) -> bool:
        """Whether this kernel measured faster than ATOM's for a step of num_seqs decodes."""
        return faster(self.num_heads, num_seqs)

    def plan(self, seq_lens: Sequence[int], tables: Sequence[Sequence[int]] | np.ndarray) -> None:
        """Plan a step: seq_lens [B] (tokens in the cache, the new one included), tables [B] (each
        sequence's blocks, or a [>= B, M] array whose rows start with them)."""
        from flashinfer.mla import MLAPlanMetadata

        num_seqs = len(seq_lens)
        if self.graph_seqs is not None and num_seqs != self.graph_seqs:
            raise ValueError(f"planned for {self.graph_seqs} sequences, got {num_seqs}")
        indptr, indices, lens = csr_pages(seq_lens, tables, self.block_size)
        if self._planned:
            self._staged.synchronize()
        metadata = MLAPlanMetadata.csr(
            torch.arange(num_seqs + 1, dtype=torch.int32),  # one query row per sequence
            torch.from_numpy(indptr),
            torch.from_numpy(indices),
            torch.from_numpy(lens),
        )
        self._wrapper.plan(
            metadata=metadata,
            num_heads=self.num_heads,
            head_dim_ckv=self.latent_dim,
            head_dim_kpe=self.rope_dim,
            page_size=self.block_size,
            causal=False,
            sm_scale=self.scale,
            q_data_type=self.q_dtype,
            kv_data_type=self.kv_dtype,
            query_layout="split",
            kv_cache_layout="packed",
        )
        self._staged.record()
        self._planned = True
        self.num_seqs = num_seqs
        self.plans += 1

    def __call__(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        kv_scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q_latent [B, H, L], q_pe [B, H, R] (the planned B), kv_cache [num_blocks, block_size,
        L + R]; returns [B, H, L] in q's dtype (into ``out`` when given). An fp8 cache takes its
        per-tensor ``kv_scale`` (a float)."""
        if not self._planned:
            raise RuntimeError("MlaDecode called before plan()")
        if q_latent.shape[0] != self.num_seqs:
            raise ValueError(f"planned for {self.num_seqs} rows, got {q_latent.shape[0]}")
        if kv_cache.dtype != self.kv_dtype:
            raise ValueError(f"planned for a {self.kv_dtype} cache, got {kv_cache.dtype}")
        scales = {}
        if self.kv_dtype == torch.float8_e4m3fn:
            if not isinstance(kv_scale, (int, float)):
                raise ValueError("an fp8 latent cache needs its scale as a float")
            scales = dict(ckv_scale=float(kv_scale), kpe_scale=float(kv_scale))
        return self._wrapper.run(
            query=(q_latent, q_pe), kv_cache=kv_cache, out=out, **scales
        )  # [B, H, L]
