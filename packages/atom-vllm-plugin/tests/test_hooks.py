"""The entry points, the platform, the model registry and the switches, in the real vLLM."""

from __future__ import annotations

import importlib.metadata

import pytest

import atom_vllm_plugin
from atom_models import supported_architectures
from atom_vllm_plugin import compat

PLATFORM_CHECK = """
import json
import vllm.platforms
from vllm.plugins import load_general_plugins
from vllm.platforms.cpu import CpuPlatform
p = vllm.platforms.current_platform
load_general_plugins()
from vllm import ModelRegistry
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.selector import AttentionSelectorConfig
import torch
model_config = EngineArgs(model={model!r}, dtype="float32").create_model_config()
cls, _ = ModelRegistry.resolve_model_cls(["LlamaForCausalLM"], model_config)
cfg = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto",
                              block_size=None)
print(json.dumps({{
    "platform": type(p).__module__ + "." + type(p).__qualname__,
    "is_cpu_platform": isinstance(p, CpuPlatform) and p.is_cpu(),
    "device_type": p.device_type,
    "llama_cls": cls.__module__ + "." + cls.__qualname__,
    "attn_backend": p.get_attn_backend_cls(None, cfg),
}}))
"""


def test_entry_points_are_discovered_by_vllm() -> None:
    from vllm.plugins import (
        DEFAULT_PLUGINS_GROUP,
        PLATFORM_PLUGINS_GROUP,
        load_plugins_by_group,
    )

    for group, target in (
        (PLATFORM_PLUGINS_GROUP, "atom_vllm_plugin:register_platform"),
        (DEFAULT_PLUGINS_GROUP, "atom_vllm_plugin:register"),
    ):
        ours = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == "atom"]
        assert [ep.value for ep in ours] == [target]
        # vLLM's own loader finds and loads it.
        assert load_plugins_by_group(group)["atom"] is getattr(
            atom_vllm_plugin, target.split(":")[1]
        )


def test_current_platform_is_atom_subclass_of_vllm_cpu() -> None:
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    from atom_vllm_plugin.platforms.cpu import AtomCpuPlatform

    platform = vllm.platforms.current_platform
    assert type(platform) is AtomCpuPlatform
    # The parent's identity is kept: vLLM's code paths for the CPU stay on.
    assert isinstance(platform, CpuPlatform) and platform.is_cpu()
    assert platform.device_type == "cpu" and platform.device_name == "cpu"


def test_hooks_are_idempotent() -> None:
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    first = atom_vllm_plugin.register_platform()
    for _ in range(3):
        assert atom_vllm_plugin.register_platform() == first
        atom_vllm_plugin.register()
    assert first == "atom_vllm_plugin.platforms.cpu.AtomCpuPlatform"
    assert AttentionBackendEnum["ATOM"].get_path().endswith("AtomAttentionBackend")
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= ModelRegistry.get_supported_archs()


def test_registry_resolves_supported_architectures_to_atom(smollm2_dir) -> None:
    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs

    from atom_vllm_plugin.model import AtomForCausalLM

    atom_vllm_plugin.register()
    model_config = EngineArgs(model=str(smollm2_dir), dtype="float32").create_model_config()
    architectures = supported_architectures()
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"} <= set(architectures)
    for arch in architectures:
        cls, resolved = ModelRegistry.resolve_model_cls([arch], model_config)
        assert (cls, resolved) == (AtomForCausalLM, arch)
        assert ModelRegistry.is_text_generation_model([arch], model_config)


def test_attention_backend_selection(smollm2_dir) -> None:
    import torch
    import vllm.platforms
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    platform = vllm.platforms.current_platform

    def backend(**kw) -> str:
        cfg = dict(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=None)
        cfg.update(kw)
        selected = cfg.pop("selected", None)
        return platform.get_attn_backend_cls(selected, AttentionSelectorConfig(**cfg))

    atom = "atom_vllm_plugin.attention.backend.AtomAttentionBackend"
    assert backend() == atom
    assert backend(has_sliding_window=True, has_sink=True) == atom
    assert backend(dtype=torch.bfloat16, kv_cache_dtype="fp8") == atom
    assert backend(selected=AttentionBackendEnum["ATOM"]) == atom
    cpu_attn = AttentionBackendEnum.CPU_ATTN.get_path()
    # Layer configurations ATOM does not serve go to the parent platform's choice.
    assert backend(attn_type="encoder_only") == cpu_attn
    assert backend(use_non_causal=True) == cpu_attn
    assert backend(dtype=torch.float32, kv_cache_dtype="bfloat16") == cpu_attn
    assert backend(selected=AttentionBackendEnum.CPU_ATTN) == cpu_attn


@pytest.mark.parametrize(
    ("switches", "platform", "llama_module", "attention"),
    [
        pytest.param(
            {},
            "atom_vllm_plugin.platforms.cpu.AtomCpuPlatform",
            "atom_vllm_plugin.model",
            "atom_vllm_plugin.attention.backend.AtomAttentionBackend",
            id="enabled",
        ),
        pytest.param(
            {"ATOM_DISABLE_VLLM_PLUGIN": "1"},
            "vllm.platforms.cpu.CpuPlatform",
            "vllm.model_executor.models.llama",
            "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend",
            id="plugin-disabled",
        ),
        pytest.param(
            {"ATOM_VLLM_PLUGIN_CPU_ATTENTION": ""},  # unset: the plugin's default on a CPU
            "atom_vllm_plugin.platforms.cpu.AtomCpuPlatform",
            "atom_vllm_plugin.model",
            "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend",
            id="cpu-default",
        ),
        pytest.param(
            {"ATOM_DISABLE_VLLM_PLUGIN_ATTENTION": "1"},
            "atom_vllm_plugin.platforms.cpu.AtomCpuPlatform",
            "atom_vllm_plugin.model",
            "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend",
            id="attention-disabled",
        ),
    ],
)
def test_switches_in_a_fresh_process(
    run_python, smollm2_dir, switches, platform, llama_module, attention
) -> None:
    result = run_python(PLATFORM_CHECK.format(model=str(smollm2_dir)), **switches)
    assert result["platform"] == platform
    assert result["is_cpu_platform"] and result["device_type"] == "cpu"
    assert result["llama_cls"].rsplit(".", 1)[0] == llama_module
    assert result["attn_backend"] == attention


@pytest.mark.parametrize(
    ("version", "tested"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.32.7rc1", True),
        ("0.33.0", False),
        ("0.33.2rc1", False),
        ("0.31.9", False),
        ("0.34.0", False),
        ("1.0.0", False),
        ("unknown", False),
    ],
)
def test_version_range(version: str, tested: bool, monkeypatch) -> None:
    monkeypatch.delenv("ATOM_VLLM_PLUGIN_ALLOW_UNTESTED", raising=False)
    assert compat.is_tested(version) is tested
    problem = compat.version_problem(version)
    if tested:
        assert problem is None
    else:
        assert f"vLLM {version} is outside the range" in problem and "vllm>=0.32,<0.33" in problem
        monkeypatch.setenv("ATOM_VLLM_PLUGIN_ALLOW_UNTESTED", "1")
        assert compat.version_problem(version) is None
        assert "untested" in compat.untested_warning(version)


def test_installed_vllm_is_in_the_tested_range_recorded_in_metadata() -> None:
    version = compat.installed_vllm_version()
    assert version is not None and compat.is_tested(version)
    metadata = importlib.metadata.metadata("atom-vllm-plugin")
    assert f"tested-with:{compat.TESTED_RANGE}" in metadata["Keywords"]
    assert compat.TESTED_RANGE in metadata["Summary"]
    # Never a dependency: installing the plugin must not pull in a (CUDA) vLLM build.
    requires = importlib.metadata.requires("atom-vllm-plugin") or []
    assert not [r for r in requires if r.split(";")[0].strip().startswith("vllm")]


# Lines the plugin logged, at their level: held until vLLM configures its logging, or printed.
CAPTURE_LOG = """
import logging
from atom_vllm_plugin import log
printed = []
class Capture(logging.Handler):
    def emit(self, record):
        printed.append((record.levelname, record.getMessage().removeprefix("ATOM: ")))
log.logger.addHandler(Capture())
def logged():
    return printed + [(logging.getLevelName(level), line) for level, line in log._pending]
"""


def test_untested_version_steps_aside_with_a_warning(run_python, smollm2_dir) -> None:
    # A vLLM version outside the range (faked where the plugin reads it; vLLM itself reads the
    # real metadata) makes both hooks step aside with a WARNING: vLLM's own platform, models and
    # attention.
    code = f"""
from atom_vllm_plugin import compat
compat.installed_vllm_version = lambda: "0.33.0"
{CAPTURE_LOG}
{PLATFORM_CHECK.format(model=str(smollm2_dir)).replace("print(json.dumps(", "checked = ((")}
import atom_vllm_plugin
from atom_models import supported_architectures
atom_vllm_plugin.register()
print(json.dumps({{
    **checked,
    "logged": logged(),
    "platform_hook": atom_vllm_plugin.register_platform(),
    "modules": sorted({{ModelRegistry.resolve_model_cls([arch], model_config)[0].__module__
                        for arch in supported_architectures()}}),
}}))
"""
    result = run_python(code)
    assert result["platform_hook"] is None
    assert result["platform"] == "vllm.platforms.cpu.CpuPlatform"
    assert result["llama_cls"] == "vllm.model_executor.models.llama.LlamaForCausalLM"
    assert result["attn_backend"] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    # No architecture resolves to ATOM's wrapper: the plugin registered nothing.
    assert all(m.startswith("vllm.model_executor.models.") for m in result["modules"])
    expected = "vLLM 0.33.0 is outside the range this plugin was tested with (vllm>=0.32,<0.33)"
    lines = [(level, line) for level, line in result["logged"] if expected in line]
    assert lines and all(level == "WARNING" for level, _ in lines), result["logged"]
    assert any(line.startswith("stepping aside") for _, line in lines)
    assert any(line.startswith("not registering ATOM models") for _, line in lines)


def test_disabled_switch_steps_aside_at_info(run_python) -> None:
    # The user's own choice is not a warning.
    code = f"""
import json
{CAPTURE_LOG}
import atom_vllm_plugin
atom_vllm_plugin.register_platform()
atom_vllm_plugin.register()
print(json.dumps({{"logged": logged()}}))
"""
    result = run_python(code, ATOM_DISABLE_VLLM_PLUGIN="1")
    switch = "ATOM_DISABLE_VLLM_PLUGIN=1"
    lines = [(level, line) for level, line in result["logged"] if switch in line]
    assert len(lines) == 2 and all(level == "INFO" for level, _ in lines), result["logged"]


def test_cpu_platform_defaults_to_vllms_attention_with_a_log_line(run_python) -> None:
    # Without ATOM_VLLM_PLUGIN_CPU_ATTENTION=1, vLLM's CPU attention; `--attention-backend ATOM`
    # (the selected backend vLLM passes) still gives ATOM's.
    code = f"""
import json
{CAPTURE_LOG}
import torch
import vllm.platforms
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig
platform = vllm.platforms.current_platform
load_general_plugins()
cfg = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto",
                              block_size=None)
print(json.dumps({{
    "default": platform.get_attn_backend_cls(None, cfg),
    "selected": platform.get_attn_backend_cls(AttentionBackendEnum["ATOM"], cfg),
    "logged": logged(),
}}))
"""
    result = run_python(code, ATOM_VLLM_PLUGIN_CPU_ATTENTION="")
    assert result["default"] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    assert result["selected"] == "atom_vllm_plugin.attention.backend.AtomAttentionBackend"
    lines = [line for _, line in result["logged"] if line.startswith("attention backend")]
    assert len(lines) == 2, result["logged"]
    assert lines[0].startswith("attention backend CPUAttentionBackend (vLLM's) for head_size=64")
    assert "the default on a CPU platform" in lines[0]
    assert "ATOM_VLLM_PLUGIN_CPU_ATTENTION=1 or --attention-backend ATOM" in lines[0]
    assert lines[1].startswith("attention backend ATOM (atom_kernels")
