"""The package's shape: no import circle between its modules (function-level imports included),
the experts module imports no optional integration, directly or through other modules, the
kernels wing imports nothing of the package outside it but the package's error type, only the
package's __init__ imports the integrations wing (and nothing imports its NeMo-RL module), only
that module imports NeMo-RL and Ray; the package holds no test scaffolding (no stand-in module, no
patch of torch: those live on the test side, tests/support), and the examples import only the
package, torch, Megatron and the libraries they demonstrate. The suite's doors: unit tests
import of the repository only the package and tests/support; an integration room
(tests/integration/<stack>/) imports nothing of another room; tests/support imports nothing of
the test folders."""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "mcore_torch_experts"
SUPPORT = Path(__file__).parent / "support"
EXAMPLES = Path(__file__).parents[1] / "examples"
TESTS = Path(__file__).parent
ROOMS = TESTS / "integration"


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
                    "convert", "upcycling", "megatron.convert", "megatron.upcycling"}
    graph = package_imports()
    reached, todo = set(), ["experts"]
    while todo:
        new = graph[todo.pop()] - reached
        reached |= new
        todo.extend(new)
    assert not reached & integrations, sorted(reached)


# The old paths of the megatron wing's modules, kept importable (with a deprecation warning but
# specs, the launcher path); each imports its module in the wing only.
MOVED_TO_THE_WING = {"specs", "moe_layer", "model", "convert", "upcycling", "recompute"}


def test_the_core_imports_nothing_of_the_megatron_wing():
    """The experts, their config, combine, packing, LoRA and kernels stand without the Megatron
    glue (specs, MoE layer, model builders, conversion, upcycling, recompute); the package's
    __init__, the integrations and the old paths reach into the wing, nothing else does."""
    graph = package_imports()
    wing = {m for m in MODULES if m == "megatron" or m.startswith("megatron.")}
    assert {f"megatron.{m}" for m in MOVED_TO_THE_WING} <= wing
    reaching = {m for m, imported in graph.items() if imported & wing} - wing
    assert reaching - {"__init__"} - MOVED_TO_THE_WING <= {"integrations.nemo_rl"}, reaching
    for old in MOVED_TO_THE_WING:
        assert graph[old] == {f"megatron.{old}"}, (old, graph[old])


def scaffolding(path: Path) -> list:
    """What in a source file is test scaffolding, one line each: a stand-in module
    (`types.ModuleType(...)`, a write to `sys.modules`), a `TorchFunctionMode` subclass, an
    assignment to an attribute of `torch` (`torch.cuda.x = ...`, `setattr(torch..., ...)`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.split(".")[-1] == "ModuleType":
                found.append(f"{path.name}:{node.lineno}: {name}(...)")
            elif name == "setattr" and node.args and ast.unparse(node.args[0]).startswith("torch"):
                found.append(f"{path.name}:{node.lineno}: setattr({ast.unparse(node.args[0])}, ...)")
        elif isinstance(node, ast.ClassDef):
            if any(ast.unparse(base).endswith("TorchFunctionMode") for base in node.bases):
                found.append(f"{path.name}:{node.lineno}: class {node.name}(TorchFunctionMode)")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                text = ast.unparse(target)
                if text.startswith("sys.modules[") or (isinstance(target, ast.Attribute)
                                                       and text.startswith("torch.")):
                    found.append(f"{path.name}:{node.lineno}: {text} = ...")
    return found


def test_the_package_holds_no_test_scaffolding():
    """The wheel ships what users import: the CPU patch table and Bridge's import without
    Transformer Engine are the test side's (tests/support). The check finds them there."""
    assert not (PACKAGE / "testing").exists()
    assert [line for path in sorted(PACKAGE.rglob("*.py")) for line in scaffolding(path)] == []
    found = "\n".join(line for path in sorted(SUPPORT.rglob("*.py")) for line in scaffolding(path))
    assert "class CudaTensorsOnTheCpu(TorchFunctionMode)" in found and "ModuleType(...)" in found


def test_the_examples_import_only_the_package_torch_and_megatron():
    """What an example imports at module level or in a function: the package, torch, Megatron,
    what an example demonstrates (transformers, safetensors, peft, matplotlib for the curve), the
    standard library and the examples' own modules; never the test side."""
    own = {path.stem for path in EXAMPLES.glob("*.py")}
    allowed = {"mcore_torch_experts", "torch", "megatron", "transformers", "safetensors", "peft",
               "matplotlib", "yaml", *sys.stdlib_module_names, *own}
    outside = {path.name: sorted(outside_imports(path) - allowed)
               for path in sorted(EXAMPLES.glob("*.py"))}
    assert {name: found for name, found in outside.items() if found} == {}
    assert "single_process" in own and len(outside) >= 6


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
    """NeMo-RL (and the Ray it runs its workers in) is optional: one module imports it."""
    importers = {module_name(path) for path in PACKAGE.rglob("*.py")
                 if outside_imports(path) & {"nemo_rl", "ray"}}
    assert importers == {"integrations.nemo_rl"}, importers


LEAVES = {"errors", "enums", "settings"}
"""The modules every other one may import: the error type, the choices, the settings' one read."""


def test_the_leaves_import_only_each_other():
    graph = package_imports()
    assert LEAVES <= MODULES
    outside = {m: sorted(graph[m] - LEAVES) for m in LEAVES}
    assert all(not found for found in outside.values()), outside


def test_the_kernels_wing_imports_only_itself_and_the_leaves():
    graph = package_imports()
    kernels = {m for m in MODULES if m == "kernels" or m.startswith("kernels.")}
    assert len(kernels) >= 6
    outside = {m: sorted(graph[m] - kernels - LEAVES) for m in kernels}
    assert all(not found for found in outside.values()), outside


def local_modules(folder: Path) -> set:
    """The importable names the repository's own files in `folder` define (a module per file,
    a package per folder holding an __init__.py), vendored third-party code left out."""
    names = set()
    for path in folder.rglob("*.py"):
        if "third_party" in path.parts:
            continue
        names.add(path.parent.name if path.name == "__init__.py" else path.stem)
    return names


REPOSITORY = (local_modules(TESTS) | local_modules(EXAMPLES) | local_modules(TESTS.parent / "benchmarks")
              | {"mcore_torch_experts", "specs"}) - {"conftest"}


def repository_imports(path: Path) -> set:
    return outside_imports(path) & REPOSITORY


def test_unit_tests_import_only_the_package_and_support():
    unit = sorted((TESTS / "unit").rglob("*.py"))
    assert len(unit) >= 20
    found = {str(p.relative_to(TESTS)): sorted(repository_imports(p) - {"mcore_torch_experts", "support"})
             for p in unit}
    assert {name: names for name, names in found.items() if names} == {}


def test_each_integration_room_imports_no_other_room():
    rooms = {room.name: room for room in ROOMS.iterdir() if room.is_dir()}
    assert {"bridge", "megatron_lm", "nemo_rl", "automodel"} <= set(rooms)
    crossings = {}
    for name, room in rooms.items():
        others = set().union(*(local_modules(r) for n, r in rooms.items() if n != name))
        for path in room.rglob("*.py"):
            if "third_party" not in path.parts and (names := repository_imports(path) & others):
                crossings[str(path.relative_to(TESTS))] = sorted(names)
    assert crossings == {}


def test_support_imports_nothing_of_the_test_folders():
    folders = set().union(*(local_modules(TESTS / f) for f in ("unit", "integration", "distributed")))
    found = {str(p.relative_to(TESTS)): sorted(repository_imports(p) & folders)
             for p in (TESTS / "support").rglob("*.py")}
    assert {name: names for name, names in found.items() if names} == {}
