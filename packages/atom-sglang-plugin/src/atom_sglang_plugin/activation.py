"""What the entry-point hook does: give `--model-impl atom` a meaning through SGLang's hooks.

SGLang 0.5.23 accepts any `--model-impl` string but only acts on its own values. The plugin
registers one AROUND hook (SGLang's `HookRegistry`, applied by SGLang's `load_plugins`) on
`sglang.srt.model_loader.utils.get_model_architecture`, the function SGLang's model loaders ask
for the model class: when `model_config.model_impl == "atom"` and atom-models implements the
checkpoint's architecture, it answers ATOM's wrapper; otherwise it calls SGLang's own lookup
unchanged. No SGLang file is modified. Nothing here imports SGLang at module level.
"""

from __future__ import annotations

from typing import Any

from atom_sglang_plugin.compat import untested_warning, version_problem
from atom_sglang_plugin.log import info_once, warning_once
from atom_sglang_plugin.switches import DISABLE_PLUGIN, MODEL_IMPL, plugin_disabled

HOOK_TARGET = "sglang.srt.model_loader.utils.get_model_architecture"
_registered = False


def install_model_selection() -> None:
    """Register the model-selection hook with SGLang's `HookRegistry` (once per process).

    SGLang's `load_plugins()` applies registered hooks right after running the plugins; a caller
    that runs this outside `load_plugins` applies them with `HookRegistry.apply_hooks()`.
    """
    global _registered
    if plugin_disabled():
        info_once("not registering ATOM models: %s=1", DISABLE_PLUGIN)
        return
    if _registered:
        return
    problem = version_problem()
    if problem is not None:
        warning_once("stepping aside, SGLang runs without ATOM: %s", problem)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    warning = untested_warning()
    if warning:
        warning_once(warning)
    HookRegistry.register(HOOK_TARGET, select_model_architecture, HookType.AROUND)
    _registered = True
    from atom_models import supported_architectures

    info_once(
        "--model-impl %s selects ATOM's models for %s",
        MODEL_IMPL,
        ", ".join(supported_architectures()),
    )


def wants_atom(model_config: Any) -> bool:
    """Whether SGLang's model config asks for ATOM's implementation (`--model-impl atom`)."""
    impl = getattr(model_config, "model_impl", None)
    impl = getattr(impl, "value", impl)  # a str, or one of SGLang's ModelImpl members
    return isinstance(impl, str) and impl.strip().lower() == MODEL_IMPL


def select_model_architecture(original, model_config, *args, **kwargs):
    """AROUND hook on SGLang's `get_model_architecture(model_config) -> (class, arch name)`."""
    if not wants_atom(model_config):
        return original(model_config, *args, **kwargs)
    from atom_models import supported_architectures

    supported = set(supported_architectures())
    architectures = list(getattr(model_config.hf_config, "architectures", None) or [])
    arch = next((a for a in architectures if a in supported), None)
    if arch is None:
        warning_once(
            "--model-impl atom: ATOM implements none of %s; SGLang's own lookup decides",
            architectures,
        )
        return original(model_config, *args, **kwargs)
    from sglang.srt.configs.model_config import ModelImpl

    from atom_sglang_plugin.model import AtomForCausalLM

    # What SGLang's own lookup records; ATOM's wrapper obeys SGLang's native model contract.
    model_config._resolved_model_arch = arch
    model_config._resolved_model_impl = ModelImpl.SGLANG
    info_once("--model-impl atom: %s runs ATOM's model implementation", arch)
    return AtomForCausalLM, arch
