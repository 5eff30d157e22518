"""kernels/grouped_gemm.py's seam: every grouped GEMM of the experts, the adapters and the fused
path goes through `kernels.grouped_gemm.grouped_mm`, so replacing it replaces all of them."""

import torch

from mcore_torch_experts import TorchGroupedMLP
from mcore_torch_experts.kernels import grouped_gemm
from mcore_torch_experts.lora import apply_lora
from support.reference import make_config

SPLITS = [5, 0, 9, 2]


def run(experts, hidden):
    x = torch.randn(sum(SPLITS), hidden, dtype=torch.bfloat16, requires_grad=True)
    out, _ = experts(x, torch.tensor(SPLITS), torch.rand(sum(SPLITS)))
    out.float().square().sum().backward()
    return out, x.grad


def test_every_grouped_gemm_goes_through_the_seam(megatron_cpu, monkeypatch):
    """Frozen experts: fc1 and fc2 forward, their two input gradients; with per-expert LoRA on
    both linears each adapter adds its two grouped GEMMs forward; a poisoned seam poisons the
    output."""
    config = make_config(activation="silu", glu=True, num_experts=len(SPLITS))
    torch.manual_seed(0)
    root = torch.nn.Module()
    root.mlp = torch.nn.Module()
    root.mlp.experts = TorchGroupedMLP(len(SPLITS), config, pg_collection=megatron_cpu)
    for p in root.parameters():
        p.requires_grad_(False)
    calls = []
    real = grouped_gemm.grouped_mm

    def counting(a, b, offs):
        calls.append(tuple(b.shape))
        return real(a, b, offs=offs)

    monkeypatch.setattr(grouped_gemm, "grouped_mm", counting)
    reference, _ = run(root.mlp.experts, config.hidden_size)
    assert len(calls) == 4, calls
    calls.clear()
    apply_lora(root, ["linear_fc1", "linear_fc2"], rank=8, alpha=16.0, expert_adapter="per_expert")
    run(root.mlp.experts, config.hidden_size)
    # + each adapter's down and up projections forward (their gradients are torch's grouped GEMM
    # autograd): 8, the frozen weights' four among them.
    frozen = {(32, 96), (48, 32), (32, 48), (96, 32)}   # fc1, fc2 forward; fc2, fc1 backward
    assert len(calls) == 8 and sum(shape[1:] in frozen for shape in calls) == 4, calls

    monkeypatch.setattr(grouped_gemm, "grouped_mm",
                        lambda a, b, offs: real(a, b, offs=offs) * float("nan"))
    poisoned, _ = run(root.mlp.experts, config.hidden_size)
    assert torch.isnan(poisoned).all() and not torch.isnan(reference).any()
