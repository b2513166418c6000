"""The engine's tensor-parallel group on the CPU (gloo): two ranks in two threads of this process.

The peer all-reduce (`ATOM_ALLREDUCE=peer`) is GPU-only (test_multi_gpu_all_reduce.py); on the
CPU the group has none,
decoder layers keep their unfused path, and `all_reduce_add_rms_norm` is gloo's all-reduce then
`fused_add_rms_norm`.
"""

from __future__ import annotations

import threading

import pytest
import torch

from atom_engine.parallel import EngineTPGroup, make_store
from atom_kernels.backends.torch.norm import fused_add_rms_norm


def _run_ranks(fn, world: int = 2) -> list:
    store = make_store(0, world)
    stores = [store] + [make_store(r, world, store.port) for r in range(1, world)]
    results, errors = [None] * world, []

    def rank(r: int) -> None:
        try:
            tp = EngineTPGroup(stores[r], r, world, torch.device("cpu"))
            results[r] = fn(tp)
            tp.close()
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_cpu_group_has_no_peer_all_reduce_and_fuses_nothing():
    def fn(tp):
        g = torch.Generator().manual_seed(tp.rank)
        x = torch.randn(3, 16, generator=g)
        residual, weight = torch.ones(3, 16), torch.full((16,), 0.5)
        out, new_residual = tp.all_reduce_add_rms_norm(x.clone(), residual, weight, 1e-6)
        return tp.peer, tp.fuses_all_reduce_norm, x, out, new_residual

    results = _run_ranks(fn)
    total = results[0][2] + results[1][2]
    want, want_residual = fused_add_rms_norm(total, torch.ones(3, 16), torch.full((16,), 0.5), 1e-6)
    for peer, fuses, _, out, new_residual in results:
        assert peer is None and not fuses
        torch.testing.assert_close(new_residual, want_residual)
        torch.testing.assert_close(out, want)


def test_peer_switch_on_the_cpu_changes_nothing(monkeypatch):
    monkeypatch.setenv("ATOM_ALLREDUCE", "peer")
    (result,) = _run_ranks(lambda tp: (tp.peer, tp.fuses_all_reduce_norm), world=1)
    assert result == (None, False)


def test_allreduce_switch_is_checked(monkeypatch):
    monkeypatch.setenv("ATOM_ALLREDUCE", "nvls")
    with pytest.raises(ValueError, match="ATOM_ALLREDUCE='nvls'"):
        EngineTPGroup(make_store(0, 1), 0, 1, torch.device("cpu"))
