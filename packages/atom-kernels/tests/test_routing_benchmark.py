"""benchmarks/routing.py --smoke: every router's Triton kernel agrees with the torch reference
(interpreted on the CPU; the timing runs on a GPU only)."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "routing.py"


def test_routing_benchmark_smoke(tmp_path):
    out = tmp_path / "routing.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["router"] for r in rows} == {
        "qwen3-235b-a22b",
        "deepseek-v3",
        "kimi-k2",
        "gpt-oss-120b",
    }
    assert all(r["check"] == "ok" for r in rows), rows
