"""`NativeAttention`: ATOM's own paged attention layer, computed with atom_kernels.

The runner binds the layer's cache (`kv_cache.bind_kv_cache`), then sets a
`PagedAttentionMetadata` with `set_forward_context` around each forward. The layer writes this
step's K/V into its cache by slot mapping, then attends over the cache (cached prefix + new
tokens). The cache dtype is the model's or fp8 (`float8_e4m3fn`): an fp8 cache stores x / scale
and every read multiplies back, with the layer's per-tensor `k_scale` / `v_scale` (1.0, or the
checkpoint's, handed over by `set_kv_scale`).

Under `torch.compile` (the engine compiles the model on the CPU) a `NativeAttention` layer is one
opaque custom op, `atom::native_attention`: the graph holds the GEMMs, norms, rotary and
activations around it, and the op reads the step's metadata from the forward context and writes
the layer's cache at run time, as vLLM's `unified_attention` does. On the CPU a decode-only step's
layers share one plan (`atom_kernels.backends.cpu.decode_step.DecodeStep`, built by the step's
first layer and kept in the metadata's `memo`: `decode_step`): every later layer is two cache
writes, two gathers and one fused attention call, with no per-layer checks.

Where the kernel backend has its own `rotary_embedding_and_cache` (Triton), a layer also takes
its model's rotary embedding (`takes_rope`, through `Attention.forward_rope`): it gets q and k
un-rotated with the positions, and one kernel rotates them (after Qwen3's q/k norms) and writes
K and V into the cache: one launch a layer fewer, at every token count.
ATOM_FUSED_ROPE_CACHE=0 turns that off (the rotary, then `reshape_and_cache`: A/B measurements).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

import atom_kernels
from atom_kernels import envs
from atom_kernels.registry import get_op, has_own_op
from atom_models.forward_context import get_forward_context
from atom_models.native_host.cache_layer import KV_CACHE_FP8_DTYPES, NativeCacheLayer
from atom_models.native_host.decode_step import build_decode_step, versions_of
from atom_models.native_host.fi_prefill import planned_prefill
from atom_models.native_host.metadata import PagedAttentionMetadata

if TYPE_CHECKING:  # annotations only: atom_models.layers picks this host lazily
    from atom_models.layers.attention import AttentionSpec

FUSE_ROPE_CACHE = envs.ATOM_FUSED_ROPE_CACHE


# Layers the custom op can find by number (a compiled graph holds the number, not the module).
_LAYERS: weakref.WeakValueDictionary[int, NativeAttention] = weakref.WeakValueDictionary()
_LAYER_IDS = itertools.count()


# NOTE: registered through `torch.library.Library` with a plain CPU kernel, not
# `torch.library.custom_op`: the latter's Python wrapper (autograd redispatch under no_grad, an
# aliasing check of the outputs) cost 45-62 us a call against 18-21 us (an empty op, this 2-core
# AMD EPYC, torch 2.15, load ~3; issue 21, session 10): ~1 ms of a 30-layer step.
_lib = torch.library.Library("atom", "FRAGMENT")
_lib.define("native_attention(Tensor q, Tensor k, Tensor v, Tensor? sinks, int layer_id) -> Tensor")


def _native_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, layer_id: int
) -> torch.Tensor:
    """`NativeAttention` layer `layer_id` (its cache write and attention) as one opaque op."""
    return _LAYERS[layer_id].forward_eager(q, k, v, sinks)


def _native_attention_fake(q, k, v, sinks, layer_id):
    spec = _LAYERS[layer_id].spec
    return q.new_empty(q.shape[0], spec.num_heads * (v.shape[-1] // spec.num_kv_heads))


for _device in ("CPU", "CUDA"):
    _lib.impl("native_attention", _native_attention_op, _device)
torch.library.register_fake("atom::native_attention", _native_attention_fake, lib=_lib)


class NativeAttention(NativeCacheLayer):
    writes_out = True  # forward(..., out=) writes its result there

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.layer_id = next(_LAYER_IDS)
        _LAYERS[self.layer_id] = self
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hk, D]
        self.v_cache: torch.Tensor | None = None
        self.kv_scales = {"k": 1.0, "v": 1.0}
        self.k_scale: float | None = None  # the scales the kernels get: fp8 caches only
        self.v_scale: float | None = None
        self._checked: tuple | None = None  # this layer's last checked arguments (`_layer_key`)
        self._checked_caches: tuple = ()  # the caches `_checked` names, held
        # (rotary embedding, q norm, k norm) of the model's layer (`takes_rope`), a plain tuple:
        # not submodules (their weights load under the model's own names)
        self.rope: tuple[nn.Module, nn.Module | None, nn.Module | None] | None = None
        self._backend_fuses_rope: bool | None = None  # the device's backend has the fused op
        # The caches' slot views [num_blocks * block_size, Hk, D] where decode-only steps may
        # take the CPU's `DecodeStep` path (`_decode_step`), else None
        self._decode_slots: tuple[torch.Tensor, torch.Tensor] | None = None

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.spec.num_kv_heads * self.spec.head_size * dtype.itemsize

    def bind_cache(self, num_blocks, block_size, dtype, device):
        spec = self.spec
        shape = (num_blocks, block_size, self.spec.num_kv_heads, self.spec.head_size)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._checked = None
        is_fp8 = dtype in KV_CACHE_FP8_DTYPES
        self.k_scale = self.kv_scales["k"] if is_fp8 else None
        self.v_scale = self.kv_scales["v"] if is_fp8 else None
        self._decode_slots = None
        if self.k_cache.device.type == "cpu" and dtype == torch.float32 and spec.soft_cap is None:
            slots = (-1, *shape[2:])
            self._decode_slots = (self.k_cache.view(slots), self.v_cache.view(slots))
        return self.k_cache, self.v_cache

    def release_cache(self) -> None:
        self.k_cache = self.v_cache = None
        self._checked = None
        self._decode_slots = None

    def takes_rope(
        self,
        q: torch.Tensor,
        rotary_emb: nn.Module,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ) -> bool:
        """Whether this call takes q and k un-rotated, with the positions (`forward`'s
        `positions`), and rotates them in its cache write: yes where the device's kernel backend
        has its own `rotary_embedding_and_cache` (not the CPU's, whose cache write is its own and
        whose compiled graph holds the rotary), outside torch.compile (the layer's custom op has
        no positions), for a rotary of the layer's head size. Binds the rotary on first use."""
        if not FUSE_ROPE_CACHE or torch.compiler.is_compiling():
            return False
        if self._backend_fuses_rope is None:
            self._backend_fuses_rope = has_own_op("rotary_embedding_and_cache", q.device)
        if not self._backend_fuses_rope:
            return False
        if self.rope is None:
            if getattr(rotary_emb, "head_size", None) != self.spec.head_size:
                return False
            self.rope = (rotary_emb, q_norm, k_norm)
        return self.rope[0] is rotary_emb

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        positions: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's attention [T, H * Dv], written into `out` ([T, H * Dv]) when given. With
        `positions` ([T], after `takes_rope`), q and k come un-rotated."""
        if torch.compiler.is_compiling() and out is None and positions is None:
            return torch.ops.atom.native_attention(q, k, v, sinks, self.layer_id)
        return self.forward_eager(q, k, v, sinks, out, positions)

    def forward_eager(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        out: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # T = tokens, H = query heads, Hk = KV heads, D = head size
        md = get_forward_context().attn_metadata
        if not isinstance(md, PagedAttentionMetadata):
            raise RuntimeError(
                "NativeAttention needs a PagedAttentionMetadata set with set_forward_context()"
            )
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(
                f"no KV cache bound to layer {self.spec.layer_idx}: call bind_kv_cache() first"
            )
        spec = self.spec
        num_tokens = q.shape[0]
        q = q.view(num_tokens, spec.num_heads, spec.head_size)  # [T, H, D]
        k = k.view(num_tokens, spec.num_kv_heads, spec.head_size)  # [T, Hk, D]
        v = v.view(num_tokens, spec.num_kv_heads, -1)  # [T, Hk, Dv]
        fast = self._decode_slots is not None and positions is None and sinks is None
        if fast and md.max_query_len == 1:
            step = self._decode_step(md, q)
            if step is not None:
                o = step.attend(q, k, v, *self._decode_slots, spec.scale)  # [T, H, Dv]
                if out is not None:
                    return out.view_as(o).copy_(o).view(num_tokens, -1)
                return o.view(num_tokens, -1)
        out = None if out is None else out.view(num_tokens, spec.num_heads, -1)
        step_key = _step_key(md, q)
        layer_key = self._layer_key(q, k, v, sinks, out, positions)
        if step_key != getattr(_checked_step, "key", None) or layer_key != self._checked:
            # First call of a step (or new shapes): atom_kernels' public, checked ops.
            if positions is not None:  # rotate q and k, and write K/V, in one kernel
                rotary, q_norm_weight, k_norm_weight, eps = self._rope_args()
                q = atom_kernels.rotary_embedding_and_cache(
                    positions, q, k, v, rotary.cos_sin_cache, rotary.is_neox, self.k_cache,
                    self.v_cache, md.slot_mapping, self.k_scale, self.v_scale,
                    q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=eps,
                )  # fmt: skip
            else:
                atom_kernels.reshape_and_cache(
                    k, v, self.k_cache, self.v_cache, md.slot_mapping, self.k_scale, self.v_scale
                )
            planned = planned_prefill(self, md, q)
            if planned is not None:  # FlashInfer's (where asked for and it computes the same)
                out = planned(q, self.k_cache, self.v_cache, out)
            else:
                out = atom_kernels.paged_attention(
                    q,
                    self.k_cache,
                    self.v_cache,
                    md.block_tables,
                    md.seq_lens,
                    md.query_start_loc,
                    spec.scale,
                    sliding_window=spec.sliding_window,
                    sinks=sinks,
                    soft_cap=spec.soft_cap,
                    k_scale=self.k_scale,
                    v_scale=self.v_scale,
                    max_query_len=md.max_query_len,
                    out=out,
                )
            # What the keys name by id is held, so the ids stay theirs.
            _checked_step.key, _checked_step.held = step_key, (md, *_step_tensors(md))
            self._checked, self._checked_caches = layer_key, (self.k_cache, self.v_cache)
            return out.reshape(num_tokens, -1)
        # A step's metadata checked (by an earlier layer), this layer's cache and input shapes
        # too (a call of an earlier step; the token count is in the step's key): the backend's
        # ops, unchecked. NOTE: the two ops' argument checks were ~10% of a layer call on the
        # CPU (SmolLM2-135M, 1 thread, issue 21), 30 layers a step.
        # get_op each call: a backend switch (atom_kernels.use_backend) resolves anew
        if positions is not None:
            rotary, q_norm_weight, k_norm_weight, eps = self._rope_args()
            q = get_op("rotary_embedding_and_cache", q.device)(
                positions, q, k, v, rotary.cos_sin_cache, rotary.is_neox, self.k_cache,
                self.v_cache, md.slot_mapping, self.k_scale, self.v_scale, q_norm_weight,
                k_norm_weight, eps,
            )  # fmt: skip
        else:
            get_op("reshape_and_cache", q.device)(
                k, v, self.k_cache, self.v_cache, md.slot_mapping, self.k_scale, self.v_scale
            )
        planned = planned_prefill(self, md, q)
        if planned is not None:
            return planned(q, self.k_cache, self.v_cache, out).reshape(num_tokens, -1)
        out = get_op("paged_attention", q.device)(
            q,
            self.k_cache,
            self.v_cache,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            float(spec.scale),
            spec.sliding_window,
            sinks,
            None if spec.soft_cap is None else float(spec.soft_cap),
            self.k_scale,
            self.v_scale,
            out,
            md.max_query_len,
        )
        return out.reshape(num_tokens, -1)

    def _decode_step(self, md: PagedAttentionMetadata, q: torch.Tensor):
        """The step's `DecodeStep` when this layer may take it (a decode-only CPU step on the
        cpu backend, float32), else None. The step's first layer builds it and still runs the
        checked ops (which check the metadata against this layer's cache and inputs)."""
        key = ("decode_step", self.k_cache.shape[1], self.spec.sliding_window)
        entry = md.memo.get(key)
        if entry is None:
            md.memo[key] = build_decode_step(md, q, self.k_cache.shape[1], self.spec)
            return None
        if entry is False:
            return None
        step, versions = entry
        if step.num_seqs != q.shape[0] or q.dtype != torch.float32 or versions != versions_of(md):
            return None
        return step

    def _layer_key(self, q, k, v, sinks, out, positions) -> tuple:
        """What the ops' checks read of this layer's arguments, the token count aside (every
        input has T rows: `forward_eager` views them so)."""
        return (
            id(self.k_cache),
            id(self.v_cache),
            self.k_scale,
            self.v_scale,
            *(x for t in (q, k, v, sinks, out, positions) for x in _shape_dtype(t)),
        )

    def _rope_args(self) -> tuple[nn.Module, torch.Tensor | None, torch.Tensor | None, float]:
        """(rotary embedding, q norm weight, k norm weight, norm eps) bound by `takes_rope`."""
        rotary, q_norm, k_norm = self.rope
        if q_norm is None:
            return rotary, None, None, 1e-6
        return rotary, q_norm.weight, k_norm.weight, float(q_norm.eps)


# The step metadata of this thread's last checked layer call (`_step_key`, and what it names)
_checked_step = threading.local()


def _step_tensors(md: PagedAttentionMetadata) -> tuple[torch.Tensor, ...]:
    return md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc


def _step_key(md: PagedAttentionMetadata, q: torch.Tensor) -> tuple:
    """What the ops' checks read of a step's metadata, and the token count and device it meets."""
    tensors = _step_tensors(md)
    return (id(md), *(id(t) for t in tensors), md.max_query_len, q.shape[0], q.device)


def _shape_dtype(t: torch.Tensor | None) -> tuple:
    return (None, None, None) if t is None else (t.shape[1:], t.dtype, t.device)
