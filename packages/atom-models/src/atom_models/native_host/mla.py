"""ATOM's own MLA: a paged latent cache per layer, computed with atom_kernels.

The cache holds, per token, only the normed latent c (L = kv_lora_rank) and the rotated rope key
k_pe (R = qk_rope_head_dim): `[num_blocks, block_size, L + R]`, one "head" shared by every query
head. `kv_b_proj.weight` [H * (Dn + Dv), L] holds each head's key up-projection W_UK [Dn, L] and
value up-projection W_UV [Dv, L]. Two exact formulations of the same attention:

- absorbed (decode): q_latent = q_nope @ W_UK, attention over the cache itself
  (`atom_kernels.mla_paged_attention`: scores q_latent . c + q_pe . k_pe, values c), then the
  output through W_UV. Reads L + R values per cached token, whatever H is.
- expanded (prefill): the cached latents of the step's blocks go up through kv_b_proj to per-head
  keys [k_nope, k_pe] and values, then ordinary paged attention. Cheaper in FLOPs when many query
  rows share each key.

`mode` picks one. "auto": absorbed for decode-only steps, expanded for prefill-only steps, and a
mixed step split by sequence (decodes absorbed, prefills expanded: expanding a decode's whole
context for one query row would cost memory in proportion to its context length).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

import atom_kernels
from atom_models.forward_context import get_forward_context
from atom_models.native_host.cache_layer import KV_CACHE_FP8_DTYPES, NativeCacheLayer
from atom_models.native_host.metadata import PagedAttentionMetadata

if TYPE_CHECKING:  # annotations only: atom_models.layers picks this host lazily
    from atom_models.layers.mla import MLAAttentionSpec


MODES = ("auto", "absorbed", "expanded")


class NativeMLAAttention(NativeCacheLayer):
    def __init__(self, spec: MLAAttentionSpec, kv_b_proj: nn.Module) -> None:
        super().__init__()
        self.spec = spec
        # Held, not registered: kv_b_proj is the attention module's (and its checkpoint name).
        self._kv_b_proj = (kv_b_proj,)
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, block_size, L + R]
        self.kv_scales = {"k": 1.0, "v": 1.0}  # an fp8 latent cache uses "k" (vLLM's convention)
        self.kv_scale: float | None = None  # the scale the kernels get: fp8 caches only
        self.mode = "auto"

    @property
    def kv_b_proj(self) -> nn.Module:
        return self._kv_b_proj[0]

    # -- cache ---------------------------------------------------------------------------------

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.spec.cache_size * dtype.itemsize

    def bind_cache(self, num_blocks, block_size, dtype, device):
        shape = (num_blocks, block_size, self.spec.cache_size)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_scale = self.kv_scales["k"] if dtype in KV_CACHE_FP8_DTYPES else None
        return (self.kv_cache,)

    def release_cache(self) -> None:
        self.kv_cache = None

    # -- compute -------------------------------------------------------------------------------

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, Dn, L] and W_UV [H, Dv, L], views of kv_b_proj's weight."""
        spec = self.spec
        weight = self.kv_b_proj.weight.view(
            spec.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank
        )
        return weight.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=1)

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        # T = tokens, H = heads, Dn / R / Dv = nope / rope / value head dims, L = latent dim
        md = get_forward_context().attn_metadata
        if not isinstance(md, PagedAttentionMetadata):
            raise RuntimeError(
                "NativeMLAAttention needs a PagedAttentionMetadata set with set_forward_context()"
            )
        if self.kv_cache is None:
            raise RuntimeError(
                f"no latent cache bound to layer {self.spec.layer_idx}: call bind_kv_cache() first"
            )
        if self.mode not in MODES:
            raise ValueError(f"MLA mode must be one of {MODES}, got {self.mode!r}")
        atom_kernels.mla_cache_write(
            kv_c, k_pe, self.kv_cache, md.slot_mapping, kv_scale=self.kv_scale
        )
        if self.mode == "auto" and md.max_query_len > 1 and md.query_lens_cpu is not None:
            if 1 in md.query_lens_cpu:
                return self._split(q_nope, q_pe, md).reshape(q_nope.shape[0], -1)
        absorbed = self.mode == "absorbed" or (self.mode == "auto" and md.max_query_len == 1)
        if absorbed:
            out = self._absorbed(q_nope, q_pe, md)
        else:
            out = self._expanded(q_nope, q_pe, md)
        return out.reshape(q_nope.shape[0], -1)  # [T, H * Dv]

    def _split(self, q_nope, q_pe, md: PagedAttentionMetadata) -> torch.Tensor:
        """A mixed step: the decode sequences absorbed, the prefill sequences expanded."""
        query_lens = md.query_lens_cpu
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        out = q_nope.new_empty(q_nope.shape[0], self.spec.num_heads, self.spec.v_head_dim)
        for is_decode in (True, False):
            seqs = [b for b, n in enumerate(query_lens) if (n == 1) == is_decode]
            rows = [r for b in seqs for r in range(starts[b], starts[b + 1])]
            sub = _sub_metadata(md, seqs)
            rows_t = torch.tensor(rows, dtype=torch.long, device=q_nope.device)
            compute = self._absorbed if is_decode else self._expanded
            out[rows_t] = compute(q_nope[rows_t], q_pe[rows_t], sub)
        return out

    def _absorbed(self, q_nope, q_pe, md: PagedAttentionMetadata) -> torch.Tensor:
        w_uk, w_uv = self._up_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        planned = md.mla_decode
        if planned is not None and md.max_query_len == 1 and planned.num_seqs == q_nope.shape[0]:
            out_latent = planned(q_latent, q_pe, self.kv_cache, self.kv_scale)  # [T, H, L]
        else:
            out_latent = atom_kernels.mla_paged_attention(
                q_latent.contiguous(),
                q_pe.contiguous(),
                self.kv_cache,
                md.block_tables,
                md.seq_lens,
                md.query_start_loc,
                self.spec.scale,
                kv_scale=self.kv_scale,
                max_query_len=md.max_query_len,
            )  # [T, H, L]
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _expanded(self, q_nope, q_pe, md: PagedAttentionMetadata) -> torch.Tensor:
        # NOTE: every block the step's tables reach is expanded, up to max_seq_len per sequence
        # (shorter sequences' padding blocks too): simple and free of host syncs.
        spec = self.spec
        num_heads, dn, dv = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim
        r = spec.qk_rope_head_dim
        block_size = self.kv_cache.shape[1]
        num_seqs = md.block_tables.shape[0]
        max_blocks = -(-md.max_seq_len // block_size)
        blocks = md.block_tables[:, :max_blocks].reshape(-1).long()  # [N] N = B * max_blocks
        latent = self.kv_cache[blocks]  # [N, block_size, L + R]
        if self.kv_scale is not None:  # an fp8 cache: dequantized for the up-projection
            latent = (latent.float() * self.kv_scale).to(q_nope.dtype)
        c, k_pe = latent.split([spec.kv_lora_rank, r], dim=-1)
        kv = self.kv_b_proj(c.reshape(-1, spec.kv_lora_rank))  # [N * block_size, H * (Dn + Dv)]
        kv = kv.view(-1, block_size, num_heads, dn + dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        k = torch.cat((k_nope, k_pe[:, :, None, :].expand(-1, -1, num_heads, -1)), dim=-1)
        tables = torch.arange(len(blocks), dtype=torch.int32, device=blocks.device)
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, Dn + R]
        return atom_kernels.paged_attention(
            q,
            k,  # [N, block_size, H, Dn + R]
            v.contiguous(),  # [N, block_size, H, Dv]
            tables.view(num_seqs, max_blocks),
            md.seq_lens,
            md.query_start_loc,
            spec.scale,
            max_query_len=md.max_query_len,
        )  # [T, H, Dv]


def _sub_metadata(md: PagedAttentionMetadata, seqs: list[int]) -> PagedAttentionMetadata:
    """The metadata of sequences `seqs` of a step (attention only: no slots)."""
    device = md.block_tables.device
    query_lens = [md.query_lens_cpu[b] for b in seqs]
    seq_lens = [md.seq_lens_cpu[b] for b in seqs]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    index = torch.tensor(seqs, dtype=torch.long, device=device)
    return PagedAttentionMetadata(
        slot_mapping=md.slot_mapping[:0],
        block_tables=md.block_tables[index],
        seq_lens=md.seq_lens[index],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )


def flashinfer_mla_decode(
    model: nn.Module, block_size: int, *, graph_seqs: int | None = None, max_blocks: int = 0
):
    """FlashInfer's MLA decode (`atom_kernels.backends.flashinfer.mla.MlaDecode`) for `model`'s
    bound latent caches, or None: no native MLA layer, `ATOM_FLASHINFER` does not name
    `mla_decode` (or FlashInfer is not installed, or the cache is not on an NVIDIA GPU), the
    kernel does not take the cache's dims or dtypes, or, for a graph of `graph_seqs` sequences
    (`max_blocks` blocks each at most), ATOM's kernel measured faster at that batch. Eager
    steps ask `MlaDecode.faster_at(num_seqs)` each step. Every MLA layer of a model has the same
    heads, dims and scale, so one instance serves them all."""
    layers = (m for m in model.modules() if isinstance(m, NativeMLAAttention))
    layer = next((m for m in layers if m.kv_cache is not None), None)
    if layer is None:
        return None
    from atom_kernels.backends import flashinfer

    cache = layer.kv_cache
    if not flashinfer.use("mla_decode", cache):
        return None
    from atom_kernels.backends.flashinfer import mla

    spec, q_dtype = layer.spec, layer.kv_b_proj.weight.dtype
    dims = spec.kv_lora_rank, spec.qk_rope_head_dim
    if not mla.supports(*dims, q_dtype, cache.dtype, cache.device):
        return None
    if layer.kv_scale is not None and not isinstance(layer.kv_scale, (int, float)):
        return None  # a tensor scale would be read on the host in every layer
    if graph_seqs is not None and not mla.faster(spec.num_heads, graph_seqs):
        return None
    return mla.MlaDecode(
        num_heads=spec.num_heads,
        latent_dim=spec.kv_lora_rank,
        rope_dim=spec.qk_rope_head_dim,
        block_size=block_size,
        scale=spec.scale,
        q_dtype=q_dtype,
        kv_dtype=cache.dtype,
        device=cache.device,
        graph_seqs=graph_seqs,
        max_blocks=max_blocks,
    )


def set_mla_mode(model: nn.Module, mode: str) -> None:
    """Force every native MLA layer of `model` to one formulation ("auto" restores the default)."""
    if mode not in MODES:
        raise ValueError(f"MLA mode must be one of {MODES}, got {mode!r}")
    for module in model.modules():
        if isinstance(module, NativeMLAAttention):
            module.mode = mode
