"""The engine's layout rules (issue 35, item 5): no import cycles inside `atom_engine`, and no
source file outside the kernels past 400 lines.

The import graph is read with `ast`, not by importing: every `import` / `from ... import` of an
`atom_engine` module, at module level *and* inside functions, is an edge. Lazy (function-level)
imports count on purpose: moving an import into a function hides a cycle from the interpreter but
not from the reader, and the point is real layering (a module below never reaches up into one
above).
Only imports under `if TYPE_CHECKING:` are left out: they exist for annotations and never run.

`from atom_engine.pkg import name` is an edge to `atom_engine.pkg.name` when that is a module,
else to `atom_engine.pkg` (its `__init__`). Importing a submodule also runs its package's
`__init__`, but that edge is not drawn: a package re-exporting its children is not a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

_PACKAGES = Path(__file__).resolve().parents[2]
_ENGINE_SRC = _PACKAGES / "atom-engine" / "src"
_MAX_LINES = 400
# The kernels are excepted from the line limit (STYLE.md: "Split a file before it passes ~400 lines
# (kernel files excepted)").
_LINE_LIMITED = {
    "atom-engine": "atom_engine",
    "atom-models": "atom_models",
    "atom-vllm-plugin": "atom_vllm_plugin",
    "atom-sglang-plugin": "atom_sglang_plugin",
}


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Absolute names `tree` imports (module- and function-level), skipping TYPE_CHECKING blocks."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _engine_import_graph() -> dict[str, set[str]]:
    root = _ENGINE_SRC / "atom_engine"
    files = {_module_name(p, _ENGINE_SRC): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        names = _imports(ast.parse(path.read_text()), module, path.name == "__init__.py")
        edges: set[str] = set()
        for name in names:
            # `from pkg import mod` names both `pkg` and `pkg.mod`; keep the most specific module.
            if name in files and not any(n.startswith(name + ".") and n in files for n in names):
                edges.add(name)
        edges.discard(module)
        graph[module] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color[nxt] == GREY:
                return stack[stack.index(nxt) :] + [nxt]
            if color[nxt] == WHITE and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        color[node] = BLACK
        return None

    for node in sorted(graph):
        if color[node] == WHITE and (cycle := dfs(node)):
            return cycle
    return None


def test_engine_has_no_import_cycles() -> None:
    cycle = _find_cycle(_engine_import_graph())
    assert cycle is None, "import cycle in atom_engine: " + " -> ".join(cycle or [])


def test_no_source_file_over_400_lines() -> None:
    too_long = []
    for package_dir, package in _LINE_LIMITED.items():
        for path in sorted((_PACKAGES / package_dir / "src" / package).rglob("*.py")):
            num_lines = len(path.read_text().splitlines())
            if num_lines > _MAX_LINES:
                too_long.append(f"{path.relative_to(_PACKAGES)}: {num_lines} lines")
    assert not too_long, f"source files over {_MAX_LINES} lines:\n" + "\n".join(too_long)
