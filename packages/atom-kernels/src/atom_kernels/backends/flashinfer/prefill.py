"""Prefill attention by FlashInfer's planned kernel (``BatchPrefillWithPagedKVCacheWrapper``,
FA3 on Hopper).

The same attention as ``atom_kernels.paged_attention`` for a step with a prefill: every sequence's
new rows (one for a decode, several for a prefill or a prefill chunk over a cached prefix) attend
causally to what the cache holds for it, over ATOM's caches ``[num_blocks, block_size, Hk, D]``
(FlashInfer's ``NHD`` pages, read where they are). FlashInfer schedules the work on the host
from the step's lengths: ``plan`` once per step (host lists, no device read), then ``__call__``
in every layer of that shape. Eager steps only (the plan cannot be captured); a plain causal
attention: no sliding window, sinks or soft cap, a cache in the query's dtype.

Only imported where FlashInfer is installed (``backends.flashinfer.installed()``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from atom_kernels.backends.flashinfer.mla import _WORKSPACE_BYTES, _workspaces, csr_pages

HEAD_DIMS = (64, 128, 256)  # FA3's prefill head sizes
DTYPES = (torch.bfloat16, torch.float16)


def supports(
    head_dim: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device,
    *,
    sliding_window: int | None = None,
    has_sinks: bool = False,
    soft_cap: float | None = None,
    kv_scaled: bool = False,
) -> bool:
    """Whether this layer's attention is one FlashInfer's FA3 prefill computes as ATOM's does:
    a head size it has, bf16 / fp16 queries over a cache of the same dtype, on an sm_90 device,
    nothing but the causal mask."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip:
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    if sliding_window is not None or has_sinks or soft_cap is not None or kv_scaled:
        return False
    return head_dim in HEAD_DIMS and q_dtype in DTYPES and kv_dtype == q_dtype


class PagedPrefill:
    """FlashInfer's prefill for one attention shape (every layer of that shape shares it)."""

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        scale: float,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        from flashinfer import BatchPrefillWithPagedKVCacheWrapper

        self.device = torch.device(device)
        if not supports(head_dim, dtype, dtype, self.device):
            raise ValueError(
                f"FlashInfer's prefill does not take head size {head_dim}, {dtype} on {self.device}"
            )
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.scale, self.dtype = block_size, float(scale), dtype
        workspace = _workspaces.get(self.device)
        if workspace is None:
            workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            _workspaces[self.device] = workspace
        self._wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="auto")
        # The plan stages its schedule through one pinned host buffer copied on the stream: the
        # next plan waits until that copy has run (see mla.MlaDecode).
        self._staged = torch.cuda.Event()
        self._planned = False
        self.num_rows = 0
        self.plans = 0  # steps planned (tests read it)

    def plan(
        self,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        tables,
    ) -> None:
        """Plan a step: query_lens [B] (new rows), seq_lens [B] (tokens in the cache after the
        step, the new ones included), tables (each sequence's blocks, or a [>= B, M] array)."""
        import numpy as np

        if len(query_lens) != len(seq_lens):
            raise ValueError(f"{len(query_lens)} query lengths for {len(seq_lens)} sequences")
        q_lens = np.asarray(query_lens, dtype=np.int32)
        if (q_lens < 1).any() or (q_lens > np.asarray(seq_lens, dtype=np.int32)).any():
            raise ValueError("each sequence needs 1..seq_len new rows")
        indptr, indices, lens = csr_pages(seq_lens, tables, self.block_size)
        qo_indptr = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qo_indptr[1:])
        last_page = (lens - 1) % self.block_size + 1
        if self._planned:
            self._staged.synchronize()
        self._wrapper.plan(
            torch.from_numpy(qo_indptr),
            torch.from_numpy(indptr),
            torch.from_numpy(indices),  # copied on the stream by plan(): no wait for the GPU
            torch.from_numpy(last_page.astype(np.int32)),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        self._staged.record()
        self._planned = True
        self.num_rows = int(qo_indptr[-1])
        self.plans += 1

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, D] (T >= the planned rows: rows past them are padding, written 0), caches
        [num_blocks, block_size, Hk, D]; returns [T, H, D] in q's dtype (into ``out`` when
        given)."""
        if not self._planned:
            raise RuntimeError("PagedPrefill called before plan()")
        rows = self.num_rows
        if q.shape[0] < rows:
            raise ValueError(f"planned for {rows} rows, got {q.shape[0]}")
        if k_cache.dtype != self.dtype or q.dtype != self.dtype:
            raise ValueError(f"planned for {self.dtype}, got q {q.dtype}, cache {k_cache.dtype}")
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        live = q[:rows] if q[:rows].is_contiguous() else q[:rows].contiguous()
        self._wrapper.run(live, (k_cache, v_cache), out=out[:rows])
        if q.shape[0] > rows:
            out[rows:].zero_()
        return out
