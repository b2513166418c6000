"""The cpu backend against the torch reference (the oracle): paged attention and the KV-cache
write over a grid of batches, NaN-poisoned caches and outputs, garbage past each block table."""

import pytest
import torch

import atom_kernels as ak
from atom_kernels import registry
from atom_kernels.backends.cpu import attention as cpu_attention
from atom_kernels.backends.cpu import cache as cpu_cache
from atom_kernels.backends.cpu import step_memo
from atom_kernels.backends.torch import activation as torch_activation
from atom_kernels.backends.torch import attention as ref_attention
from atom_kernels.backends.torch import cache as ref_cache
from atom_kernels.testing import assert_close, assert_equal

FP8 = torch.float8_e4m3fn
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}
# (H, Hk, D, Dv, block_size)
HEADS = [(9, 3, 64, 64, 16), (4, 1, 40, 40, 5), (3, 3, 24, 17, 7)]
# (seq_len, q_len) per sequence
BATCHES = {
    "decode": [(20, 1), (1, 1), (64, 1), (37, 1), (5, 1)],
    "mixed": [(37, 37), (20, 1), (50, 13), (9, 0), (64, 1), (33, 4), (2, 1)],
    "prefill": [(123, 123)],
}
FEATURES = {
    "causal": {},
    "window": {"sliding_window": 8},
    "sinks_softcap": {"sinks": True, "soft_cap": 5.0},
}


def make_batch(heads, seqs, dtype, cache_dtype=None, pad_rows=0, seed=0):
    num_heads, num_kv_heads, head_dim, head_dim_v, block_size = heads
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = [-(-s // block_size) for s, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    value_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim_v), float("nan"))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    # Past each sequence's blocks: an id beyond the cache, then NaN-poisoned spare blocks.
    table = torch.full((len(seqs), max(blocks_per_seq) + 2), 10_000, dtype=torch.int32)
    table[:, -1] = perm[-1]
    for b, (seq_len, _) in enumerate(seqs):
        ids = [perm.pop(0) for _ in range(blocks_per_seq[b])]
        table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        flat_ids = torch.tensor(ids).repeat_interleave(block_size)[:seq_len]
        offsets = torch.arange(seq_len) % block_size
        key_cache[flat_ids, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
        value_cache[flat_ids, offsets] = torch.randn(seq_len, num_kv_heads, head_dim_v, generator=g)
    scales = (0.05, 0.04) if cache_dtype == FP8 else (None, None)
    if cache_dtype == FP8:
        key_cache, value_cache = (key_cache / scales[0]).to(FP8), (value_cache / scales[1]).to(FP8)
    else:
        key_cache, value_cache = key_cache.to(cache_dtype), value_cache.to(cache_dtype)
    q_lens = [q for _, q in seqs]
    num_tokens = sum(q_lens) + pad_rows
    query = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    sinks = torch.randn(num_heads, generator=g) * 2
    return query, key_cache, value_cache, table, seq_lens, qsl, sinks, scales


def run(impl, batch, features, out=None, max_query_len=None):
    query, key_cache, value_cache, table, seq_lens, qsl, sinks, (k_scale, v_scale) = batch
    return impl(
        query, key_cache, value_cache, table, seq_lens, qsl, 0.125,
        features.get("sliding_window"), sinks if features.get("sinks") else None,
        features.get("soft_cap"), k_scale, v_scale, out, max_query_len,
    )  # fmt: skip


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mqa", "dv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_reference(dtype, heads, kind, feature):
    seqs = BATCHES[kind]
    batch = make_batch(heads, seqs, dtype, pad_rows=2, seed=len(kind) + len(feature))
    features = FEATURES[feature]
    expected = run(ref_attention.paged_attention, batch, features)
    out = torch.full_like(expected, float("nan"))
    max_query_len = max(q for _, q in seqs)
    got = run(cpu_attention.paged_attention, batch, features, out=out, max_query_len=max_query_len)
    assert got is out
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, expected.double(), atol=atol, rtol=rtol, name=f"cpu[{kind},{feature}]")
    assert bool((out[-2:] == 0).all()), "padding rows must be zeroed"


@pytest.mark.parametrize("feature", ["causal", "sinks_softcap"])
def test_paged_attention_fp8_cache_matches_reference(feature):
    batch = make_batch(HEADS[0], BATCHES["mixed"], torch.bfloat16, cache_dtype=FP8, seed=4)
    expected = run(ref_attention.paged_attention, batch, FEATURES[feature])
    got = run(cpu_attention.paged_attention, batch, FEATURES[feature])
    assert got.dtype == torch.bfloat16
    assert_close(got, expected.double(), atol=1.6e-2, rtol=1.6e-2, name="cpu fp8")


def test_query_longer_than_context_raises():
    batch = list(make_batch(HEADS[0], [(4, 1), (3, 3)], torch.float32))
    batch[4] = torch.tensor([4, 2], dtype=torch.int32)  # 3 query rows, 2 tokens cached
    with pytest.raises(ValueError, match=r"sequence 1 has 3 query rows but seq_lens\[1\] = 2"):
        run(cpu_attention.paged_attention, batch, {})


def test_decode_plan_is_computed_once_per_step_and_refreshed():
    """Every layer of a step passes the same metadata tensors: the decode plan (slots, mask) is
    reused by them; new tensors, or the same ones changed in place, get a new plan."""
    batch = list(make_batch(HEADS[0], BATCHES["decode"], torch.float32, seed=3))
    step_memo._last.decode_plan = None
    first = run(cpu_attention.paged_attention, batch, {})
    plan = step_memo._last.decode_plan
    second = run(cpu_attention.paged_attention, batch, {})
    assert step_memo._last.decode_plan is plan
    assert_equal(second, first, name="same step")
    seq_lens = batch[4]
    seq_lens.sub_((seq_lens > 1).int())  # in place: shorter contexts, same tensor object
    expected = run(ref_attention.paged_attention, batch, {})
    got = run(cpu_attention.paged_attention, batch, {})
    assert step_memo._last.decode_plan is not plan
    assert_close(got, expected.double(), atol=2e-5, rtol=2e-5, name="after an in-place change")


def test_decode_window_ignores_garbage_outside_the_window():
    """Key positions outside a sliding window are never read into the attention's arithmetic:
    NaN there must not reach the output (the plan redirects them to the last token)."""
    heads = HEADS[0]
    block_size = heads[4]
    batch = list(make_batch(heads, [(40, 1), (33, 1)], torch.float32, seed=5))
    query, key_cache, value_cache, table, seq_lens = batch[:5]
    for b, seq_len in enumerate(seq_lens.tolist()):
        for pos in range(seq_len - 8):  # outside a window of 8
            block, offset = int(table[b, pos // block_size]), pos % block_size
            key_cache[block, offset] = float("nan")
            value_cache[block, offset] = float("nan")
    got = run(cpu_attention.paged_attention, batch, {"sliding_window": 8})
    assert bool(torch.isfinite(got).all())
    clean = list(make_batch(heads, [(40, 1), (33, 1)], torch.float32, seed=5))
    expected = run(ref_attention.paged_attention, clean, {"sliding_window": 8})
    assert_close(got, expected.double(), atol=2e-5, rtol=2e-5, name="window with NaN outside")


@pytest.mark.parametrize("feature", ["causal", "window"])
def test_paged_attention_strided_cache_matches_reference(feature):
    """K and V caches that are views of one buffer (no flat slot view): the block-gather path."""
    batch = list(make_batch(HEADS[0], BATCHES["mixed"], torch.float32, seed=6))
    key_cache, value_cache = batch[1], batch[2]
    kv = torch.stack((key_cache, value_cache), dim=1)  # [num_blocks, 2, block_size, Hk, D]
    batch[1], batch[2] = kv[:, 0], kv[:, 1]
    assert cpu_cache.slot_view(batch[1]) is None
    expected = run(ref_attention.paged_attention, batch, FEATURES[feature])
    got = run(cpu_attention.paged_attention, batch, FEATURES[feature])
    assert_close(got, expected.double(), atol=2e-5, rtol=2e-5, name=f"strided {feature}")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("strided_cache", [False, True])
def test_reshape_and_cache_matches_reference(cache_dtype, strided_cache):
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 5, 3, 24, 17
    key = torch.randn(num_tokens, num_kv_heads, 2 * head_dim, generator=g)[..., :head_dim]
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].int()
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1
    scale = 0.05 if cache_dtype == FP8 else None
    caches = []
    for _ in range(2):
        if strided_cache:  # K and V views of one [num_blocks, 2, ...] buffer
            kv = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"))
            kv = kv.to(cache_dtype)
            caches.append((kv[:, 0], kv[:, 1]))
        else:
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            caches.append(tuple(torch.full(shape, float("nan")).to(cache_dtype) for _ in "kv"))
    ref_cache.reshape_and_cache(key, value, *caches[0], slots, scale, scale)
    cpu_cache.reshape_and_cache(key, value, *caches[1], slots, scale, scale)
    for expected, got in zip(caches[0], caches[1], strict=True):
        # NaN == NaN for the slots neither wrote: compare the bytes.
        assert_equal(got.view(torch.uint8), expected.view(torch.uint8), name="cache bytes")


def test_reshape_and_cache_slots_are_refreshed_when_the_mapping_changes():
    """The write slots are derived once per slot mapping (every layer of a step passes the same
    tensor); the same tensor changed in place gets them derived again."""
    g = torch.Generator().manual_seed(2)
    shape, num_tokens = (6, 5, 2, 8), 7
    key = torch.randn(num_tokens, 2, 8, generator=g)
    value = torch.randn(num_tokens, 2, 8, generator=g)
    slots = torch.randperm(30, generator=g)[:num_tokens].int()
    slots[3] = -1
    for _ in range(2):  # the same step twice, then another step in the same tensor
        caches = [tuple(torch.full(shape, float("nan")) for _ in "kv") for _ in range(2)]
        ref_cache.reshape_and_cache(key, value, *caches[0], slots, None, None)
        cpu_cache.reshape_and_cache(key, value, *caches[1], slots, None, None)
        for expected, got in zip(caches[0], caches[1], strict=True):
            assert_equal(got.view(torch.uint8), expected.view(torch.uint8), name="cache bytes")
        slots.copy_(torch.randperm(30, generator=g)[:num_tokens].int())


def test_cpu_is_the_automatic_choice_on_cpu(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    registry._reset_for_tests()
    try:
        assert ak.current_backend("cpu") == "cpu"
        assert ak.get_op("paged_attention", "cpu") is cpu_attention.paged_attention
        assert ak.get_op("reshape_and_cache", "cpu") is cpu_cache.reshape_and_cache
        assert ak.get_op("silu_and_mul", "cpu") is torch_activation.silu_and_mul
    finally:
        registry._reset_for_tests()


@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_packed_linear_matches_reference(rows, onednn):
    """MKL-packed at 1 and 8 rows, with `onednn` oneDNN-packed at 2-16 where MKL has no copy;
    other row counts run F.linear. The torch reference (the `linear` op of the torch backend) is
    the oracle."""
    from atom_kernels.backends.cpu import onednn_linear
    from atom_kernels.backends.cpu.packed_linear import PackedLinear, can_pack
    from atom_kernels.backends.torch.linear import linear as ref_linear

    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(1001, 77, generator=g)
    if not can_pack(weight):
        pytest.skip("torch without MKL")
    gemm = PackedLinear(weight, rows=(1, 8), onednn=onednn)
    assert (gemm.onednn_key is not None) == (onednn and onednn_linear.can_pack(weight))
    x = torch.randn(rows, 77, generator=g)
    assert_close(gemm(x), ref_linear(x, weight, None).double(), atol=2e-5, rtol=2e-5,
                 name=f"packed linear, {rows} rows")  # fmt: skip
    strided = torch.randn(rows, 2 * 77, generator=g)[:, ::2]
    assert_close(gemm(strided), ref_linear(strided, weight, None).double(), atol=2e-5,
                 rtol=2e-5, name="strided x")  # fmt: skip


@pytest.mark.parametrize("rows", [1, 2, 8, 13, 16, 17, 136])
@pytest.mark.parametrize("shape", [(960, 576), (123, 77), (77, 123)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_packed_linear_matches_reference(rows, shape, with_bias):
    """oneDNN-packed at MIN_ROWS..MAX_ROWS rows, the 1-row copy at 1 row (K <= N only),
    F.linear at the others; the torch reference in float64 is the oracle, for contiguous and
    strided inputs."""
    from atom_kernels.backends.cpu import onednn_linear
    from atom_kernels.backends.torch.linear import linear as ref_linear

    g = torch.Generator().manual_seed(rows * 7 + shape[1])
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    bias = torch.randn(out_features, generator=g) if with_bias else None
    if not onednn_linear.can_pack(weight):
        pytest.skip("torch without oneDNN")
    key, packed = onednn_linear.pack(weight)
    one_row = onednn_linear.pack_one_row(key, weight)
    assert (one_row is None) == (in_features > out_features)
    if one_row is not None:
        assert one_row.shape == (in_features, out_features) and one_row.is_contiguous()
    bias64 = None if bias is None else bias.double()
    x = torch.randn(rows, in_features, generator=g)
    strided = torch.randn(rows, 2 * in_features, generator=g)[:, ::2]
    for name, inputs in (("contiguous", x), ("strided", strided)):
        got = onednn_linear.packed_linear(inputs, weight, bias, key)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        expected = ref_linear(inputs.double(), weight.double(), bias64)
        assert_close(got, expected, atol=2e-5, rtol=2e-5, name=f"{name} x, {rows} rows")


def test_onednn_packed_linear_compiles():
    """Inside a compiled graph (dynamic row count) the op runs as eager: packed and not."""
    from atom_kernels.backends.cpu import onednn_linear
    from atom_kernels.backends.torch.linear import linear as ref_linear

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(123, 77, generator=g) / 77**0.5
    if not onednn_linear.can_pack(weight):
        pytest.skip("torch without oneDNN")
    key, packed = onednn_linear.pack(weight)
    one_row = onednn_linear.pack_one_row(key, weight)
    assert one_row is not None

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(onednn_linear.packed_linear(x * 2, weight, None, key))

    compiled = torch.compile(forward, dynamic=True, fullgraph=True)
    for rows in (1, 8, 40):
        x = torch.randn(rows, 77, generator=g)
        with torch.no_grad():
            got = compiled(x)
        expected = torch.relu(ref_linear(x.double() * 2, weight.double(), None))
        assert_close(got, expected, atol=2e-5, rtol=2e-5, name=f"compiled, {rows} rows")


def test_onednn_packed_linear_refuses_what_it_cannot_pack_and_frees_what_it_packed():
    import gc

    from atom_kernels.backends.cpu import onednn_linear

    key, packed = onednn_linear.pack(torch.randn(8, 8))
    one_row = onednn_linear.pack_one_row(key, torch.randn(8, 8))
    assert key in onednn_linear._PACKED and key in onednn_linear._ONE_ROW
    del packed, one_row
    gc.collect()
    # the owner's copies were the only ones
    assert key not in onednn_linear._PACKED and key not in onednn_linear._ONE_ROW
    with pytest.raises(ValueError, match="no weight packed under key"):
        onednn_linear.pack_one_row(key, torch.randn(8, 8))

    assert not onednn_linear.can_pack(torch.randn(8, 8, dtype=torch.float64))
    assert not onednn_linear.can_pack(torch.randn(8))
    with pytest.raises(ValueError, match="float32 CPU weight"):
        onednn_linear.pack(torch.randn(8, 8, dtype=torch.bfloat16))
