"""The entry point, as SGLang's own plugin loader sees it, and the hook it installs."""

from __future__ import annotations

from atom_sglang_plugin import activation, compat, log


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


def test_version_check(monkeypatch):
    monkeypatch.delenv("ATOM_SGLANG_PLUGIN_ALLOW_UNTESTED", raising=False)
    assert compat.installed_sglang_version() == compat.TESTED_VERSION
    assert compat.version_problem() is None and compat.untested_warning() is None
    assert compat.version_problem("0.5.23+cu128") is None
    assert compat.version_problem("0.5.24") == (
        "SGLang 0.5.24 is not the version this plugin was tested with (sglang==0.5.23); "
        "set ATOM_SGLANG_PLUGIN_ALLOW_UNTESTED=1 to run it anyway"
    )
    monkeypatch.setenv("ATOM_SGLANG_PLUGIN_ALLOW_UNTESTED", "1")
    assert compat.version_problem("0.5.24") is None
    assert "untested" in compat.untested_warning("0.5.24")


def test_untested_version_steps_aside_with_a_warning(monkeypatch, caplog):
    # An SGLang version other than the tested one (faked where the plugin reads it) registers no
    # hook and says so at WARNING.
    import logging

    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.delenv("ATOM_SGLANG_PLUGIN_ALLOW_UNTESTED", raising=False)
    monkeypatch.setattr(compat, "installed_sglang_version", lambda: "0.5.24")
    monkeypatch.setattr(activation, "_registered", False)
    monkeypatch.setattr(log, "_logged", set())
    before = list(HookRegistry._hooks.get(activation.HOOK_TARGET, []))
    log.logger.addHandler(caplog.handler)  # whatever SGLang's logging config did to propagation
    try:
        with caplog.at_level(logging.INFO, logger="sglang.atom"):
            activation.install_model_selection()
    finally:
        log.logger.removeHandler(caplog.handler)
    assert list(HookRegistry._hooks.get(activation.HOOK_TARGET, [])) == before
    assert activation._registered is False
    lines = [r for r in caplog.records if "SGLang 0.5.24 is not the version" in r.getMessage()]
    # (caplog may see the record twice: through propagation and the handler added above)
    assert len({r.getMessage() for r in lines}) == 1
    assert all(r.levelno == logging.WARNING for r in lines)
    assert lines[0].getMessage().startswith("ATOM: stepping aside")
