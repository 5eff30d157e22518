"""Run one of Megatron-LM's own launcher scripts, unchanged, on a CPU-only host: the CPU patch
table (support.cpu_support: `megatron_patches`, `megatron_lm_patches`) is
applied, then the script runs as `__main__` with the arguments given, CUDA tensors made on the
CPU. Started by torchrun from tests/integration/megatron_lm/test_megatron_lm.py, with the script's folder on PYTHONPATH
(where `python pretrain_gpt.py` would find its sibling modules):

    torchrun --nproc-per-node 1 tests/integration/megatron_lm/megatron_lm_cpu_launch.py SCRIPT [ARGS...]
"""

import runpy
import sys
from pathlib import Path

from support.cpu_support import (
    CudaTensorsOnTheCpu,
    apply,
    megatron_lm_patches,
    megatron_patches,
)


def main() -> None:
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script), *sys.argv[2:]]
    apply(megatron_lm_patches())
    apply(megatron_patches(on_cpu=True))
    with CudaTensorsOnTheCpu():
        runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
