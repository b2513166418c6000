"""atom_kernels.envs: every ATOM_* variable the kernels read is in its table, read through it, and
listed in docs/architecture.md section 14 with the table's default and meaning."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest

from atom_kernels import envs

ROOT = Path(__file__).resolve().parents[3]
SOURCES = [ROOT / "packages/atom-kernels/src", ROOT / "packages/atom-models/src"]
# (file name, variable) reads still allowed outside the table: none.
PENDING: set[tuple[str, str]] = set()


def environment_reads(source: str) -> list[tuple[int, str]]:
    """(line, variable) of every os.environ / os.getenv read in ``source``: the variable's name
    when it is a string literal or a module-level string constant, else "?" (a computed name)."""
    tree = ast.parse(source)
    constants = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets
        if isinstance(t, ast.Name) and isinstance(node.value.value, str)
    }

    def name_of(arg: ast.expr) -> str:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name) and arg.id in constants:
            return constants[arg.id]
        return "?"

    def is_environ(node: ast.expr) -> bool:  # os.environ, environ, anything.environ
        return (isinstance(node, ast.Name) and node.id == "environ") or (
            isinstance(node, ast.Attribute) and node.attr == "environ"
        )

    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if ast.unparse(func).split(".")[-1] == "getenv" or (
                isinstance(func, ast.Attribute)
                and func.attr in ("get", "pop", "setdefault")
                and is_environ(func.value)
            ):
                reads.append((node.lineno, name_of(node.args[0])))
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            if isinstance(node.ctx, ast.Load):
                reads.append((node.lineno, name_of(node.slice)))
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            reads.append((node.lineno, name_of(node.left)))
    return reads


def undeclared_reads(roots, tables=("envs.py",), allowed=frozenset()) -> list[str]:
    """Reads of ATOM_* variables (or of computed names) outside the table files."""
    found = []
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            if path.name in tables:
                continue
            for line, name in environment_reads(path.read_text()):
                if (name == "?" or name.startswith("ATOM_")) and (path.name, name) not in allowed:
                    found.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    return found


def shown(default) -> str:
    """A default as docs/architecture.md's table writes it."""
    if default is True:
        return "on"
    if default is False:
        return "off"
    if default in ("", None):
        return "unset"
    if isinstance(default, float) and (math.isinf(default) or default.is_integer()):
        return "inf" if math.isinf(default) else str(int(default))
    return str(default)


def documented_rows() -> dict[str, tuple[str, str, str]]:
    """Section 14's table: variable -> (default, meaning, table), backticks around the first two
    cells dropped."""
    text = (ROOT / "docs/architecture.md").read_text()
    section = text.split("## 14. Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`ATOM_[A-Z0-9_]+`", cells[0]):
            rows[cells[0].strip("`")] = (cells[1].strip("`"), cells[2], cells[3])
    return rows


def test_a_switch_reads_the_environment_when_looked_up(monkeypatch):
    monkeypatch.delenv("ATOM_PDL", raising=False)
    assert envs.ATOM_PDL is True and envs.get("ATOM_PDL") is True
    monkeypatch.setenv("ATOM_PDL", "0")
    assert envs.ATOM_PDL is False
    monkeypatch.setenv("ATOM_PDL", "true")  # only "1" is on, as before the table
    assert envs.ATOM_PDL is False
    monkeypatch.setenv("ATOM_FUSED_GATE_UP", "true")  # only "0" is off
    assert envs.ATOM_FUSED_GATE_UP is True
    monkeypatch.setenv("ATOM_KERNEL_BACKEND", " Triton ")
    assert envs.ATOM_KERNEL_BACKEND == "triton"
    monkeypatch.setenv("ATOM_DECODE_LARGE_SPLITS_BELOW", "8")
    assert envs.ATOM_DECODE_LARGE_SPLITS_BELOW == 8.0
    with pytest.raises(AttributeError):
        envs.ATOM_NOT_A_SWITCH  # noqa: B018
    with pytest.raises(KeyError):
        envs.get("ATOM_NOT_A_SWITCH")


def test_the_checker_finds_reads_outside_the_table():
    source = (
        'import os\nNAME = "ATOM_B"\nos.environ.get("ATOM_A", "1")\nos.getenv(NAME)\n'
        'os.environ["ATOM_C"]\n"ATOM_D" in os.environ\nos.environ.get(name)\n'
        'os.environ.get("TRITON_INTERPRET")\nos.environ["ATOM_E"] = "1"\n'
    )
    reads = environment_reads(source)
    assert reads == [(3, "ATOM_A"), (4, "ATOM_B"), (5, "ATOM_C"), (6, "ATOM_D"), (7, "?"),
                     (8, "TRITON_INTERPRET")]  # fmt: skip


def test_no_atom_variable_is_read_outside_the_table():
    found = undeclared_reads(SOURCES, allowed=PENDING)
    assert not found, "read these through atom_kernels.envs:\n" + "\n".join(found)


def test_every_switch_is_documented_as_in_the_table():
    rows = documented_rows()
    for switch in envs.TABLE:
        assert switch.name in rows, f"{switch.name} is missing from docs/architecture.md sec. 14"
        default, meaning, table = rows[switch.name]
        assert (default, meaning) == (shown(switch.default), switch.meaning), switch.name
        assert table == "atom-kernels `envs.py`", switch.name
    for name, (_, _, table) in rows.items():
        if table == "atom-kernels `envs.py`":
            assert name in envs.SWITCHES, f"docs list {name} in atom-kernels' table; it is not"
