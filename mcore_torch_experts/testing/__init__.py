"""What runs Megatron-Core where its CUDA-only calls would stop it: `cpu_support`, the one table
of patches (each with its reason) that the examples, the test fixtures, the test workers and the
benchmarks' CPU modes apply. Never imported by the package's own modules."""
