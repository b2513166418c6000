"""The environment switches users turn the plugin with (read when the hook runs)."""

from __future__ import annotations

import os

DISABLE_PLUGIN = "ATOM_DISABLE_SGLANG_PLUGIN"
ALLOW_UNTESTED = "ATOM_SGLANG_PLUGIN_ALLOW_UNTESTED"
MODEL_IMPL = "atom"  # the `--model-impl` value that selects ATOM's models

_TRUE = {"1", "true", "yes", "on"}


def plugin_disabled() -> bool:
    """`ATOM_DISABLE_SGLANG_PLUGIN=1`: SGLang runs exactly as if the plugin were not installed."""
    return os.environ.get(DISABLE_PLUGIN, "").strip().lower() in _TRUE


def untested_allowed() -> bool:
    """`ATOM_SGLANG_PLUGIN_ALLOW_UNTESTED=1`: run on an SGLang version other than the tested one."""
    return os.environ.get(ALLOW_UNTESTED, "").strip().lower() in _TRUE
