"""sampling_threshold: the sort-free top-k / top-p / min-p masking against the torch reference's
sort, row by row, including ties, both candidate counts and the fall-back to the sort."""

import pytest
import torch

from atom_kernels.backends.torch import sampling as reference
from atom_kernels.backends.torch import sampling_threshold as st
from atom_kernels.testing import assert_equal


def _rows(rows, vocab, seed, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * spread


def _params(rows, seed, vocab):
    g = torch.Generator().manual_seed(seed + 100)
    top_k = torch.randint(-1, 80, (rows,), generator=g)
    top_k[::5] = 0  # off
    top_k[1::7] = vocab + 3  # >= V: off
    top_p = torch.rand(rows, generator=g)
    top_p[::3] = 1.0  # off
    top_p[2::11] = 0.0  # the first token only
    min_p = torch.rand(rows, generator=g) * 0.3
    min_p[::2] = 0.0
    return top_k.int(), top_p, min_p


@pytest.mark.parametrize("vocab", [50, 700, 6000])
@pytest.mark.parametrize("which", ["k", "p", "m", "kp", "kpm"])
def test_masks_the_same_tokens_as_the_sort(vocab, which):
    rows = 40
    logits = _rows(rows, vocab, seed=vocab)
    top_k, top_p, min_p = _params(rows, vocab, vocab)
    args = (
        top_k if "k" in which else None,
        top_p if "p" in which else None,
        min_p if "m" in which else None,
    )
    expected = reference.apply_top_k_top_p_min_p(logits, *args)
    assert st.thresholds(logits, *args) is not None  # decided without the sort
    got = st.apply_top_k_top_p_min_p(logits, *args)
    assert_equal(got, expected, name=f"masked logits ({which}, V={vocab})")


def test_ties_with_the_kth_value_are_kept_beyond_the_candidates():
    vocab = 3000
    logits = torch.zeros(2, vocab)
    logits[:, :10] = torch.arange(10, 0, -1).float() + 5
    logits[:, 10:] = 1.0  # 2,990 tokens tie with the 11th
    top_k = torch.tensor([11, 300])
    top_p = torch.tensor([1.0, 0.999999])
    expected = reference.apply_top_k_top_p_min_p(logits, top_k, top_p, None)
    got = st.apply_top_k_top_p_min_p(logits, top_k, top_p, None)
    assert_equal(got, expected, name="ties kept")
    assert int((got[0] > float("-inf")).sum()) == vocab


def test_a_wide_nucleus_takes_the_second_candidate_count_then_the_sort():
    vocab = 20000
    # A nucleus of ~1,000 tokens at p = 0.9: past 256 candidates, inside 4,096.
    logits = torch.full((1, vocab), -30.0)
    logits[0, :1100] = torch.linspace(0, -1, 1100)
    top_p = torch.tensor([0.9])
    assert st._top_k_top_p(logits, None, top_p, 256) is None
    assert st.thresholds(logits, None, top_p, None) is not None
    assert_equal(
        st.apply_top_k_top_p_min_p(logits, None, top_p, None),
        reference.apply_top_k_top_p_min_p(logits, None, top_p, None),
        name="second try",
    )
    flat = _rows(2, vocab, seed=7, spread=0.1)  # a nucleus of ~18,000: the sort decides
    top_p = torch.tensor([0.9, 0.5])
    assert st.thresholds(flat, None, top_p, None) is None
    assert_equal(
        st.apply_top_k_top_p_min_p(flat, None, top_p, None),
        reference.apply_top_k_top_p_min_p(flat, None, top_p, None),
        name="fall-back",
    )


def test_all_off_and_empty():
    logits = _rows(3, 40, seed=2)
    off = (torch.zeros(3, dtype=torch.int32), torch.ones(3), torch.zeros(3))
    assert_equal(st.apply_top_k_top_p_min_p(logits, *off), logits, name="off")
    empty = torch.empty(0, 40)
    none = (torch.empty(0, dtype=torch.int32), torch.empty(0), torch.empty(0))
    assert st.apply_top_k_top_p_min_p(empty, *none).shape == (0, 40)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_vocab_152k_batch_64(dtype):
    """On the GPU at Qwen3's vocabulary: bf16 logits tie often at the cut."""
    rows, vocab = 64, 151936
    logits = _rows(rows, vocab, seed=11).to(dtype).cuda()
    top_k, top_p, min_p = (t.cuda() for t in _params(rows, 11, vocab))
    for args in ((top_k, None, None), (top_k, top_p, min_p), (None, None, min_p)):
        expected = reference.apply_top_k_top_p_min_p(logits, *args)
        got = st.apply_top_k_top_p_min_p(logits, *args)
        if dtype == torch.float32 or args[1] is None:
            assert_equal(got, expected, name=f"masked logits {dtype}")
            continue
        # bf16 ties at the top-p cut: the sort keeps some of the tied tokens, the threshold all.
        kept, ref_kept = got > float("-inf"), expected > float("-inf")
        assert bool((kept | ~ref_kept).all()), "a token the sort keeps was dropped"
        cut = expected.masked_fill(~ref_kept, float("inf")).amin(dim=-1, keepdim=True)
        extra = kept & ~ref_kept
        assert bool((got[extra] == cut.expand_as(got)[extra]).all()), "an extra token not tied"
