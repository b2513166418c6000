"""Triton rejection sampling: exactly the torch reference's tokens for the same randomness
(greedy and random requests, one-hot and full draft distributions, requests without drafts,
vocabularies over one block)."""

import pytest
import torch

from atom_kernels.backends.torch import spec_decode as reference
from atom_kernels.testing import assert_equal


@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("vocab", [7, 300])
def test_matches_the_reference(triton_backend, with_draft_probs, vocab):
    device = triton_backend.device
    gen = torch.Generator().manual_seed(vocab)
    counts = [3, 0, 1, 4, 2, 3]
    batch, drafts_total = len(counts), sum(counts)
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    target = torch.softmax(torch.randn(drafts_total + batch, vocab, generator=gen) * 3, dim=-1)
    draft_probs = (
        torch.softmax(torch.randn(drafts_total, vocab, generator=gen) * 3, dim=-1)
        if with_draft_probs
        else None
    )
    # Drafts: often the target's argmax (accepted), sometimes not.
    rows = torch.tensor([c + i for i in range(batch) for c in range(cu[i], cu[i + 1])])
    drafts = target[rows].argmax(dim=-1)
    flip = torch.rand(drafts_total, generator=gen) < 0.4
    drafts = torch.where(flip, torch.randint(0, vocab, (drafts_total,), generator=gen), drafts)
    uniform = torch.rand(drafts_total, generator=gen)
    noise = torch.empty(batch, vocab).exponential_(generator=gen)
    greedy = torch.tensor([True, False, False, True, False, False])
    args = (target, drafts, cu, draft_probs, uniform, noise, greedy)
    expected = reference.rejection_sample(*args)
    from atom_kernels.backends.triton import spec_decode

    got = spec_decode.rejection_sample(*[a.to(device) if a is not None else None for a in args])
    assert_equal(got[0].cpu(), expected[0], name="tokens")
    assert_equal(got[1].cpu(), expected[1], name="num_emitted")
    assert (expected[1] >= 1).all() and expected[1].sum() > batch  # some drafts accepted
