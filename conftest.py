"""Root pytest configuration: hardware markers, the slow-test switch, and the one fixture both
atom-models' and atom-engine's tests use (transformers' load of the bundled model).

A test marked `gpu`, `multi_gpu(n)` or `aiter` is skipped when its hardware or package is missing;
`ATOM_REQUIRE_GPU=1` (set on GPU runs) turns those skips into failures so a GPU run cannot pass by
skipping, except a `multi_gpu(n)` test on a machine with GPUs but fewer than n: one run script
serves the 2- and 4-GPU machine kinds, and the smaller one runs the cases that fit it (a machine
with no GPU at all still fails). Tests marked `slow` run only with `--run-slow` (or
`ATOM_RUN_SLOW=1`).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

# NOTE: compiling the model of a CPU engine (torch.compile, atom_engine.cpu_compile) costs ~25 s
# per engine on the 2-core CI machine with Inductor's caches warm, minutes cold; the suite builds
# dozens of engines, so they stay eager here and the compiled path is tested on its own
# (atom-engine's test_cpu_compile.py sets ATOM_CPU_COMPILE=1).
os.environ.setdefault("ATOM_CPU_COMPILE", "0")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _missing_requirement(item: pytest.Item) -> tuple[str, bool] | None:
    """Why this test's hardware or package is missing, and whether ATOM_REQUIRE_GPU=1 fails it
    (False: a smaller machine kind, see the module docstring); None when it can run."""
    if item.get_closest_marker("gpu") and _gpu_count() < 1:
        return "needs a GPU", True
    multi = item.get_closest_marker("multi_gpu")
    if multi:
        needed = int(multi.args[0]) if multi.args else 2
        found = _gpu_count()
        if found < needed:
            return f"needs {needed} GPUs, found {found}", found == 0
    if item.get_closest_marker("aiter"):
        import torch

        if torch.version.hip is None or importlib.util.find_spec("aiter") is None:
            return "needs ROCm with AITER installed", True
    return None


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' own float32 load of the bundled SmolLM2 GGUF file (eval mode): the reference
    of atom-models' and atom-engine's tests, loaded once for both.

    NOTE: the load de-quantizes the GGUF file in Python: 32 s of CPU time (405 s of wall time at
    load 15 on the 2-core machine)."""
    from atom_models.bundled import smollm2_gguf_path
    from atom_models.testing import transformers_gguf_model

    return transformers_gguf_model(smollm2_gguf_path())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest test goes first: the Triton tests under the interpreter, one test that runs a
    child pytest over every core (test_triton_interpreter.py; ~12 min on 2 cores). Under
    pytest-xdist (the README's `-n 2 --dist loadfile`) its worker starts it at once and the other
    worker takes the remaining files beside it, instead of the child running alone at the end."""
    items.sort(key=lambda item: item.name != "test_triton_backend_under_the_interpreter")


def pytest_runtest_setup(item: pytest.Item) -> None:
    missing = _missing_requirement(item)
    if missing is not None:
        reason, required = missing
        if required and os.environ.get("ATOM_REQUIRE_GPU") == "1":
            pytest.fail(f"ATOM_REQUIRE_GPU=1 but this test {reason}", pytrace=False)
        pytest.skip(reason)
    if item.get_closest_marker("slow") and not (
        item.config.getoption("--run-slow") or os.environ.get("ATOM_RUN_SLOW") == "1"
    ):
        pytest.skip("slow: run with --run-slow or ATOM_RUN_SLOW=1")


@pytest.fixture(autouse=True)
def _triton_counters_zero(request: pytest.FixtureRequest):
    """After every GPU test: the Triton kernels' shared tile counters (``zeroed_counters``) are
    all back to zero. Each kernel that counts its programs in resets its counters; one left
    non-zero makes the next kernel on that counter merge too early (wrong values, or a garbage
    token id from the greedy argmax), so the test that left it is named here."""
    yield
    if not request.node.get_closest_marker("gpu"):
        return
    import sys

    common = sys.modules.get("atom_kernels.backends.triton.common")
    if common is None:
        return
    import torch

    buffers = [*common._COUNTERS.values(), *common._RETIRED_COUNTERS]
    if not buffers:
        return
    torch.cuda.synchronize()
    for buf in buffers:
        nonzero = torch.nonzero(buf).flatten()
        if nonzero.numel():
            where = nonzero[:16].tolist()
            values = buf[nonzero[:16]].tolist()
            buf.zero_()  # the next test starts clean
            pytest.fail(
                f"Triton tile counters left non-zero on {buf.device}: indices {where} "
                f"values {values} ({nonzero.numel()} in all)",
                pytrace=False,
            )
