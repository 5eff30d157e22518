"""The package as users get it: the sdist and the wheel built from the repository with this leg's
setuptools (offline), the wheel installed into a fresh venv of this leg's interpreter, and there,
away from the source tree, the package imported, `--spec mcore_torch_experts.specs
torch_experts_gpt_spec` resolved by Megatron-LM's own helper and built into a model the way
Megatron-LM builds it, the `_target_` strings Megatron-Bridge's run_config.yaml records
resolved by the resolver Bridge reloads them with, and every import path the docs, the examples
and `__all__` name.

The fresh venv is made with `--system-site-packages`, which reaches the base interpreter's
packages, not this leg venv's: a `.pth` file names the leg's site-packages folders, so torch and
megatron-core are the leg's. Folders named by a `.pth` line are put on sys.path without their
own `.pth` files being run, so the leg's editable install of this repository stays out; the
leg's PYTHONPATH goes along without any entry holding a `mcore_torch_experts` package, the worker
runs from an empty temporary folder with its source passed by `-c`, and the tests assert that the
only importable copy is the installed one.
"""

import ast
import configparser
import fnmatch
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import megatron
import megatron.core
import pytest

import mcore_torch_experts
from mcore_torch_experts import specs
from megatron_lm_worker import documented_flags
from support.doc_snippets import PUBLISHED, README_MD, snippet, snippets
from support.specs import LAUNCHER_ENTRY_POINTS

# The venv's Python and setuptools: one leg per venv (scripts/legs.sh).
pytestmark = pytest.mark.once_per_venv

TESTS = Path(__file__).parent
REPO = TESTS.parent
PACKAGE = REPO / "mcore_torch_experts"
NAME = "mcore_torch_experts"
# What a source install needs besides the package (README.md: the long description); the
# changelog goes along. Nothing else: the suite runs from the repository.
SDIST_FILES = {"PKG-INFO", "setup.cfg", "pyproject.toml", "README.md", "CHANGELOG.md",
               "MANIFEST.in"}
STEP_TIMEOUT = 300


def source_version() -> str:
    """`__version__` as the source tree's __init__.py assigns it (read, not imported)."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__version__"]:
            return node.value.value
    raise AssertionError("mcore_torch_experts/__init__.py assigns no __version__")


def package_files() -> set:
    return {path.relative_to(REPO).as_posix() for path in PACKAGE.rglob("*.py")}


def package_modules() -> set:
    """Every module and subpackage of the package by dotted name (not the package itself)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names - {NAME}


def environment() -> dict:
    """This process's environment without a way to the source tree: PYTHONPATH (which
    tests/conftest.py points at the repository for the suite's own workers) keeps only the
    entries that hold no `mcore_torch_experts` package (this leg's megatron-core folder), after
    tests/ (the test side's CPU patches, `support.cpu_support`, which the wheel does not ship)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS)] + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and not holds_the_package(p)])
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU model on any host
    return env


def run(command, **kwargs):
    """`command` run to completion in `environment()`; its output, after asserting it exited 0."""
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True,
                          timeout=STEP_TIMEOUT, env=environment(), **kwargs)
    output = done.stdout + done.stderr
    shown = " ".join(str(c) if len(str(c)) < 200 else "<...>" for c in command)
    assert done.returncode == 0, f"{shown} exited {done.returncode}:\n{output[-6000:]}"
    return output


def copy_of_the_repository(dest: Path) -> Path:
    """The working tree without what .gitignore names (virtual environments, build outputs) and
    without .git: what a fresh clone holds, so that nothing is built inside the repository."""
    patterns = [line.strip().rstrip("/") for line in (REPO / ".gitignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")] + [".git"]

    def ignored(folder, names):
        return {n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)}

    shutil.copytree(REPO, dest, ignore=ignored, symlinks=True)
    return dest


def pip_wheel(source: Path, out: Path) -> Path:
    """`pip wheel` with this leg's setuptools (no build isolation, no index), checking that it
    satisfies pyproject.toml's build requirements."""
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--check-build-dependencies", "--no-index", "--disable-pip-version-check", "-q",
         "-w", out, source])
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def documented_import_paths() -> list:
    """[module, name or ""] for every import of the package in the published pages' python
    snippets and in examples/, every dotted `mcore_torch_experts.x.y` the pages name, `__all__`
    of the package and of its specs module, and `__version__`."""
    found = {(NAME, name) for name in mcore_torch_experts.__all__}
    found |= {(f"{NAME}.specs", name) for name in specs.__all__}
    found.add((NAME, "__version__"))
    sources = [text for doc in PUBLISHED for lang, text in snippets(doc).values()
               if lang == "python"]
    sources += [path.read_text() for path in sorted((REPO / "examples").glob("*.py"))]
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == NAME:
                found |= {(node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {(alias.name, "") for alias in node.names
                          if alias.name.split(".")[0] == NAME}
    modules = {NAME} | package_modules()
    for doc in PUBLISHED:
        for dotted in re.findall(rf"\b{NAME}(?:\.\w+)+", doc.read_text()):
            head, _, tail = dotted.rpartition(".")
            found.add((dotted, "") if dotted in modules else (head, tail))
    return sorted([module, name] for module, name in found)


def leg_site_folders() -> list:
    """This leg's site-packages folders (torch, megatron-core's 0.16.1 install, the test
    dependencies), for the fresh venv's .pth."""
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


def holds_the_package(entry: str) -> bool:
    return (Path(entry or ".") / NAME / "__init__.py").is_file()


def leg_has(relative: str) -> bool:
    """Whether this leg's megatron namespace holds `relative` (a file), without importing it."""
    return any((Path(folder) / relative).is_file() for folder in megatron.__path__)


def check_pip() -> None:
    """The leg's pip takes `--python` (22.3) and `--check-build-dependencies` (22.1)."""
    installed = importlib.metadata.version("pip")
    version = tuple(int(part) for part in re.findall(r"\d+", installed)[:2])
    assert version >= (22, 3), (
        f"tests/test_installed_wheel.py needs pip >= 22.3 in the leg (pip --python, "
        f"--check-build-dependencies); {sys.executable} has pip {installed}: "
        f"{sys.executable} -m pip install 'pip>=22.3'")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The sdist, the wheel from the repository and the wheel from the unpacked sdist."""
    check_pip()
    root = tmp_path_factory.mktemp("wheel")
    source = copy_of_the_repository(root / "repository")
    sdist_dir = root / "sdist"
    sdist_dir.mkdir()
    # The PEP 517 hook pip and `python -m build` call, with this leg's setuptools.
    run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
         "print(build_meta.build_sdist(sys.argv[1]))", sdist_dir], cwd=source)
    sdists = list(sdist_dir.glob("*.tar.gz"))
    assert len(sdists) == 1, sdists
    unpacked = root / "unpacked"
    with tarfile.open(sdists[0]) as archive:
        archive.extractall(unpacked, filter="data")
    (top,) = unpacked.iterdir()
    return {
        "sdist": sdists[0],
        "wheel": pip_wheel(source, root / "wheel-from-repository"),
        "wheel_from_sdist": pip_wheel(top, root / "wheel-from-sdist"),
        "root": root,
    }


def megatron_environment(venv: Path) -> Path:
    """A fresh venv at `venv` that already holds this leg's torch, megatron-core and einops (an
    existing Megatron environment; the module docstring says how); its python."""
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    site = Path(site.strip().splitlines()[-1])
    (site / "leg_site_packages.pth").write_text("\n".join(leg_site_folders()) + "\n")
    return python


@pytest.fixture(scope="module")
def installed(built):
    """The wheel installed in a fresh venv; what the worker found there (installed_wheel_worker)."""
    root = built["root"]
    venv = root / "venv"
    python = megatron_environment(venv)
    # This leg's pip, installing into the venv's interpreter; --no-deps: the requirements are
    # checked against the leg instead (the worker's requirements_unmet), nothing is fetched.
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--disable-pip-version-check", "-q", built["wheel"]])
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    site = Path(site.strip().splitlines()[-1])
    words = documented_flags()
    inputs = {
        "venv": str(venv),
        "spec_argument": words[words.index("--spec") + 1:words.index("--spec") + 3],
        "entry_points": list(LAUNCHER_ENTRY_POINTS),
        "targets": [f"{NAME}.specs.{name}" for name in LAUNCHER_ENTRY_POINTS],
        "import_paths": documented_import_paths(),
    }
    workdir = root / "cwd"
    workdir.mkdir()
    result_path = root / "result.json"
    run([python, "-c", (TESTS / "installed_wheel_worker.py").read_text(), result_path,
         json.dumps(inputs)], cwd=workdir)
    result = json.loads(result_path.read_text())
    result.update(venv=str(venv), site=str(site), workdir=str(workdir), inputs=inputs)
    return result


def in_folder(path, folder) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(folder) + os.sep)


# --- the distributions --------------------------------------------------------------------------


def test_sdist_holds_what_a_source_install_needs_and_nothing_else(built):
    with tarfile.open(built["sdist"]) as archive:
        names = [member.name for member in archive.getmembers() if member.isfile()]
    top = f"{NAME}-{source_version()}"
    assert all(name.startswith(top + "/") for name in names), names
    names = {name[len(top) + 1:] for name in names}
    assert names - {n for n in names if n.startswith(f"{NAME}.egg-info/")} == \
        SDIST_FILES | package_files()
    assert not any(name.startswith(("tests/", "specs/", "examples/")) for name in names)


def test_the_wheel_from_the_sdist_is_the_wheel_from_the_repository(built):
    """What pip and `python -m build` do from the sdist gives the same files, byte for byte
    (the RECORD aside, which lists hashes of the same files)."""
    with zipfile.ZipFile(built["wheel"]) as a, zipfile.ZipFile(built["wheel_from_sdist"]) as b:
        names = sorted(n for n in a.namelist() if not n.endswith("/RECORD"))
        assert names == sorted(n for n in b.namelist() if not n.endswith("/RECORD"))
        for name in names:
            assert a.read(name) == b.read(name), name


def test_wheel_holds_the_package_and_its_metadata_only(built):
    version = source_version()
    assert built["wheel"].name == f"{NAME}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(f"{NAME}-{version}.dist-info/METADATA").decode()
    dist_info = {n for n in names if n.startswith(f"{NAME}-{version}.dist-info/")}
    assert names - dist_info == package_files()
    assert {n.rsplit("/", 1)[1] for n in dist_info} >= {"METADATA", "WHEEL", "RECORD",
                                                        "top_level.txt"}
    fields = [line.split(": ", 1) for line in metadata.split("\n\n", 1)[0].splitlines()]
    assert ["Name", NAME] in fields and ["Version", version] in fields
    assert ["Requires-Python", ">=3.11"] in fields


def test_wheel_requirements_and_extras_are_setup_cfgs(built):
    """Requires-Dist is setup.cfg's install_requires and extras, markers kept: [te] is
    Transformer Engine's PyTorch build, [test] what the suite imports beyond them."""
    version = source_version()
    with zipfile.ZipFile(built["wheel"]) as wheel:
        metadata = wheel.read(f"{NAME}-{version}.dist-info/METADATA").decode()
    header = metadata.split("\n\n", 1)[0].splitlines()
    requires = [line.split(": ", 1)[1] for line in header if line.startswith("Requires-Dist: ")]
    extras = [line.split(": ", 1)[1] for line in header if line.startswith("Provides-Extra: ")]
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    declared = {extra: [line for line in text.splitlines() if line.strip()]
                for extra, text in cfg["options.extras_require"].items()}
    assert sorted(extras) == sorted(declared) == ["te", "test"]
    assert [r for r in requires if "extra ==" not in r] == \
        ["torch>=2.9", "megatron-core<0.21,>=0.16", "einops"]
    assert 'transformer_engine[pytorch]; extra == "te"' in requires
    assert 'triton; platform_system == "Linux" and extra == "test"' in requires
    assert sum("extra == \"test\"" in r for r in requires) == len(declared["test"])


# --- installed, away from the source tree --------------------------------------------------------


def test_the_only_importable_copy_is_the_installed_one(installed):
    venv = installed["venv"]
    assert in_folder(installed["package_file"], installed["site"]), installed["package_file"]
    assert installed["importable_from"] == [installed["site"]], installed["importable_from"]
    assert installed["cwd"] == installed["workdir"]
    assert not any(os.path.realpath(p or installed["cwd"]) == os.path.realpath(REPO)
                   for p in installed["sys_path"])
    assert in_folder(installed["dist_location"], venv)
    assert installed["package_version"] == installed["dist_version"] == source_version()


def missing_from_the_leg(failures: dict) -> dict:
    """{what failed: its error} for the import failures not explained by a module outside the
    package that this leg lacks too (an integration's client: nemo_automodel where no NeMo
    Automodel is installed); a module of the package itself missing is never explained."""
    def explained(name):
        if not name or name.split(".")[0] == NAME:
            return False
        try:
            return importlib.util.find_spec(name) is None
        except ModuleNotFoundError:  # a parent package is absent
            return True
    return {key: message for key, (message, name) in failures.items() if not explained(name)}


def test_every_module_of_the_installed_package_imports_from_it(installed):
    assert missing_from_the_leg(installed["module_import_errors"]) == {}
    modules = dict(installed["modules"])
    assert set(modules) | set(installed["module_import_errors"]) == \
        package_modules()
    assert all(in_folder(path, installed["site"]) for path in modules.values())
    # What only an integration's client can stop: the experts, specs and kernels import anywhere.
    assert {f"{NAME}.{m}" for m in ("experts", "specs", "config", "lora", "convert",
                                    "integrations.bridge", "kernels.activation_triton",
                                    "kernels.fused_experts_triton", "kernels.choice")} <= set(modules)


def test_the_leg_meets_the_wheels_requirements(installed):
    assert installed["requirements_unmet"] == []
    assert sorted(installed["dist_extras"]) == ["te", "test"]


def test_every_documented_import_path_resolves_from_the_installed_wheel(installed):
    paths = installed["inputs"]["import_paths"]
    assert [NAME + ".specs", "torch_experts_gpt_spec"] in paths  # the docs were read
    assert [NAME + ".integrations.automodel", "install_fp32_combine"] in paths
    assert missing_from_the_leg(installed["unresolved_import_paths"]) == {}
    assert installed["defined_outside_venv"] == {}
    # Only the paths into a module that failed for its client's absence are left unresolved.
    failed_modules = set(installed["module_import_errors"])
    assert all(key.split(":")[0] in failed_modules
               for key in installed["unresolved_import_paths"])


def test_megatron_lm_spec_argument_builds_torch_experts_from_the_wheel(installed):
    found = installed["megatron_lm_spec"]
    assert installed["inputs"]["spec_argument"] == [f"{NAME}.specs", "torch_experts_gpt_spec"]
    assert found["function"] == f"{NAME}.specs.torch_experts_gpt_spec"
    assert in_folder(found["function_file"], installed["site"])
    # From megatron-core 0.19 on, the route pretrain_gpt.py takes: GPTModelConfig, its builder.
    expected_route = ("megatron.training.models.gpt.GPTModelBuilder"
                      if leg_has("training/models/gpt.py") else
                      "megatron.core.models.gpt.GPTModel")
    assert found["route"] == expected_route
    assert [row[:2] for row in found["experts"]] == [["MoELayer", "TorchGroupedMLP"]] * 2
    assert all(in_folder(row[2], installed["site"]) for row in found["experts"])
    assert found["expert_weights_trainable"] == []  # built frozen
    assert found["params_with_grad"] > 0 and found["grads_finite"]
    assert abs(found["loss"] - math.log(128)) < 1  # an untrained model over 128 tokens


def test_bridge_run_config_targets_resolve_from_the_wheel(installed):
    resolved = installed["bridge_targets"]
    if resolved is None:
        assert not leg_has("training/config/instantiate_utils.py")
        pytest.skip(f"megatron-core {megatron.core.__version__} has no "
                    "megatron.training.config.instantiate_utils (the resolver Bridge "
                    "reloads run_config.yaml with)")
    assert set(resolved) == set(installed["inputs"]["targets"])
    for target, (value, path) in resolved.items():
        assert value == target, value
        assert in_folder(path, installed["site"]), (target, path)


@pytest.mark.parametrize("entry", list(LAUNCHER_ENTRY_POINTS))
def test_every_launcher_entry_point_builds_what_its_name_says_from_the_wheel(installed, entry):
    rows = installed["entry_points"][entry]
    assert isinstance(rows, list), rows  # otherwise the traceback of the failed build
    experts, layer = LAUNCHER_ENTRY_POINTS[entry]
    assert rows and {row[0] for row in rows} == {layer.__name__}
    assert ({row[1] for row in rows} == {"TorchGroupedMLP"}) == (experts == "torch")
    for _, experts_class, path in rows:
        if experts_class == "TorchGroupedMLP":
            assert in_folder(path, installed["site"]), path


# --- the documented pip lines ---------------------------------------------------------------------


def documented_pip_lines() -> list:
    """The pip commands of README.md's readme-install and docs/enable.md's pip-install snippets,
    as words, comments dropped, each once."""
    lines = [*snippet("readme-install", README_MD).splitlines(),
             *snippet("pip-install").splitlines()]
    found = []
    for line in lines:
        words = shlex.split(line, comments=True)
        if words and words not in found:
            found.append(words)
    return found


def test_the_documented_pip_lines_install_the_package_only_into_a_megatron_environment(
        built, tmp_path):
    """Each documented line, run as written in a copy of the repository (what a clone holds) with
    the offline options docs/enable.md names, into a venv that already holds the leg's torch,
    megatron-core and einops: pip installs this package and nothing else (with `--no-deps` and
    without), and the package imports from that venv, megatron-core the leg's."""
    lines = documented_pip_lines()
    assert [words[:2] for words in lines] == [["pip", "install"]] * 2
    assert sorted(words[2:] for words in lines) == [["--no-deps", "."], ["."]]
    for number, words in enumerate(lines):
        python = megatron_environment(tmp_path / f"venv{number}")
        output = run([sys.executable, "-m", "pip", "--python", python, *words[1:], "--no-index",
                      "--no-build-isolation", "--disable-pip-version-check"],
                     cwd=built["root"] / "repository")
        installed = [line for line in output.splitlines() if line.startswith("Successfully installed")]
        assert installed == [f"Successfully installed {NAME}-{source_version()}"], output[-3000:]
        workdir = tmp_path / f"cwd{number}"
        workdir.mkdir()
        output = run([python, "-c", "import json, megatron.core, mcore_torch_experts.specs as s; "
                      "print('FOUND', json.dumps([s.__file__, megatron.core.__file__]))"],
                     cwd=workdir)
        found = json.loads(next(line[6:] for line in output.splitlines()
                                if line.startswith("FOUND ")))
        assert in_folder(found[0], tmp_path / f"venv{number}"), found
        assert os.path.realpath(found[1]) == os.path.realpath(megatron.core.__file__)
