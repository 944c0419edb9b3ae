"""Layers import only downward, no module imports another in a cycle, and each folder is one layer.

The layers, top to bottom (docs/architecture.md's table says what each owns,
and names the same folders and modules as ``LAYERS``):

5. the app factory, which wires everything;
4. the surfaces: HTTP blueprints, CLI commands, broker consumers, the
   Idempotency-Key engine, metrics and logs, and the HTTP edge (problems,
   sessions);
3. the domain services: providers, processing (the worker side), retention;
2. the inbox and data access: every write of a received message, the
   outbox's delivery and ordering records, the idempotency record, event
   reads;
1. the foundation: engine and transactions, the driver's cursors, models,
   config, fingerprints, pointers, correlation ids, traces.

A module may import its own layer or lower ones; imports inside functions
count as much as those at the top. Every module of the package must be
placed here, so a new one is placed on purpose.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = "webhook_receiver"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
DOC = ROOT.parent / "docs" / "architecture.md"

# One line per folder (a package, with everything in it) or top-level module.
LAYERS: dict[str, int] = {
    "webhook_receiver": 5,
    "webhook_receiver.admin": 4,
    "webhook_receiver.api": 4,
    "webhook_receiver.brokers": 4,
    "webhook_receiver.cli": 4,
    "webhook_receiver.health": 4,
    "webhook_receiver.idempotency": 4,
    "webhook_receiver.observability": 4,
    "webhook_receiver.openapi": 4,
    "webhook_receiver.problem_pages": 4,
    "webhook_receiver.problems": 4,
    "webhook_receiver.sessions": 4,
    "webhook_receiver.webhooks": 4,
    "webhook_receiver.processing": 3,
    "webhook_receiver.retention": 3,
    "webhook_receiver.webhooks.providers": 3,
    "webhook_receiver.events": 2,
    "webhook_receiver.idempotency.persistence": 2,
    "webhook_receiver.inbox": 2,
    "webhook_receiver.outbox": 2,
    "webhook_receiver.rejections": 2,
    "webhook_receiver.background": 1,
    "webhook_receiver.config": 1,
    "webhook_receiver.correlation": 1,
    "webhook_receiver.database": 1,
    "webhook_receiver.database_driver": 1,
    "webhook_receiver.extensions": 1,
    "webhook_receiver.fingerprint": 1,
    "webhook_receiver.models": 1,
    "webhook_receiver.pointers": 1,
    "webhook_receiver.tracing": 1,
}

# Modules that may import the package's own modules inside a function, and why.
IMPORTS_INSIDE_FUNCTIONS: dict[str, str] = {
    # The package's __init__ runs before any of its modules is imported: at
    # its top, these would load the whole app (every surface, the broker
    # clients) for any ``import webhook_receiver.<module>``.
    "webhook_receiver": "create_app's wiring",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> int:
    name = module
    while name:  # the innermost placed folder
        if name in LAYERS:
            return LAYERS[name]
        name = name.rpartition(".")[0]
    raise KeyError(module)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for each import of the package's own modules.

    Every import counts, inside functions too; one under a module-level
    ``if`` (``TYPE_CHECKING``) is at module level.
    """
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    known = _modules()
    found = []
    top_level = {
        id(inner)
        for node in tree.body
        for inner in (ast.walk(node) if isinstance(node, ast.If) else [node])
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            names = [f"{target}.{alias.name}" for alias in node.names]
            targets = [n for n in names if n in known] or [target]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            if target.startswith(PACKAGE):
                found.append((target, node.lineno, id(node) in top_level))
    return found


def _type_checking_only(path: Path) -> set[int]:
    tree = ast.parse(path.read_text())
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom | ast.Import):
                    lines.add(inner.lineno)
    return lines


def test_every_module_has_a_layer():
    unplaced = []
    for module in _modules():
        try:
            _layer(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"


def test_no_module_imports_a_higher_layer():
    upward = []
    for module, path in _modules().items():
        for target, line, _ in _imports(module, path):
            if _layer(target) > _layer(module):
                upward.append(
                    f"{path.relative_to(ROOT.parent)}:{line} {module} (layer {_layer(module)}) "
                    f"imports {target} (layer {_layer(target)})"
                )
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph: dict[str, set[str]] = {}
    for module, path in _modules().items():
        typing_only = _type_checking_only(path)
        graph[module] = {
            target for target, line, _ in _imports(module, path) if line not in typing_only
        } - {module}
    # A package's __init__ re-exporting its own modules is not a cycle with them.
    for module in graph:
        graph[module] = {
            t for t in graph[module] if not (module.startswith(t + ".") and t in graph)
        }
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt in graph and not state.get(nxt):
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for module in sorted(graph):
        if not state.get(module):
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_no_import_below_the_top_of_a_module():
    late = []
    for path in _modules().values():
        tree = ast.parse(path.read_text())
        seen_code = False
        for node in tree.body:
            is_import = isinstance(node, ast.Import | ast.ImportFrom)
            is_docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            if is_import and seen_code:
                late.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
            elif not is_import and not is_docstring and not isinstance(node, ast.If):
                seen_code = True
    assert not late, late


def test_own_modules_are_imported_at_the_top():
    inside = []
    for module, path in _modules().items():
        if module in IMPORTS_INSIDE_FUNCTIONS:
            continue
        for target, line, at_top in _imports(module, path):
            if not at_top:
                inside.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
    assert not inside, "import these at the top, or say why in IMPORTS_INSIDE_FUNCTIONS:\n" + (
        "\n".join(inside)
    )


def test_layers_name_folders_and_top_level_modules():
    modules = _modules()
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    stray = [
        name
        for name in LAYERS
        if name not in packages and not (name in modules and name.count(".") == 1)
    ]
    assert not stray, f"LAYERS places folders and top-level modules only: {stray}"
    assert all(name in modules for name in [*LAYERS, *IMPORTS_INSIDE_FUNCTIONS])


def _documented_layers() -> dict[str, int]:
    """The folders and modules of each layer in docs/architecture.md's table."""
    layers: dict[str, int] = {}
    for row in re.findall(r"^\| (\d) [^|]+\| ([^|]+) \|", DOC.read_text(), re.MULTILINE):
        layer, cell = int(row[0]), row[1]
        for name in re.findall(r"`([\w/.]+(?:/|\.py))`", cell):
            if name == "wsgi.py":  # outside the package
                continue
            name = name.removeprefix(f"{PACKAGE}/").removesuffix("/").removesuffix(".py")
            parts = [p for p in name.split("/") if p != "__init__"]
            module = ".".join([PACKAGE, *parts])
            assert module not in layers, f"docs/architecture.md places {name} twice"
            layers[module] = layer
    return layers


def test_the_architecture_doc_names_the_same_layers():
    assert _documented_layers() == LAYERS


@pytest.mark.parametrize("layer", sorted(set(LAYERS.values())))
def test_each_layer_has_a_module(layer):
    assert any(_layer(m) == layer for m in _modules())
