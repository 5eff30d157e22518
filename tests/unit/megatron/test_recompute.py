"""LoRA adapters on a frozen GPT-MoE train under every recompute setting (full uniform/block,
selective with any module list) once the frozen-input guard is in, with the gradients of the run
without recompute.

Megatron's checkpoints give their outputs a gradient only if an input tensor requires grad; a
frozen embedding's output does not. Without the guard, "uniform" recompute trains nothing,
"block" recompute silently skips the adapters of its checkpointed layers, and selective "mlp",
"moe" or "shared_experts" recompute skips the adapters of checkpointed modules whose input is
still frozen.
"""

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from mcore_torch_experts import TorchExpertsTransformerConfig
from mcore_torch_experts.lora import apply_lora, lora_parameters
from mcore_torch_experts.megatron.model import build_gpt_model
from mcore_torch_experts.megatron.recompute import _ORIGINAL_FORWARD, install_frozen_input_guard
from mcore_torch_experts.specs import get_gpt_decoder_block_spec
from support.tiny_gpt import LORA_TARGETS as TARGETS
from support.tiny_gpt import SEQ, VOCAB, fp32_moe_config, lm_batch

NUM_LAYERS, RECOMPUTE_NUM_LAYERS = 4, 2  # block: layers 0-1 checkpointed, 2-3 plain


MLP_TARGETS = ["linear_fc1", "linear_fc2"]  # dense MLP, routed and shared experts: no attention
MOE_TARGETS = ["*experts.linear_fc1", "*experts.linear_fc2"]  # routed and shared experts only
SHARED_EXPERT_TARGETS = ["*shared_experts.linear_fc1", "*shared_experts.linear_fc2"]
ALL_SELECTIVE = ["core_attn", "layernorm", "mlp", "moe", "shared_experts"]
RECOMPUTE = {
    "none": {},
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=RECOMPUTE_NUM_LAYERS),
    "full-block": dict(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=RECOMPUTE_NUM_LAYERS),
    **{f"selective-{module}": dict(recompute_granularity="selective", recompute_modules=[module])
       for module in ALL_SELECTIVE},
    "selective-all": dict(recompute_granularity="selective", recompute_modules=ALL_SELECTIVE),
}
"""Every recompute setting Megatron offers a GPT-MoE with TorchGroupedMLP experts, by name
("selective-moe_act" is refused by the config; "selective-mla_up_proj" needs MLA)."""


def make_config(recompute="none") -> TorchExpertsTransformerConfig:
    """Layer 0 dense, layers 1-3 MoE with a shared expert; FP32 on the CPU."""
    return fp32_moe_config(moe_layer_freq=[0, 1, 1, 1], moe_shared_expert_intermediate_size=64,
                           **RECOMPUTE[recompute])


def build(recompute="none", guard=True, lora=True, expert_adapter="shared", targets=TARGETS):
    """The same frozen GPT-MoE every time (seeded), with LoRA adapters whose B is non-zero: B
    starts at zero, which would leave every A without gradient at step 0."""
    torch.manual_seed(0)
    config = make_config(recompute)
    if guard:
        model = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ)
    else:  # Megatron's own path: no guard anywhere
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                         max_sequence_length=SEQ)
    if lora:
        apply_lora(model, targets, rank=8, alpha=16, expert_adapter=expert_adapter)
        with torch.no_grad():
            for name, p in lora_parameters(model).items():
                if name.endswith("linear_out.weight"):
                    p.normal_(std=0.1)
    else:
        model.requires_grad_(False)
    return model


def adapter_grads(model):
    """{adapter key: gradient or None} after one forward and backward of the LM loss."""
    loss = model(**lm_batch()).mean()
    if loss.requires_grad:
        loss.backward()
    return {name: p.grad for name, p in lora_parameters(model).items()}


def layer_of(name: str) -> int:
    return int(name.split("decoder.layers.")[1].split(".")[0])


@pytest.mark.parametrize("targets", [TARGETS, MLP_TARGETS, MOE_TARGETS],
                         ids=["attention+mlp", "mlp-only", "moe-only"])
@pytest.mark.parametrize("recompute", [name for name in RECOMPUTE if name != "none"])
def test_adapter_gradients_under_every_recompute_setting_match_no_recompute(
        megatron_cpu_training, recompute, targets):
    expected = adapter_grads(build("none", targets=targets))
    grads = adapter_grads(build(recompute, targets=targets))

    assert grads.keys() == expected.keys() and len(grads) >= 2 * len(targets) * NUM_LAYERS
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, f"{name} got no gradient"
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("recompute", ["full-uniform", "full-block", "selective-moe"])
def test_per_expert_adapter_gradients_under_recompute_match_no_recompute(megatron_cpu_training,
                                                                         recompute):
    expected = adapter_grads(build("none", expert_adapter="per_expert", targets=MOE_TARGETS))
    grads = adapter_grads(build(recompute, expert_adapter="per_expert", targets=MOE_TARGETS))
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("module, targets, starved_layers", [
    ("mlp", MLP_TARGETS, {0}),  # layer 0's dense MLP; its output then requires grad
    ("moe", MOE_TARGETS, {1, 2, 3}),  # nothing outside a checkpoint trains: no adapter does
    ("shared_experts", SHARED_EXPERT_TARGETS, {1, 2, 3}),
])
def test_without_guard_selective_recompute_starves_adapters(megatron_cpu_training, module,
                                                           targets, starved_layers):
    """Megatron's own path: a checkpointed module whose input is frozen (every layer before the
    first adapter outside a checkpoint) gives its adapters no gradient."""
    grads = adapter_grads(build(f"selective-{module}", guard=False, targets=targets))
    starved = {name for name, g in grads.items() if g is None}
    assert starved == {name for name in grads if layer_of(name) in starved_layers}


def test_without_guard_uniform_recompute_trains_nothing(megatron_cpu_training):
    model = build("full-uniform", guard=False)
    loss = model(**lm_batch()).mean()
    assert not loss.requires_grad  # every checkpointed chunk is detached from the adapters


def test_without_guard_block_recompute_skips_the_checkpointed_layers(megatron_cpu_training):
    grads = adapter_grads(build("full-block", guard=False))
    starved = {name for name, g in grads.items() if g is None}
    assert starved == {name for name in grads if layer_of(name) < RECOMPUTE_NUM_LAYERS}


def test_install_is_idempotent_and_counts_blocks(megatron_cpu_training):
    model = build("full-uniform")  # build_gpt_model installed it already
    guarded_forward = model.decoder.forward
    assert install_frozen_input_guard(model) == 1
    assert install_frozen_input_guard(model) == 1
    assert model.decoder.forward is guarded_forward
    assert vars(model.decoder)[_ORIGINAL_FORWARD].__func__ is type(model.decoder).forward
    assert all(g is not None for g in adapter_grads(model).values())


def test_guard_leaves_a_model_with_nothing_trainable_alone(megatron_cpu_training):
    model = build("full-uniform", lora=False)
    assert not model(**lm_batch()).requires_grad


def test_guard_keeps_an_input_that_already_requires_grad(megatron_cpu_training):
    model = build("full-uniform")
    decoder_input = model.embedding(lm_batch()["input_ids"], lm_batch()["position_ids"])
    decoder_input = decoder_input.detach().requires_grad_(True)
    model(**lm_batch(decoder_input)).mean().backward()
    assert decoder_input.grad is not None and decoder_input.grad.abs().sum() > 0
