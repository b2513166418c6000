"""`NativeAttention` checks a step's arguments once (atom_kernels' public, checked ops on a
layer's first call of a step), then calls the backend's ops: the same outputs and caches as the
checked ops every call, and a bad call still raises, through the layer and the public ops."""

from __future__ import annotations

import pytest
import torch

import atom_kernels
from atom_models import set_forward_context
from atom_models.layers.attention import AttentionSpec
from atom_models.native_host import NativeAttention, PagedAttentionMetadata

# H = query heads, Hk = kv heads, D = head size
H, HK, D, BLOCK_SIZE, NUM_LAYERS = 4, 2, 16, 4, 3


def _layers() -> list[NativeAttention]:
    layers = []
    for i in range(NUM_LAYERS):
        layer = NativeAttention(AttentionSpec(H, D, D**-0.5, HK, i, f"layers.{i}"))
        layer.bind_cache(16, BLOCK_SIZE, torch.float32, "cpu")
        layer.k_cache.normal_()
        layer.v_cache.normal_()
        layers.append(layer)
    return layers


def _checked(layer: NativeAttention, md, caches, q, k, v) -> torch.Tensor:
    """The layer's body through the public ops, on caches of its own."""
    num_tokens = q.shape[0]
    atom_kernels.reshape_and_cache(
        k.view(num_tokens, HK, D), v.view(num_tokens, HK, D), *caches, md.slot_mapping
    )
    out = atom_kernels.paged_attention(
        q.view(num_tokens, H, D), *caches, md.block_tables, md.seq_lens, md.query_start_loc,
        D**-0.5, max_query_len=md.max_query_len,
    )  # fmt: skip
    return out.reshape(num_tokens, -1)


# (seq_lens, query_lens, whether the layers get `out`) of each step, and how many layer calls of
# it go through the checked ops: every layer on its first call (or with new input shapes: `out`
# in the fifth step), else the step's first layer only; a decode-only step's later layers take
# the step's `DecodeStep` (built by its first layer) whatever their `out`
STEPS = [
    ([5, 9], [5, 1], False, NUM_LAYERS),
    ([6, 10], [1, 1], False, 1),
    ([7, 11], [1, 1], True, 1),
    ([8], [1], True, 1),
    ([9, 12], [2, 1], True, NUM_LAYERS),
]


def test_layer_matches_checked_ops_and_checks_once_per_step(monkeypatch):
    torch.manual_seed(0)
    layers = _layers()
    ref_caches = [(la.k_cache.clone(), la.v_cache.clone()) for la in layers]
    tables = [[0, 1, 2], [3, 4, 5]]
    checked_calls = []
    public = atom_kernels.paged_attention

    def counting(*args, **kwargs):
        checked_calls.append(1)
        return public(*args, **kwargs)

    for seq_lens, query_lens, use_out, num_checked in STEPS:
        md = PagedAttentionMetadata.build(seq_lens, query_lens, tables[: len(seq_lens)], BLOCK_SIZE)
        num_tokens = sum(query_lens)
        before = len(checked_calls)
        for layer, caches in zip(layers, ref_caches, strict=True):
            q, k, v = (torch.randn(num_tokens, n * D) for n in (H, HK, HK))
            expected = _checked(layer, md, caches, q, k, v)
            out = torch.full((num_tokens, H * D), float("nan")) if use_out else None
            with set_forward_context(md), monkeypatch.context() as patch:
                patch.setattr(atom_kernels, "paged_attention", counting)
                got = layer.forward_eager(q, k, v, None, out)
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            if use_out:
                assert got.data_ptr() == out.data_ptr()
            torch.testing.assert_close(layer.k_cache, caches[0], rtol=0, atol=0)
            torch.testing.assert_close(layer.v_cache, caches[1], rtol=0, atol=0)
        assert len(checked_calls) - before == num_checked, (seq_lens, query_lens, use_out)
        decode_only = max(query_lens) == 1
        assert bool(md.memo) == decode_only  # a DecodeStep built (decode-only steps only)
        assert all(entry is not False for entry in md.memo.values())


def test_decode_step_only_on_the_cpu_backend_and_float32(monkeypatch):
    """ATOM_KERNEL_BACKEND=torch keeps the reference on every layer; a bf16 cache too."""
    from atom_kernels import registry

    torch.manual_seed(0)
    layers = _layers()
    md = PagedAttentionMetadata.build([6], [1], [[0, 1]], BLOCK_SIZE)
    q, k, v = torch.randn(1, H * D), torch.randn(1, HK * D), torch.randn(1, HK * D)
    monkeypatch.setenv(registry.ENV_VAR, "torch")
    registry._reset_for_tests()
    try:
        with set_forward_context(md):
            for layer in layers:
                layer.forward_eager(q, k, v, None)
    finally:
        monkeypatch.delenv(registry.ENV_VAR)
        registry._reset_for_tests()
    assert list(md.memo.values()) == [False]
    layers[0].bind_cache(16, BLOCK_SIZE, torch.bfloat16, "cpu")
    assert layers[0]._decode_slots is None and layers[1]._decode_slots is not None


def test_bad_calls_still_raise():
    torch.manual_seed(0)
    (layer,) = _layers()[:1]
    md = PagedAttentionMetadata.build([6], [1], [[0, 1]], BLOCK_SIZE)
    q, k, v = torch.randn(1, H * D), torch.randn(1, HK * D), torch.randn(1, HK * D)
    with set_forward_context(md):
        layer.forward_eager(q, k, v, None)
        layer.forward_eager(q, k, v, None)  # the backend's ops: checked already
    # the public ops check every call, whatever a layer did before
    with pytest.raises(ValueError, match="block_tables"):
        atom_kernels.paged_attention(
            q.view(1, H, D), layer.k_cache, layer.v_cache, md.block_tables.float(),
            md.seq_lens, md.query_start_loc, D**-0.5,
        )  # fmt: skip
    with pytest.raises(ValueError, match="slot_mapping"):
        atom_kernels.reshape_and_cache(
            k.view(1, HK, D), v.view(1, HK, D), layer.k_cache, layer.v_cache,
            md.slot_mapping.repeat(2),
        )  # fmt: skip
    # a layer call with new metadata is checked again: a bad table raises
    bad = PagedAttentionMetadata.build([6], [1], [[0, 1]], BLOCK_SIZE)
    bad.block_tables = bad.block_tables.float()
    with set_forward_context(bad), pytest.raises(ValueError, match="block_tables"):
        layer.forward_eager(q, k, v, None)
    # and the same metadata with a cache rebound to another dtype
    layer.bind_cache(16, BLOCK_SIZE, torch.float64, "cpu")
    with set_forward_context(md), pytest.raises(ValueError, match="key_cache"):
        layer.forward_eager(q, k, v, None)
