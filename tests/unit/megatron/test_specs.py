"""The reference specs put TorchGroupedMLP in every MoE layer when the flag says "torch", and a
GPTModel built from them computes what Megatron's SequentialMLP model computes with the same
weights. The spec helpers also handle the partial-based specs of Megatron-Core 0.18+."""

import dataclasses
import functools
import inspect
import re

import megatron.core
import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_torch_experts import TorchExpertsConfigError, TorchGroupedMLP, _compat
from mcore_torch_experts.megatron import specs
from support.reference import rel_err
from support.specs import (
    GRAD_TOL,
    LOGITS_TOL,
    experts_class,
    mlp_kinds,
    plain_config,
    spec_structure,
)
from support.tiny_gpt import (
    MOE_LAYER_FREQ,
    MOE_LAYERS,
    NUM_EXPERTS,
    forward_backward,
    freeze_experts,
    gpt,
    sequential_to_grouped,
    tiny_config,
)


def test_gpt_model_from_the_reference_spec_matches_the_sequential_mlp_model(megatron_cpu):
    ours_config = tiny_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True)
    ours = gpt(ours_config, specs.get_gpt_decoder_block_spec(ours_config, False), seed=1)
    ref_config = tiny_config(moe_grouped_gemm=False)  # the default backend: Megatron's experts
    reference = gpt(ref_config, gpt_layer_specs.get_gpt_decoder_block_spec(ref_config, False))

    expected_kinds = [TorchGroupedMLP if freq else MLP for freq in MOE_LAYER_FREQ]
    assert mlp_kinds(ours) == expected_kinds
    assert mlp_kinds(reference) == [SequentialMLP if freq else MLP for freq in MOE_LAYER_FREQ]

    # Load the reference weights: non-expert keys are identical, expert keys map one to one.
    grouped = sequential_to_grouped(reference.state_dict())
    assert not torch.equal(ours.state_dict()["decoder.layers.1.mlp.experts.linear_fc1.weight2"],
                           grouped["decoder.layers.1.mlp.experts.linear_fc1.weight2"])
    missing, unexpected = ours.load_state_dict(grouped, strict=False)
    assert unexpected == []
    assert missing == [f"decoder.layers.{layer}.mlp.experts.linear_fc{j}._extra_state"
                       for layer in MOE_LAYERS for j in (1, 2)]
    freeze_experts(ours)
    freeze_experts(reference)

    logits, loss, grads = forward_backward(ours)
    ref_logits, ref_loss, ref_grads = forward_backward(reference)
    assert logits.shape == (2, 16, 128)
    assert rel_err(logits, ref_logits) < LOGITS_TOL
    assert rel_err(loss, ref_loss) < LOGITS_TOL
    assert grads.keys() == ref_grads.keys()
    assert "embedding.word_embeddings.weight" in grads  # reached through every layer's input grad
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) < GRAD_TOL, name


def test_transformer_engine_backend_leaves_megatron_specs_unchanged(megatron_cpu):
    config = tiny_config(moe_grouped_gemm=False)
    assert spec_structure(specs.get_gpt_decoder_block_spec(config, False)) == \
        spec_structure(gpt_layer_specs.get_gpt_decoder_block_spec(config, False))
    assert experts_class(specs.get_gpt_layer_local_spec(config)) is SequentialMLP


def test_block_spec_swaps_only_moe_experts_and_never_mutates_megatron_specs(megatron_cpu):
    config = tiny_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True)
    block = specs.get_gpt_decoder_block_spec(config, False)
    assert not _compat.is_moe_mlp_spec(block.layer_specs[0].submodules.mlp)
    assert all(experts_class(layer) is TorchGroupedMLP for layer in block.layer_specs[1:])

    megatron_moe_spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=NUM_EXPERTS,
                                                                 moe_grouped_gemm=False)
    swapped = specs.with_torch_experts(megatron_moe_spec)
    assert experts_class(swapped) is TorchGroupedMLP
    assert experts_class(megatron_moe_spec) is SequentialMLP


def test_spec_builder_arguments_are_checked_too():
    config = tiny_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True)
    with pytest.raises(TorchExpertsConfigError, match="use_te_op_fuser=True: the TE operation"):
        specs.get_gpt_layer_local_spec(config, use_te_op_fuser=True)


@pytest.mark.parametrize("helper", [specs.get_gpt_layer_local_spec,
                                    specs.get_gpt_layer_with_transformer_engine_spec])
def test_a_grouped_gemm_argument_the_torch_backend_cannot_honour_is_refused(helper):
    """moe_grouped_gemm=False asks Megatron's builder for SequentialMLP; the config field of the
    same name is refused, and so is the argument, which overrides it."""
    config = tiny_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True)
    with pytest.raises(TorchExpertsConfigError, match=re.escape(
            "moe_expert_gemm_backend='torch' does not support moe_grouped_gemm=False: "
            "TorchGroupedMLP is a grouped experts module; pass moe_grouped_gemm=True or leave "
            "the argument out.")):
        helper(config, moe_grouped_gemm=False)


def test_a_grouped_gemm_argument_is_megatrons_with_the_default_backend():
    local = specs.get_gpt_layer_local_spec
    torch_config = tiny_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True)
    assert experts_class(local(torch_config, moe_grouped_gemm=True)) is TorchGroupedMLP
    megatron = tiny_config(moe_grouped_gemm=True)
    assert experts_class(local(megatron, moe_grouped_gemm=False)) is SequentialMLP


SPEC_BUILDERS = {
    "layer_local": lambda config: specs.get_gpt_layer_local_spec(config),
    "decoder_block": lambda config: specs.get_gpt_decoder_block_spec(config, False),
    "provider": lambda config: specs.gpt_transformer_layer_spec(config,
                                                                use_transformer_engine=False),
}


@pytest.mark.parametrize("builder", list(SPEC_BUILDERS))
@pytest.mark.parametrize("value", ["Torch", "pytorch", None])
def test_a_misspelt_backend_attribute_is_an_error_naming_the_choices(megatron_cpu, builder,
                                                                     value):
    with pytest.raises(TorchExpertsConfigError,
                       match=rf"moe_expert_gemm_backend={value!r} is not a backend: set it to "
                             rf"one of \('transformer_engine', 'torch'\)"):
        SPEC_BUILDERS[builder](plain_config(moe_expert_gemm_backend=value))


@pytest.mark.parametrize("builder", list(SPEC_BUILDERS))
def test_the_backend_attribute_picks_the_experts(megatron_cpu, builder):
    def experts(spec):
        layers = getattr(spec, "layer_specs", [spec])
        return {experts_class(s) for s in layers
                if _compat.is_moe_mlp_spec(s.submodules.mlp)}

    assert experts(SPEC_BUILDERS[builder](plain_config(moe_expert_gemm_backend="torch"))) == \
        {TorchGroupedMLP}
    assert TorchGroupedMLP not in experts(SPEC_BUILDERS[builder](plain_config()))
    assert TorchGroupedMLP not in experts(
        SPEC_BUILDERS[builder](plain_config(moe_expert_gemm_backend="transformer_engine")))


def test_provider_spec_is_a_block_for_moe_and_a_layer_for_dense_models(megatron_cpu):
    moe = specs.gpt_transformer_layer_spec(
        tiny_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True),
        use_transformer_engine=False)
    assert [experts_class(spec) for spec in moe.layer_specs[1:]] == \
        [TorchGroupedMLP, TorchGroupedMLP]
    dense_config = tiny_config(num_moe_experts=None, moe_ffn_hidden_size=None, moe_layer_freq=1)
    dense = specs.gpt_transformer_layer_spec(dense_config,
                                             use_transformer_engine=False)
    assert isinstance(dense, ModuleSpec) and not _compat.is_moe_mlp_spec(dense.submodules.mlp)


# --- Megatron-Core 0.18+ spec forms, fabricated on the installed release ------------------------


def partial_moe_layer_spec():
    """A 0.18-style TransformerLayer spec: mlp = partial(MoELayer, submodules=MoESubmodules(...))
    whose experts entry is itself a partial, as 0.17+ builds them."""
    experts = functools.partial(
        SequentialMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                linear_fc2=RowParallelLinear))
    mlp = functools.partial(MoELayer, submodules=MoESubmodules(experts=experts))
    layer = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=NUM_EXPERTS)
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))


def test_partial_moe_spec_gets_torch_experts_without_touching_the_original(megatron_cpu):
    layer_spec = partial_moe_layer_spec()
    original_mlp = layer_spec.submodules.mlp
    assert _compat.is_moe_mlp_spec(original_mlp)

    swapped = specs.with_torch_experts(layer_spec)
    mlp = swapped.submodules.mlp
    assert isinstance(mlp, functools.partial) and mlp.func is MoELayer
    assert _compat.moe_submodules(mlp).experts == ModuleSpec(module=TorchGroupedMLP)
    assert original_mlp.keywords["submodules"].experts.func is SequentialMLP
    assert layer_spec.submodules.mlp is original_mlp

    # The partial builds a working MoE layer (0.18 calls it with config and pg_collection).
    config = tiny_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True)
    layer = mlp(config=config, pg_collection=megatron_cpu)
    assert isinstance(layer.experts, TorchGroupedMLP)
    hidden = torch.randn(8, 2, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    out, _ = layer(hidden)
    out.float().sum().backward()
    assert out.shape == hidden.shape and torch.isfinite(hidden.grad).all()


def test_experts_spec_follows_the_0_18_builder_protocol(megatron_cpu):
    """0.18+ calls experts(num_local_experts, config, pg_collection=..., name=...)."""
    config = tiny_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True)
    experts = specs.torch_experts_spec()(NUM_EXPERTS, config, pg_collection=megatron_cpu,
                                         name="decoder.layers.1.mlp.experts")
    assert isinstance(experts, TorchGroupedMLP)
    assert experts.linear_fc1.name == "decoder.layers.1.mlp.experts.linear_fc1"


def test_dense_layer_specs_pass_through():
    dense_layer = gpt_layer_specs.get_gpt_layer_local_spec()
    dense_mlp = dense_layer.submodules.mlp
    assert not _compat.is_moe_mlp_spec(dense_mlp)
    assert not _compat.is_moe_mlp_spec(functools.partial(MLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)))
    assert specs.with_torch_experts(dense_layer) is dense_layer


def test_layer_spec_arguments_follow_the_builder_signature():
    """0.17 removed moe_use_legacy_grouped_gemm from the spec builders."""
    config = tiny_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True)

    def builder_0_17(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                     multi_latent_attention=False, normalization=None):
        pass

    assert _compat.gpt_layer_spec_kwargs(builder_0_17, config, normalization="RMSNorm") == dict(
        num_experts=NUM_EXPERTS, moe_grouped_gemm=True, qk_layernorm=False,
        multi_latent_attention=False, normalization="RMSNorm")
    builder = gpt_layer_specs.get_gpt_layer_local_spec
    installed = _compat.gpt_layer_spec_kwargs(builder, config)
    takes_legacy = "moe_use_legacy_grouped_gemm" in inspect.signature(builder).parameters
    assert installed.get("moe_use_legacy_grouped_gemm", None) is (False if takes_legacy else None)


@pytest.mark.parametrize("helper", [specs.get_gpt_layer_local_spec,
                                    specs.get_gpt_layer_with_transformer_engine_spec])
def test_layer_spec_builders_refuse_an_argument_megatron_does_not_take(helper):
    """A misspelled argument (or one only another release's builder takes) is an error naming it,
    the installed megatron-core and the parameters its builder takes, not dropped."""
    config = tiny_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True)
    builder = getattr(gpt_layer_specs, helper.__name__)
    accepted = ", ".join(inspect.signature(builder).parameters)
    with pytest.raises(TypeError, match=re.escape(
            f"{helper.__name__} of megatron-core {megatron.core.__version__} takes no argument "
            f"'normalisation'; it takes {accepted}.")):
        helper(config, normalisation="LayerNorm")


def test_layer_spec_arguments_override_the_config_settings():
    """A builder argument the helper also derives from the config (qk_layernorm) is the caller's."""
    config = tiny_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True, qk_layernorm=False)
    attention = specs.get_gpt_layer_local_spec(config, qk_layernorm=True).submodules.self_attention
    assert attention.submodules.q_layernorm is not IdentityOp
    assert attention.submodules.k_layernorm is not IdentityOp


def test_the_launcher_path_serves_every_spec_under_the_name_checkpoints_record():
    """mcore_torch_experts.specs, the path Megatron-LM's --spec names and Bridge's run_config.yaml
    records (from each function's __module__), serves every documented spec of the wing's module,
    without a deprecation warning; the other old paths warn, naming the new one."""
    import importlib
    import sys
    import warnings

    import mcore_torch_experts.specs as launcher_path

    for name in specs.__all__:
        function = getattr(launcher_path, name)
        assert function is getattr(specs, name)
        assert f"{function.__module__}.{function.__qualname__}" == f"mcore_torch_experts.specs.{name}"
    for old in ("moe_layer", "model", "convert", "upcycling", "recompute"):
        sys.modules.pop(f"mcore_torch_experts.{old}", None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(f"mcore_torch_experts.{old}")
        assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
            f"mcore_torch_experts.{old} moved to mcore_torch_experts.megatron.{old}: import it "
            "from there."], old
        new = importlib.import_module(f"mcore_torch_experts.megatron.{old}")
        public = [n for n in vars(new) if not n.startswith("_")
                  and getattr(vars(new)[n], "__module__", None) == new.__name__]
        assert public and all(getattr(module, n) is getattr(new, n) for n in public), old
