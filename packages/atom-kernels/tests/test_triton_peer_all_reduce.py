"""The one-shot peer all-reduce kernel (`atom_kernels.collectives`) against its PyTorch
reference, with every rank of a world simulated in one process (interpreted on the CPU, compiled
on one GPU; the real multi-GPU run is benchmarks/allreduce.py and the engine's GPU tests).

The ranks' kernels run one after the other, so the barrier is pre-satisfied: before a round
every rank's staging half holds its rows and every flag a value past the round's count. What is
tested: indexing, the buffer halves alternating with the call count, the flags each rank raises,
the sum in rank order (the same bits on every rank) and the fused residual + RMSNorm.
"""

import pytest
import torch

from atom_kernels.backends.torch import norm as reference
from atom_kernels.collectives import (
    MAX_PROGRAMS,
    PeerAllReduce,
    reference_all_reduce_add_rms_norm,
)
from atom_kernels.testing import assert_close, assert_equal, tolerances

PASSED = 2**30  # a flag value every wait accepts


def _world(world: int, max_bytes: int, device) -> list[PeerAllReduce]:
    buffers = [torch.zeros(2 * max_bytes // 4, device=device) for _ in range(world)]
    flags = [
        torch.zeros(MAX_PROGRAMS * world, dtype=torch.int32, device=device) for _ in range(world)
    ]
    return [PeerAllReduce(r, world, buffers, flags, max_bytes) for r in range(world)]


def _stage(ranks: list[PeerAllReduce], parts: list[torch.Tensor], count: int) -> None:
    """What the ranks' copies and flags would hold once all reached round `count`'s barrier."""
    for group, part in zip(ranks, parts, strict=True):
        half = group.half * 4 // part.element_size()
        view = group.buffers[group.rank].view(part.dtype)
        start = (count & 1) * half
        view[start : start + part.numel()] = part.flatten()
        group.flags[group.rank].fill_(PASSED)


def _parts(world, rows, cols, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, cols, generator=g) * 2).to(dtype).to(device) for _ in range(world)]


# 4 programs on the CPU: 9 rows loop (rows 0, 4, 8 in program 0). Kept few: the interpreter runs
# every rank's kernel in turn (the whole suite's interpreter child has a time limit).
@pytest.mark.parametrize(
    ("world", "dtype", "rows", "cols"),
    [
        (2, torch.float32, 1, 64),
        (2, torch.bfloat16, 9, 32),
        (4, torch.bfloat16, 3, 100),
        (8, torch.float32, 9, 32),
    ],
)
def test_all_reduce_add_rms_norm(triton_backend, world, dtype, rows, cols):
    device = triton_backend.device
    ranks = _world(world, 1 << 16, device)
    g = torch.Generator().manual_seed(1)
    weight = (torch.rand(cols, generator=g) + 0.5).to(dtype).to(device)
    for count in (1, 2, 3):  # both halves of the staging buffer, then the first again
        parts = _parts(world, rows, cols, dtype, device, seed=count)
        residual = _parts(1, rows, cols, dtype, device, seed=100 + count)[0]
        _stage(ranks, parts, count)
        expected, expected_residual = reference_all_reduce_add_rms_norm(
            parts, residual, weight, 1e-6
        )
        results = [
            group.all_reduce_add_rms_norm(part.clone(), residual, weight, 1e-6)
            for group, part in zip(ranks, parts, strict=True)
        ]
        atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else tolerances(dtype)
        for out, new_residual in results:
            assert_equal(new_residual, expected_residual, name="residual")
            assert_close(out, expected, atol=atol, rtol=rtol, name="normed")
            assert_equal(out, results[0][0], name="the same bits on every rank")
        programs = min(rows, ranks[0].max_programs)
        for group in ranks:  # each rank's programs raised their flags, at this count, everywhere
            for peer in ranks:
                raised = peer.flags[peer.rank].view(MAX_PROGRAMS, world)[:programs, group.rank]
                assert (raised == count).all()
            counters = group.counters
            assert (counters[:programs] == count).all() and not counters[programs:].any()


@pytest.mark.parametrize("world", [2, 8])
def test_all_reduce(triton_backend, world):
    device = triton_backend.device
    ranks = _world(world, 1 << 16, device)
    parts = _parts(world, 2, 48, torch.float32, device, seed=5)
    _stage(ranks, parts, 1)
    expected = sum(p for p in parts)
    for group, part in zip(ranks, parts, strict=True):
        x = part.clone()
        assert_close(group.all_reduce(x), expected, atol=1e-5, rtol=1e-5, name="sum")
        assert_equal(x, part, name="x unchanged")


def test_fits(triton_backend):
    group = _world(2, 4096, triton_backend.device)[0]
    cuda = triton_backend.device.type == "cuda"
    x = torch.zeros(2, 1024, dtype=torch.bfloat16, device=triton_backend.device)
    assert group.fits(x) == cuda  # 4 KB
    assert not group.fits(torch.zeros(3, 1024, dtype=torch.bfloat16))  # over max_bytes / on CPU
    assert not group.fits(x.t())  # not contiguous
    assert not group.fits(x.to(torch.int32))


def test_reference_matches_unfused():
    parts = [torch.randn(2, 16) for _ in range(3)]
    residual, weight = torch.randn(2, 16), torch.rand(16) + 0.5
    out, new_residual = reference_all_reduce_add_rms_norm(parts, residual, weight, 1e-6)
    total = parts[0] + parts[1] + parts[2]
    assert_close(new_residual, total + residual, atol=1e-6, rtol=1e-6)
    assert_close(out, reference.rms_norm(total + residual, weight, 1e-6), atol=1e-5, rtol=1e-5)
