"""The package's shape: no import circle between its modules (function-level imports included),
and the experts module imports no optional integration, directly or through other modules."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "mcore_torch_experts"
MODULES = {p.stem for p in PACKAGE.glob("*.py")}


def imported_names(node):
    """The dotted names an import statement reaches, relative ones made absolute: `from .x
    import y` reaches mcore_torch_experts.x and mcore_torch_experts.x.y."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom) or node.level > 1:
        return []
    module = ".".join(filter(None, [PACKAGE.name if node.level else None, node.module]))
    return [module] + [f"{module}.{alias.name}" for alias in node.names]


def package_imports():
    """{module: the package modules it imports anywhere in its source, by relative or absolute
    import}."""
    graph = {}
    for path in sorted(PACKAGE.glob("*.py")):
        names = [name.split(".") for node in ast.walk(ast.parse(path.read_text()))
                 for name in imported_names(node)]
        graph[path.stem] = {parts[1] for parts in names
                            if len(parts) > 1 and parts[0] == PACKAGE.name} & MODULES
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
    """Nor does any package module that experts.py imports, however far down."""
    integrations = {"automodel", "bridge", "lora", "convert", "upcycling"}
    graph = package_imports()
    reached, todo = set(), ["experts"]
    while todo:
        new = graph[todo.pop()] - reached
        reached |= new
        todo.extend(new)
    assert not reached & integrations, sorted(reached)
