"""The CPU thread choice: --num-threads, OMP_NUM_THREADS, else the cores the process may use
less one; the cgroup quota caps the affinity mask; the flag reaches torch at start-up."""

import logging

import pytest
import torch

from atom_engine import cpu_threads
from atom_engine.cli.args import engine_config_from_args
from atom_engine.cli.main import build_parser
from atom_engine.config import EngineConfig


@pytest.fixture
def cores(monkeypatch):
    """Pretend the process may run on `n` cores (affinity) with no cgroup quota."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: None)

    def set_cores(n):
        monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(n)))

    return set_cores


@pytest.mark.parametrize(("n", "tp", "expected"), [(1, 1, 1), (2, 1, 1), (8, 1, 7), (9, 2, 4)])
def test_default_leaves_one_core(cores, n, tp, expected):
    cores(n)
    threads, why = cpu_threads.choose_num_threads(None, tp)
    assert threads == expected
    assert f"{n} cores available" in why


def test_flag_then_environment_win(cores, monkeypatch):
    cores(8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads.choose_num_threads(None) == (3, "OMP_NUM_THREADS")
    assert cpu_threads.choose_num_threads(5) == (5, "--num-threads")


def test_cgroup_quota_caps_the_affinity(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_threads.cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_threads.cgroup_cpu_limit(tmp_path) is None
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: 2.5)
    assert cpu_threads.available_cpus() == 3


def test_set_cpu_threads_sets_torch_and_logs(cores, caplog):
    cores(4)
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="atom_engine"):
            assert cpu_threads.set_cpu_threads(None) == 3
        assert torch.get_num_threads() == 3
        assert "torch computes with 3 thread(s) per rank (4 cores available" in caplog.text
    finally:
        torch.set_num_threads(before)


def test_num_threads_flag():
    args = build_parser().parse_args(["serve", "--num-threads", "3"])
    assert engine_config_from_args(args).num_threads == 3
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        EngineConfig(num_threads=0)
