"""Triton filtered sampling (sampling_filter.py) against the torch reference's masking: each row's
threshold keeps exactly the reference's tokens, draws stay inside, greedy rows are the raw argmax,
log-probs are raw."""

import pytest
import torch

from atom_kernels.backends.torch import sampling as reference
from atom_kernels.testing import assert_close, assert_equal


def _batch(rows, vocab, seed, device):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2
    temperature = torch.rand(rows, generator=g) * 2 + 0.3
    top_k = torch.randint(0, 30, (rows,), generator=g, dtype=torch.int32)
    top_k[::4] = 0  # off
    top_k[1] = vocab + 5  # >= V: off
    top_p = torch.rand(rows, generator=g)
    top_p[::3] = 1.0  # off
    top_p[2] = 0.0  # the max only
    min_p = torch.rand(rows, generator=g) * 0.4
    min_p[::2] = 0.0
    return [t.to(device) for t in (logits, temperature, top_k, top_p, min_p)]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.interpreter_slow
def test_thresholds_keep_exactly_the_reference_tokens(triton_backend, split):
    from atom_kernels.backends.triton import sampling_filter as sf
    from atom_kernels.backends.triton import sampling_filter_split

    device = triton_backend.device
    rows = 12 if split else 24  # the split kernel's ~25 launches are slow in the interpreter
    logits, temperature, top_k, top_p, min_p = _batch(rows, 150, seed=1, device=device)
    for args in ((top_k, None, None), (None, top_p, None), (top_k, top_p, min_p)):
        thresholds = torch.empty(rows, dtype=torch.int64, device=device)
        if split:  # two programs a row
            ids, logprobs = sampling_filter_split.filtered_sample(
                logits, temperature, *args, num_splits=2, thresholds=thresholds
            )
        else:
            ids, logprobs = sf.filtered_sample(
                logits, temperature, *args, block_v=256, thresholds=thresholds
            )
        raw = torch.log_softmax(logits, dim=-1).gather(1, ids[:, None]).squeeze(1)
        assert_close(logprobs, raw, atol=1e-5, rtol=1e-5, name="raw log-probs")
        masked = reference.apply_top_k_top_p_min_p(logits / temperature[:, None], *args)
        expected = torch.isfinite(masked)
        kept = logits >= sf.values(thresholds)[:, None]
        assert_equal(kept, expected, name=f"kept tokens (filters {[a is not None for a in args]})")
        assert bool(expected.gather(1, ids[:, None]).all()), "a draw outside the kept tokens"


@pytest.mark.interpreter_slow
def test_thresholds_read_off_the_top_equal_the_searched_ones(triton_backend):
    """The first pass's kept top (top-k <= TOP, top-p cuts above its last) gives the search's
    thresholds: the same batch with ``top=0`` (every threshold searched) and ``top=16``."""
    from atom_kernels.backends.triton import sampling_filter as sf

    device = triton_backend.device
    logits, temperature, top_k, top_p, min_p = _batch(24, 150, seed=4, device=device)
    found = []
    for top in (0, 16):
        thresholds = torch.empty(24, dtype=torch.int64, device=device)
        sf.filtered_sample(logits, temperature, top_k, top_p, min_p, block_v=64,
                           thresholds=thresholds, top=top)  # fmt: skip
        found.append(thresholds)
    assert_equal(found[1], found[0], name="thresholds read off the top vs searched")


@pytest.mark.parametrize("spread", [2.0, 8.0], ids=["flat", "peaked"])
@pytest.mark.interpreter_slow
def test_pruned_blocks_change_no_threshold_and_no_draw(triton_backend, spread):
    """PRUNE (a block's top merge, top-p's mass pass and a block's draw skipped where they cannot
    change anything) against the kernel without it, the same seed: equal thresholds, tokens and
    log-probs for every filter mix, with the reference's tokens kept. Rows whose largest logits
    lie in the first block leave the later blocks nothing to merge or draw; rows of whole-number
    logits tie at the k-th and the kept TOP-th; a row has -inf logits, one is greedy, one has a
    top-k past the vocabulary."""
    from atom_kernels.backends.triton import sampling_filter as sf

    device = triton_backend.device
    rows, vocab = 12, 200
    logits, temperature, top_k, top_p, min_p = _batch(rows, vocab, seed=9, device=device)
    logits = logits * spread
    logits[::2, :64] += 3 * spread  # rows whose largest logits all lie in the first block
    tied = torch.zeros(rows, dtype=torch.bool, device=device)
    tied[1::3] = True
    logits[tied] = torch.round(logits[tied])  # ties, among them at the k-th and the TOP-th
    logits[3, 100:150] = float("-inf")
    temperature[6] = 0.0  # greedy
    # within the interpreter's kept top (TOP_INTERPRETED), but row 1's top-k past the vocabulary
    top_k = torch.where(top_k > vocab, top_k, top_k.clamp(max=16))
    checked = ~tied
    checked[6] = False  # the reference divides by the temperature
    for args in ((top_k, top_p, None), (None, top_p, min_p), (top_k, top_p, min_p)):
        results = []
        for prune in (False, True):
            thresholds = torch.empty(rows, dtype=torch.int64, device=device)
            torch.manual_seed(3)  # the kernel's seed comes from torch's generator
            ids, logprobs = sf.filtered_sample(logits, temperature, *args, block_v=64,
                                               thresholds=thresholds, prune=prune)  # fmt: skip
            results.append((thresholds, ids, logprobs))
        (t0, i0, l0), (t1, i1, l1) = results
        name = f"filters {[a is not None for a in args]}"
        assert_equal(t1, t0, name=f"thresholds, {name}")
        assert_equal(i1, i0, name=f"tokens, {name}")
        assert_close(l1, l0, atol=0, rtol=0, name=f"log-probs, {name}")
        masked = reference.apply_top_k_top_p_min_p(logits / temperature[:, None], *args)
        kept = logits >= sf.values(t1)[:, None]
        assert_equal(kept[checked], torch.isfinite(masked)[checked], name=name)


def test_pruning_at_the_edges_of_the_kept_top(triton_backend):
    """The two cases PRUNE must leave alone (the interpreter keeps the top 16): a tie group at
    the k-th logit running past the kept top (top-p's mass then needs the whole group: cut at 2
    keeping all 31, not at 5 keeping 1) and a later block whose largest is just above the kept
    16th (it must enter the top: the 16th largest is 5.5, not 5). With and without PRUNE the
    same kept tokens, the threshold reference's (ties with the cut kept: the sort's reference
    keeps 6 of row 0's, as its sort orders them)."""
    from atom_kernels.backends.torch import sampling_threshold
    from atom_kernels.backends.triton import sampling_filter as sf

    device = triton_backend.device
    vocab = 200
    logits = torch.full((2, vocab), -5.0)
    logits[0, 0] = 5.0
    logits[0, 10:40] = 2.0  # 30 tied at the 16th largest
    logits[1, :16] = 20.0 - torch.arange(16.0)  # 20 .. 5 in the first block
    logits[1, 150] = 5.5  # in the third block, 0.5 above the kept 16th
    logits = logits.to(device)
    temperature = torch.ones(2, device=device)
    top_k = torch.full((2,), 16, dtype=torch.int32, device=device)
    top_p = torch.tensor([0.5, 1.0], device=device)
    masked = sampling_threshold.apply_top_k_top_p_min_p(logits, top_k, top_p, None)
    expected = torch.isfinite(masked)
    assert expected.sum(dim=1).tolist() == [31, 16]
    for prune in (False, True):
        thresholds = torch.empty(2, dtype=torch.int64, device=device)
        sf.filtered_sample(logits, temperature, top_k, top_p, None, block_v=64,
                           thresholds=thresholds, prune=prune)  # fmt: skip
        kept = logits >= sf.values(thresholds)[:, None]
        assert_equal(kept, expected, name=f"kept tokens, prune {prune}")


def test_greedy_rows_top_k_1_and_top_p_0_are_the_argmax(triton_backend):
    from atom_kernels.backends.triton import sampling_filter as sf

    device = triton_backend.device
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 200, generator=g) * 3).to(device)
    logits[1, 17] = logits[1, 150] = logits[1].max() + 1  # a tie at the max: 17
    temperature = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.7, 2.0], device=device)
    top_k = torch.tensor([5, 0, 1, 0, 1, 300], dtype=torch.int32, device=device)
    top_p = torch.tensor([0.5, 1.0, 1.0, 0.0, 0.9, 0.0], device=device)
    ids, logprobs = sf.filtered_sample(logits, temperature, top_k, top_p, None)
    assert_equal(ids, logits.argmax(-1), name="argmax rows")
    raw = torch.log_softmax(logits, dim=-1).gather(1, ids[:, None]).squeeze(1)
    assert_close(logprobs, raw, atol=1e-5, rtol=1e-5, name="raw log-probs")


def test_the_op_draws_filtered_rows_with_the_kernels(triton_backend):
    """Unseeded filtered rows: the split kernel below SPLIT_BELOW rows (here), top log-probs
    alongside; seeded rows keep the reference (test_triton_sampling.py)."""
    device = triton_backend.device
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(5, 120, generator=g) * 2).to(device)
    temperature = torch.tensor([1.0, 0.0, 0.8, 1.5, 1.0], device=device)
    min_p = torch.tensor([0.3, 0.5, 0.2, 0.1, 0.0], device=device)
    allowed = torch.isfinite(
        reference.apply_top_k_top_p_min_p(
            logits / torch.where(temperature > 0, temperature, 1.0)[:, None], None, None, min_p
        )
    )
    for _ in range(3):
        out = triton_backend.custom_ops.sample_op(logits, temperature, None, None, min_p, None, 2)
        assert bool(allowed.gather(1, out.token_ids[:, None]).all()), "a draw outside min-p"
        assert int(out.token_ids[1]) == int(logits[1].argmax())
        assert_close(out.top_logprobs, torch.log_softmax(logits, -1).topk(2, dim=-1).values,
                     atol=1e-5, rtol=1e-5, name="top log-probs")  # fmt: skip


@pytest.mark.interpreter_slow
def test_draws_cover_the_kept_tokens_and_bf16_ties_at_the_kth_are_kept(triton_backend):
    from atom_kernels.backends.triton import sampling_filter as sf

    device = triton_backend.device
    logits = torch.full((48, 100), -5.0)
    logits[:, :3] = torch.tensor([1.3, 1.2, 1.1])
    logits[:, 3:8] = 1.0  # 5 tokens tie with the 4th
    logits = logits.to(torch.bfloat16).to(device)
    temperature = torch.full((48,), 4.0, device=device)  # nearly flat over the kept 8
    top_k = torch.full((48,), 4, dtype=torch.int32, device=device)
    ids = [sf.filtered_sample(logits, temperature, top_k, None, None, block_v=128)[0]
           for _ in range(2)]  # fmt: skip
    assert set(torch.cat(ids).tolist()) == set(range(8))


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_vocab_152k_batch_64(triton_backend, dtype, split):
    from atom_kernels.backends.triton import sampling_filter, sampling_filter_split

    sf = sampling_filter_split if split else sampling_filter

    logits, temperature, top_k, top_p, min_p = _batch(64, 151936, seed=7, device="cuda")
    logits = (logits * 2).to(dtype)
    top_k = top_k * 4
    for args in ((top_k, None, None), (top_k, top_p, min_p), (None, None, min_p)):
        thresholds = torch.empty(64, dtype=torch.int64, device="cuda")
        ids, _ = sf.filtered_sample(logits, temperature, *args, thresholds=thresholds)
        masked = reference.apply_top_k_top_p_min_p(logits.float() / temperature[:, None], *args)
        expected = torch.isfinite(masked)
        kept = logits.float() >= sampling_filter.values(thresholds)[:, None]
        assert bool(kept.gather(1, ids[:, None]).all()), "a draw outside the kept tokens"
        if dtype == torch.float32 or args[1] is None:
            assert_equal(kept, expected, name=f"kept tokens {dtype}")
            continue
        # bf16 ties at the top-p cut: the sort keeps some of the tied tokens, the threshold all.
        assert bool((kept | ~expected).all()), "a token the sort keeps was dropped"
        cut = logits.float().masked_fill(~expected, float("inf")).amin(dim=-1, keepdim=True)
        extra = kept & ~expected
        assert bool((logits.float() == cut)[extra].all()), "an extra token not tied at the cut"


def test_the_filter_switch_off_sends_filtered_rows_to_the_reference(triton_backend, monkeypatch):
    """ATOM_SAMPLE_FILTER=0 (read into FILTER_KERNELS at import): the torch reference draws the
    filtered rows, the same draws as the reference's under the same global seed."""
    monkeypatch.setattr(triton_backend.custom_ops, "FILTER_KERNELS", False)
    logits, temperature, top_k, top_p, min_p = _batch(16, 150, seed=3, device=triton_backend.device)
    args = (logits, temperature, top_k, top_p, min_p, None, 2)
    torch.manual_seed(7)
    out = triton_backend.custom_ops.sample_op(*args)
    torch.manual_seed(7)
    expected = reference.sample(*args)
    assert_equal(out.token_ids, expected.token_ids, name="token ids")
    assert_equal(out.top_token_ids, expected.top_token_ids, name="top ids")
