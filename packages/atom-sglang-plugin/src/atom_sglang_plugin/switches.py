"""The environment switch users turn the plugin off with (read when the hook runs)."""

from __future__ import annotations

import os

DISABLE_PLUGIN = "ATOM_DISABLE_SGLANG_PLUGIN"
MODEL_IMPL = "atom"  # the `--model-impl` value that selects ATOM's models

_TRUE = {"1", "true", "yes", "on"}


def plugin_disabled() -> bool:
    """`ATOM_DISABLE_SGLANG_PLUGIN=1`: SGLang runs exactly as if the plugin were not installed."""
    return os.environ.get(DISABLE_PLUGIN, "").strip().lower() in _TRUE
