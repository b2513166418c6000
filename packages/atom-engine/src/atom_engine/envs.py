"""Every ``ATOM_*`` environment variable atom-engine reads: one table, its defaults and meanings.

As ``atom_kernels.envs`` (whose ``Switch`` it uses): ``envs.ATOM_STEP_LOG`` or
``envs.get("ATOM_STEP_LOG")`` reads ``os.environ`` at that moment, so tests that set a variable
see it; each reader reads when it needs the value (an engine at construction, a worker at start,
the CLI when it builds its parser). docs/architecture.md section 14 lists this table
(packages/atom-engine/tests/test_envs.py keeps the two in step).
"""

from __future__ import annotations

from typing import Any

from atom_kernels.envs import Switch


def _not_zero(value: str) -> bool:  # off only for "0" (surrounding spaces ignored)
    return value.strip() != "0"


def _stripped(value: str) -> str:
    return value.strip()


def _same(value: str) -> str:
    return value


TABLE: tuple[Switch, ...] = (
    Switch(
        "ATOM_CPU_COMPILE", True, _not_zero,
        "Inductor-compiled CPU forward (`0`: it stays eager; the test suite sets it)",
    ),
    Switch(
        "ATOM_CPU_PACKED_LINEAR", True, _not_zero,
        "oneDNN-packed / transposed copies of CPU linear weights (`0`: none)",
    ),
    Switch(
        "ATOM_TP_CONNECT_TIMEOUT", 300.0, float,
        "seconds the tensor-parallel ranks wait to meet at rank 0's TCPStore (and the default of "
        "`--dist-timeout`)",
    ),
    Switch(
        "ATOM_DIST_AUTHKEY", None, _same,
        "data parallelism across nodes: the secret every node shares (the replicas' connections "
        "to node 0 are authenticated with it)",
    ),
    Switch(
        "ATOM_ALLREDUCE", "peer", _stripped,
        "tensor-parallel all-reduce on GPUs: `peer` (the one-shot kernel over peer-mapped "
        "buffers up to a measured size, NCCL for the rest and where GPUs lack peer access; see "
        "parallel.py) or `nccl` (NCCL for every message)",
    ),
    Switch(
        "ATOM_ALLREDUCE_PEER_MAX_BYTES", None, int,
        "with `ATOM_ALLREDUCE=peer`: the largest message the peer kernel takes, plain and fused "
        "(unset: parallel.py's measured limits by group size)",
    ),
    Switch(
        "ATOM_STEP_LOG", "", _stripped,
        "a path: one JSON line per synchronous engine step appended there (unset: no log)",
    ),
    Switch(
        "ATOM_TORCH_PROFILER_DIR", None, _same,
        "where `/stop_profile` writes torch.profiler traces (`--profiler-dir` wins)",
    ),
    Switch(
        "ATOM_API_KEY", None, _same,
        "default of `atom serve --api-key`",
    ),
    Switch(
        "ATOM_TEST_WORKER_FAILURE", None, _same,
        "`<rank>:<step>`: that tensor-parallel worker raises as that step starts (tests)",
    ),
)  # fmt: skip

SWITCHES: dict[str, Switch] = {s.name: s for s in TABLE}


def get(name: str) -> Any:
    """The value of switch ``name`` now (its default when unset)."""
    return SWITCHES[name].read()


def __getattr__(name: str) -> Any:
    if name in SWITCHES:
        return SWITCHES[name].read()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *SWITCHES])
