"""convert_experts_to_torch turns a model someone else's provider built (SequentialMLP or
TEGroupedMLP experts) into one with TorchGroupedMLP experts: same outputs, same sharded keys."""

import gc
import re
import types
import weakref

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP

from mcore_torch_experts import TorchExpertsConfigError, TorchGroupedMLP, _compat
from mcore_torch_experts.lora import apply_lora, lora_parameters
from mcore_torch_experts.megatron.convert import ConversionSummary, convert_experts_to_torch
from support.reference import rel_err
from support.tiny_gpt import (
    BYTES_PER_LAYER,
    EXPERTS,
    HIDDEN,
    MOE_FFN,
    NUM_EXPERTS,
    forward_backward,
    freeze_experts,
    gpt,
    sequential_to_grouped,
    sharded_layout,
    tiny_config,
)


def sequential_mlp_model(**overrides):
    """What a provider builds with Megatron's local spec and moe_grouped_gemm=False."""
    config = tiny_config(moe_grouped_gemm=False, **overrides)
    return gpt(config, gpt_layer_specs.get_gpt_decoder_block_spec(config, False))


def test_conversion_keeps_outputs_weights_and_sharded_keys(megatron_cpu):
    model = sequential_mlp_model()
    freeze_experts(model)
    logits, loss, grads = forward_backward(model)
    state = sequential_to_grouped(model.state_dict())
    layout = sharded_layout(model)
    # Megatron's global expert key (MoELayer's `experts.` prefix, then the experts' own): one
    # entry per expert and GLU half.
    assert len(layout[f"{EXPERTS[0]}.experts.linear_fc1.weight"]) == 2 * NUM_EXPERTS
    old_experts = [weakref.ref(model.get_submodule(name)) for name in EXPERTS]
    old_configs = [model.get_submodule(name).config for name in EXPERTS]

    summary = convert_experts_to_torch(model)

    assert summary == ConversionSummary(modules_converted=2, bytes_packed=2 * BYTES_PER_LAYER,
                                        names=EXPERTS, blocks_guarded=1)
    assert model.decoder.forward.__func__.__name__ == "_guarded_forward"  # the frozen-input guard
    for name, config in zip(EXPERTS, old_configs):
        experts = model.get_submodule(name)
        assert isinstance(experts, TorchGroupedMLP) and experts.linear_fc1.name == f"{name}.linear_fc1"
        assert experts.config is config and experts.linear_fc2.config is config
        assert not any(p.requires_grad for p in experts.parameters())
    gc.collect()
    assert all(ref() is None for ref in old_experts)  # no second copy of the weights stays alive

    new_state = model.state_dict()
    assert not any("local_experts" in key for key in new_state)
    assert set(new_state) == set(state) | {f"{name}.linear_fc{j}._extra_state"
                                           for name in EXPERTS for j in (1, 2)}
    for key, value in state.items():
        assert torch.equal(new_state[key], value) if torch.is_tensor(value) else \
            new_state[key] == value, key
    assert sharded_layout(model) == layout

    new_logits, new_loss, new_grads = forward_backward(model)
    assert rel_err(new_logits, logits) < 1e-3 and rel_err(new_loss, loss) < 1e-3
    assert new_grads.keys() == grads.keys()
    for name, grad in new_grads.items():
        assert rel_err(grad, grads[name]) < 1e-2, name


def modules_and_parameters(model):
    """{qualified name: (module, {parameter name: parameter})}: to compare by identity."""
    return {name: (module, dict(module.named_parameters()))
            for name, module in model.named_modules()}


def assert_same_objects(model, before):
    after = modules_and_parameters(model)
    assert after.keys() == before.keys()
    for name, (module, params) in after.items():
        assert module is before[name][0], name
        assert params.keys() == before[name][1].keys()
        assert all(p is before[name][1][k] for k, p in params.items()), name


def test_refused_model_is_left_untouched(megatron_cpu):
    model = sequential_mlp_model(add_bias_linear=True)
    with pytest.raises(TorchExpertsConfigError, match="add_bias_linear=True"):
        convert_experts_to_torch(model)
    assert all(isinstance(model.get_submodule(name), SequentialMLP) for name in EXPERTS)


@pytest.mark.parametrize("targets", [["linear_fc1", "linear_fc2"], ["linear_qkv", "linear_fc2"]])
def test_a_model_with_expert_adapters_is_refused_untouched(megatron_cpu, targets):
    model = sequential_mlp_model()
    apply_lora(model, targets, rank=4, alpha=8)
    before = modules_and_parameters(model)
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\.mlp\.experts\.local_experts\.0\."
                                         r"linear_fc\d .*already carries a LoRA adapter.*call "
                                         r"convert_experts_to_torch, then apply_lora"):
        convert_experts_to_torch(model)
    assert_same_objects(model, before)


def test_a_wrong_shaped_expert_weight_in_a_later_layer_is_refused_before_any_layer_changes(
        megatron_cpu):
    """The shapes of every layer's expert weights are checked before the first one is replaced."""
    model = sequential_mlp_model()
    model.get_submodule(EXPERTS[1]).local_experts[3].linear_fc2.weight = torch.nn.Parameter(
        torch.zeros(HIDDEN, MOE_FFN + 8, dtype=torch.bfloat16))
    before = modules_and_parameters(model)
    with pytest.raises(ValueError, match=re.escape(
            f"{EXPERTS[1]}: expert 3's linear_fc2 weight has shape [{HIDDEN}, {MOE_FFN + 8}], "
            f"expected [{HIDDEN}, {MOE_FFN}] from its config")):
        convert_experts_to_torch(model)
    assert isinstance(model.get_submodule(EXPERTS[0]), SequentialMLP)
    assert_same_objects(model, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_meta_device_expert_weights_are_refused_untouched(megatron_cpu, dtype):
    """Weights on the meta device (a model built with init_model_with_meta_device) hold no values
    to take over; the refusal says to materialise and load them first, before any check of the
    settings (FP32 weights are refused off the CPU, but these have no device yet)."""
    model = sequential_mlp_model(bf16=dtype == torch.bfloat16, params_dtype=dtype)
    model.get_submodule(EXPERTS[1]).to("meta")
    before = modules_and_parameters(model)
    with pytest.raises(ValueError, match=re.escape(
            f"{EXPERTS[1]}'s expert weights are on ['meta']; they are taken over on one CPU or "
            "CUDA device") + ".*materialise and load its weights first"):
        convert_experts_to_torch(model)
    assert_same_objects(model, before)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_new_experts_are_built_on_their_weights_device_not_the_current_one(megatron_cpu):
    """A model on cuda:1 converted while cuda:0 is current keeps its experts on cuda:1."""
    model = sequential_mlp_model().to("cuda:1")
    with torch.cuda.device(0):
        convert_experts_to_torch(model)
        assert torch.cuda.current_device() == 0
    for name in EXPERTS:
        experts = model.get_submodule(name)
        tensors = [*experts.parameters(), *experts.buffers()]
        assert {t.device for t in tensors} == {torch.device("cuda", 1)}, name


def test_adapters_outside_the_experts_survive_conversion(megatron_cpu):
    model = sequential_mlp_model()
    apply_lora(model, ["linear_qkv", "linear_proj"], rank=4, alpha=8)
    adapters = lora_parameters(model)
    logits = forward_backward(model)[0]
    convert_experts_to_torch(model)
    assert lora_parameters(model) == adapters
    assert rel_err(forward_backward(model)[0], logits) < 1e-3


def test_an_experts_module_passed_itself_is_refused_untouched(megatron_cpu):
    model = sequential_mlp_model()
    experts = model.get_submodule(EXPERTS[0])
    weights = {k: v.clone() for k, v in experts.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(TypeError, match="SequentialMLP passed in is itself the experts module"):
        convert_experts_to_torch(experts)
    assert type(model.get_submodule(EXPERTS[0])).__name__ == "SequentialMLP"
    assert all(torch.equal(experts.state_dict()[k], v) for k, v in weights.items())


def test_model_chunks_and_a_second_conversion(megatron_cpu):
    model = sequential_mlp_model()
    summary = convert_experts_to_torch([model])  # Megatron-LM and Bridge hand over chunk lists
    assert summary.names == [f"0.{name}" for name in EXPERTS]
    assert convert_experts_to_torch(model) == ConversionSummary(blocks_guarded=1)


EXPERT_GROUPS = ("ep", "expt_tp", "expt_dp")


def own_expert_groups():
    """One-rank expert groups that are not Megatron's global ones."""
    return ProcessGroupCollection(**{name: torch.distributed.new_group([0])
                                     for name in EXPERT_GROUPS})


def test_converted_experts_run_with_the_groups_the_module_was_built_with(megatron_cpu):
    """SequentialMLP: the expert groups it was built with (not Megatron's global ones), expert DP
    (its dp_group) included."""
    own = own_expert_groups()
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    holder = torch.nn.ModuleDict(dict(experts=SequentialMLP(
        NUM_EXPERTS, tiny_config(moe_grouped_gemm=False), submodules, pg_collection=own)))
    convert_experts_to_torch(holder)
    groups = holder.experts.linear_fc1._pg_collection
    assert all(getattr(groups, name) is getattr(own, name) for name in EXPERT_GROUPS)


def test_te_grouped_mlp_expert_dp_comes_from_its_te_linears(megatron_cpu):
    """TEGroupedMLP keeps no dp_group; its TE grouped linears keep the groups it was built with as
    `_pg_collection`, and expert DP is read there, not from Megatron's globals (a stand-in of that
    layout: TE's linears need CUDA)."""
    own = own_expert_groups()
    te_grouped_mlp = types.SimpleNamespace(ep_group=own.ep, tp_group=own.expt_tp,
                                           linear_fc1=types.SimpleNamespace(_pg_collection=own))
    groups = _compat.experts_process_groups(te_grouped_mlp)
    assert all(getattr(groups, name) is getattr(own, name) for name in EXPERT_GROUPS)
