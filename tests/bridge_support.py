"""Importing Megatron-Bridge's PEFT in tests, with or without Transformer Engine.

Bridge imports `transformer_engine.pytorch` unconditionally, and TE cannot be built on CPU-only
machines; `examples/cpu_support.import_megatron_bridge` makes a stand-in visible during Bridge's
import only (see its docstring). Here tests skip, with the reason, where Bridge cannot be had.
"""

import importlib.util
import sys
from pathlib import Path

import pytest


def import_bridge_peft() -> None:
    """Import Bridge's PEFT modules, or skip the test with the reason Bridge is unavailable."""
    if sys.version_info < (3, 12):
        pytest.skip("Megatron-Bridge 0.6 needs Python 3.12")
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("megatron-bridge is not installed")
    examples = str(Path(__file__).parents[1] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    from cpu_support import import_megatron_bridge

    import_megatron_bridge()
