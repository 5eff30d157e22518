"""Importing Megatron-Bridge's PEFT in tests, with or without Transformer Engine.

`megatron/bridge/peft/lora_layers.py` runs `import transformer_engine.pytorch as te` at import
time (it needs TE only for its op-fuser wrapper, which these tests never build), and TE cannot
be built on CPU-only machines. Where TE is absent, `import_bridge_peft()` puts a stand-in
`transformer_engine` / `transformer_engine.pytorch` (no attributes besides `ops.Sequential`, read
by an annotation) into sys.modules for the duration of Bridge's import only, then removes it.

Without TE, Megatron-Core (0.19) exports MagicMock placeholders under the TE class names; Bridge
imports them and sets its `HAVE_TE*` flags, and its `isinstance` checks against them raise
TypeError. After the import those Bridge flags are set to False, which is what they mean here.

Megatron-Core decides whether TE is present when each of its modules is first imported. So that
no Megatron module sees the stand-in, every Megatron (non-Bridge) module that Bridge's import
pulls in is imported before the stand-in goes in (PREIMPORT), and the window is checked: a
Megatron module first imported inside it fails the test setup, naming the module.
"""

import importlib
import importlib.util
import sys
import types

import pytest

PREIMPORT = (  # Megatron modules that `import megatron.bridge` (0.6.2) imports
    "megatron.training",
    "megatron.core.models.T5",
    "megatron.core.models.multimodal.llava_model",
    "megatron.core.models.vision.radio",
    "megatron.core.models.vision.vit_layer_specs",
    "megatron.core.ssm.mamba_hybrid_layer_allocation",
)
BRIDGE_MODULES = (
    "megatron.bridge.peft.lora",
    "megatron.bridge.peft.canonical_lora",
    "megatron.bridge.peft.dora",
)
STAND_IN = ("transformer_engine", "transformer_engine.pytorch")


def _stand_in_modules() -> dict:
    te = types.ModuleType("transformer_engine")
    te.__path__ = []
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.ops = types.SimpleNamespace(Sequential=object)
    return {"transformer_engine": te, "transformer_engine.pytorch": te.pytorch}


def import_bridge_peft() -> None:
    """Import Bridge's PEFT modules, or skip the test with the reason Bridge is unavailable."""
    if sys.version_info < (3, 12):
        pytest.skip("Megatron-Bridge 0.6 needs Python 3.12")
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("megatron-bridge is not installed")
    if "megatron.bridge.peft.lora" in sys.modules or importlib.util.find_spec("transformer_engine"):
        for name in BRIDGE_MODULES:
            importlib.import_module(name)
        return
    for name in PREIMPORT:
        importlib.import_module(name)
    before = set(sys.modules)
    sys.modules.update(_stand_in_modules())
    try:
        for name in BRIDGE_MODULES:
            importlib.import_module(name)
    finally:
        for name in STAND_IN:
            sys.modules.pop(name, None)
    from megatron.bridge.peft import module_matcher, utils

    for module in (utils, module_matcher):
        for flag in [name for name in vars(module) if name.startswith("HAVE_TE")]:
            setattr(module, flag, False)
    leaked = sorted(n for n in set(sys.modules) - before
                    if n.startswith("megatron.") and not n.startswith("megatron.bridge"))
    assert not leaked, (f"Megatron modules first imported while the TE stand-in was in place "
                        f"(add them to PREIMPORT): {leaked}")
