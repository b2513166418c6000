"""The one-shot peer all-reduce kernel (`atom_kernels.collectives`) against its PyTorch
reference, with every rank of a world simulated in one process (interpreted on the CPU, compiled
on one GPU; the real multi-GPU run is benchmarks/allreduce.py and the engine's GPU tests).

The ranks' kernels run one after the other. Before rank r runs, the test writes the rows of the
ranks after it into r's buffer (their pushes, not made yet); the ranks before it pushed theirs
when they ran. Afterwards r's own slots must be empty again, and what r pushed into the ranks
already done must be its rows (then emptied by the test: in a real run they arrive before those
ranks read). What is tested: where each row goes, the three phases in turn, the empty mark (never
sent, restored after reading), the sum in rank order (the same bits on every rank) and the fused
residual + RMSNorm.
"""

import pytest
import torch

from atom_kernels.backends.torch import norm as reference
from atom_kernels.backends.triton.peer_all_reduce import EMPTY16, EMPTY32, PHASES
from atom_kernels.collectives import PeerAllReduce, reference_all_reduce_add_rms_norm
from atom_kernels.testing import assert_close, assert_equal, tolerances

MAX_BYTES = 1 << 14


def _world(world: int, device) -> list[PeerAllReduce]:
    buffers = [PeerAllReduce.empty_buffer(world, MAX_BYTES, device) for _ in range(world)]
    return [PeerAllReduce(r, world, buffers, MAX_BYTES) for r in range(world)]


def _slots(group: PeerAllReduce, dtype: torch.dtype) -> torch.Tensor:
    """Rank `group.rank`'s own buffer as [PHASES, W, slot elements] of `dtype`."""
    return group.buffers[group.rank].view(dtype).view(PHASES, group.world, -1)


def _sent(part: torch.Tensor) -> torch.Tensor:
    """A row as the kernel sends it: the empty mark replaced (16 bits: by +0.0; 32: by -0.0)."""
    if part.element_size() == 2:
        bits = part.view(torch.int16)
        return torch.where(bits == -(1 << 15), 0, bits).view(part.dtype)
    bits = part.view(torch.int32)
    return torch.where(bits == EMPTY32, -(1 << 31), bits).view(part.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _owner_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Two-shot: the rows as their owners send them (the fp32 sum in rank order, rounded, the
    mark replaced)."""
    return _sent(sum(_sent(p).float() for p in parts).to(parts[0].dtype))


def _run_round(ranks, parts, phase, call, two_shot=False):
    """Every rank's call in turn, the pushes of the ranks not run yet written by the test."""
    world, results = len(ranks), []
    rows, n = parts[0].shape[0], parts[0].shape[1]
    owner = [r * world // rows for r in range(rows)]
    sums = _owner_sum(parts)
    for group, part in zip(ranks, parts, strict=True):
        r = group.rank
        slots = _slots(group, part.dtype)
        for s in range(r + 1, world):
            if not two_shot:
                slots[phase, s, : part.numel()] = _sent(parts[s]).flatten()
                continue
            for row in range(rows):
                at = slice(row * n, (row + 1) * n)
                if owner[row] == r:  # s's row for me to sum
                    slots[phase, s, at] = _sent(parts[s][row])
                elif owner[row] == s:  # s's sum of its row
                    slots[phase, s, at] = sums[row]
        results.append(call(group, part))
        empty = _slots(group, torch.int32)[phase].flatten()
        assert (empty == EMPTY32).all(), f"rank {r} left its phase-{phase} slots not empty"
        for done in ranks[:r]:  # what r pushed to a rank already done: check, then empty it
            pushed = _slots(done, part.dtype)[phase, r]
            for row in range(rows):
                at = slice(row * n, (row + 1) * n)
                if not two_shot:
                    want = _sent(part[row])
                elif owner[row] == done.rank:
                    want = _sent(part[row])  # r's row for `done` to sum
                elif owner[row] == r:
                    want = sums[row]  # r's sum of its row
                else:
                    want = None  # never sent there
                got = _bits(pushed[at])
                if want is None:
                    assert (got == (EMPTY16 if part.element_size() == 2 else EMPTY32)).all()
                else:
                    assert_equal(got, _bits(want.to(got.device)),
                                 name=f"rank {r}'s row {row} at rank {done.rank}")  # fmt: skip
            _slots(done, torch.int32)[phase] = EMPTY32
    for group in ranks:
        assert group.counter.tolist() == [(phase + 1) % PHASES, 0]
    return results


def _parts(world, rows, cols, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    parts = [(torch.randn(rows, cols, generator=g) * 2).to(dtype) for _ in range(world)]
    parts[0][0, :2] = -0.0  # the 16-bit mark's bits: sent as +0.0
    if dtype == torch.float32:  # the 32-bit mark's bits (a denormal): sent as -0.0
        parts[-1].view(torch.int32)[-1, -1] = EMPTY32
    return [p.to(device) for p in parts]


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
@pytest.mark.parametrize("two_shot", [False, True])
def test_all_reduce_add_rms_norm(triton_backend, world, dtype, rows, cols, two_shot):
    device = triton_backend.device
    ranks = _world(world, device)
    g = torch.Generator().manual_seed(1)
    weight = (torch.rand(cols, generator=g) + 0.5).to(dtype).to(device)
    for count in range(PHASES + 1):  # every phase, then the first again
        parts = _parts(world, rows, cols, dtype, device, seed=count)
        residual = _parts(1, rows, cols, dtype, device, seed=100 + count)[0]
        expected, expected_residual = reference_all_reduce_add_rms_norm(
            [_sent(p) for p in parts], residual, weight, 1e-6
        )
        results = _run_round(
            ranks,
            parts,
            count % PHASES,
            lambda group, part, residual=residual: group.all_reduce_add_rms_norm(
                part.clone(), residual, weight, 1e-6, two_shot=two_shot
            ),
            two_shot,
        )
        atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else tolerances(dtype)
        for out, new_residual in results:
            assert_equal(new_residual, expected_residual, name="residual")
            assert_close(out, expected, atol=atol, rtol=rtol, name="normed")
            assert_equal(out, results[0][0], name="the same bits on every rank")


@pytest.mark.parametrize(("world", "two_shot"), [(2, False), (8, False), (4, True)])
def test_all_reduce(triton_backend, world, two_shot):
    device = triton_backend.device
    ranks = _world(world, device)
    for count in range(2):  # a message of another shape and dtype in the next phase
        dtype, shape = (torch.float32, (2, 48)) if count == 0 else (torch.bfloat16, (5, 40))
        parts = _parts(world, *shape, dtype, device, seed=5 + count)
        expected = sum(_sent(p).float() for p in parts).to(dtype)
        copies = [p.clone() for p in parts]
        results = _run_round(
            ranks,
            copies,
            count,
            lambda group, part: group.all_reduce(part, two_shot=two_shot),
            two_shot,
        )
        for out, x, part in zip(results, copies, parts, strict=True):
            assert_equal(out, expected, name="sum")
            assert_equal(x, part, name="x unchanged")


def test_fits(triton_backend):
    device = triton_backend.device
    group = PeerAllReduce(0, 2, [PeerAllReduce.empty_buffer(2, 4096, device)] * 2, 4096)
    cuda = device.type == "cuda"
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


def test_each_slot_form(triton_backend, monkeypatch):
    """The first one-shot form (one slot polled at a time, kept for benchmarks/allreduce.py's
    A/B) sums the same."""
    from atom_kernels.backends.triton import peer_all_reduce

    monkeypatch.setattr(peer_all_reduce, "EACH_SLOT", True)
    test_all_reduce(triton_backend, 4, False)
