"""Megatron-Bridge's LoRA (shared and per-expert expert adapters) on TorchGroupedMLP in
batch_invariant_mode (megatron-core 0.20 with Bridge 0.7.0): a batch of probe tokens through an
MoE layer alone and among other tokens, output bit for bit; on the CPU (the mode's flag only:
its kernels need CUDA) the input gradient too, on a GPU within two BF16 roundings."""


import pytest
import torch

from mcore_torch_experts import TorchGroupedLinear, _compat, register_with_megatron_bridge
from support.batch_invariance import (
    CPU_CONTEXTS,
    RANK,
    gpu_in_the_mode,
    moe_layer_in_the_mode,
    probe_differences,
    randomize_adapter_outputs,
)
from support.bridge import import_bridge_peft

pytestmark = [pytest.mark.bridge, pytest.mark.skipif(
    _compat.megatron_core_release() < (0, 20),
    reason="batch-invariant MoE is megatron-core 0.20's (this leg is older)")]

LAYOUTS = {"shared": {}, "per_expert": dict(share_expert_adapters=False)}


@pytest.fixture(scope="module")
def bridge_lora():
    import_bridge_peft()
    assert register_with_megatron_bridge()
    from megatron.bridge.peft.lora import LoRA

    return LoRA


def layer_with_bridge_lora(bridge_lora, layout, combine, kernel, device):
    """The probe layer with Bridge's LoRA on the experts' linear_fc1 and linear_fc2 (Bridge
    freezes the rest), adapters' outputs random."""
    layer = moe_layer_in_the_mode(combine, kernel, device)
    if device == "cuda":   # Bridge's shared adapter initializes on the GPU under Megatron's RNG
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    root = torch.nn.Module()
    root.mlp = layer   # Bridge's expert rule wants the experts under `mlp.experts`
    bridge_lora(target_modules=["linear_fc1", "linear_fc2"], dim=RANK, alpha=2 * RANK,
                **LAYOUTS[layout])(root)
    experts = root.mlp.experts
    assert {type(m.to_wrap) for m in (experts.linear_fc1, experts.linear_fc2)} == {
        TorchGroupedLinear}
    randomize_adapter_outputs(layer)
    trained = {n for n, p in layer.named_parameters() if p.requires_grad}
    assert trained and all("adapter" in n for n in trained), trained
    return layer.to(device)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_on_the_cpu_bridge_adapters_keep_probe_tokens_bitwise_in_any_batch(
        bridge_lora, megatron_cpu, cpu_cuda_streams, monkeypatch, layout):
    from megatron.core.transformer.custom_layers import batch_invariant_kernels

    monkeypatch.setattr(batch_invariant_kernels, "_batch_invariant_MODE", True)
    layer = layer_with_bridge_lora(bridge_lora, layout, "megatron", "grouped_mm", "cpu")
    differences, largest_dx = probe_differences(layer, "cpu", CPU_CONTEXTS)
    print(f"\n[batch invariance, cpu, Bridge {layout}] max |dx| alone {largest_dx:.3g}; "
          f"max differences (output, dx): {differences}")
    assert all(out == 0 and dx == 0 for out, dx in differences.values()), differences


@gpu_in_the_mode
@pytest.mark.parametrize("kernel", ["grouped_mm", "fused_gemm"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("combine", ["megatron", "fp32_triton"])
def test_bridge_adapters_keep_probe_tokens_bitwise_in_any_batch(megatron_world, bridge_lora,
                                                                combine, layout, kernel):
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import (
        set_batch_invariant_mode,
    )

    layer = layer_with_bridge_lora(bridge_lora, layout, combine, kernel, "cuda")
    with set_batch_invariant_mode(True, backend="triton"):
        differences, largest_dx = probe_differences(layer, "cuda")
    print(f"\n[batch invariance, Bridge {layout}] {combine} {kernel}: max |dx| alone "
          f"{largest_dx:.3g}; max differences (output, dx): {differences}")
    assert all(out == 0 for out, _ in differences.values()), differences
    bound = 2 ** -6 * largest_dx   # as tests/unit/test_batch_invariance.py's layer probe
    assert all(dx <= bound for _, dx in differences.values()), (bound, differences)
