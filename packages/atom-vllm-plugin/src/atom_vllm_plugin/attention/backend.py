"""ATOM's attention backend for vLLM: atom_kernels on vLLM's own KV-cache tensor. [host: vllm]

vLLM allocates the KV cache and hands each layer a 4-D view of its part, logical shape
[num_blocks, Hk, block_size, Dk + Dv] (each token's key and value side by side in the last dim, the
order vLLM's Triton backend reads too), laid out in memory as the resolved `KVCacheLayout` says.
`split_kv_cache` views it as the key and value caches atom_kernels takes
([num_blocks, block_size, Hk, D], strided): no copies, for any layout. (vLLM's CPU_ATTN backend
packs its pages differently, K rows then V rows per block and head; a page belongs to one layer and
so to one backend, and only block ids cross between components, so the two never have to agree.)

vLLM writes this step's K/V first (`do_kv_cache_update`, by slot mapping), then calls `forward`,
which attends over the cache: cached prefix and new tokens of a mixed prefill/decode batch at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

import atom_kernels
from atom_vllm_plugin.attention import ATOM_BACKEND_NAME, graphs
from atom_vllm_plugin.stats import counters

FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
_FLOAT_CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class AtomAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False  # vLLM calls do_kv_cache_update first

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = [  # type: ignore[assignment]
        "auto",
        *_FLOAT_CACHE_DTYPES,
        *FP8_CACHE_DTYPES,
    ]

    @staticmethod
    def get_name() -> str:
        return ATOM_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[AtomAttentionImpl]:
        return AtomAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AtomAttentionMetadataBuilder]:
        return AtomAttentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> None:
        # None: any layout. atom_kernels read the cache through strides and every layout keeps
        # the K|V content dim innermost, so split_kv_cache is a view whatever vLLM picks.
        return None

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: object,
    ) -> str | None:
        cache_dtype = _FLOAT_CACHE_DTYPES.get(kv_cache_dtype or "auto")
        if cache_dtype is not None and cache_dtype != dtype:
            # atom_kernels attend with the cache in the query's dtype (or fp8 with scales).
            return f"kv_cache_dtype {kv_cache_dtype} differs from the model dtype {dtype}"
        return None


@dataclass
class AtomAttentionMetadata:
    """One step's batch. T = tokens, B = sequences, M = max blocks per sequence."""

    num_actual_tokens: int  # T without padding
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [B + 1] int32, sequence b owns query rows [qsl[b], qsl[b+1])
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache after this step (prefix + new)
    block_table: torch.Tensor  # [B, M] int32, kernel-block ids
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token (-1: padding)
    # One query row per sequence and no padding row: the kernel may skip its prefill path.
    decode_only: bool = False


class AtomAttentionMetadataBuilder(AttentionMetadataBuilder[AtomAttentionMetadata]):
    """The step's metadata as views of vLLM's persistent input buffers (see `graphs`)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """ALWAYS where the kernels this backend runs on the model's device are capture-safe
        (atom_kernels' Triton ops: any mixed batch, no host read), NEVER otherwise (the torch
        reference reads the batch layout on the host). vLLM keeps its default cudagraph mode
        with ALWAYS, and drops to piecewise graphs around eager attention with NEVER."""
        device = vllm_config.device_config.device
        if graphs.capture_unsafe_reason(device) is None:
            return AttentionCGSupport.ALWAYS
        return AttentionCGSupport.NEVER

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AtomAttentionMetadata:
        md = common_attn_metadata
        if md.causal is not True:
            raise NotImplementedError("ATOM attention computes causal decoder attention only")
        num_reqs = md.num_reqs
        # Slices from offset 0 of vLLM's persistent buffers: the same addresses every step, so a
        # graph captured with these tensors reads what the runner writes before each replay.
        return AtomAttentionMetadata(
            num_actual_tokens=md.num_actual_tokens,
            max_query_len=md.max_query_len,
            max_seq_len=md.max_seq_len,
            query_start_loc=md.query_start_loc[: num_reqs + 1],
            seq_lens=md.seq_lens[:num_reqs],
            block_table=md.block_table_tensor[:num_reqs],
            slot_mapping=md.slot_mapping,
            decode_only=md.max_query_len == 1 and md.num_actual_tokens == num_reqs,
        )

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> AtomAttentionMetadata:
        """The metadata a FULL graph is captured with. A FULL graph is replayed for every batch
        of its size; when vLLM's mode puts mixed batches in FULL graphs too, the graph must not
        have skipped the prefill kernel because its dummy batch was all decodes."""
        metadata = self.build(0, common_attn_metadata)
        mode = self.vllm_config.compilation_config.cudagraph_mode
        if metadata.decode_only and not graphs.full_graphs_are_decode_only(mode):
            metadata = replace(metadata, decode_only=False)
        return metadata


def split_kv_cache(
    kv_cache: torch.Tensor, head_size: int, storage_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer cache view -> (key cache, value cache) as atom_kernels takes them.

    Hk = kv heads, N = block size, D / Dv = key / value head dims.
    kv_cache: [num_blocks, Hk, N, D + Dv], any memory layout; storage_dtype reinterprets the
    elements (vLLM stores fp8 caches as uint8). Returns views [num_blocks, N, Hk, D] and
    [num_blocks, N, Hk, Dv].
    """
    if storage_dtype is not None and kv_cache.dtype != storage_dtype:
        kv_cache = kv_cache.view(storage_dtype)
    per_token = kv_cache.transpose(1, 2)  # [num_blocks, N, Hk, D + Dv]
    return per_token[..., :head_size], per_token[..., head_size:]


class AtomAttentionImpl(AttentionImpl[AtomAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unsupported: object,
    ) -> None:
        hint = "; set ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1 to use vLLM's attention"
        if alibi_slopes is not None:
            raise NotImplementedError("ATOM attention does not implement ALiBi" + hint)
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"ATOM attention does not implement {attn_type}" + hint)
        if unsupported:
            raise NotImplementedError(
                f"ATOM attention does not take {', '.join(sorted(unsupported))}" + hint
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap or None  # vLLM uses 0 for "none" in places
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks  # [H], a parameter of the model's layer
        self.is_fp8 = kv_cache_dtype in FP8_CACHE_DTYPES
        self.storage_dtype: torch.dtype | None = None
        if self.is_fp8:
            from vllm.platforms import current_platform

            self.storage_dtype = current_platform.fp8_dtype()
        counters.attention_impls += 1

    def _scales(self, layer: AttentionLayer) -> tuple[float | None, float | None]:
        if not self.is_fp8:
            return None, None
        return layer._k_scale_float, layer._v_scale_float

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write this step's key [T, Hk, D] / value [T, Hk, Dv] at slot_mapping [T] (-1: skip)."""
        counters.kv_cache_writes += 1
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size, self.storage_dtype)
        num_tokens = min(key.shape[0], slot_mapping.shape[0])
        k_scale, v_scale = self._scales(layer)
        atom_kernels.reshape_and_cache(
            key[:num_tokens],
            value[:num_tokens],
            key_cache,
            value_cache,
            slot_mapping[:num_tokens],
            k_scale,
            v_scale,
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AtomAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, H, D] -> output [T, H, Dv] (written in place; rows past T are left as is)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ATOM attention does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling and warm-up runs carry no metadata
            return output
        counters.attention_forwards += 1
        md = attn_metadata
        num_tokens = md.num_actual_tokens
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size, self.storage_dtype)
        k_scale, v_scale = self._scales(layer)
        atom_kernels.paged_attention(
            query[:num_tokens],
            key_cache,
            value_cache,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            self.scale,
            sliding_window=self.sliding_window,
            sinks=self.sinks,
            soft_cap=self.logits_soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
            out=output[:num_tokens],
            max_query_len=1 if md.decode_only else None,
        )
        return output
