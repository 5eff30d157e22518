"""Integrations with the clients that drive TorchGroupedMLP and the FP32 combine, each pinned to
the client's own code and imported only where that client is used:

- `bridge.py`: Megatron-Bridge's PEFT (LoRA, CanonicalLoRA) on TorchGroupedMLP experts:
  registration, `check_bridge_peft`, `merge_bridge_lora`; `bridge_adapters.py`: Bridge's
  adapters computed on the experts (one grouped GEMM per projection; inside the fused kernels).
- `automodel.py`: the FP32 combine in NeMo Automodel's grouped experts (`install_fp32_combine`;
  imports nemo_automodel).
- `nemo_rl.py`: NeMo-RL's Megatron policy worker with TorchGroupedMLP experts
  (`TorchExpertsMegatronPolicyWorker`, `enable_torch_experts`; imports nemo_rl and ray). NeMo-RL
  imports it by name (`worker_extension_cls_fqn`); the package's `__init__` does not.

The package's core (experts, kernels, specs) imports nothing from here.
"""
