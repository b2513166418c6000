"""Runs the Triton backend's tests through Triton's CPU interpreter on machines without a GPU.

TRITON_INTERPRET=1 must be set before triton is imported (see conftest.py), so the ``test_triton_*``
files run in a child pytest process started with it; this test passes when they all pass and shows
the child's report when they do not. On a GPU the same files run directly, compiled.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]  # the workspace root, where the pytest configuration lives


def triton_test_files() -> list[str]:
    return sorted(str(p) for p in HERE.glob("test_triton_*.py") if p.name != Path(__file__).name)


NOT_HERE = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(),
    reason="the Triton tests run directly here (GPU, or already under the interpreter)",
)


def _run_child(request, capsys, slow: bool) -> None:
    """The ``test_triton_*`` files in a child pytest under the interpreter: the default selection,
    or (``slow``) only the tests slow under it (``interpreter_slow``, conftest.py). With
    ``--durations=N`` the child's slowest tests are written to the terminal too (the calling
    test's own duration is the sum of theirs)."""
    for package in ("triton", "numpy"):  # the interpreter runs kernels with numpy
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    # One interpreter thread a worker: the child's tests are single-threaded Python, so they run
    # over every core (pytest-xdist), while this process only waits for them.
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("ATOM_RUN_SLOW", None)
    workers = max(1, min(4, os.cpu_count() or 1))
    durations = request.config.getoption("durations", None)
    command = [
        sys.executable, "-m", "pytest", *triton_test_files(), "-q",
        "-m", "not gpu and slow" if slow else "not gpu", *(["--run-slow"] if slow else []),
        "-p", "no:cacheprovider", "--no-header", "-W", "ignore::RuntimeWarning",
        *(["-n", str(workers)] if workers > 1 else []),
        *([f"--durations={durations}"] if durations is not None else []),
    ]  # fmt: skip
    # A hang guard, not a time budget: the default child took ~15 min on one core of a 2-core
    # machine (2026-11-28), before it ran over both.
    child = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500, check=False
    )
    report = (child.stdout + child.stderr)[-20000:]
    assert child.returncode == 0, f"Triton tests under the interpreter failed:\n{report}"
    print(report.strip().splitlines()[-1])
    lines = child.stdout.splitlines()
    table = [i for i, line in enumerate(lines) if "slowest" in line and "durations" in line]
    if table:
        with capsys.disabled():
            print("\n(the Triton tests under the interpreter, in a child process)")
            print("\n".join(lines[table[0] :]))


@NOT_HERE
def test_triton_backend_under_the_interpreter(request, capsys):
    """Every Triton test but the ones slow under the interpreter (~7 min on 2 cores)."""
    _run_child(request, capsys, slow=False)


@NOT_HERE
@pytest.mark.slow
def test_triton_slow_tests_under_the_interpreter(request, capsys):
    """The ``interpreter_slow`` ones: statistical draws of many rows (~5 min of one core's
    interpreter time in all; compiled on a GPU they run by default)."""
    _run_child(request, capsys, slow=True)
