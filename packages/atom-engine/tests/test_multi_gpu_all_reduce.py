"""The engine's peer all-reduce (issue 36) on 2 and 4 GPUs, against NCCL and the unfused norm,
for every message size the engine sends, eagerly and inside CUDA graphs (`all_reduce_ranks.py`).

The kernel's indexing, phases and empty mark are also checked without GPUs, every rank
simulated in one process under Triton's interpreter
(packages/atom-kernels/tests/test_triton_peer_all_reduce.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RANKS = Path(__file__).with_name("all_reduce_ranks.py")


@pytest.mark.parametrize("world", [pytest.param(n, marks=pytest.mark.multi_gpu(n)) for n in (2, 4)])
def test_peer_all_reduce_matches_nccl(world):
    done = subprocess.run(
        [sys.executable, str(RANKS), str(world)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert f"world {world}: 42 message shapes checked" in done.stdout, done.stdout
