"""ATOM's attention impl on a KV cache laid out by vLLM itself, against a dense reference.

The layer is vLLM's own `Attention` (which picks ATOM's backend through ATOM's platform), the cache
views come from vLLM's `create_kv_cache_views` for each KV-cache layout, and the metadata is built
by ATOM's builder from vLLM's `CommonAttentionMetadata`. One step is a mixed batch: a chunked
prefill over a cached prefix, a decode, and a fresh prefill, with block tables in shuffled order.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

# T = tokens, H = query heads, Hk = kv heads, D = head size, N = block size
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 64, 32, 16
# (cached prefix, new tokens) per sequence: chunked prefill, decode, fresh prefill
SEQUENCES = [(40, 7), (74, 1), (0, 33)]
NUM_PADDING_TOKENS = 2  # trailing rows vLLM may pad a batch with
_names = itertools.count()


def make_config(kv_cache_dtype: str, model_dir):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        kv_cache_dtype=kv_cache_dtype,
    ).create_engine_config()


def make_layer(vllm_config, *, sliding_window=None, soft_cap=None, sinks=None):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    extra = {} if sinks is None else {"sinks": sinks}
    with set_current_vllm_config(vllm_config):
        return Attention(
            num_heads=NUM_HEADS,
            head_size=HEAD_SIZE,
            scale=HEAD_SIZE**-0.5,
            num_kv_heads=NUM_KV_HEADS,
            cache_config=vllm_config.cache_config,
            logits_soft_cap=soft_cap,
            per_layer_sliding_window=sliding_window,
            prefix=f"test.layers.{next(_names)}.attn",
            **extra,
        )


def make_cache(layer, vllm_config, layout):
    """The layer's cache view exactly as vLLM's worker creates it, poisoned with NaN."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views

    spec = layer.get_kv_cache_spec(vllm_config)
    page = spec.page_size_bytes
    # All-ones bytes read as NaN in fp32 and fp8: a slot read before it was written shows.
    raw = torch.full((page * NUM_BLOCKS,), -1, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=page * NUM_BLOCKS, layers=[layer.layer_name], layer_stride=page * NUM_BLOCKS,
        block_stride=page,
    )  # fmt: skip
    (view,) = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)
    assert view.shape == (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    return view


def metadata(builder, seq_lens, query_lens, block_tables, slot_mapping):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    num_tokens = int(starts[-1])
    return builder.build(
        0,
        CommonAttentionMetadata(
            query_start_loc=starts,
            query_start_loc_cpu=starts,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_reqs=len(seq_lens),
            num_actual_tokens=num_tokens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_table_tensor=block_tables,
            slot_mapping=slot_mapping,
        ),
    )


def slots(block_table, positions):
    return [int(block_table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def dense_reference(q, k, v, scale, sliding_window, soft_cap, sinks):
    """One sequence: q [q_len, H, D] at the last q_len of L positions; k, v [L, Hk, D]; fp64."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    k = k.double().repeat_interleave(group, dim=1)  # [L, H, D]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q.double(), k) * scale  # [H, q_len, L]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(-1, q_len, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hql,lhd->qhd", probs, v)  # [q_len, H, D]


# Layouts whose single-layer page is one dense run (block stride = page), as built below.
LAYOUTS = ["LBNHC", "LBHNC", "BLNHC"]
VARIANTS = {
    "plain": {},
    "sliding-window": {"sliding_window": 16},
    "soft-cap": {"soft_cap": 5.0},
    "sinks": {"sinks": True},
    "fp8": {"kv_cache_dtype": "fp8"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_impl_matches_dense_reference(smollm2_dir, layout_name, variant) -> None:
    from vllm.v1.kv_cache_interface import KVCacheLayout

    from atom_vllm_plugin.attention.backend import (
        AtomAttentionImpl,
        AtomAttentionMetadataBuilder,
    )

    opts = dict(VARIANTS[variant])
    kv_cache_dtype = opts.pop("kv_cache_dtype", "auto")
    vllm_config = make_config(kv_cache_dtype, smollm2_dir)
    gen = torch.Generator().manual_seed(len(layout_name) + len(variant))
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(NUM_HEADS, generator=gen)
    layer = make_layer(vllm_config, **opts)
    impl = layer.impl
    assert isinstance(impl, AtomAttentionImpl)  # vLLM's layer picked ATOM's backend
    if kv_cache_dtype == "fp8":
        layer._k_scale_float, layer._v_scale_float = 0.02, 0.03
    kv_cache = make_cache(layer, vllm_config, KVCacheLayout[layout_name])
    builder = AtomAttentionMetadataBuilder(
        layer.get_kv_cache_spec(vllm_config), [layer.layer_name], vllm_config, torch.device("cpu")
    )

    # Full K/V of every sequence, and shuffled, disjoint block tables.
    seqs = []
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)
    max_blocks = max(-(-(p + n) // BLOCK_SIZE) for p, n in SEQUENCES)
    block_tables = torch.zeros(len(SEQUENCES), max_blocks, dtype=torch.int32)
    used = 0
    for i, (prefix, new) in enumerate(SEQUENCES):
        seq_len = prefix + new
        n = -(-seq_len // BLOCK_SIZE)
        block_tables[i, :n] = blocks[used : used + n]
        used += n
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        q = torch.randn(new, NUM_HEADS, HEAD_SIZE, generator=gen)
        seqs.append((prefix, new, q, k, v))

    # An earlier step cached the prefixes (vLLM's write path: do_kv_cache_update).
    prefix_k = torch.cat([k[:p] for p, _, _, k, _ in seqs])
    prefix_v = torch.cat([v[:p] for p, _, _, _, v in seqs])
    prefix_slots = sum((slots(block_tables[i], range(s[0])) for i, s in enumerate(seqs)), [])
    impl.do_kv_cache_update(
        layer, prefix_k, prefix_v, kv_cache, torch.tensor(prefix_slots, dtype=torch.int64)
    )

    # This step: the new tokens of every sequence, plus padding rows (slot -1, never attended).
    new_q = torch.cat([q for _, _, q, _, _ in seqs])
    new_k = torch.cat([k[p:] for p, _, _, k, _ in seqs])
    new_v = torch.cat([v[p:] for p, _, _, _, v in seqs])
    new_slots = sum(
        (slots(block_tables[i], range(s[0], s[0] + s[1])) for i, s in enumerate(seqs)), []
    )
    pad = NUM_PADDING_TOKENS
    query = torch.cat([new_q, torch.randn(pad, NUM_HEADS, HEAD_SIZE, generator=gen)])
    key = torch.cat([new_k, torch.randn(pad, NUM_KV_HEADS, HEAD_SIZE, generator=gen)])
    value = torch.cat([new_v, torch.randn(pad, NUM_KV_HEADS, HEAD_SIZE, generator=gen)])
    slot_mapping = torch.tensor(new_slots + [-1] * pad, dtype=torch.int64)
    impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
    md = metadata(
        builder,
        [p + n for p, n, *_ in seqs],
        [n for _, n, *_ in seqs],
        block_tables,
        slot_mapping,
    )
    output = torch.full_like(query, math.nan)
    impl.forward(layer, query, key, value, kv_cache, md, output)

    if kv_cache_dtype == "fp8":  # the reference sees what the fp8 cache holds
        fp8 = torch.float8_e4m3fn
        k_scale, v_scale = layer._k_scale_float, layer._v_scale_float
        seqs = [
            (
                p,
                n,
                q,
                (k / k_scale).to(fp8).double() * k_scale,
                (v / v_scale).to(fp8).double() * v_scale,
            )
            for p, n, q, k, v in seqs
        ]
    expected = torch.cat(
        [
            dense_reference(
                q,
                k,
                v,
                HEAD_SIZE**-0.5,
                opts.get("sliding_window"),
                opts.get("soft_cap"),
                opts.get("sinks"),
            )
            for _, _, q, k, v in seqs
        ]  # fmt: skip
    )
    actual = output[: len(new_q)].double()
    assert torch.isfinite(actual).all(), "an output row was left unwritten"
    tol = 2e-2 if kv_cache_dtype == "fp8" else 1e-5
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)
    assert torch.isnan(output[len(new_q) :]).all()  # padding rows are not ATOM's to write


def test_profiling_run_without_metadata_leaves_output(smollm2_dir) -> None:
    from vllm.v1.kv_cache_interface import KVCacheLayout

    vllm_config = make_config("auto", smollm2_dir)
    layer = make_layer(vllm_config)
    kv_cache = make_cache(layer, vllm_config, KVCacheLayout.LBNHC)
    query = torch.randn(3, NUM_HEADS, HEAD_SIZE)
    output = torch.zeros_like(query)
    assert (
        layer.impl.forward(layer, query, query[:, :2], query[:, :2], kv_cache, None, output)
        is output
    )
