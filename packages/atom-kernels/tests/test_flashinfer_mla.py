"""FlashInfer's MLA decode (backends/flashinfer/mla.py): its page lists and its choice by
measurement everywhere; on a GPU with ``flashinfer`` installed, its output against the torch
reference over NaN-poisoned caches with shuffled block tables, eager and replanned under a
captured CUDA graph, bf16 and an fp8 cache."""

import importlib.util

import numpy as np
import pytest
import torch

from atom_kernels.backends import flashinfer
from atom_kernels.backends.flashinfer import mla
from atom_kernels.backends.torch import mla as reference
from atom_kernels.testing import assert_close

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")


def test_csr_pages_list_each_sequence_first_blocks_in_order():
    tables = [[7, 3, 9], [4], [5, 6, 8, 2]]
    indptr, indices, lens = mla.csr_pages([33, 16, 49], tables, 16)
    assert indptr.tolist() == [0, 3, 4, 8]
    assert indices.tolist() == [7, 3, 9, 4, 5, 6, 8, 2]
    assert lens.tolist() == [33, 16, 49]
    assert indptr.dtype == indices.dtype == lens.dtype == np.int32
    # A [>= B, M] array of rows (the graphs' staged tables): stale entries past a row's blocks
    # and rows past B are never read.
    rows = np.full((4, 5), -1, dtype=np.int32)
    for r, t in enumerate(tables):
        rows[r, : len(t)] = t
    rows[:, 4] = 99
    indptr2, indices2, lens2 = mla.csr_pages(np.asarray([33, 16, 49], dtype=np.int32), rows, 16)
    assert indptr2.tolist() == indptr.tolist() and indices2.tolist() == indices.tolist()
    assert lens2.tolist() == lens.tolist()


def test_csr_pages_refuse_a_table_shorter_than_its_sequence():
    with pytest.raises(ValueError, match="cannot hold"):
        mla.csr_pages([33], [[1, 2]], 16)
    with pytest.raises(ValueError, match="cannot hold"):
        mla.csr_pages([33], np.zeros((1, 2), dtype=np.int32), 16)


def test_the_measured_rule_keeps_atom_only_for_few_heads_and_sequences():
    """Asked for by name: wherever the kernel alone measured faster."""
    assert mla.faster(128, 1, True) and mla.faster(64, 1, True)
    assert not mla.faster(16, 1, True) and not mla.faster(32, 8, True)
    assert mla.faster(16, 16, True) and mla.faster(16, 256, True)


@pytest.mark.parametrize(
    ("setting", "named"),
    [(None, False), ("auto", False), ("mla_decode", True), ("sample,mla_decode", True)],
)
def test_auto_takes_it_only_where_the_engine_step_measured_faster(monkeypatch, setting, named):
    """``auto`` (the table's entry): 64 heads or more from 64 sequences, where DeepSeek-V3's
    step won; named: the kernel's own rule."""
    if setting is None:
        monkeypatch.delenv("ATOM_FLASHINFER", raising=False)
    else:
        monkeypatch.setenv("ATOM_FLASHINFER", setting)
    assert flashinfer.wanted("mla_decode")
    assert flashinfer.named("mla_decode") is named
    assert mla.faster(128, 64) and mla.faster(128, 256)
    assert mla.faster(128, 16) is named and mla.faster(128, 1) is named
    assert mla.faster(16, 64) is named and not mla.faster(16, 1)


def test_the_switch_and_the_cpu_never_take_it(monkeypatch):
    monkeypatch.setenv("ATOM_FLASHINFER", "mla_decode")
    assert flashinfer.wanted("mla_decode")
    assert not flashinfer.use("mla_decode", torch.zeros(2, 8))
    assert not mla.supports(512, 64, torch.bfloat16, torch.bfloat16, "cpu")
    if torch.cuda.is_available():
        assert not mla.supports(512, 64, torch.float32, torch.float32, "cuda")
        assert not mla.supports(40, 8, torch.bfloat16, torch.bfloat16, "cuda")
    monkeypatch.setenv("ATOM_FLASHINFER", "0")
    assert not flashinfer.wanted("mla_decode")


# -- on a GPU with FlashInfer ------------------------------------------------------------------

LATENT, ROPE, BLOCK = 512, 64, 16
TOL = {torch.bfloat16: (1.6e-2, 1.6e-2)}


def _batch(seq_lens, num_heads, dtype, seed, num_blocks=None, cache_dtype=None):
    """Random decode queries and a NaN-poisoned cache whose sequences sit in shuffled blocks:
    (q_latent, q_pe, kv_cache, tables (lists), and the reference's tensors)."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = num_blocks or sum(pages) + 5
    cache = torch.full((num_blocks, BLOCK, LATENT + ROPE), float("nan"))
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n, p in zip(seq_lens, pages, strict=True):
        table = [free.pop() for _ in range(p)]
        tables.append(table)
        pos = torch.arange(n)
        cache[torch.tensor(table)[pos // BLOCK], pos % BLOCK] = torch.randn(
            n, LATENT + ROPE, generator=g
        )
    q = torch.randn(len(seq_lens), num_heads, LATENT + ROPE, generator=g).to(dtype).cuda()
    width = max(pages)
    block_tables = torch.tensor([t + [num_blocks + 9] * (width - len(t)) for t in tables])
    ref = dict(
        block_tables=block_tables.int().cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).cuda(),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32).cuda(),
    )
    if cache_dtype is not None:  # an fp8 cache of x / scale (NaN blocks stay NaN)
        cache = (cache / 0.05).clamp(-448, 448).to(cache_dtype)
    else:
        cache = cache.to(dtype)
    return q[..., :LATENT], q[..., LATENT:], cache.cuda(), tables, ref


def _expected(q_latent, q_pe, cache, ref, scale, kv_scale=None):
    return reference.mla_paged_attention(
        q_latent.contiguous(), q_pe.contiguous(), cache, ref["block_tables"], ref["seq_lens"],
        ref["query_start_loc"], scale, None, kv_scale=kv_scale,
    )  # fmt: skip


def _decode(num_heads, dtype, kv_dtype=None, **kwargs):
    return mla.MlaDecode(
        num_heads=num_heads, latent_dim=LATENT, rope_dim=ROPE, block_size=BLOCK,
        scale=(128 + ROPE) ** -0.5, q_dtype=dtype, kv_dtype=kv_dtype or dtype,
        device="cuda", **kwargs,
    )  # fmt: skip


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("num_heads", [16, 128])
def test_gpu_eager_decode_matches_the_reference(num_heads):
    dtype = torch.bfloat16
    decode = _decode(num_heads, dtype)
    for seed, seq_lens in enumerate([[1], [37, 1, 16, 200, 513, 64, 17], [4096] * 3 + [5]]):
        q_latent, q_pe, cache, tables, ref = _batch(seq_lens, num_heads, dtype, seed)
        decode.plan(seq_lens, tables)
        out = torch.full(q_latent.shape, float("nan"), dtype=dtype, device="cuda")
        result = decode(q_latent, q_pe, cache, out=out)  # strided query views
        assert result is out
        atol, rtol = TOL[dtype]
        expected = _expected(q_latent, q_pe, cache, ref, decode.scale)
        assert_close(out, expected, atol=atol, rtol=rtol, name=f"mla decode {seq_lens}")
    assert decode.plans == 3


@pytest.mark.gpu
@needs_flashinfer
def test_gpu_fp8_cache_decode_matches_the_reference():
    decode = _decode(128, torch.bfloat16, torch.float8_e4m3fn)
    seq_lens = [300, 1, 47, 1024]
    q_latent, q_pe, cache, tables, ref = _batch(
        seq_lens, 128, torch.bfloat16, 3, cache_dtype=torch.float8_e4m3fn
    )
    decode.plan(seq_lens, tables)
    out = decode(q_latent, q_pe, cache, kv_scale=0.05)
    expected = _expected(q_latent, q_pe, cache, ref, decode.scale, kv_scale=0.05)
    assert_close(out, expected, atol=3e-2, rtol=3e-2, name="fp8-cache mla decode")
    with pytest.raises(ValueError, match="float"):
        decode(q_latent, q_pe, cache)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("num_heads", [16, 128])
def test_gpu_a_captured_graph_reads_each_replan(num_heads):
    """Planned for 8 sequences, captured once; each later plan (other lengths, other blocks,
    contexts long enough to split) changes what the replayed graph computes, as it should."""
    dtype, seqs = torch.bfloat16, 8
    num_blocks = 8 * 130 + 5
    steps = [
        [1] * seqs,
        [5, 17, 300, 1, 64, 2048, 33, 1000],
        [2048] * seqs,
        [1, 2, 3, 4, 5, 6, 7, 2080],
    ]
    batches = [_batch(s, num_heads, dtype, i, num_blocks=num_blocks) for i, s in enumerate(steps)]
    decode = _decode(num_heads, dtype, graph_seqs=seqs, max_blocks=130)
    q_latent = torch.empty_like(batches[0][0].contiguous())
    q_pe = torch.empty_like(batches[0][1].contiguous())
    cache = torch.empty_like(batches[0][2])
    out = torch.empty_like(q_latent)

    def load(i):
        lat, pe, c, tables, _ = batches[i]
        q_latent.copy_(lat), q_pe.copy_(pe), cache.copy_(c)
        decode.plan(steps[i], tables)

    load(0)
    decode(q_latent, q_pe, cache, out=out)  # warm-up (JIT, allocations)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(q_latent, q_pe, cache, out=out)
    for i in (1, 2, 3, 1):
        load(i)
        out.fill_(float("nan"))
        graph.replay()
        expected = _expected(q_latent, q_pe, cache, batches[i][4], decode.scale)
        assert_close(out, expected, atol=1.6e-2, rtol=1.6e-2, name=f"replayed step {i}")
    with pytest.raises(ValueError, match="8 sequences"):
        decode.plan([1] * 4, [[0]] * 4)
