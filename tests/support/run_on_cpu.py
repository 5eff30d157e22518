"""Run an example on a host without CUDA: the CPU patches first, then the example as `__main__`.

    python tests/support/run_on_cpu.py examples/finetune_lora.py [its arguments]

The examples import only the package, torch and Megatron. On the CPU Megatron needs the patches of
`cpu_support.megatron_patches` (each with its reason), and Megatron-Bridge's import needs
`bridge_imports.import_megatron_bridge` where Transformer Engine is absent: this launcher applies
them in this process, hides any GPU (`CUDA_VISIBLE_DEVICES=""`: the model stays on the CPU on a
CUDA host too), sets MCORE_TORCH_EXPERTS_EXAMPLE_ON_CPU=1 (the examples' `single_process.on_cpu`
reads it) and runs the example with its own folder first on sys.path, as Python would.
"""

import importlib.util
import os
import runpy
import sys
from pathlib import Path

USAGE = "usage: python tests/support/run_on_cpu.py EXAMPLE.py [its arguments]"


def main(argv: list) -> None:
    if not argv or not argv[0].endswith(".py") or not Path(argv[0]).is_file():
        raise SystemExit(f"run_on_cpu: {argv[0] if argv else 'no example'} is not a Python file; "
                         f"{USAGE}")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package
    from support import cpu_support

    cpu_support.apply(cpu_support.megatron_patches(on_cpu=True))
    if importlib.util.find_spec("megatron.bridge") is not None:
        from support.bridge_imports import import_megatron_bridge

        import_megatron_bridge()
    os.environ["MCORE_TORCH_EXPERTS_EXAMPLE_ON_CPU"] = "1"
    example = Path(argv[0]).resolve()
    sys.path.insert(0, str(example.parent))
    sys.argv = [str(example), *argv[1:]]
    runpy.run_path(str(example), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
