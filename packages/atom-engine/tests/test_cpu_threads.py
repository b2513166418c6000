"""The CPU thread choice: --num-threads, OMP_NUM_THREADS, else the cores the process may use (all
for a batched step, one fewer for a one-token step); the cgroup quota caps the affinity mask; the
flag reaches torch at start-up and each step runs under its own count."""

import logging

import pytest
import torch

from atom_engine import SamplingParams, cpu_threads
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


@pytest.mark.parametrize(
    ("n", "tp", "single", "batched"),
    [(1, 1, 1, 1), (2, 1, 1, 2), (8, 1, 7, 8), (9, 2, 4, 4), (2, 2, 1, 1)],
)
def test_default_leaves_one_core_to_one_token_steps(cores, n, tp, single, batched):
    cores(n)
    threads, why = cpu_threads.choose_num_threads(None, tp)
    assert threads == cpu_threads.CpuThreads(single, batched)
    assert (threads.for_tokens(1), threads.for_tokens(2), threads.for_tokens(300)) == (
        single,
        batched,
        batched,
    )
    assert f"{n} cores available" in why


def test_flag_then_environment_win_for_every_step(cores, monkeypatch):
    cores(8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    fixed = cpu_threads.CpuThreads(3, 3)
    assert cpu_threads.choose_num_threads(None) == (fixed, "OMP_NUM_THREADS")
    assert cpu_threads.choose_num_threads(5) == (cpu_threads.CpuThreads(5, 5), "--num-threads")


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
            threads = cpu_threads.set_cpu_threads(None)
        assert threads == cpu_threads.CpuThreads(3, 4)
        assert torch.get_num_threads() == 3
        assert "3 thread(s) per rank for one-token steps and 4 for larger" in caplog.text
        assert "(4 cores available" in caplog.text
        threads.apply(17)
        assert torch.get_num_threads() == 4
        threads.apply(1)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_each_step_runs_under_its_count(smollm2_llm):
    """The runner sets the count before each forward: a prefill and a batched decode under
    `batched`, a decode of one sequence under `single`."""
    runner = smollm2_llm.engine.runner
    forward, saved = runner.forward, runner.cpu_threads
    seen = []

    def recording_forward(ids, positions):
        seen.append((len(ids), torch.get_num_threads()))
        return forward(ids, positions)

    before = torch.get_num_threads()
    runner.forward, runner.cpu_threads = recording_forward, cpu_threads.CpuThreads(1, 2)
    try:
        params = SamplingParams(temperature=0, max_tokens=3)
        smollm2_llm.generate(["Hello there", "One, two,"], params, use_tqdm=False)
        smollm2_llm.generate(["Hello there"], params, use_tqdm=False)
    finally:
        runner.forward, runner.cpu_threads = forward, saved
        torch.set_num_threads(before)
    assert seen, "no step ran through the runner's forward"
    assert all(threads == (1 if tokens == 1 else 2) for tokens, threads in seen), seen
    assert {tokens > 1 for tokens, _ in seen} == {True, False}, seen


def test_num_threads_flag():
    args = build_parser().parse_args(["serve", "--num-threads", "3"])
    assert engine_config_from_args(args).num_threads == 3
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        EngineConfig(num_threads=0)
