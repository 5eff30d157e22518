"""Run by tests/test_installed_wheel.py with the interpreter of a fresh venv that has the wheel
installed, from a temporary working directory, its source passed with `python -c` (so neither
this folder nor the repository is on sys.path). What a user's process does with the installed
package: import it, resolve `--spec mcore_torch_experts.specs torch_experts_gpt_spec` with
Megatron-LM's own helper and build the model from it the way Megatron-LM does, resolve the
`_target_` strings Bridge's run_config.yaml records, and every import path the docs name. Writes
what it found as JSON to the path in argv[1]; argv[2] is a JSON object of inputs.

Nothing here imports the package from the repository: the package comes from the installed
wheel, and only the CPU patch table from the test side (`support.cpu_support`, tests/ on
PYTHONPATH), as a user's CPU host would get it.
"""

import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import pkgutil
import sys
import traceback
import warnings

warnings.simplefilter("ignore")


def main(out_path, inputs):
    result = {"sys_path": list(sys.path), "cwd": os.getcwd()}
    import mcore_torch_experts

    result["package_file"] = mcore_torch_experts.__file__
    result["package_version"] = mcore_torch_experts.__version__
    distribution = importlib.metadata.distribution("mcore_torch_experts")
    result["dist_version"] = distribution.version
    result["dist_location"] = str(distribution.locate_file(""))
    result["dist_requires"] = distribution.requires or []
    result["dist_extras"] = distribution.metadata.get_all("Provides-Extra") or []
    result["requirements_unmet"] = unmet_requirements(distribution.requires or [])
    # Every place on sys.path from which some `mcore_torch_experts` could be imported.
    result["importable_from"] = sorted(
        entry for entry in sys.path
        if os.path.isfile(os.path.join(entry or ".", "mcore_torch_experts", "__init__.py")))

    # Every module of the installed package imports, or fails for a module outside it (an
    # integration's client this leg lacks: [message, the missing module's name]).
    modules, failed = [], {}
    for info in pkgutil.walk_packages(mcore_torch_experts.__path__, "mcore_torch_experts."):
        name = info.name
        try:
            module = importlib.import_module(name)
        except ImportError as error:
            failed[name] = [f"{type(error).__name__}: {error}", error.name]
            continue
        modules.append([name, module.__file__])
    result["modules"], result["module_import_errors"] = modules, failed

    # The public import paths: `from MODULE import NAME` for each pair the docs, examples and
    # __all__ lists name; a class or function of this package must come from the installed copy.
    unresolved, defined_outside = {}, {}
    for module_name, name in inputs["import_paths"]:
        key = f"{module_name}:{name}" if name else module_name
        try:
            value = importlib.import_module(module_name)
            if name:
                value = getattr(value, name)
        except (ImportError, AttributeError) as error:
            unresolved[key] = [f"{type(error).__name__}: {error}",
                               getattr(error, "name", None) if isinstance(error, ImportError)
                               else None]
            continue
        source = defining_file(value)
        if source and not inside(source, inputs["venv"]) and is_ours(value):
            defined_outside[key] = source
    result["unresolved_import_paths"], result["defined_outside_venv"] = unresolved, defined_outside

    from support.cpu_support import init_single_process_megatron

    init_single_process_megatron(on_cpu=True)
    result["megatron_lm_spec"] = megatron_lm_spec_route(inputs)
    result["bridge_targets"] = bridge_targets(inputs)
    result["entry_points"] = entry_point_specs(inputs)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


def has_module(name):
    """Whether `name` exists (its parent packages are imported to find out). A parent package
    that is absent answers False; one that is there but fails to import (a dependency of it
    missing from the leg) raises, naming what is missing."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError as error:
        if error.name and (name == error.name or name.startswith(error.name + ".")):
            return False
        raise


def inside(path, folder):
    return os.path.realpath(path).startswith(os.path.realpath(folder) + os.sep)


def is_ours(value):
    return getattr(value, "__module__", getattr(value, "__name__", "")).startswith(
        "mcore_torch_experts")


def defining_file(value):
    try:
        return inspect.getfile(value)
    except TypeError:  # a constant: its module was checked when imported
        return None


def unmet_requirements(requires):
    """The wheel's unconditional Requires-Dist entries the leg's environment does not satisfy
    (pip installed the wheel with --no-deps: nothing may be fetched)."""
    from packaging.requirements import Requirement

    unmet = []
    for text in requires:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's, or another platform's
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{text}: not installed")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            unmet.append(f"{text}: {version} installed")
    return unmet


def tiny_config(**overrides):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                    moe_ffn_hidden_size=32, moe_router_topk=2, moe_grouped_gemm=True,
                    moe_token_dispatcher_type="allgather", add_bias_linear=False,
                    use_cpu_initialization=True, transformer_impl="local",
                    params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**settings, **overrides})


def experts_of(model):
    return [[type(layer.mlp).__name__, type(layer.mlp.experts).__name__,
             inspect.getfile(type(layer.mlp.experts))]
            for layer in model.decoder.layers if hasattr(layer.mlp, "experts")]


def megatron_lm_spec_route(inputs):
    """`--spec MODULE NAME` as Megatron-LM resolves it: megatron-core's `import_module`
    (spec_utils), which Megatron-LM 0.19's `gpt_config_from_args` and its `gpt_builders.py` call
    on `args.spec`. Where the release has megatron.training.models (megatron-core 0.19 on), the
    model is built as `pretrain_gpt.py` builds it: a `GPTModelConfig` holding the callable, built
    by its own `GPTModelBuilder`. Before that, the callable is called as that builder calls it
    and Megatron-Core's GPTModel takes the spec."""
    import torch
    from megatron.core.transformer.spec_utils import import_module

    module_name, name = inputs["spec_argument"]
    spec_function = import_module((module_name, name))
    found = {"function": f"{spec_function.__module__}.{spec_function.__qualname__}",
             "function_file": inspect.getfile(spec_function)}
    config = tiny_config()
    torch.manual_seed(0)
    if has_module("megatron.training.models.gpt"):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.training.models.gpt import GPTModelConfig

        model_cfg = GPTModelConfig(transformer=config, transformer_layer_spec=spec_function,
                                   vocab_size=128, seq_length=16)
        builder = model_cfg.get_builder_cls()(model_cfg)
        found["route"] = f"{type(builder).__module__}.{type(builder).__name__}"
        model = builder.build_model(ProcessGroupCollection.use_mpu_process_groups())
    else:
        from megatron.core.models.gpt import GPTModel

        found["route"] = "megatron.core.models.gpt.GPTModel"
        kwargs = {"vp_stage": None} if "vp_stage" in inspect.signature(
            spec_function).parameters else {}
        model = GPTModel(config, transformer_layer_spec=spec_function(config, **kwargs),
                         vocab_size=128, max_sequence_length=16)
    found["experts"] = experts_of(model)
    # One forward and backward through the built model, its expert weights frozen as built.
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)
    loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    found["loss"] = loss.item()
    found["expert_weights_trainable"] = sorted(
        n for n, p in model.named_parameters() if ".mlp.experts." in n and p.requires_grad)
    found["grads_finite"] = all(bool(torch.isfinite(p.grad).all())
                                for p in model.parameters() if p.grad is not None)
    found["params_with_grad"] = sum(p.grad is not None for p in model.parameters())
    return found


def bridge_targets(inputs):
    """Each `{_target_: mcore_torch_experts.specs.NAME, _call_: false}` run_config.yaml records,
    through the resolver Megatron-Bridge reloads it with: Bridge's `instantiate` is
    megatron.training's (megatron/training/config/instantiate_utils.py, in megatron-core 0.18+),
    with the prefix allowed as docs/enable.md says. None where that module is absent (no Bridge
    runs on those releases)."""
    if not has_module("megatron.training.config.instantiate_utils"):
        return None
    from megatron.training.config.instantiate_utils import instantiate, target_allowlist

    target_allowlist.add_prefix("mcore_torch_experts.")
    resolved = {}
    for target in inputs["targets"]:
        try:
            value = instantiate({"_target_": target, "_call_": False})
            resolved[target] = [f"{value.__module__}.{value.__qualname__}", inspect.getfile(value)]
        except Exception as error:  # noqa: BLE001 - reported to the test, which names it
            resolved[target] = [f"{type(error).__name__}: {error}", None]
    return resolved


def entry_point_specs(inputs):
    """Every launcher entry point resolved by its import path and called on a plain
    TransformerConfig: [MoE layer class, experts class, experts class file] per MoE layer."""
    from megatron.core.transformer.spec_utils import import_module

    from mcore_torch_experts import _compat

    config = tiny_config()
    built = {}
    for name in inputs["entry_points"]:
        try:
            spec = import_module(("mcore_torch_experts.specs", name))(config)
        except Exception:  # noqa: BLE001 - reported to the test, which names it
            built[name] = traceback.format_exc(limit=3)
            continue
        if hasattr(spec, "layer_specs"):
            mlps = [s.submodules.mlp for s in spec.layer_specs
                    if _compat.is_moe_mlp_spec(s.submodules.mlp)]
        else:
            mlps = [spec.submodules.moe_layer.submodules.mlp]
        rows = []
        for mlp in mlps:
            experts = _compat.spec_class(_compat.moe_submodules(mlp).experts)
            rows.append([_compat.spec_class(mlp).__name__, experts.__name__,
                         inspect.getfile(experts)])
        built[name] = rows
    return built


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
