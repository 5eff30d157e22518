# Sourced by the scripts/gpu_*.sh: `gpu_env` puts the repository and tests/ (the test side's
# `support`, which test workers and benchmarks import) on PYTHONPATH after what is there. The
# scripts run in the environment they find: torch with CUDA, and Transformer Engine, megatron-core,
# megatron-bridge as each script's header says, installed with pip (or NVIDIA's PyTorch container).
gpu_env() {
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/tests" PYTHONUNBUFFERED=1
}
