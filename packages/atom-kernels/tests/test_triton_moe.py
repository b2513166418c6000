"""Triton fused_moe against the torch reference: routing grids, activations, biases, dtypes, experts
that receive no token, every align mode and top-k combine; real Qwen3-MoE / Mixtral layer shapes
on a GPU."""

from __future__ import annotations

import pytest
import torch

from atom_kernels.backends.torch import moe as reference
from atom_kernels.testing import assert_close

# (atol, rtol): both sides run GEMMs in the input dtype; they differ in summation order and in the
# Triton path rounding each pair's weighted output to the input dtype before the top-k sum.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
ACTIVATIONS = [  # (activation, gate_up_interleaved)
    ("silu", False),
    ("gelu", False),
    ("swiglu_oai", False),
    ("swiglu_oai", True),
]


def _inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, device, seed, bias=False):
    """Weights scaled so activations stay O(1); distinct routing weights (not one-hot)."""
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: Mixtral is 2.8 GB

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    x = randn(num_tokens, hidden)
    w13 = randn(num_experts, 2 * inter, hidden) * hidden**-0.5 * 2
    w2 = randn(num_experts, hidden, inter) * inter**-0.5
    logits = randn(num_tokens, num_experts)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    b13 = randn(num_experts, 2 * inter) if bias else None
    b2 = randn(num_experts, hidden) if bias else None

    def cast(t):
        return None if t is None else t.to(dtype)

    return cast(x), cast(w13), cast(w2), weights, ids.int(), cast(b13), cast(b2)


def _check(backend, x, w13, w2, weights, ids, activation="silu", b13=None, b2=None,
           interleaved=False, tol=None, **kwargs):  # fmt: skip
    args = (x, w13, w2, weights, ids, activation, b13, b2, interleaved, 1.702, 7.0)
    if kwargs:
        from atom_kernels.backends.triton import moe

        out = moe.fused_moe(*args, **kwargs)
    else:
        out = backend.custom_ops.fused_moe(*args)
    assert out.shape == x.shape and out.dtype == x.dtype
    expected = reference.fused_moe(*args)
    atol, rtol = tol or TOLERANCES[x.dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"fused_moe({activation})")


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_experts", [4, 8])
def test_fused_moe_routing_grid(triton_backend, num_experts, top_k, num_tokens):
    # hidden 40 and intermediate 24: neither a multiple of the tiles
    seed = num_experts * 100 + top_k * 10 + num_tokens
    inputs = _inputs(
        num_tokens, num_experts, top_k, 40, 24, torch.bfloat16, triton_backend.device, seed
    )
    _check(triton_backend, *inputs[:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("activation", "interleaved"), ACTIVATIONS)
def test_fused_moe_activations_biases(triton_backend, activation, interleaved, dtype):
    x, w13, w2, weights, ids, b13, b2 = _inputs(
        5, 4, 2, 32, 16, dtype, triton_backend.device, seed=7, bias=True
    )
    _check(triton_backend, x, w13, w2, weights, ids, activation, b13, b2, interleaved)


@pytest.mark.parametrize("align_kernel_max_pairs", [0, 4096])  # sort align / Triton align
def test_fused_moe_empty_experts_and_align_paths(triton_backend, align_kernel_max_pairs):
    """Only experts 1 and 6 of 8 get tokens (17 rows for one: past one BLOCK_M); int64 ids,
    strided hidden states."""
    device = triton_backend.device
    x, w13, w2, weights, _, _, _ = _inputs(20, 8, 2, 32, 16, torch.float32, device, seed=3)
    ids = torch.tensor([[1, 6]] * 17 + [[6, 1]] * 3, dtype=torch.int64, device=device)
    strided = torch.empty(20, 64, device=device)[:, ::2]
    strided.copy_(x)
    _check(triton_backend, strided, w13, w2, weights, ids,
           align_kernel_max_pairs=align_kernel_max_pairs)  # fmt: skip


@pytest.mark.parametrize("align", ["kernel", "sort", "hist", "onehot"])
def test_align_modes_agree(triton_backend, align):
    """Each align mode against a plain Python sort: 10 experts, 0, 4 and 9 with no pair, counts 1,
    16 and 17 (below, at and past BLOCK_M 16), pairs in order within an expert; the same with
    every third pair -1 (left out of every segment) and all pairs -1; also N = 1 and N = 700
    over four experts (several programs of the sort and hist aligns' second kernels), and
    (hist) N = 16700 int64 ids: more chunks than one block of its histogram loop."""
    from atom_kernels.backends.triton import moe

    device = triton_backend.device
    g = torch.Generator().manual_seed(2)
    counts_in = [0, 5, 16, 3, 0, 17, 1, 2, 7, 0]
    ids_list = [e for e, c in enumerate(counts_in) for _ in range(c)]
    ids_list = [ids_list[i] for i in torch.randperm(len(ids_list), generator=g).tolist()]
    many = torch.tensor([1, 2, 5, 7])[torch.randint(0, 4, (700,), generator=g)].tolist()
    # -1: pairs in no segment (another rank's experts), every third one, or all of them
    skipped = [-1 if i % 3 == 0 else e for i, e in enumerate(ids_list)]
    cases = [ids_list, [3], many, skipped, [-1, -1, -1]]
    if align == "hist":
        cases.append(torch.randint(0, 10, (16700,), generator=g).tolist())
    for ids_py in cases:
        dtype = torch.int64 if len(ids_py) > 1000 else torch.int32
        ids = torch.tensor(ids_py, dtype=dtype, device=device)
        num_experts, block_m = len(counts_in), 16
        counts_ref = [ids_py.count(e) for e in range(num_experts)]
        padded = [(c + block_m - 1) // block_m * block_m for c in counts_ref]
        ends_ref = torch.tensor(padded).cumsum(0).tolist()
        rows = ends_ref[-1]
        sorted_ids = torch.full((rows + block_m,), -1, dtype=torch.int32, device=device)
        counts = torch.empty(num_experts, dtype=torch.int32, device=device)
        ends = torch.empty_like(counts)
        if align == "kernel":
            moe._align_kernel[(1,)](
                ids, sorted_ids, counts, ends, ids.numel(), num_experts,
                BLOCK_M=block_m, BLOCK_E=16, CHUNK=8,
            )  # fmt: skip
        elif align == "onehot":
            moe._align_torch(ids.long(), num_experts, block_m, sorted_ids, counts, ends)
        else:
            fn = moe._align_sort if align == "sort" else moe._align_hist
            fn(ids, num_experts, block_m, sorted_ids, counts, ends)
        assert counts.tolist() == counts_ref and ends.tolist() == ends_ref
        got = sorted_ids.tolist()
        for e in range(num_experts):
            start = ends_ref[e] - padded[e]
            want = [i for i, x in enumerate(ids_py) if x == e]
            assert got[start : start + counts_ref[e]] == want, (align, e)
            assert all(v == -1 for v in got[start + counts_ref[e] : ends_ref[e]])  # padding


def _config(per_pair, group_m=4, block_k=32, combine="sum", align=None, block_m=16,
            remainder_m=None):  # fmt: skip
    cfg = dict(BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=block_k, num_warps=4, GROUP_M=group_m)
    out = {"per_pair": per_pair, "combine": combine, "gemm1": cfg, "gemm2": cfg}
    if align:
        out["align"] = align
    if remainder_m is not None:
        out["remainder_m"] = remainder_m
    return out


@pytest.mark.parametrize("combine", ["sum", "atomic", "token"])
@pytest.mark.parametrize("num_tokens", [1, 3, 6])
@pytest.mark.parametrize(("activation", "interleaved"), [("silu", False), ("swiglu_oai", True)])
def test_fused_moe_per_pair_path(triton_backend, activation, interleaved, num_tokens, combine):
    """The decode path (no align; routing weight folded into GEMM 1; GEMM 2 per (pair, column
    tile) with a sum kernel or fp32 atomics, or per token over its K experts), forced past its
    default pair count: 4 experts for 2-12 pairs, so pairs share experts; biases; BLOCK_K 16 over
    I = 24 (a K-block half masked, not aligned to an expert's end)."""
    device = triton_backend.device
    x, w13, w2, weights, ids, b13, b2 = _inputs(
        num_tokens, 4, 2, 40, 24, torch.bfloat16, device, seed=11 + num_tokens, bias=True
    )
    config = _config(per_pair=True, block_k=16, combine=combine)
    _check(triton_backend, x, w13, w2, weights, ids, activation, b13, b2, interleaved,
           config=config)  # fmt: skip


@pytest.mark.parametrize(
    ("per_pair", "group_m", "combine", "align"),
    [
        (False, 1, "sum", "kernel"),
        (False, 3, "atomic", "sort"),
        (False, 0, "sum", "onehot"),  # 0: one group of all row blocks
        (False, 1, "atomic", "kernel"),
        (False, 2, "sum_kernel", "hist"),
        (True, 1, "sum_kernel", None),
        (True, 1, "sum", None),
        (True, 1, "atomic", None),
        (True, 1, "token", None),
    ],
)
def test_fused_moe_paths_and_program_order(triton_backend, per_pair, group_m, combine, align):
    """Both paths, GROUP_M orderings, align modes and top-k combines over the same routing: 8
    experts, three with no token, per-expert counts 2..7 (none a multiple of BLOCK_M), fp32."""
    device = triton_backend.device
    x, w13, w2, weights, _, _, _ = _inputs(7, 8, 3, 40, 24, torch.float32, device, seed=5)
    ids = torch.tensor(
        [[0, 2, 3], [2, 3, 5], [5, 2, 0], [7, 2, 5], [2, 3, 0], [5, 2, 7], [2, 3, 5]],
        dtype=torch.int32, device=device,
    )  # fmt: skip
    config = _config(per_pair, group_m, combine=combine, align=align)
    _check(triton_backend, x, w13, w2, weights, ids, config=config)


# -1 slots (not computed here: another expert-parallel rank's experts): mixed rows, token 1
# with every slot -1, experts 1, 4 and 6 with no pair.
SKIPPED_IDS = [[0, -1, 3], [-1, -1, -1], [5, 2, -1], [-1, 2, 5], [2, 3, 0], [-1, -1, 7], [2, -1, 5]]


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors while the test runs: a buffer row fused_moe
    reads but never wrote (a -1 pair's) turns the output NaN."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def _owned_reference(x, w13, w2, weights, ids, activation="silu", b13=None, b2=None, **quant):
    """The torch reference on the owned slots only (no -1 reaches it): per slot k, one top-1 call
    on the tokens whose slot k is owned, summed in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(ids.shape[1]):
        rows = (ids[:, k] >= 0).nonzero().squeeze(1)
        if rows.numel():
            part = reference.fused_moe(x[rows], w13, w2, weights[rows, k : k + 1],
                                       ids[rows, k : k + 1], activation, b13, b2, False, 1.702,
                                       7.0, **quant)  # fmt: skip
            out[rows] += part.float()
    return out.to(x.dtype)


def _check_skipped(x, w13, w2, weights, ids, out, tol, expected=None, **quant):
    """out against ``_owned_reference``; the tokens with every slot -1 exactly zero."""
    if expected is None:
        expected = _owned_reference(x, w13, w2, weights, ids, **quant)
    assert_close(out, expected, atol=tol[0], rtol=tol[1], name="fused_moe with -1 slots")
    idle = (ids < 0).all(dim=1)
    assert idle.any() and out[idle].eq(0).all(), "a token with every slot -1 is not a zero row"


@pytest.mark.parametrize(
    ("per_pair", "combine", "align", "top_k"),
    [
        (True, "sum", None, 3),
        (True, "atomic", None, 3),
        (True, "token", None, 3),
        (False, "sum", "kernel", 3),
        (False, "sum_kernel", "hist", 3),
        (False, "atomic", "sort", 3),
        (False, "sum", "onehot", 3),
        (False, "sum", "sort", 1),  # top-1: GEMM 2 writes the output itself
        (False, "atomic", "hist", 1),
    ],
)
def test_fused_moe_skipped_slots(triton_backend, poisoned_empty, per_pair, combine, align, top_k):
    """-1 slots through both paths, every align mode and combine, biases (a -1 slot adds no bias
    either), fp32, NaN-poisoned buffers."""
    device = triton_backend.device
    x, w13, w2, weights, _, b13, b2 = _inputs(7, 8, 3, 40, 24, torch.float32, device, seed=31,
                                              bias=True)  # fmt: skip
    ids = torch.tensor(SKIPPED_IDS, dtype=torch.int32, device=device)[:, :top_k]
    weights = weights[:, :top_k].contiguous()
    if top_k == 1:
        ids[1::2] = -1  # idle tokens 1, 3, 5
    from atom_kernels.backends.triton import moe

    args = (x, w13, w2, weights, ids, "silu", b13, b2, False, 1.702, 7.0)
    out = moe.fused_moe(*args, config=_config(per_pair, group_m=2, combine=combine, align=align))
    expected = _owned_reference(x, w13, w2, weights, ids, "silu", b13, b2)
    _check_skipped(x, w13, w2, weights, ids, out, TOLERANCES[torch.float32], expected)


@pytest.mark.parametrize("num_tokens", [1, 5])  # default per-pair / sorted path
def test_fused_moe_skipped_slots_default_path(triton_backend, poisoned_empty, num_tokens):
    """The registered op at T = 1 (the per-pair path; token 0's slots all -1) and T = 5, bf16:
    about half the slots -1."""
    device = triton_backend.device
    x, w13, w2, weights, ids, _, _ = _inputs(num_tokens, 8, 2, 40, 24, torch.bfloat16, device,
                                             seed=33)  # fmt: skip
    g = torch.Generator().manual_seed(34)
    skipped = (torch.rand(ids.shape, generator=g) < 0.5).to(device)
    skipped[0] = True
    ids = ids.masked_fill(skipped, -1)
    args = (x, w13, w2, weights, ids, "silu", None, None, False, 1.702, 7.0)
    out = triton_backend.custom_ops.fused_moe(*args)
    _check_skipped(x, w13, w2, weights, ids, out, TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize(
    ("quant", "per_pair", "combine", "mode"),
    [
        ("fp8_block", True, "token", None),
        ("fp8_block", False, "sum_kernel", None),
        ("mxfp4", True, "sum", "bits"),  # register multiply-adds (mxfp4_row)
        ("mxfp4", False, "sum", "scaled"),
    ],
)
def test_fused_moe_skipped_slots_quantized(triton_backend, poisoned_empty, quant, per_pair,
                                           combine, mode):  # fmt: skip
    """-1 slots with FP8-block and MXFP4 experts (weights dequantized in the K loops), bf16."""
    from atom_kernels.backends.triton import moe
    from atom_kernels.testing import quantize_fp8_block, quantize_mxfp4

    device = triton_backend.device
    x, w13, w2, weights, _, _, _ = _inputs(7, 8, 3, 64, 32, torch.float32, device, seed=35)
    x = x.to(torch.bfloat16)
    ids = torch.tensor(SKIPPED_IDS, dtype=torch.int32, device=device)
    if quant == "fp8_block":
        block = (16, 32)
        (q13, s13), (q2, s2) = quantize_fp8_block(w13, block), quantize_fp8_block(w2, block)
    else:
        block = None
        (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    quant_args = dict(quant=quant, w13_scale=s13, w2_scale=s2, block_size=block)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, GROUP_M=2)
    config = {"per_pair": per_pair, "combine": combine, "gemm1": cfg, "gemm2": cfg}
    args = (x, q13, q2, weights, ids, "silu", None, None, False, 1.702, 7.0)
    out = moe.fused_moe(*args, config=config, mxfp4_mode=mode, **quant_args)
    _check_skipped(x, q13, q2, weights, ids, out, TOLERANCES[torch.bfloat16], **quant_args)


@pytest.mark.parametrize("combine", ["sum", "atomic"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_fused_moe_sorted_single_token_sort_align(triton_backend, top_k, combine):
    """One token through the sorted path with the sort align (N = 1 or 2 pairs), bf16, biases."""
    device = triton_backend.device
    x, w13, w2, weights, ids, b13, b2 = _inputs(
        1, 8, top_k, 40, 24, torch.bfloat16, device, seed=21 + top_k, bias=True
    )
    config = _config(per_pair=False, group_m=1, combine=combine, align="sort")
    _check(triton_backend, x, w13, w2, weights, ids, "silu", b13, b2, config=config)


# Pairs per expert for the mixed-tile tests (BLOCK_M 32, remainder tile 16): a multiple of the
# full tile (remainder 0), remainders 8 and 16 (fit the small tile), 25 and 17 (do not), no pair.
MIXED_TILE_COUNTS = (32, 40, 57, 0, 16, 17)


def _ids_with_counts(counts, top_k, device, seed):
    """[T, K] expert ids where expert e gets counts[e] pairs, a token's K experts distinct (every
    count <= T), tokens shuffled."""
    labels = [e for e, c in enumerate(counts) for _ in range(c)]
    num_tokens = len(labels) // top_k
    assert num_tokens * top_k == len(labels) and max(counts) <= num_tokens
    ids = torch.tensor(labels).view(top_k, num_tokens).t()  # column k: labels k*T .. (k+1)*T - 1
    g = torch.Generator().manual_seed(seed)
    return ids[torch.randperm(num_tokens, generator=g)].to(torch.int32).to(device)


@pytest.mark.parametrize(
    ("activation", "interleaved", "combine", "align", "remainder_m"),
    [
        ("silu", False, "sum", "hist", 16),
        ("gelu", False, "atomic", "sort", 16),
        ("swiglu_oai", True, "sum", "kernel", 16),
        ("silu", False, "sum", "hist", 0),  # off: every block a full tile
    ],
)
def test_fused_moe_mixed_tiles(
    triton_backend, activation, interleaved, combine, align, remainder_m
):
    """Full 32-row tiles plus a 16-row tile for an expert's last <= 16 pairs: 81 tokens x top-2
    (162 pairs, not a multiple of the tile) with MIXED_TILE_COUNTS per expert, biases, bf16;
    GROUP_M 3 so a group mixes experts and tile sizes."""
    device = triton_backend.device
    counts = MIXED_TILE_COUNTS
    ids = _ids_with_counts(counts, 2, device, seed=4)
    x, w13, w2, weights, _, b13, b2 = _inputs(
        81, len(counts), 2, 40, 24, torch.bfloat16, device, seed=9, bias=True
    )
    config = _config(False, group_m=3, combine=combine, align=align, block_m=32,
                     remainder_m=remainder_m)  # fmt: skip
    _check(triton_backend, x, w13, w2, weights, ids, activation, b13, b2, interleaved,
           config=config)  # fmt: skip


@pytest.mark.parametrize(
    ("activation", "interleaved", "warp_specialize", "remainder_m", "dtype"),
    [
        ("silu", False, False, 16, torch.bfloat16),
        ("gelu", False, True, 0, torch.bfloat16),
        ("gelu", False, True, 0, torch.float32),  # float32: the request is ignored (see fused_moe)
        ("swiglu_oai", True, False, 16, torch.bfloat16),  # interleaved: falls back to pointers
    ],
)
def test_fused_moe_tma_weight_loads(
    triton_backend, activation, interleaved, warp_specialize, remainder_m, dtype
):
    """Weight tiles through TMA descriptors ("tma"; "ws": warp-specialized loop) on the mixed-tile
    routing: I = 24 is not a multiple of BLOCK_N = 16 (a column tile reads into the up half and,
    for the last expert, past the tensor: zeros) nor of BLOCK_K = 32 (a K tile half past I)."""
    from atom_kernels.backends.triton import moe

    device = triton_backend.device
    counts = MIXED_TILE_COUNTS
    ids = _ids_with_counts(counts, 2, device, seed=6)
    x, w13, w2, weights, _, b13, b2 = _inputs(
        81, len(counts), 2, 40, 24, dtype, device, seed=13, bias=True
    )
    # Warp specialization is honoured from 64-row tiles on.
    config = _config(False, group_m=3, combine="sum_kernel", align="hist",
                     block_m=64 if warp_specialize else 32, remainder_m=remainder_m)  # fmt: skip
    config.update(tma=True, ws=warp_specialize)
    assert (moe._weight_descriptors(config, w13, w2, interleaved) is None) == interleaved
    _check(triton_backend, x, w13, w2, weights, ids, activation, b13, b2, interleaved,
           config=config)  # fmt: skip


def test_fused_moe_tma_needs_contiguous_aligned_weights(triton_backend):
    """No descriptor (pointer loads) for the per-pair path, strided weights, or rows not a
    multiple of 16 bytes."""
    from atom_kernels.backends.triton import moe

    device = triton_backend.device
    x, w13, w2, *_ = _inputs(3, 4, 2, 40, 24, torch.bfloat16, device, seed=1)
    config = dict(_config(False), tma=True)
    assert moe._weight_descriptors(config, w13, w2, False) is not None
    assert moe._weight_descriptors(dict(config, per_pair=True), w13, w2, False) is None
    assert moe._weight_descriptors(dict(config, tma=False), w13, w2, False) is None
    strided = torch.empty(4, 48, 80, dtype=torch.bfloat16, device=device)[:, :, :40]
    assert moe._weight_descriptors(config, strided, w2, False) is None
    odd = torch.empty(4, 40, 20, dtype=torch.bfloat16, device=device)  # 40-byte rows
    assert moe._weight_descriptors(config, w13, odd, False) is None


@pytest.mark.parametrize("remainder_m", [8, 24, 32])
def test_fused_moe_mixed_tiles_bad_remainder(triton_backend, remainder_m):
    """remainder_m must be a power of two from 16 to BLOCK_M / 2 (checked before any launch)."""
    from atom_kernels.backends.triton import moe

    device = triton_backend.device
    x, w13, w2, weights, ids, _, _ = _inputs(3, 4, 2, 40, 24, torch.float32, device, seed=1)
    args = (x, w13, w2, weights, ids, "silu", None, None, False, 1.702, 7.0)
    with pytest.raises(ValueError, match="remainder_m"):
        moe.fused_moe(*args, config=_config(False, block_m=32, remainder_m=remainder_m))


def test_fused_moe_is_registered(triton_backend):
    from atom_kernels import registry

    assert registry._IMPLS["triton"]["fused_moe"] is triton_backend.custom_ops.ENTRIES["fused_moe"]
    assert hasattr(torch.ops.atom, "triton_fused_moe")


# Real layer shapes: (experts, top-k, hidden, expert intermediate)
QWEN3_30B_A3B = (128, 8, 2048, 768)
MIXTRAL_8X7B = (8, 2, 4096, 14336)


REAL_SIZES = [(shape, t) for shape in (QWEN3_30B_A3B, MIXTRAL_8X7B) for t in (1, 16, 256, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "num_tokens"),
    REAL_SIZES,
    ids=[f"{'qwen3' if s[0] == 128 else 'mixtral'}-{t}" for s, t in REAL_SIZES],
)
def test_fused_moe_gpu_real_sizes(triton_backend, shape, num_tokens):
    num_experts, top_k, hidden, inter = shape
    inputs = _inputs(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, "cuda", seed=1)
    _check(triton_backend, *inputs[:5], tol=(5e-2, 5e-2))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 2048])
def test_fused_moe_gpu_float32(triton_backend, num_tokens):
    """float32 through every default configuration (the tiles are tuned for 16-bit weights; the
    K tile halves for 4-byte ones so the pipeline stages fit in shared memory)."""
    num_experts, top_k, hidden, inter = QWEN3_30B_A3B
    inputs = _inputs(num_tokens, num_experts, top_k, hidden, inter, torch.float32, "cuda", seed=3)
    _check(triton_backend, *inputs[:5], tol=(1e-4, 1e-4))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_tokens", "combine", "align", "remainder_m"),
    [
        (1, "atomic", None, 0),
        (1, "token", None, 0),
        (2048, "atomic", "sort", 0),
        (2048, "sum", "onehot", 0),
        (2048, "sum", "hist", 32),
        (4096, "atomic", "hist", 64),
        (4096, "sum", "sort", 16),
        (4096, "sum_kernel", "hist", 32),
        (4096, "sum_kernel", "hist", "pointers"),
        (4096, "sum_kernel", "hist", "tma"),
        (4096, "sum_kernel", "hist", "tma+ws"),
        (256, "sum_kernel", "hist", "tma"),
    ],
)
def test_fused_moe_gpu_combines_and_aligns(triton_backend, num_tokens, combine, align,
                                           remainder_m):  # fmt: skip
    """The non-default combines, align modes, mixed tiles and weight loads ("pointers": no TMA;
    "tma": TMA, also on the 16-row tiles at 256 tokens; "tma+ws": with a warp-specialized loop)
    at the Qwen3-30B-A3B shape (default tiles: 128 rows from 2048 tokens on)."""
    from atom_kernels.backends.triton import moe

    num_experts, top_k, hidden, inter = QWEN3_30B_A3B
    inputs = _inputs(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, "cuda", seed=2)
    config = moe._configs(num_tokens, top_k, num_experts, hidden, inter, torch.device("cuda"))
    config["combine"] = combine
    if align:
        config["align"] = align
    if isinstance(remainder_m, str):
        config.update(tma=remainder_m != "pointers", ws=remainder_m == "tma+ws")
    elif remainder_m:
        config["remainder_m"] = remainder_m
    _check(triton_backend, *inputs[:5], tol=(5e-2, 5e-2), config=config)
