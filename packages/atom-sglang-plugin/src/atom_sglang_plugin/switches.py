"""The environment switches users turn the plugin with (read when the hook runs).

Every ``ATOM_*`` variable the plugin reads is read here; ``TABLE`` is what docs/architecture.md
section 14 lists (packages/atom-engine/tests/test_envs.py keeps the two in step)."""

from __future__ import annotations

import os

DISABLE_PLUGIN = "ATOM_DISABLE_SGLANG_PLUGIN"
ALLOW_UNTESTED = "ATOM_SGLANG_PLUGIN_ALLOW_UNTESTED"
MODEL_IMPL = "atom"  # the `--model-impl` value that selects ATOM's models

# name -> (default, meaning)
TABLE: dict[str, tuple[str, str]] = {
    DISABLE_PLUGIN: ("off", "`1`: the SGLang plugin registers nothing"),
    ALLOW_UNTESTED: ("off", "`1`: run on an SGLang other than the tested one"),
}

_TRUE = {"1", "true", "yes", "on"}


def plugin_disabled() -> bool:
    """`ATOM_DISABLE_SGLANG_PLUGIN=1`: SGLang runs exactly as if the plugin were not installed."""
    return os.environ.get(DISABLE_PLUGIN, "").strip().lower() in _TRUE


def untested_allowed() -> bool:
    """`ATOM_SGLANG_PLUGIN_ALLOW_UNTESTED=1`: run on an SGLang version other than the tested one."""
    return os.environ.get(ALLOW_UNTESTED, "").strip().lower() in _TRUE
