"""The entry point, as SGLang's own plugin loader sees it, and the hook it installs."""

from __future__ import annotations

from atom_sglang_plugin import activation, compat


def test_entry_point_discovered_by_sglang():
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    func, dist = plugins["atom"]
    assert dist == "atom-sglang-plugin"
    import atom_sglang_plugin

    assert func is atom_sglang_plugin.register


def test_hook_registered_once_and_applied(sglang_plugins):
    import sglang.srt.model_loader.loader as loader
    import sglang.srt.model_loader.utils as utils
    from sglang.srt.plugins.hook_registry import HookRegistry

    import atom_sglang_plugin

    atom_sglang_plugin.register()  # SGLang may call it again (every process, sometimes twice)
    ours = [h for _, h, _ in HookRegistry._hooks[activation.HOOK_TARGET]
            if h is activation.select_model_architecture]  # fmt: skip
    assert len(ours) == 1
    assert activation.HOOK_TARGET in HookRegistry._patched
    # SGLang's file is untouched; its module attribute (and the loader's import of it) is wrapped.
    assert utils.get_model_architecture.__wrapped__.__module__ == utils.__name__
    assert loader.get_model_architecture is utils.get_model_architecture


def test_disabled_switch_registers_nothing(monkeypatch):
    monkeypatch.setenv("ATOM_DISABLE_SGLANG_PLUGIN", "1")
    monkeypatch.setattr(activation, "_registered", False)
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = len(HookRegistry._hooks[activation.HOOK_TARGET])
    activation.install_model_selection()
    assert len(HookRegistry._hooks[activation.HOOK_TARGET]) == before


def test_wants_atom_only_for_the_atom_value():
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelImpl

    assert activation.wants_atom(SimpleNamespace(model_impl="atom"))
    assert activation.wants_atom(SimpleNamespace(model_impl="ATOM"))
    for other in ("auto", "sglang", "transformers", ModelImpl.AUTO, ModelImpl.SGLANG, None):
        assert not activation.wants_atom(SimpleNamespace(model_impl=other))


def test_version_check():
    assert compat.installed_sglang_version() == compat.TESTED_VERSION
    assert compat.untested_warning() is None
    assert compat.untested_warning("0.5.24") == (
        "SGLang 0.5.24 is untested (sglang==0.5.23 was tested); running anyway"
    )
