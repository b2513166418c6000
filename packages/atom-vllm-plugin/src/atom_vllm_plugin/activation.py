"""What the two entry-point hooks do: decide whether ATOM takes part, pick the platform, register.

Nothing here imports vLLM at module level; vLLM is imported inside the functions, which only run
when vLLM calls the hooks.
"""

from __future__ import annotations

import functools

from atom_vllm_plugin.compat import untested_warning, version_problem
from atom_vllm_plugin.log import info_once, warning_once
from atom_vllm_plugin.switches import DISABLE_PLUGIN, attention_disabled, plugin_disabled

MODEL_WRAPPER = "atom_vllm_plugin.model:AtomForCausalLM"

# vLLM's platform for this hardware -> ATOM's subclass of it (one module per parent, because each
# parent module imports hardware-specific code).
ATOM_PLATFORMS = {
    "vllm.platforms.cuda.CudaPlatform": "atom_vllm_plugin.platforms.cuda.AtomCudaPlatform",
    "vllm.platforms.rocm.RocmPlatform": "atom_vllm_plugin.platforms.rocm.AtomRocmPlatform",
    "vllm.platforms.cpu.CpuPlatform": "atom_vllm_plugin.platforms.cpu.AtomCpuPlatform",
    "vllm.platforms.zen_cpu.ZenCpuPlatform": (
        "atom_vllm_plugin.platforms.zen_cpu.AtomZenCpuPlatform"
    ),
}


def step_aside_reason() -> str | None:
    """Why ATOM takes no part in this vLLM process, or None when it does."""
    if plugin_disabled():
        return f"{DISABLE_PLUGIN}=1"
    return version_problem()


def log_step_aside(what: str, reason: str) -> None:
    """Say that ATOM steps aside: INFO when the user asked for it (`ATOM_DISABLE_VLLM_PLUGIN=1`),
    a WARNING otherwise (an untested vLLM, unknown hardware), so it is not missed in the log."""
    log = info_once if reason == f"{DISABLE_PLUGIN}=1" else warning_once
    log("%s: %s", what, reason)


def detect_parent_platform() -> tuple[str | None, str]:
    """(vLLM's own platform class path for this hardware or None, how it was decided).

    Uses vLLM's built-in detection functions, so ATOM's choice is exactly the platform vLLM would
    have picked without the plugin.
    """
    from vllm.platforms import builtin_platform_plugins

    found: dict[str, str] = {}
    for name, detect in builtin_platform_plugins.items():
        try:
            path = detect()
        except Exception:  # noqa: BLE001 - vLLM's own detection treats errors as "absent"
            path = None
        if path:
            found[name] = path
    if len(found) != 1:
        return None, f"vLLM's hardware detection found {sorted(found) or 'no platform'}"
    ((name, path),) = found.items()
    return path, f"vLLM detected {name}"


@functools.cache
def platform_class_path() -> str | None:
    """ATOM's platform class path, or None (with a log line saying why) when ATOM steps aside.

    Cached: vLLM calls the platform hook twice per process (detection, then activation).
    """
    reason = step_aside_reason()
    if reason is not None:
        log_step_aside("stepping aside, vLLM runs without ATOM", reason)
        return None
    parent, how = detect_parent_platform()
    atom = ATOM_PLATFORMS.get(parent or "")
    if atom is None:
        log_step_aside("stepping aside, no ATOM platform for this hardware", how)
        return None
    warning = untested_warning()
    if warning:
        warning_once(warning)
    info_once("platform %s, a subclass of %s (%s)", atom.rsplit(".", 1)[1], parent, how)
    return atom


def register_models_and_backend() -> None:
    """Point vLLM's ModelRegistry at ATOM's wrapper for every atom-models architecture.

    Idempotent: registering an architecture again overwrites it with the same wrapper.
    """
    reason = step_aside_reason()
    if reason is not None:
        log_step_aside("not registering ATOM models (vLLM's own are used)", reason)
        return
    from vllm import ModelRegistry

    from atom_models import supported_architectures

    architectures = supported_architectures()
    for arch in architectures:
        ModelRegistry.register_model(arch, MODEL_WRAPPER)
    info_once(
        "registered ATOM models for %s (vLLM's own implementations of these are replaced)",
        ", ".join(architectures),
    )
    if attention_disabled():
        info_once("ATOM attention disabled (ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1)")
        return
    from atom_vllm_plugin.attention import ensure_backend_registered

    ensure_backend_registered()
