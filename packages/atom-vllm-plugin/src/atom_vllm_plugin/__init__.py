"""atom-vllm-plugin: ATOM's models and attention inside vLLM, through vLLM's plugin entry points.

vLLM discovers the two hooks below from this package's entry points and calls them in every
process it starts (API server, engine core, workers), sometimes twice. Both return fast, import
heavy modules only inside, and tolerate repeated calls. `ATOM_DISABLE_VLLM_PLUGIN=1` turns both off;
`ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1` keeps ATOM's models on vLLM's own attention backends.
"""

__version__ = "0.1.0"


def register_platform() -> str | None:
    """`vllm.platform_plugins` hook: the dotted path of ATOM's platform class for this machine's
    hardware (a subclass of vLLM's CUDA, ROCm or CPU platform), or None when ATOM steps aside."""
    from atom_vllm_plugin.activation import platform_class_path

    return platform_class_path()


def register() -> None:
    """`vllm.general_plugins` hook: point vLLM's ModelRegistry at ATOM's model wrapper for every
    architecture atom-models implements, and register the ATOM attention backend name."""
    from atom_vllm_plugin.activation import register_models_and_backend

    register_models_and_backend()
