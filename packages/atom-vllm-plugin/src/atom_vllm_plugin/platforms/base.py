"""The one thing ATOM's platforms change: which attention backend vLLM's attention layers get.

Mixed in before a vLLM platform class (`class AtomCpuPlatform(AtomPlatformMixin, CpuPlatform)`),
so everything else (device, identity, memory, communicators) is the parent's.
"""

from __future__ import annotations

import inspect
from typing import Any

from atom_vllm_plugin.attention import ATOM_BACKEND_NAME, ATOM_BACKEND_PATH
from atom_vllm_plugin.handback import handed_back_reason
from atom_vllm_plugin.log import flush_pending, info_once
from atom_vllm_plugin.switches import (
    CPU_ATTENTION,
    DISABLE_ATTENTION,
    attention_disabled,
    cpu_attention_wanted,
)


def describe_layer(cfg: Any) -> str:
    """A short description of an attention layer configuration for log lines."""
    dtype = str(cfg.dtype).removeprefix("torch.")
    window = ", sliding window" if getattr(cfg, "has_sliding_window", False) else ""
    sinks = ", sinks" if getattr(cfg, "has_sink", False) else ""
    return (
        f"head_size={cfg.head_size} dtype={dtype} kv_cache_dtype={cfg.kv_cache_dtype or 'auto'}"
        f"{window}{sinks}"
    )


CPU_DEFAULT_REASON = (
    "the default on a CPU platform, where vLLM's CPU attention is faster than ATOM's; "
    f"{CPU_ATTENTION}=1 or --attention-backend ATOM selects ATOM's"
)


class AtomPlatformMixin:
    """ATOM's attention backend for the layer configurations it supports, the parent's otherwise."""

    @classmethod
    def get_attn_backend_cls(
        cls, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None
    ) -> str:
        reason = cls.atom_attention_unsupported(selected_backend, attn_selector_config)
        layer = describe_layer(attn_selector_config)
        if reason is None:
            from atom_vllm_plugin.attention import ensure_backend_registered

            ensure_backend_registered()
            info_once(
                "attention backend ATOM (atom_kernels %s kernels) for %s",
                cls.atom_kernel_backend(),
                layer,
            )
            return ATOM_BACKEND_PATH
        path = super().get_attn_backend_cls(  # type: ignore[misc]
            selected_backend, attn_selector_config, num_heads
        )
        info_once("attention backend %s (vLLM's) for %s: %s", path.rsplit(".", 1)[1], layer, reason)
        return path

    @classmethod
    def atom_attention_unsupported(
        cls, selected_backend: Any, attn_selector_config: Any
    ) -> str | None:
        """Why ATOM's backend does not take this layer, or None when it does."""
        if attention_disabled():
            return f"{DISABLE_ATTENTION}=1"
        handed_back = handed_back_reason()
        if handed_back is not None:
            return f"the model is vLLM's own (ATOM does not support {handed_back})"
        name = getattr(selected_backend, "name", None)
        if name is not None and name != ATOM_BACKEND_NAME:
            return f"the {name} attention backend was requested"
        if name is None and cls.cpu_default_to_vllm_attention():
            return CPU_DEFAULT_REASON
        from atom_vllm_plugin.attention.backend import AtomAttentionBackend

        # vLLM's own validation, on ATOM's declared capabilities. Fields a newer vLLM adds to the
        # selector config and that this vLLM's validate_configuration does not know are dropped.
        accepted = inspect.signature(AtomAttentionBackend.validate_configuration).parameters
        fields = {k: v for k, v in attn_selector_config._asdict().items() if k in accepted}
        reasons = AtomAttentionBackend.validate_configuration(
            **fields,
            device_capability=cls.get_device_capability(),  # type: ignore[attr-defined]
        )
        return "; ".join(reasons) if reasons else None

    @classmethod
    def cpu_default_to_vllm_attention(cls) -> bool:
        """On a CPU platform vLLM's own attention is the default: ATOM's CPU attention (a
        per-sequence loop) is slower than vLLM's CPU kernels for now. ATOM's stays selectable."""
        return getattr(cls, "device_type", None) == "cpu" and not cpu_attention_wanted()

    @classmethod
    def log_warnings(cls) -> None:
        # vLLM calls this once its logging is configured: print the lines the hooks logged before.
        flush_pending()
        super().log_warnings()  # type: ignore[misc]

    @classmethod
    def atom_kernel_backend(cls) -> str:
        import atom_kernels

        return atom_kernels.current_backend(cls.device_type)  # type: ignore[attr-defined]
