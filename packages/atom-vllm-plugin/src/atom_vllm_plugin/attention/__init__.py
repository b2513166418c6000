"""ATOM's attention backend for vLLM: its registered name and class path (no vLLM import here)."""

from __future__ import annotations

ATOM_BACKEND_NAME = "ATOM"
ATOM_BACKEND_PATH = "atom_vllm_plugin.attention.backend.AtomAttentionBackend"


def ensure_backend_registered() -> None:
    """Add "ATOM" to vLLM's AttentionBackendEnum (vLLM's layer looks its backend up by name, and
    users may pass `--attention-backend ATOM`). Idempotent."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if ATOM_BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(ATOM_BACKEND_NAME, ATOM_BACKEND_PATH)
