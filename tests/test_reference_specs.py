"""The reference specs per model family (specs/: Qwen3-MoE, DeepSeek-V3 style, Nemotron-3 hybrid):
each family's config keeps its MoE layout and the torch backend; a tiny variant built on the CPU
has TorchGroupedMLP experts in its MoE layers and runs one forward/backward to a finite loss (the
hybrid family: its spec on the CPU, its model where Transformer Engine is); `use_torch_experts`
names the package's entry point on a real Megatron-Bridge provider; `NEMO_RL_MEGATRON_CFG` has the
keys of docs/enable.md's `nemo-rl-config` snippet."""

import importlib.util
from pathlib import Path

import pytest
import torch
import yaml
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from mcore_torch_experts import TorchExpertsTransformerConfig, TorchGroupedMLP, _compat, specs
from support.doc_snippets import snippet
from support.tiny_gpt import SEQ, VOCAB, batch

SPECS = Path(__file__).resolve().parents[1] / "specs"
FAMILIES = ("qwen3_moe", "deepseek_v3", "nemotron3_hybrid")
GPT_FAMILIES = ("qwen3_moe", "deepseek_v3")
CPU_FP32 = dict(bf16=False, params_dtype=torch.float32, use_cpu_initialization=True)


def family(name):
    """specs/NAME.py, imported by path (specs/ is a folder of reference modules, not a package
    on the test path)."""
    spec = importlib.util.spec_from_file_location(f"reference_specs.{name}", SPECS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _layer_experts(layer_specs):
    return [_compat.spec_class(_compat.moe_submodules(s.submodules.mlp).experts)
            for s in layer_specs if _compat.is_moe_mlp_spec(s.submodules.mlp)]


# Tiny sizes of each GPT family, FP32 local modules on the CPU.
TINY = {
    "qwen3_moe": dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_query_groups=2, kv_channels=16, num_moe_experts=4,
                      moe_ffn_hidden_size=32, moe_router_topk=2),
    "deepseek_v3": dict(first_dense_layers=1, num_layers=3, hidden_size=64, ffn_hidden_size=128,
                        num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
                        qk_pos_emb_head_dim=8, v_head_dim=16, num_moe_experts=8,
                        moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                        moe_router_topk=2, moe_router_num_groups=4, moe_router_group_topk=2),
}
# Each family's MoE layout, as its full-size config must keep it.
LAYOUT = {
    "qwen3_moe": dict(num_layers=48, hidden_size=2048, num_attention_heads=32,
                      num_query_groups=4, kv_channels=128, num_moe_experts=128,
                      moe_ffn_hidden_size=768, moe_router_topk=8, gated_linear_unit=True,
                      qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False,
                      moe_shared_expert_intermediate_size=None,
                      moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True),
    "deepseek_v3": dict(num_layers=61, moe_layer_freq=[0] * 3 + [1] * 58,
                        multi_latent_attention=True, num_moe_experts=256,
                        moe_ffn_hidden_size=2048, moe_router_topk=8,
                        moe_shared_expert_intermediate_size=2048,
                        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_num_groups=8, moe_router_group_topk=4, gated_linear_unit=True,
                        moe_grouped_gemm=True),
    "nemotron3_hybrid": dict(num_layers=52, num_moe_experts=128, moe_ffn_hidden_size=1856,
                             moe_router_topk=6, gated_linear_unit=False,
                             moe_shared_expert_intermediate_size=3712, moe_grouped_gemm=True),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_full_size_config_keeps_the_family_layout_and_the_torch_backend(name):
    config = family(name).transformer_config()
    assert isinstance(config, TorchExpertsTransformerConfig)
    assert config.moe_expert_gemm_backend == "torch"
    assert {field: getattr(config, field) for field in LAYOUT[name]} == LAYOUT[name]
    if name == "nemotron3_hybrid":
        assert config.activation_func.__name__ == "squared_relu"
        assert config.num_layers == len(family(name).HYBRID_LAYER_PATTERN)
    else:
        assert config.activation_func is torch.nn.functional.silu


def test_tiny_qwen3_moe_trains_one_step_with_torch_experts(megatron_cpu, cpu_cuda_streams):
    """Qwen3-MoE's `model_provider` at tiny sizes on the CPU (FP32, local modules, its alltoall
    dispatcher): TorchGroupedMLP in every layer, built frozen; one forward/backward gives a
    finite loss and gradients to the routers and the embedding."""
    module = family("qwen3_moe")
    config = module.transformer_config(**TINY["qwen3_moe"], **CPU_FP32, transformer_impl="local")
    torch.manual_seed(0)
    model = module.model_provider(config=config, vocab_size=VOCAB, max_sequence_length=SEQ)

    assert [type(layer.mlp.experts) for layer in model.decoder.layers] == [TorchGroupedMLP] * 2
    assert all(layer.mlp.shared_experts is None for layer in model.decoder.layers)
    experts = [p for n, p in model.named_parameters() if ".mlp.experts." in n]
    assert experts and not any(p.requires_grad for p in experts)

    inputs, positions, mask, labels = batch()
    model.train()
    loss = model(inputs, positions, mask, labels=labels)
    assert loss.shape == (2, SEQ) and torch.isfinite(loss).all()
    loss.mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    router = [n for n in grads if n.endswith("mlp.router.weight")]
    assert len(router) == 2
    assert all(grads[n] is not None and torch.isfinite(grads[n]).all() for n in router)
    assert grads["embedding.word_embeddings.weight"] is not None


def test_tiny_deepseek_v3_spec_and_moe_layer_train_one_step(megatron_cpu, cpu_cuda_streams):
    """DeepSeek-V3 on the CPU up to the spec, plus one MoE layer built from it: Megatron's local
    (non-TE) multi-latent attention does not build on the CPU (the local DotProductAttention of
    megatron-core 0.16.1 and 0.20.0 takes no `k_channels`, which MLASelfAttention passes), so the
    whole model is not built here. The block spec has a dense first layer, then MoE layers with
    TorchGroupedMLP routed experts and a shared expert, MLA attention in every layer; the MoE
    layer (sigmoid router with expert bias, group-limited routing, shared expert, alltoall
    dispatcher) runs one forward/backward to finite outputs and gradients."""
    module = family("deepseek_v3")
    config = module.transformer_config(**TINY["deepseek_v3"], **CPU_FP32,
                                       transformer_impl="local")
    block = specs.torch_experts_gpt_spec(config)
    assert [_compat.is_moe_mlp_spec(s.submodules.mlp) for s in block.layer_specs] == \
        [False, True, True]
    assert _layer_experts(block.layer_specs) == [TorchGroupedMLP] * 2
    assert {_compat.spec_class(s.submodules.self_attention).__name__
            for s in block.layer_specs} == {"MLASelfAttention"}
    moe_spec = block.layer_specs[1].submodules.mlp
    assert _compat.moe_submodules(moe_spec).shared_experts is not None

    torch.manual_seed(0)
    layer = _compat.build_moe_layer(moe_spec, config, pg_collection=megatron_cpu)
    assert isinstance(layer.experts, TorchGroupedMLP)
    assert isinstance(layer.shared_experts, SharedExpertMLP)
    assert layer.router.enable_expert_bias and config.moe_router_num_groups == 4
    assert not any(p.requires_grad for p in layer.experts.parameters())
    hidden = torch.randn(SEQ, 2, config.hidden_size, requires_grad=True)
    layer.train()
    out, _ = layer(hidden)
    out.sum().backward()
    assert out.shape == hidden.shape and torch.isfinite(out).all()
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0
    assert torch.isfinite(layer.router.weight.grad).all()
    assert layer.shared_experts.linear_fc1.weight.grad is not None


def tiny_hybrid_config(module, pattern):
    return module.transformer_config(
        num_layers=len(pattern), hidden_size=64, ffn_hidden_size=64, num_attention_heads=4,
        num_query_groups=2, kv_channels=16, mamba_num_heads=4, mamba_head_dim=16,
        mamba_state_dim=16, mamba_num_groups=2, num_moe_experts=4, moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=32, moe_router_topk=2)


def test_hybrid_stack_spec_has_torch_experts_and_megatrons_other_layers():
    """On the CPU only the spec: Megatron's hybrid stack spec is built from Transformer Engine
    modules (tests/unit/test_hybrid.py). Its MoE layer gets TorchGroupedMLP; Mamba and attention
    layers stay Megatron's."""
    module = family("nemotron3_hybrid")
    config = tiny_hybrid_config(module, "MEM*E")
    stack = specs.torch_experts_hybrid_stack_spec(config)
    megatron = _compat.megatron_hybrid_stack_spec()
    moe = _compat.moe_submodules(stack.submodules.moe_layer.submodules.mlp)
    assert _compat.spec_class(moe.experts) is TorchGroupedMLP
    assert stack.submodules.mamba_layer is megatron.submodules.mamba_layer
    assert stack.submodules.attention_layer is megatron.submodules.attention_layer


def test_hybrid_provider_refuses_a_pattern_of_another_length():
    module = family("nemotron3_hybrid")
    with pytest.raises(ValueError, match="hybrid_layer_pattern has 3 layers, config.num_layers=5"):
        module.model_provider(config=tiny_hybrid_config(module, "MEM*E"),
                              hybrid_layer_pattern="M*E")


@pytest.mark.te
def test_tiny_hybrid_model_trains_one_step_with_torch_experts(megatron_world):
    """The full hybrid model: needs CUDA, Transformer Engine and mamba_ssm (Megatron's Mamba
    mixer), BF16 on the GPU."""
    missing = [package for package in ("transformer_engine", "mamba_ssm")
               if importlib.util.find_spec(package) is None]
    if not torch.cuda.is_available() or missing:
        pytest.skip(f"Megatron's hybrid stack spec needs CUDA, Transformer Engine and mamba_ssm "
                    f"(CUDA: {torch.cuda.is_available()}, missing: {missing or 'none'})")
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)  # te_world's seeding, once CUDA is known to be there
    module = family("nemotron3_hybrid")
    pattern = "MEM*E"
    model = module.model_provider(config=tiny_hybrid_config(module, pattern), vocab_size=VOCAB,
                                  max_sequence_length=SEQ, hybrid_layer_pattern=pattern).cuda()
    experts = [type(m) for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert experts == [TorchGroupedMLP] * pattern.count("E")
    inputs, positions, _, labels = (t.cuda() for t in batch())
    loss = model(inputs, positions, None, labels=labels)
    assert torch.isfinite(loss).all()
    loss.float().mean().backward()
    assert model.embedding.word_embeddings.weight.grad is not None


@pytest.fixture(scope="module")
def bridge_providers():
    """Megatron-Bridge's GPT and hybrid provider classes (bridge_support: skipped, with the
    reason, where Bridge cannot be imported)."""
    from support.bridge import import_bridge_peft

    import_bridge_peft()
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider

    return dict(gpt=GPTModelProvider, hybrid=HybridModelProvider)


@pytest.mark.bridge
@pytest.mark.parametrize("name", GPT_FAMILIES)
def test_use_torch_experts_names_the_gpt_entry_point_on_a_bridge_provider(name, bridge_providers,
                                                                          megatron_cpu):
    provider = bridge_providers["gpt"](
        num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
        moe_ffn_hidden_size=32, moe_router_topk=2, moe_grouped_gemm=False, add_bias_linear=False,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        transformer_impl="local", bf16=True, params_dtype=torch.bfloat16, vocab_size=VOCAB,
        seq_length=SEQ)
    assert "mcore_torch_experts" not in getattr(provider.transformer_layer_spec, "__module__", "")
    assert family(name).use_torch_experts(provider) is provider
    assert provider.transformer_layer_spec is specs.torch_experts_gpt_spec
    assert provider.moe_grouped_gemm is True
    block = provider.transformer_layer_spec(provider, vp_stage=None)  # as provide() calls it
    assert _layer_experts(block.layer_specs) == [TorchGroupedMLP] * 2


@pytest.mark.bridge
def test_use_torch_experts_names_the_hybrid_entry_point_on_a_bridge_provider(bridge_providers,
                                                                             megatron_cpu):
    provider = bridge_providers["hybrid"](
        num_layers=2, hybrid_layer_pattern="*E", hidden_size=64, num_attention_heads=4,
        num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_grouped_gemm=False,
        add_bias_linear=False, vocab_size=VOCAB, seq_length=SEQ)
    assert family("nemotron3_hybrid").use_torch_experts(provider) is provider
    assert provider.hybrid_stack_spec is specs.torch_experts_hybrid_stack_spec
    assert provider.moe_grouped_gemm is True
    stack = provider.hybrid_stack_spec(provider)  # as HybridModelProvider.provide() calls it
    assert _layer_experts([stack.submodules.moe_layer]) == [TorchGroupedMLP]


@pytest.mark.parametrize("name,attribute", [("qwen3_moe", "transformer_layer_spec"),
                                            ("deepseek_v3", "transformer_layer_spec"),
                                            ("nemotron3_hybrid", "hybrid_stack_spec")])
def test_use_torch_experts_refuses_what_is_not_a_provider_of_its_kind(name, attribute):
    with pytest.raises(TypeError, match=rf"\(it has `{attribute}`.*\), got object$"):
        family(name).use_torch_experts(object())


@pytest.mark.parametrize("name", FAMILIES)
def test_nemo_rl_megatron_cfg_has_the_documented_keys(name):
    documented = yaml.safe_load(snippet("nemo-rl-config"))["policy"]["megatron_cfg"]
    ours = yaml.safe_load(family(name).NEMO_RL_MEGATRON_CFG)
    assert ours.keys() == documented.keys()
    assert ours["peft"].keys() == documented["peft"].keys()
    assert ours["enabled"] is ours["moe_grouped_gemm"] is ours["peft"]["enabled"] is True
    assert {"linear_fc1", "linear_fc2"} <= set(ours["peft"]["target_modules"])
