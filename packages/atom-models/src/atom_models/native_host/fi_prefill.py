"""FlashInfer's prefill attention for the native host's steps with a prefill, where asked for
(`ATOM_FLASHINFER=prefill_attention`; `atom_kernels.backends.flashinfer.prefill`).

A step built on the host (`PagedAttentionMetadata.build`: its lengths and block tables are host
arrays) with a prefill row is planned once per attention shape, by the first layer of that shape
(kept in the metadata's `memo`); every layer of the shape then runs the planned kernel in place of
`atom_kernels.paged_attention`. Steps built for a CUDA graph carry no host tables and keep ATOM's
kernel, as do layers FlashInfer's kernel does not compute the same way (`prefill.supports`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atom_models.native_host.metadata import PagedAttentionMetadata

if TYPE_CHECKING:
    from atom_models.native_host.attention import NativeAttention

# (device, heads, KV heads, head size, scale, dtype, block size) -> PagedPrefill: a wrapper's
# pinned and device buffers are made once and planned again each step.
_PREFILLS: dict[tuple, object] = {}


def _takes(layer: NativeAttention, q_dtype: torch.dtype, device) -> bool:
    from atom_kernels.backends.flashinfer import prefill

    spec, cache = layer.spec, layer.k_cache
    return layer.v_cache.shape[-1] == spec.head_size and prefill.supports(
        spec.head_size, q_dtype, cache.dtype, device, sliding_window=spec.sliding_window,
        has_sinks=spec.has_sinks, soft_cap=spec.soft_cap, kv_scaled=layer.k_scale is not None,
    )  # fmt: skip


def takes_any(layers) -> bool:
    """Whether FlashInfer's prefill is asked for and takes one of these bound attention layers
    (the engine then leaves the steps with a prefill to graphs with attention eager)."""
    from atom_kernels.backends import flashinfer
    from atom_models.native_host.attention import NativeAttention

    for layer in layers:
        cache = getattr(layer, "k_cache", None)
        if type(layer) is not NativeAttention or cache is None:
            continue
        if flashinfer.use("prefill_attention", cache) and _takes(layer, cache.dtype, cache.device):
            return True
    return False


def planned_prefill(layer: NativeAttention, md: PagedAttentionMetadata, q: torch.Tensor):
    """This step's planned FlashInfer prefill for `layer` (q [T, H, D]), or None: ATOM's."""
    if md.max_query_len <= 1 or md.block_tables_cpu is None or md.query_lens_cpu is None:
        return None
    from atom_kernels.backends import flashinfer

    if not flashinfer.use("prefill_attention", q):
        return None
    spec, cache = layer.spec, layer.k_cache
    key = (
        q.device, spec.num_heads, spec.num_kv_heads, spec.head_size, float(spec.scale),
        q.dtype, cache.shape[1],
    )  # fmt: skip
    if key in md.memo:
        return md.memo[key]
    from atom_kernels.backends.flashinfer import prefill

    planned = None
    if _takes(layer, q.dtype, q.device):
        planned = _PREFILLS.get(key)
        if planned is None:
            planned = prefill.PagedPrefill(
                num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_size, block_size=cache.shape[1], scale=spec.scale,
                dtype=q.dtype, device=q.device,
            )  # fmt: skip
            _PREFILLS[key] = planned
        planned.plan(md.query_lens_cpu, md.seq_lens_cpu, md.block_tables_cpu)
    md.memo[key] = planned
    return planned
