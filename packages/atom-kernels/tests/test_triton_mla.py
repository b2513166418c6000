"""Triton MLA kernels against the torch reference: the latent-cache write, and attention over the
latent cache for mixed prefill-with-prefix + decode batches over NaN-poisoned caches with shuffled
block tables; L not a power of two, several head blocks, several decode splits, strided q. Small
shapes run everywhere (interpreted on CPU), real DeepSeek-V3 sizes on a GPU (``gpu`` marker)."""

import math
from dataclasses import replace

import pytest
import torch

from atom_kernels.backends.torch import mla as reference
from atom_kernels.testing import assert_close, assert_equal

TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# (H, L, R, block_size)
DEEPSEEK = (16, 512, 64, 16)  # DeepSeek-V3's latent / rope dims, 128 heads over TP 8
ODD = (5, 40, 8, 16)
ODD_PAGE = (3, 40, 16, 7)
TWO_HEAD_BLOCKS = (20, 40, 8, 16)  # more heads than one decode program takes (16 interpreted)
# (seq_len, q_len): prefill, prefill over a cached prefix, decodes, an empty query, a short prefill
MIXED = [(37, 37), (50, 13), (20, 1), (1, 1), (64, 1), (9, 0), (33, 4)]
SMALL = [(20, 20), (45, 6), (40, 1), (3, 1), (9, 0)]  # for L = 512 under the interpreter


class MlaBatch:
    """Random latents / rope keys per sequence written through shuffled blocks into a NaN-poisoned
    latent cache; block-table entries past a sequence's blocks point far outside the cache."""

    def __init__(
        self, seqs, shape, dtype, device, *, strided=False, pad_rows=2,
        index_dtype=torch.int32, seed=0,
    ):  # fmt: skip
        num_heads, latent_dim, rope_dim, block_size = shape
        g = torch.Generator().manual_seed(seed)
        self.seq_lens = [s for s, _ in seqs]
        self.q_lens = [q for _, q in seqs]
        num_tokens = sum(self.q_lens) + pad_rows
        # q as one [T, H, L + R] buffer: strided q_latent / q_pe are its two views.
        q = torch.randn(num_tokens, num_heads, latent_dim + rope_dim, generator=g)
        q = q.to(dtype).to(device)
        if strided:
            self.q_latent, self.q_pe = q[..., :latent_dim], q[..., latent_dim:]
        else:
            self.q_latent = q[..., :latent_dim].contiguous()
            self.q_pe = q[..., latent_dim:].contiguous()
        blocks_per_seq = [-(-s // block_size) for s in self.seq_lens]
        num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
        block_tables = torch.full((len(seqs), max(blocks_per_seq) + 1), num_blocks + 1000)
        kv_cache = torch.full((num_blocks, block_size, latent_dim + rope_dim), float("nan"))
        kv_cache = kv_cache.to(dtype)
        free = torch.randperm(num_blocks, generator=g).tolist()
        for b, seq_len in enumerate(self.seq_lens):
            ids = torch.tensor([free.pop() for _ in range(blocks_per_seq[b])], dtype=torch.long)
            block_tables[b, : len(ids)] = ids
            pos = torch.arange(seq_len)
            rows = torch.randn(seq_len, latent_dim + rope_dim, generator=g)
            kv_cache[ids[pos // block_size], pos % block_size] = rows.to(dtype)
        self.kv_cache = kv_cache.to(device)
        self.block_tables = block_tables.to(index_dtype).to(device)
        self.seq_lens_t = torch.tensor(self.seq_lens, dtype=index_dtype, device=device)
        starts = [0, *torch.tensor(self.q_lens).cumsum(0).tolist()]
        self.query_start_loc = torch.tensor(starts, dtype=index_dtype, device=device)
        self.scale = 1 / math.sqrt(latent_dim + rope_dim)

    def args(self):
        """The op's positional arguments, without ``out``."""
        return (
            self.q_latent,
            self.q_pe,
            self.kv_cache,
            self.block_tables,
            self.seq_lens_t,
            self.query_start_loc,
            self.scale,
        )


def _check(triton_backend, batch, tolerances, **kwargs):
    """NaN-poisoned out, the Triton launcher with ``kwargs``, against the torch reference."""
    args = batch.args()
    out = torch.full(batch.q_latent.shape, float("nan"), dtype=batch.q_latent.dtype)
    out = out.to(batch.q_latent.device)
    result = triton_backend.mla_attention.mla_paged_attention(*args, out, **kwargs)
    assert result is out
    expected = reference.mla_paged_attention(*args, None)
    atol, rtol = tolerances
    assert_close(out, expected, atol=atol, rtol=rtol, name="mla_paged_attention")
    return out


# (shape, seqs, dtype, strided, num_splits): each shape, dtype and split mode at least once
CASES = [
    (DEEPSEEK, SMALL, torch.bfloat16, True, 3),
    (DEEPSEEK, SMALL, torch.float32, False, 1),
    (ODD, MIXED, torch.float32, False, 1),
    (ODD, MIXED, torch.bfloat16, True, 3),
    (ODD_PAGE, MIXED, torch.float32, True, 2),
    (ODD_PAGE, MIXED, torch.bfloat16, False, 1),
    (TWO_HEAD_BLOCKS, MIXED, torch.float32, False, 4),
    (ODD, MIXED, torch.float16, False, 2),
]


@pytest.mark.parametrize(
    ("shape", "seqs", "dtype", "strided", "num_splits"),
    CASES,
    ids=[
        f"h{s[0]}l{s[1]}r{s[2]}p{s[3]}-{str(d)[6:]}-s{int(st)}-{n}split" for s, _, d, st, n in CASES
    ],
)
def test_mixed_batch(triton_backend, shape, seqs, dtype, strided, num_splits):
    batch = MlaBatch(seqs, shape, dtype, triton_backend.device, strided=strided, seed=shape[0])
    out = _check(triton_backend, batch, TOLERANCES[dtype], num_splits=num_splits)
    assert bool((out[-2:] == 0).all()), "rows past query_start_loc[B] must be zeroed"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_only_hint(triton_backend, num_splits):
    """max_query_len=1 on a decode-only batch (T == B) skips the prefill kernel and still gives
    the reference's result."""
    seqs = [(40, 1), (65, 1), (3, 1), (17, 1)]
    device = triton_backend.device
    batch = MlaBatch(seqs, TWO_HEAD_BLOCKS, torch.bfloat16, device, pad_rows=0, seed=8)
    _check(
        triton_backend, batch, TOLERANCES[torch.bfloat16], max_query_len=1, num_splits=num_splits
    )


def test_decode_per_sequence_splits(triton_backend):
    """Each sequence cuts its own context: at most 4 splits of at least 16 tokens (one split for 5
    and 16 tokens, 3 for 40, 4 of 32 for 100, 4 of 48 for 190)."""
    seqs = [(5, 1), (40, 1), (100, 1), (16, 1), (190, 1), (30, 4)]
    batch = MlaBatch(seqs, ODD, torch.float32, triton_backend.device, pad_rows=1, seed=12)
    _check(triton_backend, batch, TOLERANCES[torch.float32], num_splits=4, min_split_len=16)


def test_decode_split_merge_fused_and_separate(triton_backend, monkeypatch):
    """The last split of a (sequence, head block) merges the partials and resets its counter;
    the separate reduce kernel (the path without counters) gives the same rows."""
    from atom_kernels.backends.triton.common import zeroed_counters

    seqs = [(5, 1), (40, 1), (100, 1), (16, 1), (190, 1), (30, 4)]
    device = triton_backend.device
    batch = MlaBatch(seqs, TWO_HEAD_BLOCKS, torch.bfloat16, device, pad_rows=1, seed=14)
    outs = {}
    for fused in (True, False):
        monkeypatch.setattr(triton_backend.attention, "FUSED_DECODE_REDUCE", fused)
        outs[fused] = _check(
            triton_backend, batch, TOLERANCES[torch.bfloat16], num_splits=4, min_split_len=16
        )
    assert int(zeroed_counters(device, 64).abs().sum()) == 0
    assert_close(outs[True], outs[False], atol=1e-2, rtol=1e-2, name="fused vs separate")


@pytest.mark.parametrize(
    "head_blocks_first", [True, False], ids=["head-blocks-first", "seqs-first"]
)
@pytest.mark.parametrize("fused", [True, False], ids=["fused-merge", "reduce-kernel"])
def test_decode_grid_orders(triton_backend, monkeypatch, head_blocks_first, fused):
    """Both decode grid orders (a sequence's head blocks side by side, or the sequences first)
    give the reference's rows with several head blocks and splits, the fused merge's counters
    indexed by (sequence, head block) either way."""
    from atom_kernels.backends.triton.common import zeroed_counters

    mla = triton_backend.mla_attention
    monkeypatch.setattr(triton_backend.attention, "FUSED_DECODE_REDUCE", fused)
    seqs = [(5, 1), (40, 1), (100, 1), (16, 1), (190, 1), (30, 4)]
    device = triton_backend.device
    batch = MlaBatch(seqs, TWO_HEAD_BLOCKS, torch.bfloat16, device, pad_rows=1, seed=16)
    config = mla.default_config(TWO_HEAD_BLOCKS[1], torch.bfloat16, True, TWO_HEAD_BLOCKS[0])
    config = replace(config, decode_head_blocks_first=head_blocks_first)
    _check(
        triton_backend, batch, TOLERANCES[torch.bfloat16], num_splits=4, min_split_len=16,
        config=config,
    )  # fmt: skip
    assert int(zeroed_counters(device, 64).abs().sum()) == 0


def test_decode_grid_order_falls_back_past_the_grid_limit(triton_backend, monkeypatch):
    """More sequences than a grid's second dim holds (MAX_GRID_Y, lowered here): the launcher
    puts the sequences first and the rows still match the reference."""
    mla = triton_backend.mla_attention
    monkeypatch.setattr(mla, "MAX_GRID_Y", 3)
    seqs = [(40, 1), (65, 1), (3, 1), (17, 1), (90, 1)]
    batch = MlaBatch(seqs, TWO_HEAD_BLOCKS, torch.float32, triton_backend.device, pad_rows=0)
    _check(triton_backend, batch, TOLERANCES[torch.float32], max_query_len=1, num_splits=2)


# (block_m, block_n, block_size, heavy_first): tiles of several pages, a tile inside one page,
# pages straddling tiles, both tile orders; H = 5 pairs cut rows across tiles.
PREFILL_TILES = [(32, 32, 4, True), (16, 16, 32, False), (32, 16, 5, True)]


@pytest.mark.parametrize(
    ("block_m", "block_n", "block_size", "heavy_first"),
    PREFILL_TILES,
    ids=[f"{m}x{n}-page{b}-{'heavy' if h else 'fwd'}" for m, n, b, h in PREFILL_TILES],
)
def test_prefill_tiles_and_pages(triton_backend, block_m, block_n, block_size, heavy_first):
    mla_attention = triton_backend.mla_attention
    seqs = [(70, 30), (21, 21), (20, 1), (33, 4)]
    shape = (5, 40, 16, block_size)
    batch = MlaBatch(seqs, shape, torch.bfloat16, triton_backend.device, seed=7)
    config = replace(
        mla_attention.default_config(40, torch.bfloat16, interpreted=True),
        prefill_block_m=block_m,
        prefill_block_n=block_n,
        prefill_heavy_first=heavy_first,
    )
    _check(triton_backend, batch, TOLERANCES[torch.bfloat16], config=config)


def test_prefill_only_batch_int64_metadata(triton_backend):
    seqs = [(30, 30), (45, 20), (18, 2)]
    batch = MlaBatch(
        seqs, ODD_PAGE, torch.float32, triton_backend.device, pad_rows=5, index_dtype=torch.int64
    )
    _check(triton_backend, batch, TOLERANCES[torch.float32])


def test_empty_batches(triton_backend):
    batch = MlaBatch([(5, 2)], ODD, torch.float32, triton_backend.device, pad_rows=0)
    q_latent, q_pe, cache, tables, seq_lens, qsl, scale = batch.args()
    run = triton_backend.mla_attention.mla_paged_attention
    empty = run(q_latent[:0], q_pe[:0], cache, tables, seq_lens, qsl[:1] * 0, scale, None)
    assert empty.shape == (0, 5, 40)
    no_seqs = run(q_latent, q_pe, cache, tables[:0], seq_lens[:0], qsl[:1] * 0, scale, None)
    assert bool((no_seqs == 0).all()), "with no sequences every row is padding"


@pytest.mark.parametrize(
    ("latent_dim", "rope_dim", "dtype", "cache_dtype", "strided"),
    [
        (512, 64, torch.bfloat16, torch.bfloat16, True),
        (40, 8, torch.float32, torch.float32, False),
        (40, 16, torch.float32, torch.bfloat16, True),
    ],
)
def test_mla_cache_write(triton_backend, latent_dim, rope_dim, dtype, cache_dtype, strided):
    """Bit-exact against the reference: -1 slots skipped, unwritten slots stay NaN, strided
    kv_c / k_pe (views of kv_a_proj's [T, L + R] output), int32 slots with the strided inputs."""
    device = triton_backend.device
    num_blocks, block_size, num_tokens = 5, 7, 23
    g = torch.Generator().manual_seed(latent_dim + rope_dim)
    kv = torch.randn(num_tokens, latent_dim + rope_dim, generator=g).to(dtype).to(device)
    kv_c, k_pe = kv[:, :latent_dim], kv[:, latent_dim:]
    if not strided:
        kv_c, k_pe = kv_c.contiguous(), k_pe.contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    slots = (slots.int() if strided else slots).to(device)
    cache = torch.full((num_blocks, block_size, latent_dim + rope_dim), float("nan"))
    cache = cache.to(cache_dtype).to(device)
    expected = cache.clone()
    reference.mla_cache_write(kv_c, k_pe, expected, slots)
    assert triton_backend.custom_ops.ENTRIES["mla_cache_write"](kv_c, k_pe, cache, slots) is None
    assert_equal(cache.float(), expected.float(), name="kv_cache")
    assert int(expected.isnan().any(-1).sum()) > 0  # some slots stayed unwritten


def test_public_ops_through_the_registry(triton_backend, monkeypatch):
    """ak.mla_cache_write / ak.mla_paged_attention with ATOM_KERNEL_BACKEND=triton run the Triton
    entries; out= semantics."""
    import atom_kernels as ak
    from atom_kernels import registry

    monkeypatch.setenv(registry.ENV_VAR, "triton")
    if triton_backend.interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    registry._reset_for_tests()
    try:
        device = triton_backend.device
        for name in ("mla_cache_write", "mla_paged_attention"):
            assert ak.get_op(name, device) is triton_backend.custom_ops.ENTRIES[name]
        batch = MlaBatch(MIXED[:4], ODD, torch.bfloat16, device, seed=6)
        # Overwrite the cache rows of sequence 1's last 13 tokens through the public write op.
        g = torch.Generator().manual_seed(9)
        kv = torch.randn(13, 48, generator=g).to(torch.bfloat16).to(device)
        pos = torch.arange(37, 50, device=device)
        slots = batch.block_tables[1].long()[pos // 16] * 16 + pos % 16
        ak.mla_cache_write(kv[:, :40], kv[:, 40:], batch.kv_cache, slots)
        assert_equal(batch.kv_cache.flatten(0, 1)[slots], kv, name="written rows")
        out = torch.full_like(batch.q_latent, float("nan"))
        assert ak.mla_paged_attention(*batch.args(), out=out) is out
        fresh = ak.mla_paged_attention(*batch.args())
        assert fresh.dtype == torch.bfloat16
        assert_equal(fresh, out, name="out= vs returned")
        expected = reference.mla_paged_attention(*batch.args(), None)
        assert_close(out, expected, atol=1.6e-2, rtol=1.6e-2, name="via registry")
    finally:
        registry._reset_for_tests()


def test_default_config(triton_backend):
    default_config = triton_backend.mla_attention.default_config
    for latent_dim in (40, 128, 512):
        for dtype in (torch.bfloat16, torch.float32):
            config = default_config(latent_dim, dtype, False)
            assert config.prefill_block_m >= 16 and config.prefill_block_n >= 16
            assert config.decode_block_h >= 16 and config.decode_block_n >= 16


def test_choose_splits(triton_backend):
    choose = triton_backend.mla_attention.choose_splits
    max_splits = triton_backend.attention.MAX_SPLITS
    # 128 heads in 64-head blocks (one program an SM) on 132 SMs: batch 64 fills the GPU (no
    # split); batch 4 takes 132 // 8 = 16 splits, batch 1 as many as the table allows (at most
    # MAX_SPLITS), splits of one tile at least.
    assert choose(64, 2, 4096, 132, 64, 64) == (1, 4096)
    assert choose(4, 2, 4096, 132, 64, 64) == (16, 64)
    assert choose(1, 2, 163840, 132, 64, 64) == (max_splits, 64)
    assert choose(1, 2, 1024, 132, 64, 64) == (16, 64)  # the table's 16 tiles
    # 16 heads (TP 8): two programs an SM, so batch 64 still splits 4 ways and 256 does not.
    assert choose(64, 1, 4096, 132, 64, 16) == (4, 64)
    assert choose(128, 1, 4096, 132, 64, 16) == (2, 64)
    assert choose(256, 1, 4096, 132, 64, 16) == (1, 4096)
    assert choose(4, 1, 20, 132, 32, 16) == (1, 32)  # shorter than one tile


# --- real sizes on a GPU ----------------------------------------------------------------------

DEEPSEEK_TP1 = (128, 512, 64, 16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [DEEPSEEK, (32, 512, 64, 16), DEEPSEEK_TP1], ids=["h16", "h32", "h128"]
)
def test_gpu_prefill_with_prefix_and_decodes(triton_backend, shape):
    seqs = [(2048, 2048), (3000, 700), (4096, 1), (300, 1), (1024, 17)]
    batch = MlaBatch(seqs, shape, torch.bfloat16, "cuda", seed=10)
    _check(triton_backend, batch, TOLERANCES[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs", [1, 8, 64])
def test_gpu_decode(triton_backend, num_seqs):
    # Contexts from 512 to 8K; the split count comes from the heuristic.
    lens = torch.linspace(512, 8192, num_seqs).long().tolist() if num_seqs > 1 else [8192]
    batch = MlaBatch([(n, 1) for n in lens], DEEPSEEK_TP1, torch.bfloat16, "cuda", pad_rows=0)
    _check(triton_backend, batch, TOLERANCES[torch.bfloat16], max_query_len=1)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused-merge", "reduce-kernel"])
@pytest.mark.parametrize(
    "head_blocks_first", [True, False], ids=["head-blocks-first", "seqs-first"]
)
@pytest.mark.parametrize("num_seqs", [16, 200])
def test_gpu_decode_grid_orders(triton_backend, monkeypatch, num_seqs, head_blocks_first, fused):
    """128 heads (two 64-head blocks) in both grid orders, more programs than SMs at 200
    sequences; one split and several, merged by the last split (counters per (sequence, head
    block), programs running together: what the interpreter's one-at-a-time programs cannot
    show) or by the reduce kernel."""
    mla = triton_backend.mla_attention
    monkeypatch.setattr(triton_backend.attention, "FUSED_DECODE_REDUCE", fused)
    lens = [int(n) + 13 for n in torch.linspace(64, 3000, num_seqs).tolist()]
    batch = MlaBatch([(n, 1) for n in lens], DEEPSEEK_TP1, torch.bfloat16, "cuda", pad_rows=0)
    config = mla.default_config(512, torch.bfloat16, False, 128)
    config = replace(config, decode_head_blocks_first=head_blocks_first)
    for num_splits in (None, 3):
        _check(
            triton_backend, batch, TOLERANCES[torch.bfloat16], max_query_len=1,
            num_splits=num_splits, config=config,
        )  # fmt: skip


@pytest.mark.gpu
def test_gpu_fp32(triton_backend):
    seqs = [(1000, 1000), (2000, 100), (3000, 1)]
    batch = MlaBatch(seqs, DEEPSEEK, torch.float32, "cuda", seed=14)
    _check(triton_backend, batch, (1e-4, 1e-4))


@pytest.mark.gpu
def test_gpu_cuda_graph_and_torch_compile(triton_backend):
    """The MLA custom ops capture into a CUDA graph and compile with fullgraph=True; replays give
    the eager result."""
    entries = triton_backend.custom_ops.ENTRIES
    seqs = [(3000, 1), (700, 1), (5000, 1), (20, 1)]
    batch = MlaBatch(seqs, DEEPSEEK_TP1, torch.bfloat16, "cuda", pad_rows=0, seed=15)
    kv = torch.randn(4, 576, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([5, -1, 30, 17], device="cuda")

    def step(kv):
        entries["mla_cache_write"](kv[:, :512], kv[:, 512:], batch.kv_cache, slots)
        return entries["mla_paged_attention"](*batch.args(), None, 1)

    eager = step(kv)
    compiled = torch.compile(step, fullgraph=True)
    assert_equal(compiled(kv), eager, name="compiled")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(kv)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step(kv)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(graph_out, eager, name="graph")
