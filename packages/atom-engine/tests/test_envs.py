"""atom_engine.envs and the plugins' switches.py: every ATOM_* variable the engine and the plugins
read is in a table and read through it, and docs/architecture.md section 14's table is exactly
the union of the tables (atom-kernels' included), with their defaults and meanings."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from atom_engine import envs
from atom_kernels import envs as kernel_envs

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ROOT / "packages"
KERNEL_TEST = PACKAGES / "atom-kernels/tests/test_envs.py"
# (file, variable) reads allowed outside a table: replica.py's `_environ` saves the variables it
# sets while a replica's process starts (CUDA_VISIBLE_DEVICES), to restore them after.
ALLOWED = {("replica.py", "?")}
PLUGIN_TABLES = {
    "atom-vllm-plugin `switches.py`": "atom_vllm_plugin.switches",
    "atom-sglang-plugin `switches.py`": "atom_sglang_plugin.switches",
}


def _kernel_test():
    """atom-kernels' test_envs (its checker and the docs' table parser)."""
    spec = importlib.util.spec_from_file_location("atom_kernels_test_envs", KERNEL_TEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_switch_reads_the_environment_when_looked_up(monkeypatch):
    monkeypatch.delenv("ATOM_CPU_COMPILE", raising=False)
    assert envs.ATOM_CPU_COMPILE is True
    monkeypatch.setenv("ATOM_CPU_COMPILE", " 0 ")
    assert envs.ATOM_CPU_COMPILE is False
    monkeypatch.delenv("ATOM_TP_CONNECT_TIMEOUT", raising=False)
    assert envs.ATOM_TP_CONNECT_TIMEOUT == 300.0
    monkeypatch.setenv("ATOM_TP_CONNECT_TIMEOUT", "12.5")
    assert envs.get("ATOM_TP_CONNECT_TIMEOUT") == 12.5
    monkeypatch.delenv("ATOM_API_KEY", raising=False)
    assert envs.ATOM_API_KEY is None
    monkeypatch.setenv("ATOM_API_KEY", "")  # set but empty: as os.environ.get gave it
    assert envs.ATOM_API_KEY == ""
    with pytest.raises(AttributeError):
        envs.ATOM_NOT_A_SWITCH  # noqa: B018


def test_no_atom_variable_is_read_outside_the_tables():
    sources = [PACKAGES / p for p in ("atom-engine/src", "atom-vllm-plugin/src",
                                      "atom-sglang-plugin/src")]  # fmt: skip
    found = _kernel_test().undeclared_reads(sources, ("envs.py", "switches.py"), ALLOWED)
    assert not found, "read these through atom_engine.envs or switches.py:\n" + "\n".join(found)


def test_the_docs_table_is_the_union_of_the_tables():
    helpers = _kernel_test()
    tables = {"atom-kernels `envs.py`": kernel_envs.TABLE, "atom-engine `envs.py`": envs.TABLE}
    expected = {
        s.name: (helpers.shown(s.default), s.meaning, table)
        for table, switches in tables.items()
        for s in switches
    }
    for table, module in PLUGIN_TABLES.items():
        switches = pytest.importorskip(module)
        expected.update({n: (d, m, table) for n, (d, m) in switches.TABLE.items()})
    rows = helpers.documented_rows()
    assert rows.keys() == expected.keys(), (
        f"only in the docs: {sorted(rows.keys() - expected.keys())}; "
        f"only in a table: {sorted(expected.keys() - rows.keys())}"
    )
    for name, row in expected.items():
        assert rows[name] == row, name


def test_names_are_atom_names():
    names = [s.name for s in (*kernel_envs.TABLE, *envs.TABLE)]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"ATOM_[A-Z0-9_]+", n) for n in names)
