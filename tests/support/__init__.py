"""The test side's support, never shipped in the wheel: `cpu_support`, the one table of patches
(each with its reason) that runs Megatron-Core, Megatron-LM, Megatron-Bridge and NeMo-RL where
their CUDA-only calls would stop them (the test fixtures, the test workers, the benchmarks' CPU
modes); `run_on_cpu`, the launcher that applies them and runs an example on a host without CUDA;
`bridge_imports`, Megatron-Bridge's imports on a host without Transformer Engine or Bridge's
optional training packages; `bridge_finetune`, the Bridge training config the finetune test
worker and the GPU finetune benchmark share. Imported as `support.<name>` with tests/ on the path
(pytest's `pythonpath`, the workers' PYTHONPATH, benchmarks/harness.py)."""
