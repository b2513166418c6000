"""Rejection sampling of draft tokens (torch reference): the emitted tokens follow the target
distribution whatever the drafts are (lossless), greedy requests take the argmax, and bad
arguments are errors that name them."""

from __future__ import annotations

import pytest
import torch

import atom_kernels

P1 = torch.tensor([0.5, 0.2, 0.2, 0.1])
P2 = torch.tensor([0.1, 0.6, 0.05, 0.25])
P3 = torch.tensor([0.3, 0.3, 0.2, 0.2])
Q1 = torch.tensor([0.1, 0.1, 0.7, 0.1])
Q2 = torch.tensor([0.25, 0.25, 0.25, 0.25])


def batch(n: int, drafts: torch.Tensor, draft_probs, seed: int):
    """n requests with the same two drafting positions (targets P1, P2; bonus P3)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.stack([P1, P2, P3]).repeat(n, 1)
    cu = torch.arange(0, 2 * n + 1, 2, dtype=torch.int32)
    uniform = torch.rand(2 * n, generator=gen)
    noise = torch.empty(n, 4).exponential_(generator=gen)
    greedy = torch.zeros(n, dtype=torch.bool)
    return target, drafts, cu, draft_probs, uniform, noise, greedy


def check_distribution(counts: torch.Tensor, p: torch.Tensor, name: str) -> None:
    n = counts.sum().item()
    freq = counts.double() / n
    sigma = (p.double() * (1 - p.double()) / n).sqrt()
    assert ((freq - p).abs() <= 4.5 * sigma + 1e-9).all(), (
        f"{name}: {freq.tolist()} vs {p.tolist()}"
    )


@pytest.mark.parametrize("drafting", ["sampled-from-q", "deterministic"])
def test_emitted_tokens_follow_the_target(drafting):
    n = 20000
    gen = torch.Generator().manual_seed(1)
    if drafting == "sampled-from-q":
        x1 = torch.multinomial(Q1, n, replacement=True, generator=gen)
        x2 = torch.multinomial(Q2, n, replacement=True, generator=gen)
        drafts = torch.stack([x1, x2], dim=1).reshape(-1)
        draft_probs = torch.stack([Q1, Q2]).repeat(n, 1)
    else:  # n-gram: the same drafts every time, q one-hot
        drafts = torch.tensor([2, 1]).repeat(n)
        draft_probs = None
    out, num = atom_kernels.rejection_sample(*batch(n, drafts, draft_probs, seed=2))
    assert ((num >= 1) & (num <= 3)).all()
    first = out[:, 0]
    check_distribution(torch.bincount(first, minlength=4), P1, "first token")
    # The second token exists when the first draft was accepted, and then follows P2.
    drafts = drafts.view(n, 2)
    accepted = (num >= 2) & (first == drafts[:, 0])
    assert ((num >= 2) == (first == drafts[:, 0])).all()
    check_distribution(torch.bincount(out[accepted, 1], minlength=4), P2, "second token")
    bonus = num == 3
    assert (out[bonus, 1] == drafts[bonus, 1]).all()
    check_distribution(torch.bincount(out[bonus, 2], minlength=4), P3, "bonus token")
    assert (out[num == 1, 1:] == -1).all() and (out[num == 2, 2] == -1).all()


def test_greedy_accepts_the_argmax_prefix_and_emits_the_argmax():
    target = torch.tensor(
        [[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3]]
    )
    # request 0: drafts [1, 0] both right -> + bonus argmax(row 2) = 2
    # request 1: drafts [2] wrong (argmax 2? row 3 argmax is 2: right) -> + bonus argmax(row 4) = 1
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    drafts = torch.tensor([1, 0, 2])
    noise = torch.ones(2, 3)
    out, num = atom_kernels.rejection_sample(
        target, drafts, cu, None, torch.zeros(3), noise, torch.tensor([True, True])
    )
    assert out.tolist() == [[1, 0, 2], [2, 1, -1]] and num.tolist() == [3, 2]
    wrong = torch.tensor([0, 0, 1])  # request 0 rejected at its first draft: emits argmax 1
    out, num = atom_kernels.rejection_sample(
        target, wrong, cu, None, torch.zeros(3), noise, torch.tensor([True, True])
    )
    assert out.tolist() == [[1, -1, -1], [2, -1, -1]] and num.tolist() == [1, 1]


def test_requests_without_drafts_draw_one_token():
    target = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    cu = torch.tensor([0, 0, 0], dtype=torch.int32)
    out, num = atom_kernels.rejection_sample(
        target,
        torch.zeros(0, dtype=torch.int64),
        cu,
        None,
        torch.zeros(0),
        torch.ones(2, 3),
        torch.tensor([False, True]),
    )
    assert out.tolist() == [[1], [2]] and num.tolist() == [1, 1]


def test_bad_arguments_name_them():
    target = torch.rand(3, 5)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    drafts = torch.tensor([1, 2])
    args = dict(uniform=torch.rand(2), noise=torch.rand(1, 5), greedy=torch.tensor([False]))
    with pytest.raises(
        ValueError, match=r"one row per draft plus one per request \(2 \+ 1\), got 4"
    ):
        atom_kernels.rejection_sample(torch.rand(4, 5), drafts, cu, None, **args)
    with pytest.raises(ValueError, match=r"draft_probs must be \[2, 5\]"):
        atom_kernels.rejection_sample(target, drafts, cu, torch.rand(2, 4), **args)
    with pytest.raises(ValueError, match=r"noise must be \[1, 5\]"):
        atom_kernels.rejection_sample(
            target, drafts, cu, None, **{**args, "noise": torch.rand(2, 5)}
        )
    with pytest.raises(ValueError, match=r"greedy"):
        atom_kernels.rejection_sample(
            target, drafts, cu, None, **{**args, "greedy": torch.tensor([1])}
        )
