"""The kernels TorchGroupedMLP and the FP32 combine run, and the one place that chooses them.

- `choice.py`: every kernel setting's values (`ExpertKernel`, `ActivationImpl`), what each
  Triton kernel covers, the resolved `KernelChoice` a TorchGroupedMLP holds, and the per-call
  obstacles of the fused GEMM path.
- `grouped_gemm.py`: the grouped GEMM entry point, split validation, the frozen-weight
  autograd Function.
- `activation_triton.py`: activation x probs in one Triton kernel.
- `fused_experts_triton.py`: grouped GEMMs with the activation (and LoRA adapters) in their
  epilogues; `fused_experts.py`: the autograd Functions around them and the adapters' term.
- `combine_triton.py`: the deterministic FP32 top-k combine kernel.
- `factor_grad_triton.py`: a shared LoRA factor's weight gradient in fixed chunks of rows;
  `factor_linear.py`: the products that take it while Megatron's batch-invariant kernels are on.

The Triton modules import triton at module level; `choice.py` and `grouped_gemm.py` do not;
this file imports neither triton nor Megatron-Core (the FP32 combine runs without them).
"""

import os

TRITON_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether triton runs this package's kernels in its interpreter (CPU tensors): `triton.jit` reads
the variable when each kernel module is imported, so this is read at import too. The one place
the package (and its tests and benchmarks) asks."""
