"""The public linear op: F.linear semantics and argument checks."""

import pytest
import torch
import torch.nn.functional as F

import atom_kernels


def test_linear_matches_functional_linear():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(5)
    assert torch.equal(atom_kernels.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(atom_kernels.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize(
    "x, w, b, message",
    [
        (torch.randn(2, 8), torch.randn(5, 7), None, "to match x's last dim"),
        (torch.randn(2, 8), torch.randn(5, 8, dtype=torch.bfloat16), None, "dtype"),
        (torch.randn(2, 8), torch.randn(5, 8), torch.randn(4), "to match weight's rows"),
        (torch.randn(2, 8), torch.randn(5, 8, 1), None, "must have 2 dims"),
        (torch.ones(2, 8, dtype=torch.int32), torch.randn(5, 8), None, "expected one of"),
    ],
)
def test_linear_rejects_bad_arguments(x, w, b, message):
    with pytest.raises(ValueError, match=message):
        atom_kernels.linear(x, w, b)
