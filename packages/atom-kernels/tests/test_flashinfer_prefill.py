"""FlashInfer's prefill attention (backends/flashinfer/prefill.py): which layers it may take, and
on a GPU with ``flashinfer`` installed its output against the torch reference: a mixed step
(prefill chunks over cached prefixes, a fresh prompt, decode rows, padding rows) over a
NaN-poisoned cache with shuffled block tables, replanned for a second step."""

import importlib.util

import pytest
import torch

from atom_kernels.backends import flashinfer
from atom_kernels.backends.flashinfer import prefill
from atom_kernels.backends.torch import attention as reference
from atom_kernels.testing import assert_close

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
BLOCK = 16


def test_only_a_plain_causal_layer_on_sm90_takes_it(monkeypatch):
    monkeypatch.setenv("ATOM_FLASHINFER", "prefill_attention")
    assert flashinfer.wanted("prefill_attention") and not flashinfer.wanted("mla_decode")
    assert not flashinfer.use("prefill_attention", torch.zeros(2, 8))  # the CPU never
    assert not prefill.supports(128, torch.bfloat16, torch.bfloat16, "cpu")
    monkeypatch.setenv("ATOM_FLASHINFER", "auto")
    assert flashinfer.wanted("prefill_attention") == (
        "prefill_attention" in flashinfer.MEASURED_FASTER
    )
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        bf16 = torch.bfloat16
        assert prefill.supports(128, bf16, bf16, "cuda")
        assert not prefill.supports(128, bf16, bf16, "cuda", sliding_window=128)
        assert not prefill.supports(128, bf16, bf16, "cuda", has_sinks=True)
        assert not prefill.supports(128, bf16, bf16, "cuda", soft_cap=30.0)
        assert not prefill.supports(128, bf16, torch.float8_e4m3fn, "cuda", kv_scaled=True)
        assert not prefill.supports(96, bf16, bf16, "cuda")
        assert not prefill.supports(128, torch.float32, torch.float32, "cuda")


def _step(query_lens, seq_lens, heads, kv_heads, dim, seed, num_blocks):
    """q [T + 3 padding rows, H, D], NaN-poisoned caches, shuffled tables (lists) and the
    reference's tensors for sequences whose last query_lens[b] of seq_lens[b] tokens are new."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK, kv_heads, dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in seq_lens:
        table = [free.pop() for _ in range(-(-n // BLOCK))]
        tables.append(table)
        for pos in range(n):
            blk, off = table[pos // BLOCK], pos % BLOCK
            k_cache[blk, off] = torch.randn(kv_heads, dim, generator=g)
            v_cache[blk, off] = torch.randn(kv_heads, dim, generator=g)
    rows = sum(query_lens)
    q = torch.randn(rows + 3, heads, dim, generator=g)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        bt[b, : len(t)] = torch.tensor(t)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return q, k_cache, v_cache, tables, bt, torch.tensor(seq_lens, dtype=torch.int32), qsl


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 128), (16, 16, 64), (8, 1, 256)])
def test_gpu_mixed_steps_match_the_reference(heads, kv_heads, dim):
    dt, dev = torch.bfloat16, torch.device("cuda")
    scale = dim**-0.5
    planned = prefill.PagedPrefill(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, block_size=BLOCK, scale=scale,
        dtype=dt, device=dev,
    )  # fmt: skip
    steps = [
        ([25, 70, 1, 1, 40], [65, 70, 33, 1, 300]),  # chunks over prefixes, a prompt, decodes
        ([200, 1, 17], [200, 500, 17]),  # the same wrapper replanned: other lengths, fewer rows
    ]
    for seed, (query_lens, seq_lens) in enumerate(steps):
        q, kc, vc, tables, bt, sl, qsl = _step(query_lens, seq_lens, heads, kv_heads, dim, seed, 80)
        rows = sum(query_lens)
        expected = reference.paged_attention(
            q[:rows].to(dt).float(), kc.to(dt).float(), vc.to(dt).float(), bt, sl, qsl, scale,
            None, None, None, None, None, None,
        )  # fmt: skip
        planned.plan(query_lens, seq_lens, tables)
        assert planned.num_rows == rows and planned.plans == seed + 1
        out = torch.full((rows + 3, heads, dim), float("nan"), dtype=dt, device=dev)
        got = planned(q.to(dev, dt), kc.to(dev, dt), vc.to(dev, dt), out)
        assert got is out
        assert_close(got[:rows].float().cpu(), expected, atol=2e-2, rtol=2e-2, name="out")
        assert (got[rows:] == 0).all()  # padding rows


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")
def test_gpu_refuses_what_it_was_not_planned_for():
    dev = torch.device("cuda")
    planned = prefill.PagedPrefill(
        num_heads=4, num_kv_heads=2, head_dim=128, block_size=BLOCK, scale=0.1,
        dtype=torch.bfloat16, device=dev,
    )  # fmt: skip
    cache = torch.zeros(4, BLOCK, 2, 128, dtype=torch.bfloat16, device=dev)
    q = torch.zeros(10, 4, 128, dtype=torch.bfloat16, device=dev)
    with pytest.raises(RuntimeError, match="before plan"):
        planned(q, cache, cache)
    with pytest.raises(ValueError, match="new rows"):
        planned.plan([5, 0], [5, 3], [[0], [1]])
    planned.plan([10], [10], [[2]])
    with pytest.raises(ValueError, match="planned for 10 rows"):
        planned(q[:9], cache, cache)
    with pytest.raises(ValueError, match="got q torch.float16"):
        planned(q.half(), cache.half(), cache.half())
