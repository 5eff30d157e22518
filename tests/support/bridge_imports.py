"""Importing Megatron-Bridge on a host without Transformer Engine or Bridge's optional
training packages: `import_megatron_bridge` (its PEFT modules, a Transformer Engine stand-in
visible during that import only), `import_megatron_bridge_checkpointing` and
`import_megatron_bridge_training` (stand-ins for packages the leg lacks, during the import only).
An installed package is always used as it is; nothing here patches Bridge or this package."""

import sys
import types

BRIDGE_PREIMPORT = (
    "megatron.core.extensions.transformer_engine",
    "megatron.core.models.hybrid.hybrid_layer_specs",
    "megatron.core.models.T5",
    "megatron.core.models.multimodal.llava_model",
    "megatron.core.models.vision.radio",
    "megatron.core.models.vision.vit_layer_specs",
    "megatron.core.ssm.mamba_hybrid_layer_allocation",
    "megatron.training",
)


def import_megatron_bridge():
    """`import megatron.bridge` (and its PEFT modules), on a host without Transformer Engine too.

    Megatron-Bridge's `peft/lora_layers.py` runs `import transformer_engine.pytorch as te`
    unconditionally (and uses `te.Linear`, `te.LayerNormLinear`, `te.ops.Sequential` in
    isinstance checks and annotations). Without TE, a stand-in module with those three names
    (classes nothing is an instance of) is visible while Bridge is imported and removed right
    after. Megatron-Core decides whether TE is present when each of its modules is first
    imported, so every Megatron-Core module Bridge's import pulls in is imported first
    (BRIDGE_PREIMPORT), and one first imported while the stand-in is visible is an error naming
    it. Bridge's PEFT modules then hold Megatron-Core's placeholders for the TE classes and
    `HAVE_TE*` flags that say TE is there; the flags are set to False, which is what they mean
    here (their `isinstance` checks against placeholders would raise). With TE installed, or
    once Bridge is imported, nothing is stood in.
    """
    import importlib
    import importlib.util

    bridge_modules = ("megatron.bridge", "megatron.bridge.peft.lora",
                      "megatron.bridge.peft.canonical_lora", "megatron.bridge.peft.dora")
    if "megatron.bridge.peft.lora" in sys.modules or importlib.util.find_spec("transformer_engine"):
        for name in bridge_modules:
            importlib.import_module(name)
        return sys.modules["megatron.bridge"]
    for name in BRIDGE_PREIMPORT:
        importlib.import_module(name)

    class _NoTEModule:
        """No object is an instance of this: Bridge's TE branches are never taken."""

    te = types.ModuleType("transformer_engine")
    te.__path__ = []
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.Linear = te.pytorch.LayerNormLinear = _NoTEModule
    te.pytorch.ops = types.SimpleNamespace(Sequential=_NoTEModule)
    before = set(sys.modules)
    sys.modules.update({"transformer_engine": te, "transformer_engine.pytorch": te.pytorch})
    try:
        for name in bridge_modules:
            importlib.import_module(name)
    finally:
        del sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"]
    from megatron.bridge.peft import module_matcher, utils

    for module in (utils, module_matcher):
        for flag in [name for name in vars(module) if name.startswith("HAVE_TE")]:
            setattr(module, flag, False)
    leaked = sorted(name for name in set(sys.modules) - before
                    if name.startswith("megatron.") and not name.startswith("megatron.bridge"))
    if leaked:
        raise RuntimeError(f"Megatron-Core modules first imported while the Transformer Engine "
                           f"stand-in was visible (add them to BRIDGE_PREIMPORT): {leaked}")
    return sys.modules["megatron.bridge"]


def _import_with_stand_ins(names, stand_ins: dict) -> list:
    """The modules `names`, imported with the `stand_ins` ({name: module}) visible in sys.modules
    during that import only."""
    import importlib

    sys.modules.update(stand_ins)
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        for name in stand_ins:
            sys.modules.pop(name, None)
    return [sys.modules[name] for name in names]


BRIDGE_CHECKPOINTING = ("megatron.bridge.training.model_load_save",
                        "megatron.bridge.training.checkpointing",
                        "megatron.bridge.training.post_training.checkpointing",
                        "megatron.bridge.training.setup")


def import_megatron_bridge_checkpointing():
    """Import Megatron-Bridge's checkpointing (`training.model_load_save`: save_megatron_model,
    load_model_config, load_megatron_model; `training.checkpointing`: save_checkpoint,
    load_checkpoint; `training.setup`: finetune's PEFT pre-wrap hook) on a host without
    nvidia-modelopt, Hugging Face `datasets`, Megatron-Energon or tensorboard, after
    `import_megatron_bridge()`.

    Bridge imports them unconditionally: `training.config` pulls in its SFT dataset builders
    (`import datasets`, `from datasets import load_dataset`), `training.checkpointing` imports
    `save_modelopt_state`, `save_sharded_modelopt_state` and `restore_modelopt_state` from
    `modelopt.torch.opt.plugins` and calls them on every save and load,
    `training.post_training.checkpointing` imports `modelopt.torch.opt`, the data builders
    import Megatron-Energon (`megatron.energon`, multimodal loaders) and `training.state` imports
    tensorboard's `SummaryWriter` (made only with a `logger.tensorboard_dir`). Where a package is
    missing, a stand-in is visible while these modules are imported and removed right after
    (as the Transformer Engine stand-in of `import_megatron_bridge`). What the modules bound
    stays: the dataset functions raise if called (no dataset is loaded here), the Energon and
    SummaryWriter names are classes nothing is an instance of and nothing makes; the ModelOpt
    functions do what ModelOpt does for a model it never converted (no quantizer, no
    distillation): add nothing to the checkpoint and restore nothing. Installed packages are
    used as they are."""
    import importlib
    import importlib.util

    stand_ins = {}
    if importlib.util.find_spec("datasets") is None:
        def no_datasets(*args, **kwargs):
            raise ModuleNotFoundError("Hugging Face `datasets` is not installed (a stand-in let "
                                      "Megatron-Bridge's training modules import)")
        data = types.ModuleType("datasets")
        data.builder = types.SimpleNamespace()
        data.utils = types.SimpleNamespace()
        data.load_dataset = data.concatenate_datasets = no_datasets
        stand_ins["datasets"] = data
    if importlib.util.find_spec("modelopt") is None:
        names = ("modelopt", "modelopt.torch", "modelopt.torch.opt", "modelopt.torch.opt.plugins",
                 "modelopt.torch.opt.plugins.mcore_dist_checkpointing")
        modules = {name: types.ModuleType(name) for name in names}
        for parent, child in zip(names, names[1:]):
            setattr(modules[parent], child.rpartition(".")[2], modules[child])
        for module in modules.values():
            module.__path__ = []
        modules["modelopt"].__version__ = "0+stand-in"
        opt, plugins = modules["modelopt.torch.opt"], modules["modelopt.torch.opt.plugins"]
        opt.ModeloptStateManager = types.SimpleNamespace(is_converted=lambda *args, **kwargs: False)
        plugins.save_modelopt_state = lambda *args, **kwargs: None
        plugins.save_sharded_modelopt_state = lambda *args, **kwargs: None
        plugins.restore_modelopt_state = lambda *args, **kwargs: None
        modules[names[-1]]._load_extra_state_from_sharded_checkpoint = lambda *args, **kwargs: None
        stand_ins.update(modules)
    if importlib.util.find_spec("megatron.energon") is None:
        energon = types.ModuleType("megatron.energon")
        energon.__path__ = []
        energon.__getattr__ = lambda name: type(name, (), {})  # classes nothing is an instance of
        stand_ins["megatron.energon"] = energon
    if importlib.util.find_spec("tensorboard") is None:
        writer = types.ModuleType("torch.utils.tensorboard.writer")
        writer.SummaryWriter = type("SummaryWriter", (), {})  # never made: no tensorboard_dir
        stand_ins["torch.utils.tensorboard.writer"] = writer
    return _import_with_stand_ins(BRIDGE_CHECKPOINTING, stand_ins)


BRIDGE_TRAINING = ("megatron.bridge.training.pretrain", "megatron.bridge.training.finetune",
                   "megatron.bridge.training.gpt_step")


def import_megatron_bridge_training():
    """Import Megatron-Bridge's training entry (`training.finetune`, `training.pretrain`,
    `training.gpt_step`'s forward_step), after `import_megatron_bridge()`, with the packages its
    training modules import installed (scripts/legs.sh, BRIDGE_TRAINING_DEPS: HF `datasets`,
    nvidia-modelopt, Megatron-Energon, tensorboard and what they import) but one.

    `training.pretrain` runs `from nvidia_resiliency_ext.inprocess import CallWrapper`
    unconditionally (the name is used only with in-process restart on). The package that runs
    with megatron-core 0.19 and 0.20, nvidia-resiliency-ext 0.7.0, is published only as a cp312
    manylinux_2_39 wheel: hosts with an older glibc (the CPU legs' Debian 12 has 2.36) cannot
    install it, and what they can install, 0.4.1, breaks `import megatron.core` (Megatron-Core
    asks for 0.6+ and reads 0.4.1's missing `__version__`). On the GPU the real package is
    installed and used (scripts/gpu_client_routes.sh). Where the package is missing, a stand-in
    holding that one name (a class nothing makes) is visible while Bridge's training modules are
    imported and removed right after; Megatron-Core's dist_checkpointing is imported first, so
    it decides without it. An installed package is used as it is."""
    import importlib
    import importlib.util

    importlib.import_module("megatron.core.dist_checkpointing")
    stand_ins = {}
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:
        nvrx = types.ModuleType("nvidia_resiliency_ext")
        nvrx.__path__ = []
        nvrx.inprocess = types.ModuleType("nvidia_resiliency_ext.inprocess")
        nvrx.inprocess.CallWrapper = type("CallWrapper", (), {})  # in-process restart is off
        stand_ins = {"nvidia_resiliency_ext": nvrx,
                     "nvidia_resiliency_ext.inprocess": nvrx.inprocess}
    return _import_with_stand_ins(BRIDGE_TRAINING, stand_ins)
