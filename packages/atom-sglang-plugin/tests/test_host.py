"""atom-models' attention spec -> SGLang's RadixAttention, field by field."""

from __future__ import annotations

import pytest

from atom_models.layers.attention import AttentionSpec

SPEC = dict(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2, layer_idx=3,
            prefix="model.layers.3.self_attn.attn")  # fmt: skip


def build(**overrides):
    from atom_sglang_plugin.host import SglangAttentionHost

    return SglangAttentionHost().make_attention(AttentionSpec(**{**SPEC, **overrides})).attn


def test_heads_scale_and_layer_id():
    attn = build()
    assert (attn.tp_q_head_num, attn.tp_k_head_num, attn.tp_v_head_num) == (8, 2, 2)
    assert (attn.head_dim, attn.scaling, attn.layer_id) == (64, 0.125, 3)


def test_sliding_window_is_sglangs_exclusive_count():
    assert build().sliding_window_size == -1
    assert build(sliding_window=4096).sliding_window_size == 4095  # HF's inclusive window


def test_soft_cap():
    assert build().logit_cap == 0.0
    assert build(soft_cap=30.0).logit_cap == 30.0


def test_sinks_refused():
    with pytest.raises(NotImplementedError, match="sinks"):
        build(has_sinks=True)
