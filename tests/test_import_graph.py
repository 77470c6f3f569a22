"""The `dspark` modules import each other without a cycle, and layers import downwards only.

Every import statement counts, wherever it is: at the top of a module, inside a function (a deferred
import still ties the two modules together) or under `if TYPE_CHECKING:`. The graph is read from the
source with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import root -> its directory (pyproject's package-dir).
PACKAGES = {"dspark": ROOT / "backend" / "dspark"}


def module_files() -> dict[str, Path]:
    """Every module of the `dspark` import root, by dotted name."""
    modules: dict[str, Path] = {}
    for root_name, directory in PACKAGES.items():
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([root_name, *parts])] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules that module `name` (at `path`) imports, by any import statement in it."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node.module, node.level)
            # `from package import module` imports the module; `from module import name`, the module.
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _absolute(name: str, is_package: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    package = name if is_package else name.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{module}" if module else package


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports, over the whole `dspark` import root."""
    files = module_files()
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle [a, b, ..., a], or None when the graph has none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_dspark_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50, "the module walk found too few modules"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# Lowest first; a module may import its own layer and the ones before it (the README's package table).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("kernels", ("dspark.kernels",)),
    (
        "values",
        (
            "dspark.config",
            "dspark.sampling_params",
            "dspark.outputs",
            "dspark.sequence",
            "dspark.tokenizer",
            "dspark.prompts",
            "dspark.process_heap",
        ),
    ),
    ("parallel", ("dspark.parallel",)),
    ("runner", ("dspark.runner",)),
    ("sampling", ("dspark.sampling",)),
    ("spec", ("dspark.spec",)),
    ("engine", ("dspark.engine",)),
    ("api", ("dspark.llm",)),
    ("serving", ("dspark.serving",)),
    ("training", ("dspark.training",)),
    ("tools", ("dspark.tools",)),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer that `module` belongs to (the package root counts as api)."""
    if module == "dspark":
        return next(i for i, (name, _) in enumerate(LAYERS) if name == "api")
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to the README's package table")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a later layer than the importer's, as 'importer -> imported'."""
    return [
        f"{module} ({LAYERS[layer_of(module)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]


def test_every_module_is_in_a_layer_and_imports_only_downwards() -> None:
    assert upward_imports(import_graph()) == []


def test_an_upward_import_is_found() -> None:
    graph = {"dspark.runner.model_runner": {"dspark.engine.step"}, "dspark.engine.step": {"dspark.runner.x"}}
    assert upward_imports(graph) == ["dspark.runner.model_runner (runner) -> dspark.engine.step (engine)"]


def test_a_function_level_import_closes_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_kind_of_import_statement_is_an_edge(tmp_path) -> None:
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import dspark.x\n"
        "from dspark import y\n"
        "from dspark.z import thing\n"
        "from . import w\n"
        "if TYPE_CHECKING:\n"
        "    from dspark.v import T\n"
        "def f():\n"
        "    from dspark.u import g\n"
    )
    known = {"dspark", "dspark.x", "dspark.y", "dspark.z", "dspark.w", "dspark.v", "dspark.u", "dspark.mod"}
    found = imported_modules("dspark.mod", source, known)
    assert found == {"dspark", "dspark.x", "dspark.y", "dspark.z", "dspark.w", "dspark.v", "dspark.u"}
