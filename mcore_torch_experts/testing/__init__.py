"""What runs Megatron-Core, Megatron-LM, Megatron-Bridge and NeMo-RL where their CUDA-only calls
would stop them: `cpu_support`, the one table of patches (each with its reason) that the
examples, the test fixtures, the test workers and the benchmarks' CPU modes apply, and
`bridge_imports`, Megatron-Bridge's imports on a host without Transformer Engine or Bridge's
optional training packages, and `bridge_finetune`, the Bridge training config the finetune test
worker and the GPU finetune benchmark share. Never imported by the package's own modules."""
