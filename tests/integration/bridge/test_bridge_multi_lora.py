"""Megatron-Bridge 0.7.0's multi-LoRA (`megatron.bridge.peft.multi_lora.MultiLoRA`) on
TorchGroupedMLP experts: every MoE layer of a GPT-MoE (FP32, CPU, alltoall dispatcher) with
adapter slots on `experts.linear_fc1/fc2` (Bridge's MultiLoRAGroupedExpertLinear, its per-(slot,
expert) grouped path) against an FP64 per-token reference built from the same model's
SequentialMLP weights: per token, the expert MLP of each routed expert plus the LoRA delta of the
token's slot. Output and every slot's adapter gradients; the docs' snippet trained a few steps;
the fused GEMM kernels' refusal; Bridge's own refusal of the allgather dispatcher and its skip
of SequentialMLP experts. Skipped, with the reason, where Bridge has no multi-LoRA (< 0.7.0)."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel

from mcore_torch_experts import TorchGroupedLinear, register_with_megatron_bridge
from mcore_torch_experts.specs import get_gpt_decoder_block_spec
from support.bridge import import_bridge_multi_lora
from support.doc_snippets import run_snippet
from support.reference import rel_err
from support.tiny_gpt import BATCH, SEQ, VOCAB, fp32_moe_config, lm_batch, sequential_to_grouped

pytestmark = pytest.mark.bridge

TOKENS = SEQ * BATCH
SLOTS = {"split": [TOKENS // 2 + 3, TOKENS // 2 - 3], "slot0_only": [TOKENS, 0],
         "slot1_only": [0, TOKENS]}
SLOT_SETTINGS = [(8, 16.0), (4, 2.0)]  # (rank, alpha) of slots 0 and 1; max rank 8
TOL = 1e-5  # relative L2, FP32 against FP64


@pytest.fixture(scope="module")
def multi_lora():
    """Bridge's multi-LoRA modules, or a skip naming why they are absent (Bridge < 0.7)."""
    modules = import_bridge_multi_lora()
    assert register_with_megatron_bridge()
    return modules


def gpt(backend, seed=0, **overrides):
    """2 MoE layers (4 SwiGLU experts, top-2), FP32, the alltoall dispatcher without permute
    fusion (what MultiLoRA's slot routing replays); SequentialMLP for backend
    'transformer_engine' without grouped GEMM."""
    config = fp32_moe_config(**dict(dict(num_layers=2, moe_token_dispatcher_type="alltoall",
                                         moe_permute_fusion=False), **overrides))
    config.moe_expert_gemm_backend = backend
    if backend != "torch":
        config.moe_grouped_gemm = False
    torch.manual_seed(seed)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ)


def multi_lora_gpt(multi_lora, **overrides):
    """Our GPT with MultiLoRA on the expert linears, random adapters masked to each slot's rank,
    and the SequentialMLP GPT with the same weights (its experts the reference's base)."""
    module, layers = multi_lora
    ours, seq = gpt("torch", **overrides), gpt("transformer_engine")
    ours.load_state_dict(sequential_to_grouped(seq.state_dict()), strict=False)
    module.MultiLoRA(target_modules=["linear_fc1", "linear_fc2"], n_adapters=2, dim=8,
                     alpha=16)(ours)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(ours.named_parameters()):
            if ".adapters." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    for slot, (rank, alpha) in enumerate(SLOT_SETTINGS):
        layers.init_adapter_slot(ours, slot, rank=rank, alpha=alpha)
    return ours, seq


def expert_linears(model, layer):
    experts = model.decoder.layers[layer].mlp.experts
    return experts.linear_fc1, experts.linear_fc2


def fp64_moe(seq, layer, wrappers, x, probs, routing_map, slot_of_token):
    """FP64, per token t of slot s and routed expert e: probs[t, e] * fc2_e(SwiGLU(fc1_e(x_t)))
    summed over e, with fc_j(h) = h W_j,e^T + alpha_s / r_s * h A_j,s,e^T B_j,s,e^T (W_j,e from the
    SequentialMLP model). Returns (y [T, H], {(j, s): (A, B)} FP64 leaves)."""
    local = seq.decoder.layers[layer].mlp.experts.local_experts
    factors, scales = {}, {}
    for j, wrapper in enumerate(wrappers):
        for s, adapter in enumerate(wrapper.adapters):
            factors[j, s] = tuple(w.detach().double().requires_grad_(True)
                                  for w in (adapter.linear_in.weight, adapter.linear_out.weight))
            scales[j, s] = float(wrapper.alpha_values[s] / wrapper.rank_values[s])
    x = x.detach().double()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        s = int(slot_of_token[t])
        for e in torch.nonzero(routing_map[t]).flatten().tolist():
            h = x[t]
            for j, linear in enumerate((local[e].linear_fc1, local[e].linear_fc2)):
                a, b = factors[j, s]
                h = h @ linear.weight.double().T + scales[j, s] * (h @ a[e].T) @ b[e].T
                if j == 0:
                    gate, up = h.chunk(2)
                    h = F.silu(gate) * up * probs[t, e].double()
            y[t] = y[t] + h
    return y, factors


@pytest.mark.parametrize("combine_in_fp32", [False, True], ids=["combine", "fp32_combine"])
@pytest.mark.parametrize("slots", list(SLOTS))
def test_multi_lora_on_torch_experts_matches_an_fp64_per_token_reference(
        multi_lora, megatron_cpu, cpu_cuda_streams, slots, combine_in_fp32):
    _, layers = multi_lora
    ours, seq = multi_lora_gpt(multi_lora, moe_combine_in_fp32=combine_in_fp32)
    counts = torch.tensor(SLOTS[slots])
    slot_of_token = torch.repeat_interleave(torch.arange(2), counts)
    layers.set_tokens_per_adapter_slot(ours, counts)
    generator = torch.Generator().manual_seed(3)
    for layer in range(len(ours.decoder.layers)):
        wrappers = expert_linears(ours, layer)
        assert all(type(w) is layers.MultiLoRAGroupedExpertLinear
                   and isinstance(w.to_wrap, TorchGroupedLinear) for w in wrappers)
        mlp = ours.decoder.layers[layer].mlp
        assert (type(mlp).__name__ == "FP32CombineMoELayer") == combine_in_fp32
        x = torch.randn(SEQ, BATCH, 64, generator=generator)
        grad = torch.randn(SEQ, BATCH, 64, generator=generator)
        ours.zero_grad()
        y, _ = mlp(x)
        (y * grad).sum().backward()
        with torch.no_grad():
            probs, routing_map = mlp.router(x)
        ref, factors = fp64_moe(seq, layer, wrappers, x.reshape(TOKENS, -1), probs, routing_map,
                                slot_of_token)
        (ref * grad.reshape(TOKENS, -1).double()).sum().backward()
        errors = {"output": rel_err(y.reshape(TOKENS, -1), ref.detach())}
        # the slots' deltas differ: the same tokens in the other slot give another output
        other_slot, _ = fp64_moe(seq, layer, wrappers, x.reshape(TOKENS, -1), probs,
                                 routing_map, 1 - slot_of_token)
        assert rel_err(other_slot.detach(), ref.detach()) > 0.1
        for j, wrapper in enumerate(wrappers):
            for s, adapter in enumerate(wrapper.adapters):
                for side, weight, expected in zip(("A", "B"), (adapter.linear_in.weight,
                                                               adapter.linear_out.weight),
                                                  factors[j, s]):
                    key = f"layer{layer}.fc{j + 1}.slot{s}.{side}"
                    if SLOTS[slots][s] == 0:  # a slot without tokens: exactly zero gradients
                        assert weight.grad is not None and not weight.grad.any(), key
                    else:
                        errors[key] = rel_err(weight.grad, expected.grad)
        print(slots, layer, {k: f"{v:.1e}" for k, v in errors.items()})
        assert max(errors.values()) < TOL, errors


def test_multi_lora_snippet_trains_both_slots_on_torch_experts(multi_lora, megatron_cpu,
                                                                cpu_cuda_streams):
    """The bridge-multi-lora snippet on our GPT; 6 Adam steps with the tokens split between the
    slots: the loss falls, every adapter tensor of both slots moves, slot 1's rank-4 mask holds."""
    _, layers = multi_lora
    model = gpt("torch")
    model = run_snippet("bridge-multi-lora", model=model,
                        tokens_per_slot=torch.tensor(SLOTS["split"]))["model"]
    assert all(type(w) is layers.MultiLoRAGroupedExpertLinear
               for layer in range(2) for w in expert_linears(model, layer))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".adapters." in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        layers.set_tokens_per_adapter_slot(model, torch.tensor(SLOTS["split"]))
        optimizer.zero_grad()
        loss = model(**lm_batch()).mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    for slot in range(2):
        moved = [n for n, p in model.named_parameters()
                 if f".adapters.{slot}." in n and not torch.equal(p, before[n])]
        assert len(moved) == sum(f".adapters.{slot}." in n for n in before), slot
    for layer in range(2):
        for wrapper in expert_linears(model, layer):
            a, b = wrapper.adapters[1].linear_in.weight, wrapper.adapters[1].linear_out.weight
            assert not a[:, 4:].any() and not b[..., 4:].any()


def test_fused_gemm_kernels_refuse_multi_lora_wrappers_by_name(multi_lora, megatron_cpu,
                                                                cpu_cuda_streams):
    """The fused GEMM kernels read only Bridge's LoRALinear: a forced moe_expert_kernel=
    'fused_gemm' call names the MultiLoRA wrapper; 'auto' takes the grouped_mm path, where the
    wrappers are called."""
    from mcore_torch_experts.kernels.choice import fused_gemm_obstacle

    ours, _ = multi_lora_gpt(multi_lora)
    wrappers = expert_linears(ours, 0)
    reason = fused_gemm_obstacle(wrappers, TorchGroupedLinear, torch.zeros(4, 64))
    assert "linear_fc1 is a MultiLoRAGroupedExpertLinear" in reason and "grouped_mm" in reason


def test_bridge_refuses_multi_lora_experts_without_the_alltoall_dispatcher(
        multi_lora, megatron_cpu, cpu_cuda_streams):
    """Bridge's own refusal (its slot routing replays the alltoall dispatcher), at the first
    expert linear: the allgather dispatcher of the other CPU tests is not for MultiLoRA."""
    module, _ = multi_lora
    model = gpt("torch", moe_token_dispatcher_type="allgather")
    with pytest.raises(NotImplementedError, match="moe_token_dispatcher_type='alltoall'"):
        module.MultiLoRA(target_modules=["linear_fc1", "linear_fc2"])(model)


def test_bridge_skips_sequential_mlp_experts(multi_lora, megatron_cpu, cpu_cuda_streams):
    """The contrast: on Megatron's SequentialMLP, Bridge's MultiLoRA leaves the experts
    unwrapped (a logged warning); TorchGroupedMLP experts get MultiLoRAGroupedExpertLinear."""
    module, layers = multi_lora
    seq = gpt("transformer_engine")
    module.MultiLoRA(target_modules=["linear_fc1", "linear_fc2"])(seq)
    assert not any(isinstance(m, layers.MultiLoRALinear) for m in seq.modules())
