"""The package's shape: no import circle between its modules (function-level imports included),
and the experts module imports no optional integration."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "mcore_torch_experts"


def package_imports():
    """{module: the package modules it imports anywhere in its source}."""
    graph = {}
    for path in sorted(PACKAGE.glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                imported.update(n.split(".")[0] for n in names)
        graph[path.stem] = imported & {p.stem for p in PACKAGE.glob("*.py")}
    return graph


def test_no_import_circle_between_package_modules():
    graph = package_imports()
    graph.pop("__init__")
    state = {}

    def visit(module, path):
        if state.get(module) == "open":
            raise AssertionError("import circle: " + " -> ".join([*path, module]))
        if state.get(module) is None:
            state[module] = "open"
            for imported in sorted(graph[module]):
                visit(imported, [*path, module])
            state[module] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_experts_module_imports_no_integration():
    integrations = {"automodel", "bridge", "lora", "convert", "upcycling"}
    assert not package_imports()["experts"] & integrations
