"""Megatron-Bridge 0.7.0's multi-LoRA on a GPT built from Megatron's TE spec (CUDA, BF16; the TE
leg): TorchGroupedMLP experts against TEGroupedMLP experts with the same weights and the same
adapters. MultiLoRA on linear_fc1 and linear_fc2 as docs/enable.md gives it (the dense MLP's TE
linears and the expert linears, through MultiLoRAGroupedExpertLinear), two slots of ranks 8 and
4, the alltoall dispatcher without permute fusion (Bridge's requirement for expert slots).

Logits, loss and every slot's adapter gradients agree with the TEGroupedMLP model, with and
without our FP32 combine; a slot without tokens gets exactly zero gradients; Adam steps train
both slots on both models, the losses agreeing step by step. The FP64 per-token reference (CPU,
FP32): tests/integration/bridge/test_bridge_multi_lora.py."""

import pytest
import torch

from mcore_torch_experts import (
    FP32CombineMoELayer,
    TorchGroupedLinear,
    TorchGroupedMLP,
    register_with_megatron_bridge,
)
from support.bridge import import_bridge_multi_lora
from support.reference import rel_err
from support.te import needs_te, te_config, te_gpt
from support.tiny_gpt import BATCH, MOE_LAYERS, SEQ, batch, forward_backward

pytestmark = [*needs_te, pytest.mark.bridge]

TOKENS = SEQ * BATCH
SLOTS = {"split": [TOKENS // 2 + 3, TOKENS // 2 - 3], "slot1_only": [0, TOKENS]}
SLOT_SETTINGS = [(8, 16.0), (4, 2.0)]  # (rank, alpha) of slots 0 and 1; max rank 8
SAME_TOL, SAME_GRAD_TOL = 1e-2, 5e-2  # BF16: two experts implementations, the same math


@pytest.fixture(scope="module")
def multi_lora():
    modules = import_bridge_multi_lora()
    assert register_with_megatron_bridge()
    return modules


def multi_lora_gpt(multi_lora, backend, state=None, adapters=None, **fields):
    """A TE-spec GPT (experts: TEGroupedMLP, or ours for backend "torch") with the weights
    `state` (its own when None) and MultiLoRA on linear_fc1/fc2; adapter weights `adapters` (by
    name) or random, then the two slots claimed (Bridge masks each to its rank)."""
    module, layers = multi_lora
    if backend == "torch":
        fields["moe_expert_gemm_backend"] = "torch"
    model = te_gpt(te_config(moe_token_dispatcher_type="alltoall", moe_permute_fusion=False,
                             **fields))
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert unexpected == [] and all(key.endswith("_extra_state") for key in missing)
    model = module.MultiLoRA(target_modules=["linear_fc1", "linear_fc2"], n_adapters=2, dim=8,
                             alpha=16)(model, training=True)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".adapters." in n for n in trainable)
    generator = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for name, p in sorted(trainable.items()):
            p.copy_(adapters[name] if adapters is not None else
                    torch.randn(p.shape, device="cuda", generator=generator) * 0.05)
    for slot, (rank, alpha) in enumerate(SLOT_SETTINGS):
        layers.init_adapter_slot(model, slot, rank=rank, alpha=alpha)
    return model


def ours_and_theirs(multi_lora, **ours_fields):
    theirs = multi_lora_gpt(multi_lora, "transformer_engine")
    state = {k: v for k, v in theirs.state_dict().items() if ".adapters." not in k}
    adapters = {n: p.detach().clone() for n, p in theirs.named_parameters() if p.requires_grad}
    ours = multi_lora_gpt(multi_lora, "torch", state, adapters, **ours_fields)
    _, layers = multi_lora
    for i in MOE_LAYERS:
        experts = ours.decoder.layers[i].mlp.experts
        assert type(experts) is TorchGroupedMLP
        for wrapper in (experts.linear_fc1, experts.linear_fc2):
            assert type(wrapper) is layers.MultiLoRAGroupedExpertLinear
            assert isinstance(wrapper.to_wrap, TorchGroupedLinear)
        assert type(theirs.decoder.layers[i].mlp.experts).__name__ == "TEGroupedMLP"
    return ours, theirs


@pytest.mark.parametrize("combine_in_fp32", [False, True], ids=["combine", "fp32_combine"])
@pytest.mark.parametrize("slots", list(SLOTS))
def test_multi_lora_on_torch_experts_matches_te_grouped_mlp(te_world, multi_lora, slots,
                                                            combine_in_fp32):
    _, layers = multi_lora
    ours, theirs = ours_and_theirs(multi_lora, moe_combine_in_fp32=combine_in_fp32)
    assert all((type(ours.decoder.layers[i].mlp) is FP32CombineMoELayer) == combine_in_fp32
               for i in MOE_LAYERS)
    counts = torch.tensor(SLOTS[slots], device="cuda")
    results = []
    for model in (ours, theirs):
        layers.set_tokens_per_adapter_slot(model, counts)
        results.append(forward_backward(model))
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = results
    assert rel_err(logits, ref_logits) < SAME_TOL and rel_err(loss, ref_loss) < SAME_TOL
    assert grads.keys() == ref_grads.keys()
    assert any(".experts.linear_fc1.adapters.1." in name for name in grads)
    errors = {}
    for name, grad in grads.items():
        slot = int(name.split(".adapters.")[1].split(".")[0])
        if SLOTS[slots][slot] == 0:  # no tokens in this slot: exactly zero, in both models
            assert not grad.any() and not ref_grads[name].any(), name
        else:
            assert grad.any(), name
            errors[name] = rel_err(grad, ref_grads[name])
    print(slots, combine_in_fp32, f"max adapter-gradient error {max(errors.values()):.1e}")
    assert max(errors.values()) < SAME_GRAD_TOL, errors


def test_multi_lora_trains_both_slots_on_torch_experts_as_on_te_grouped_mlp(te_world, multi_lora):
    """6 Adam steps, the tokens split between the slots, on both models from the same start: the
    losses agree every step and fall; every adapter tensor of both slots moves."""
    _, layers = multi_lora
    ours, theirs = ours_and_theirs(multi_lora)
    inputs, positions, mask, labels = (t.cuda() for t in batch())
    counts = torch.tensor(SLOTS["split"], device="cuda")
    losses = {}
    for name, model in (("ours", ours), ("theirs", theirs)):
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses[name] = []
        for _ in range(6):
            layers.set_tokens_per_adapter_slot(model, counts)
            optimizer.zero_grad()
            loss = model(inputs, positions, mask, labels=labels).float().mean()
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
        moved = [n for n, p in model.named_parameters() if n in before
                 and not torch.equal(p, before[n])]
        assert len(moved) == len(before), (name, sorted(set(before) - set(moved))[:4])
    print({k: [f"{v:.4f}" for v in vs] for k, vs in losses.items()})
    assert losses["ours"][-1] < losses["ours"][0]
    assert losses["ours"] == pytest.approx(losses["theirs"], rel=SAME_TOL)
