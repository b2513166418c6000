"""benchmarks/startup.py on the CPU (issue 41, item 4): a fresh process's start on a tiny shape,
timed from its launch, with the engine's start-up phases read from its log line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "startup.py"


@pytest.mark.slow  # a fresh engine process: ~30 s on 2 cores
def test_startup_benchmark_times_each_phase(tmp_path):
    out = tmp_path / "startup.json"
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--shape", "llama3-8b", "--tp", "1"]
    subprocess.run([*cmd, "--warm", "0", "--out", str(out)], check=True, timeout=600)
    record = json.loads(out.read_text())
    assert [run["triton_cache"] for run in record["runs"]] == ["cold"]
    for run in record["runs"]:
        assert "error" not in run, run.get("error")
        assert {"front", "load", "kv-cache"} <= set(run["phases"])
        parts = run["interpreter_s"] + run["imports_s"] + run["engine_s"] + run["first_token_s"]
        assert run["total_s"] == pytest.approx(parts, abs=1e-3)
        # the logged line's phases add up to the engine's construction, within its rounding
        assert sum(run["phases"].values()) == pytest.approx(run["engine_s"], abs=0.5)
        assert run["first_token_s"] > 0
    assert record["runs"][0]["kernels_compiled"] == 0  # the CPU path runs no Triton kernels
