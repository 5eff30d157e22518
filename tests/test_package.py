"""The package's shape: no import circle between its modules (function-level imports included),
the experts module imports no optional integration, directly or through other modules, the
kernels wing imports nothing of the package outside it but the package's error type, only the
package's __init__ imports the integrations wing (and nothing imports its NeMo-RL module), only
that module imports NeMo-RL and Ray (and the testing wing, which patches them), and nothing
imports the testing wing."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "mcore_torch_experts"


def module_name(path: Path) -> str:
    """A source file's module, dotted, relative to the package: "experts", "kernels.choice",
    "kernels" (the subpackage's __init__), "__init__" (the package's own)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p) for p in PACKAGE.rglob("*.py")}


def imported_names(node, module: str):
    """The dotted names (relative to the package) an import statement in `module` reaches,
    relative imports made absolute: `from .x import y` reaches x and x.y."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            package = module.split(".")
            if not (PACKAGE / Path(*package)).is_dir():  # a module, not a subpackage's __init__
                package = package[:-1]
            base = [PACKAGE.name, *package[:len(package) - node.level + 1]]
        else:
            base = []
        head = ".".join([*base, *filter(None, [node.module])])
        names = [head] + [f"{head}.{alias.name}" for alias in node.names]
    else:
        return []
    prefix = PACKAGE.name + "."
    return [name[len(prefix):] for name in names if name.startswith(prefix)]


def package_imports():
    """{module: the package modules it imports anywhere in its source, by relative or absolute
    import}."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        graph[module] = {name for node in ast.walk(ast.parse(path.read_text()))
                         for name in imported_names(node, module)} & MODULES
    return graph


def test_imports_are_resolved_across_the_wings():
    """The resolver itself: a module of the kernels wing reaching the package's errors module,
    the experts module reaching the kernels."""
    graph = package_imports()
    assert "errors" in graph["kernels.choice"]
    assert {"kernels.choice", "kernels.grouped_gemm"} <= graph["experts"]
    assert "kernels.activation_triton" in graph["kernels.fused_experts_triton"]


def test_no_import_circle_between_package_modules():
    graph = package_imports()
    graph.pop("__init__")
    state = {}

    def visit(module, path):
        if state.get(module) == "open":
            raise AssertionError("import circle: " + " -> ".join([*path, module]))
        if state.get(module) is None:
            state[module] = "open"
            for imported in sorted(graph.get(module, ())):
                visit(imported, [*path, module])
            state[module] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_experts_module_imports_no_integration():
    """Nor does any package module that experts.py imports, however far down."""
    integrations = {"integrations", "integrations.automodel", "integrations.bridge",
                    "integrations.bridge_adapters", "integrations.nemo_rl", "lora",
                    "convert", "upcycling"}
    graph = package_imports()
    reached, todo = set(), ["experts"]
    while todo:
        new = graph[todo.pop()] - reached
        reached |= new
        todo.extend(new)
    assert not reached & integrations, sorted(reached)


def test_no_package_module_imports_the_testing_wing():
    graph = package_imports()
    wing = {m for m in MODULES if m == "testing" or m.startswith("testing.")}
    assert "testing.cpu_support" in wing
    assert {m for m, imported in graph.items() if imported & wing and m not in wing} == set()


def test_only_the_package_init_imports_the_integrations():
    graph = package_imports()
    wing = {m for m in MODULES if m == "integrations" or m.startswith("integrations.")}
    assert {"integrations.bridge", "integrations.automodel"} <= wing
    importers = {m for m, imported in graph.items() if imported & wing and m not in wing}
    assert importers == {"__init__"}, importers
    # NeMo-RL is optional: its worker extension is imported by name (NeMo-RL's worker builder),
    # never by the package, its __init__ included.
    assert "integrations.nemo_rl" in wing
    assert {m for m, imported in graph.items() if "integrations.nemo_rl" in imported} == set()


def outside_imports(path: Path) -> set:
    """The top-level names of the absolute imports in a source file, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_only_the_nemo_rl_integration_imports_nemo_rl():
    """NeMo-RL (and the Ray it runs its workers in) is optional: one module imports it, besides
    the testing wing's CPU patch table (`nemo_rl_patches` patches NeMo-RL's own functions)."""
    importers = {module_name(path) for path in PACKAGE.rglob("*.py")
                 if outside_imports(path) & {"nemo_rl", "ray"}}
    assert importers - {"testing.cpu_support"} == {"integrations.nemo_rl"}, importers


def test_the_kernels_wing_imports_only_itself_and_the_error_type():
    graph = package_imports()
    kernels = {m for m in MODULES if m == "kernels" or m.startswith("kernels.")}
    assert len(kernels) >= 6
    outside = {m: sorted(graph[m] - kernels - {"errors"}) for m in kernels}
    assert all(not found for found in outside.values()), outside
