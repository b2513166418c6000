"""The environment switches users turn the plugin with (read when a hook runs, never cached).

Every ``ATOM_*`` variable the plugin reads is read here; ``TABLE`` is what docs/architecture.md
section 14 lists (packages/atom-engine/tests/test_envs.py keeps the two in step)."""

from __future__ import annotations

import os

DISABLE_PLUGIN = "ATOM_DISABLE_VLLM_PLUGIN"
DISABLE_ATTENTION = "ATOM_DISABLE_VLLM_PLUGIN_ATTENTION"
ALLOW_UNTESTED = "ATOM_VLLM_PLUGIN_ALLOW_UNTESTED"
CPU_ATTENTION = "ATOM_VLLM_PLUGIN_CPU_ATTENTION"
COMPILE = "ATOM_VLLM_PLUGIN_COMPILE"
CPU_GEMM = "ATOM_VLLM_PLUGIN_CPU_GEMM"

# name -> (default, meaning)
TABLE: dict[str, tuple[str, str]] = {
    DISABLE_PLUGIN: ("off", "`1`: vLLM runs as if the plugin were absent"),
    DISABLE_ATTENTION: ("off", "`1`: ATOM's models on vLLM's own attention backends"),
    ALLOW_UNTESTED: ("off", "`1`: run on a vLLM outside the tested range"),
    CPU_ATTENTION: ("off", "`1`: ATOM's attention on vLLM's CPU platform too"),
    COMPILE: ("on", "`1` / `0`: compile ATOM's model with vLLM's `torch.compile` / never"),
    CPU_GEMM: ("on", "`0`: `atom_kernels.linear` instead of vLLM's prepacked CPU GEMM"),
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def is_set(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def plugin_disabled() -> bool:
    """`ATOM_DISABLE_VLLM_PLUGIN=1`: vLLM runs exactly as if the plugin were not installed."""
    return is_set(DISABLE_PLUGIN)


def attention_disabled() -> bool:
    """`ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1`: ATOM's models, vLLM's own attention backends."""
    return is_set(DISABLE_ATTENTION)


def untested_allowed() -> bool:
    """`ATOM_VLLM_PLUGIN_ALLOW_UNTESTED=1`: run on a vLLM version outside the tested range."""
    return is_set(ALLOW_UNTESTED)


def cpu_attention_wanted() -> bool:
    """`ATOM_VLLM_PLUGIN_CPU_ATTENTION=1`: ATOM's attention on a CPU platform too (the default
    there is vLLM's own CPU attention, which is faster than ATOM's CPU path for now)."""
    return is_set(CPU_ATTENTION)


def vllm_cpu_gemm_wanted() -> bool:
    """`ATOM_VLLM_PLUGIN_CPU_GEMM` (default on): on a CPU platform ATOM's unquantized linear
    layers run vLLM's prepacked CPU GEMM (`cpu_gemm`); 0 keeps `atom_kernels.linear`."""
    return os.environ.get(CPU_GEMM, "").strip().lower() not in _FALSE


def compile_wanted(default: bool) -> bool:
    """`ATOM_VLLM_PLUGIN_COMPILE`: 1 compiles ATOM's model with vLLM's torch.compile (when vLLM's
    compilation mode compiles at all), 0 never; unset: `default` (on, see `model`)."""
    value = os.environ.get(COMPILE, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    return default
