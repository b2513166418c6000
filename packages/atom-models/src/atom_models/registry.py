"""Hugging Face `architectures` names -> ATOM model classes (imported lazily)."""

from __future__ import annotations

import importlib

from torch import nn

_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("atom_models.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("atom_models.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("atom_models.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("atom_models.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("atom_models.models.mixtral", "MixtralForCausalLM"),
    "DeepseekV2ForCausalLM": ("atom_models.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("atom_models.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "Glm4MoeForCausalLM": ("atom_models.models.glm4_moe", "Glm4MoeForCausalLM"),
    "GptOssForCausalLM": ("atom_models.models.gpt_oss", "GptOssForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def get_model_class(architectures: list[str] | str | None) -> type[nn.Module]:
    """The ATOM class for the first supported name in an HF config's `architectures`."""
    names = [architectures] if isinstance(architectures, str) else list(architectures or [])
    for name in names:
        if name in _ARCHITECTURES:
            module, cls = _ARCHITECTURES[name]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"architecture {names or '(none given)'} is not supported by ATOM; "
        f"supported: {', '.join(supported_architectures())}"
    )
