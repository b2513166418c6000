"""The Triton ops as torch custom ops ("atom::triton_<op>") with fake (meta) implementations, so
they sit inside torch.compile graphs as single opaque nodes.

The registry's ``triton`` entry of each op (``ENTRIES``) is a router: under torch.compile it calls
the custom op; in eager code (eager steps, CUDA-graph capture) it calls the Triton host code
directly. A custom op's eager dispatch (autograd and dynamo-disable wrappers, the aliasing check)
costs host time of the order of the launch it wraps, and an eager prefill step of a small model
is bound by host time (Qwen3-0.6B on an H100: ~5.6 ms of GPU work in a 30-60 ms step).

Schemas are written out (not inferred from annotations) so they read the same on every torch
version. A per-tensor scale (float or one-element tensor in the public API) travels as two
arguments, ``Tensor? <name>`` and ``float? <name>_value``; ops that write into tensors declare them
in ``mutates_args``.
"""

from __future__ import annotations

import torch

from atom_kernels import envs
from atom_kernels.backends import flashinfer
from atom_kernels.backends.flashinfer import sampling as flashinfer_sampling
from atom_kernels.backends.triton import (
    activation,
    attention,
    cache,
    gated_linear,
    linear,
    mla_cache,
    mla_custom_ops,
    moe,
    norm,
    rotary,
    rotary_cache,
    routing,
    sampling,
    sampling_filter,
    sampling_filter_split,
)
from atom_kernels.ops.sampling import SamplerOutput
from atom_kernels.registry import register_op


def _new_like(x: torch.Tensor, shape=None) -> torch.Tensor:
    return torch.empty(x.shape if shape is None else shape, dtype=x.dtype, device=x.device)


def _split_scale(scale: float | torch.Tensor | None) -> tuple[torch.Tensor | None, float | None]:
    if isinstance(scale, torch.Tensor):
        return scale, None
    return None, None if scale is None else float(scale)


def _join_scale(tensor: torch.Tensor | None, value: float | None) -> float | torch.Tensor | None:
    return tensor if tensor is not None else value


# --- norms ------------------------------------------------------------------------------------


@torch.library.custom_op(
    "atom::triton_rms_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, float eps) -> Tensor",
)
def rms_norm(x, weight, eps):
    return norm.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return _new_like(x)


@torch.library.custom_op(
    "atom::triton_fused_add_rms_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
)
def fused_add_rms_norm(x, residual, weight, eps):
    return norm.fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return _new_like(x), _new_like(x)


@torch.library.custom_op(
    "atom::triton_fused_add_rms_norm_",
    mutates_args=("x", "residual"),
    schema="(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
)
def fused_add_rms_norm_(x, residual, weight, eps):
    norm.fused_add_rms_norm_(x, residual, weight, eps)


@fused_add_rms_norm_.register_fake
def _(x, residual, weight, eps):
    return None


# --- MoE routing ------------------------------------------------------------------------------


def _routing_like(router_logits, top_k):
    tokens, device = router_logits.shape[0], router_logits.device
    return (
        torch.empty(tokens, top_k, dtype=torch.float32, device=device),
        torch.empty(tokens, top_k, dtype=torch.int32, device=device),
    )


@torch.library.custom_op(
    "atom::triton_topk_softmax",
    mutates_args=(),
    schema="(Tensor router_logits, int top_k, bool renormalize) -> (Tensor, Tensor)",
)
def topk_softmax(router_logits, top_k, renormalize):
    return routing.topk_softmax(router_logits, top_k, renormalize)


@topk_softmax.register_fake
def _(router_logits, top_k, renormalize):
    return _routing_like(router_logits, top_k)


@torch.library.custom_op(
    "atom::triton_topk_then_softmax",
    mutates_args=(),
    schema="(Tensor router_logits, int top_k) -> (Tensor, Tensor)",
)
def topk_then_softmax(router_logits, top_k):
    return routing.topk_then_softmax(router_logits, top_k)


@topk_then_softmax.register_fake
def _(router_logits, top_k):
    return _routing_like(router_logits, top_k)


@torch.library.custom_op(
    "atom::triton_grouped_topk",
    mutates_args=(),
    schema="(Tensor router_logits, int top_k, int num_expert_group, int topk_group, "
    "str scoring_func, Tensor? e_score_correction_bias, bool renormalize, "
    "float routed_scaling_factor) -> (Tensor, Tensor)",
)
def grouped_topk(router_logits, top_k, num_expert_group, topk_group, scoring_func,
                 e_score_correction_bias, renormalize, routed_scaling_factor):  # fmt: skip
    return routing.grouped_topk(
        router_logits, top_k, num_expert_group, topk_group, scoring_func,
        e_score_correction_bias, renormalize, routed_scaling_factor,
    )  # fmt: skip


@grouped_topk.register_fake
def _(router_logits, top_k, *rest):
    return _routing_like(router_logits, top_k)


# --- rotary -----------------------------------------------------------------------------------


@torch.library.custom_op(
    "atom::triton_rotary_embedding",
    mutates_args=(),
    schema="(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache, bool is_neox, "
    "Tensor? q_norm_weight=None, Tensor? k_norm_weight=None, float norm_eps=1e-6) "
    "-> (Tensor, Tensor)",
)
def rotary_embedding(
    positions, q, k, cos_sin_cache, is_neox, q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6
):
    return rotary.rotary_embedding(
        positions, q, k, cos_sin_cache, is_neox, q_norm_weight, k_norm_weight, norm_eps
    )


@rotary_embedding.register_fake
def _(positions, q, k, cos_sin_cache, is_neox, *norm):
    return _new_like(q), _new_like(k)


@torch.library.custom_op(
    "atom::triton_rotary_embedding_and_cache",
    mutates_args=("key_cache", "value_cache"),
    schema="(Tensor positions, Tensor q, Tensor k, Tensor v, Tensor cos_sin_cache, bool is_neox, "
    "Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, Tensor? k_scale, "
    "float? k_scale_value, Tensor? v_scale, float? v_scale_value, Tensor? q_norm_weight, "
    "Tensor? k_norm_weight, float norm_eps) -> Tensor",
)
def _rotary_embedding_and_cache_op(
    positions, q, k, v, cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping, k_scale,
    k_scale_value, v_scale, v_scale_value, q_norm_weight, k_norm_weight, norm_eps,
):  # fmt: skip
    return rotary_cache.rotary_embedding_and_cache(
        positions, q, k, v, cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping,
        _join_scale(k_scale, k_scale_value), _join_scale(v_scale, v_scale_value), q_norm_weight,
        k_norm_weight, norm_eps,
    )  # fmt: skip


@_rotary_embedding_and_cache_op.register_fake
def _(positions, q, k, v, *rest):
    return _new_like(q)


def rotary_embedding_and_cache(
    positions, q, k, v, cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping, k_scale,
    v_scale, q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6,
):  # fmt: skip
    return _rotary_embedding_and_cache_op(
        positions, q, k, v, cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping,
        *_split_scale(k_scale), *_split_scale(v_scale), q_norm_weight, k_norm_weight,
        float(norm_eps),
    )  # fmt: skip


# --- activations ------------------------------------------------------------------------------


@torch.library.custom_op(
    "atom::triton_silu_and_mul", mutates_args=(), schema="(Tensor x) -> Tensor"
)
def silu_and_mul(x):
    return activation.silu_and_mul(x)


@torch.library.custom_op(
    "atom::triton_gelu_and_mul", mutates_args=(), schema="(Tensor x, str approximate) -> Tensor"
)
def gelu_and_mul(x, approximate):
    return activation.gelu_and_mul(x, approximate)


@silu_and_mul.register_fake
def _(x):
    return _new_like(x, (*x.shape[:-1], x.shape[-1] // 2))


@gelu_and_mul.register_fake
def _(x, approximate):
    return _new_like(x, (*x.shape[:-1], x.shape[-1] // 2))


# --- KV cache ---------------------------------------------------------------------------------


@torch.library.custom_op(
    "atom::triton_reshape_and_cache",
    mutates_args=("key_cache", "value_cache"),
    schema="(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, Tensor? k_scale, float? k_scale_value, Tensor? v_scale, "
    "float? v_scale_value) -> ()",
)
def _reshape_and_cache_op(
    key, value, key_cache, value_cache, slot_mapping, k_scale, k_scale_value, v_scale, v_scale_value
):
    cache.reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        _join_scale(k_scale, k_scale_value),
        _join_scale(v_scale, v_scale_value),
    )


@_reshape_and_cache_op.register_fake
def _(key, value, key_cache, value_cache, slot_mapping, *scales):
    return None


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
) -> None:
    _reshape_and_cache_op(
        key, value, key_cache, value_cache, slot_mapping, *_split_scale(k_scale),
        *_split_scale(v_scale),
    )  # fmt: skip


# --- attention --------------------------------------------------------------------------------


@torch.library.custom_op(
    "atom::triton_paged_attention",
    mutates_args=("out",),
    schema="(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor seq_lens, Tensor query_start_loc, float scale, int? sliding_window, Tensor? sinks, "
    "float? soft_cap, Tensor? k_scale, float? k_scale_value, Tensor? v_scale, "
    "float? v_scale_value, Tensor(a!) out, int? max_query_len=None) -> ()",
)
def _paged_attention_op(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    sliding_window,
    sinks,
    soft_cap,
    k_scale,
    k_scale_value,
    v_scale,
    v_scale_value,
    out,
    max_query_len=None,
):
    attention.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
        sinks,
        soft_cap,
        _join_scale(k_scale, k_scale_value),
        _join_scale(v_scale, v_scale_value),
        out,
        max_query_len=max_query_len,
    )


@_paged_attention_op.register_fake
def _(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *rest):
    return None


def _attention_out(query, value_cache, out):
    """``out``, or a new [T, H, Dv] tensor when None."""
    return _new_like(query, (*query.shape[:2], value_cache.shape[3])) if out is None else out


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    soft_cap: float | None,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    out: torch.Tensor | None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    out = _attention_out(query, value_cache, out)
    _paged_attention_op(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        sliding_window, sinks, soft_cap, *_split_scale(k_scale), *_split_scale(v_scale), out,
        max_query_len,
    )  # fmt: skip
    return out


# --- mixture of experts -------------------------------------------------------------------------


@torch.library.custom_op(
    "atom::triton_fused_moe",
    mutates_args=(),
    schema="(Tensor hidden_states, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    "str activation, Tensor? w13_bias, Tensor? w2_bias, bool gate_up_interleaved, "
    "float swiglu_alpha, float swiglu_limit, str? quant=None, Tensor? w13_scale=None, "
    "Tensor? w2_scale=None, int[]? block_size=None, Tensor? w13_zeros=None, "
    "Tensor? w2_zeros=None) -> Tensor",
)
def fused_moe(
    hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
    gate_up_interleaved, swiglu_alpha, swiglu_limit, quant=None, w13_scale=None,
    w2_scale=None, block_size=None, w13_zeros=None, w2_zeros=None,
):  # fmt: skip
    return moe.fused_moe(
        hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
        gate_up_interleaved, swiglu_alpha, swiglu_limit, quant=quant, w13_scale=w13_scale,
        w2_scale=w2_scale, block_size=None if block_size is None else tuple(block_size),
        w13_zeros=w13_zeros, w2_zeros=w2_zeros,
    )  # fmt: skip


@fused_moe.register_fake
def _(hidden_states, *rest, **quant):
    return _new_like(hidden_states)


# --- linear -----------------------------------------------------------------------------------


@torch.library.custom_op(
    "atom::triton_skinny_linear",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
)
def skinny_linear(x, weight, bias):
    return linear.skinny_linear(x, weight, bias)


@skinny_linear.register_fake
def _(x, weight, bias):
    return _new_like(x, (*x.shape[:-1], weight.shape[0]))


def _linear_router(skinny):
    def linear_op(x, weight, bias):
        """A plain function, not a custom op: cuBLAS GEMMs stay visible to torch.compile and skip
        the custom-op dispatch; only the Triton kernel (``skinny``) is opaque."""
        if linear.takes(x, weight):
            return skinny(x, weight, bias)
        return torch.nn.functional.linear(x, weight, bias)

    return linear_op


linear_op = _linear_router(skinny_linear)


@torch.library.custom_op(
    "atom::triton_gated_skinny_linear",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
)
def gated_skinny_linear(x, weight, bias):
    return gated_linear.gated_skinny_linear(x, weight, bias)


@gated_skinny_linear.register_fake
def _(x, weight, bias):
    return _new_like(x, (*x.shape[:-1], weight.shape[0] // 2))


def _gated_linear_router(fused, linear_op, silu_and_mul):
    def linear_silu_and_mul_op(x, weight, bias):
        """The fused kernel (``fused``) where it applies; else the GEMM, then SiLU-and-mul."""
        if gated_linear.takes(x, weight):
            return fused(x, weight, bias)
        return silu_and_mul(linear_op(x, weight, bias))

    return linear_silu_and_mul_op


linear_silu_and_mul_op = _gated_linear_router(gated_skinny_linear, linear_op, silu_and_mul)


@torch.library.custom_op(
    "atom::triton_norm_gated_skinny_linear",
    mutates_args=(),
    schema="(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor weight, Tensor? bias)"
    " -> (Tensor, Tensor)",
)
def norm_gated_skinny_linear(x, residual, norm_weight, eps, weight, bias):
    return gated_linear.norm_gated_skinny_linear(x, residual, norm_weight, eps, weight, bias)


@norm_gated_skinny_linear.register_fake
def _(x, residual, norm_weight, eps, weight, bias):
    return _new_like(x, (*x.shape[:-1], weight.shape[0] // 2)), _new_like(x)


def _norm_gated_linear_router(fused, add_rms_norm, gated):
    def norm_linear_silu_and_mul_op(x, residual, norm_weight, eps, weight, bias):
        """The fused kernel (``fused``) where it applies; else the norm, then the gated op."""
        if gated_linear.takes_norm(x, weight):
            return fused(x, residual, norm_weight, eps, weight, bias)
        normed, residual = add_rms_norm(x, residual, norm_weight, eps)
        return gated(normed, weight, bias), residual

    return norm_linear_silu_and_mul_op


norm_linear_silu_and_mul_op = _norm_gated_linear_router(
    norm_gated_skinny_linear, fused_add_rms_norm, linear_silu_and_mul_op
)


@torch.library.custom_op(
    "atom::triton_norm_skinny_linear",
    mutates_args=(),
    schema="(Tensor x, Tensor? residual, Tensor norm_weight, float eps, Tensor weight, "
    "Tensor? bias) -> (Tensor, Tensor)",
)
def norm_skinny_linear(x, residual, norm_weight, eps, weight, bias):
    out, new_residual = gated_linear.norm_skinny_linear(x, residual, norm_weight, eps, weight, bias)
    # A custom op's outputs may not alias its inputs: without a residual, x's copy.
    return out, new_residual if residual is not None else new_residual.clone()


@norm_skinny_linear.register_fake
def _(x, residual, norm_weight, eps, weight, bias):
    return _new_like(x, (*x.shape[:-1], weight.shape[0])), _new_like(x)


def _norm_linear_router(fused, rms_norm_, add_rms_norm, linear_):
    def rms_norm_linear_op(x, residual, norm_weight, eps, weight, bias):
        """The fused kernel (``fused``) where it applies; else the norm, then the GEMM."""
        if gated_linear.takes_norm_linear(x, weight):
            return fused(x, residual, norm_weight, eps, weight, bias)
        if residual is None:
            normed, residual = rms_norm_(x, norm_weight, eps), x
        else:
            normed, residual = add_rms_norm(x, residual, norm_weight, eps)
        return linear_(normed, weight, bias), residual

    return rms_norm_linear_op


rms_norm_linear_op = _norm_linear_router(
    norm_skinny_linear, rms_norm, fused_add_rms_norm, linear_op
)


# --- sampling ---------------------------------------------------------------------------------


@torch.library.custom_op(
    "atom::triton_sample",
    mutates_args=(),
    schema="(Tensor logits, Tensor temperature) -> (Tensor, Tensor)",
)
def fused_sample(logits, temperature):
    return sampling.fused_sample(logits, temperature)


@fused_sample.register_fake
def _(logits, temperature):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.float32)


# ATOM_SAMPLE_FILTER=0: filtered rows go to the torch reference (the A/B of the filter kernels).
FILTER_KERNELS = envs.ATOM_SAMPLE_FILTER


def _sample_router(fused):
    def sample_op(logits, temperature, top_k, top_p, min_p, generators, num_logprobs):
        """A plain function (generators are not a schema type): the fused kernel (``fused``)
        where it applies; for unseeded rows with top-k / top-p, FlashInfer's sampler when it is
        installed and wanted (``backends/flashinfer``), else (and with min-p)
        ``sampling_filter``'s kernels (a row over programs below ``SPLIT_BELOW`` rows); the torch
        reference otherwise (seeded rows, float64)."""
        if sampling.takes(logits, top_k, top_p, min_p, generators, num_logprobs):
            token_ids, logprobs = fused(logits, temperature)
            empty = logits.new_empty((logits.shape[0], 0), dtype=torch.float32)
            return SamplerOutput(token_ids, logprobs, empty, empty.to(torch.int64))
        if FILTER_KERNELS and sampling.takes(logits, None, None, None, generators, 0):
            if min_p is None and flashinfer.use("sample", logits):
                token_ids, logprobs = flashinfer_sampling.filtered_sample(
                    logits, temperature, top_k, top_p
                )
            else:
                split = logits.shape[0] < sampling_filter.SPLIT_BELOW
                kernel = sampling_filter_split if split else sampling_filter
                token_ids, logprobs = kernel.filtered_sample(
                    logits, temperature, top_k, top_p, min_p
                )
            raw = torch.log_softmax(logits.float(), dim=-1) if num_logprobs else None
            empty = logits.new_empty((logits.shape[0], 0), dtype=torch.float32)
            top, top_ids = raw.topk(num_logprobs, dim=-1) if num_logprobs else (empty, empty.long())
            return SamplerOutput(token_ids, logprobs, top, top_ids)
        return sampling.reference.sample(
            logits, temperature, top_k, top_p, min_p, generators, num_logprobs
        )

    return sample_op


sample_op = _sample_router(fused_sample)


# --- the registry's entries -------------------------------------------------------------------

# False: every call goes through the custom op (kept for A/B measurements of the dispatch cost).
DIRECT_EAGER = True


def _paged_attention_direct(
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
    sliding_window, sinks, soft_cap, k_scale, v_scale, out, max_query_len=None,
):  # fmt: skip
    out = _attention_out(query, value_cache, out)
    attention.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        sliding_window, sinks, soft_cap, k_scale, v_scale, out, max_query_len=max_query_len,
    )  # fmt: skip
    return out


def _router(name: str, traced, direct):
    """The registry's entry: ``traced`` (through the custom op) under torch.compile, ``direct``
    (the same Triton host code, no custom-op dispatch) otherwise."""

    def entry(*args, **kwargs):
        if DIRECT_EAGER and not torch.compiler.is_compiling():
            return direct(*args, **kwargs)
        return traced(*args, **kwargs)

    entry.__name__ = entry.__qualname__ = f"triton_{name}"
    entry.__doc__ = f"Triton {name}: the custom op under torch.compile, direct in eager code."
    return entry


ENTRIES = {
    name: _router(name, traced, direct)
    for name, (traced, direct) in {
        "rms_norm": (rms_norm, norm.rms_norm),
        "fused_add_rms_norm": (fused_add_rms_norm, norm.fused_add_rms_norm),
        "fused_add_rms_norm_": (fused_add_rms_norm_, norm.fused_add_rms_norm_),
        "rotary_embedding": (rotary_embedding, rotary.rotary_embedding),
        "rotary_embedding_and_cache": (
            rotary_embedding_and_cache,
            rotary_cache.rotary_embedding_and_cache,
        ),
        "silu_and_mul": (silu_and_mul, activation.silu_and_mul),
        "gelu_and_mul": (gelu_and_mul, activation.gelu_and_mul),
        "reshape_and_cache": (reshape_and_cache, cache.reshape_and_cache),
        "paged_attention": (paged_attention, _paged_attention_direct),
        "mla_cache_write": (mla_custom_ops.mla_cache_write, mla_cache.mla_cache_write),
        "mla_paged_attention": (
            mla_custom_ops.mla_paged_attention,
            mla_custom_ops.mla_paged_attention_direct,
        ),
        "fused_moe": (fused_moe, moe.fused_moe),
        "topk_softmax": (topk_softmax, routing.topk_softmax),
        "topk_then_softmax": (topk_then_softmax, routing.topk_then_softmax),
        "grouped_topk": (grouped_topk, routing.grouped_topk),
        "linear": (linear_op, _linear_router(linear.skinny_linear)),
        "linear_silu_and_mul": (
            linear_silu_and_mul_op,
            _gated_linear_router(
                gated_linear.gated_skinny_linear,
                _linear_router(linear.skinny_linear),
                activation.silu_and_mul,
            ),
        ),
        "rms_norm_linear": (
            rms_norm_linear_op,
            _norm_linear_router(
                gated_linear.norm_skinny_linear,
                norm.rms_norm,
                norm.fused_add_rms_norm,
                _linear_router(linear.skinny_linear),
            ),
        ),
        "fused_add_rms_norm_linear_silu_and_mul": (
            norm_linear_silu_and_mul_op,
            _norm_gated_linear_router(
                gated_linear.norm_gated_skinny_linear,
                norm.fused_add_rms_norm,
                _gated_linear_router(
                    gated_linear.gated_skinny_linear,
                    _linear_router(linear.skinny_linear),
                    activation.silu_and_mul,
                ),
            ),
        ),
        "sample": (sample_op, _sample_router(sampling.fused_sample)),
    }.items()
}
for _name, _entry in ENTRIES.items():
    register_op(_name, "triton")(_entry)
