"""The launcher entry points and the launchers' routes to them.

- `specs.torch_experts_gpt_spec` / `torch_experts_hybrid_stack_spec` build TorchGroupedMLP
  experts from a config without the backend field, Megatron's own spec otherwise unchanged (TE
  or local modules as `transformer_impl` says), refuse on the real TransformerConfig, and give a
  model that computes what Megatron's SequentialMLP model computes.
- Megatron-LM 0.19: parsed command-line arguments to a built model (megatron_lm_worker.py).
- Megatron-Bridge 0.6 and NeMo-RL's calls on it: AutoBridge, LoRA, run_config.yaml round trips
  (bridge_launcher_worker.py).
"""

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_torch_experts import (
    TorchExpertsConfigError,
    TorchExpertsTransformerConfig,
    TorchGroupedMLP,
    _compat,
    specs,
)
from support.bridge import import_bridge_peft, run_worker
from support.reference import rel_err
from support.specs import (
    GRAD_TOL,
    LAUNCHER_ENTRY_POINTS,
    LOGITS_TOL,
    experts_class,
    mlp_kinds,
    plain_config,
    spec_structure,
)
from support.tiny_gpt import (
    assert_experts_built_frozen,
    forward_backward,
    freeze_experts,
    gpt,
    sequential_to_grouped,
    tiny_config,
)


def with_torch_experts_in_moe_layers(structure):
    """The independent expectation, made on plain data (spec_structure) without the package's
    spec helpers: every MoESubmodules' `experts` entry replaced by TorchGroupedMLP's spec, all
    else as given."""
    if isinstance(structure, tuple) and structure and structure[0] is MoESubmodules:
        experts = spec_structure(ModuleSpec(module=TorchGroupedMLP))
        return (MoESubmodules, {**structure[1], "experts": experts})
    if isinstance(structure, (tuple, list)):
        return type(structure)(map(with_torch_experts_in_moe_layers, structure))
    if isinstance(structure, dict):
        return {k: with_torch_experts_in_moe_layers(v) for k, v in structure.items()}
    return structure


@pytest.mark.parametrize("impl", ["local",
                                  pytest.param("transformer_engine", marks=pytest.mark.te)])
def test_gpt_spec_without_the_backend_field_is_megatrons_block_with_torch_experts(megatron_cpu,
                                                                                  impl):
    config = plain_config(transformer_impl=impl)
    assert not hasattr(config, "moe_expert_gemm_backend")
    use_te = impl == "transformer_engine"
    try:  # TE or local modules, as transformer_impl asked: Megatron's own choice for it
        megatron = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_te, normalization=config.normalization, qk_l2_norm=config.qk_l2_norm)
    except (NameError, TypeError) as error:  # its TE spec without Transformer Engine
        pytest.skip(f"Megatron's own TE block spec cannot be built here: {error}")
    ours = specs.torch_experts_gpt_spec(config)
    expected = with_torch_experts_in_moe_layers(spec_structure(megatron))
    assert expected != spec_structure(megatron)  # Megatron's block has MoE layers
    assert spec_structure(ours) == expected
    assert [experts_class(s) for s in ours.layer_specs[1:]] == [TorchGroupedMLP, TorchGroupedMLP]
    assert ours.layer_specs[0].submodules.self_attention.submodules.linear_qkv is \
        megatron.layer_specs[0].submodules.self_attention.submodules.linear_qkv


def test_gpt_spec_on_a_transformer_engine_backend_field_gives_megatrons_spec_unchanged(
        megatron_cpu):
    config = tiny_config(transformer_impl="local", moe_grouped_gemm=True)
    assert config.moe_expert_gemm_backend == "transformer_engine"  # a field: the YAML keeps it
    ours = specs.torch_experts_gpt_spec(config)
    assert spec_structure(ours) == spec_structure(gpt_layer_specs.get_gpt_decoder_block_spec(
        config, False, normalization=config.normalization, qk_l2_norm=config.qk_l2_norm))
    assert TorchGroupedMLP not in {experts_class(s) for s in ours.layer_specs[1:]}


def test_gpt_spec_passes_the_pipeline_stage_to_megatron(megatron_cpu, monkeypatch):
    seen = {}
    builder = gpt_layer_specs.get_gpt_decoder_block_spec

    def recording_builder(config, use_transformer_engine, **kwargs):
        seen.update(kwargs)
        return builder(config, use_transformer_engine, **kwargs)

    monkeypatch.setattr(gpt_layer_specs, "get_gpt_decoder_block_spec", recording_builder)
    specs.torch_experts_gpt_spec(plain_config(transformer_impl="local"), vp_stage=0)
    assert seen["vp_stage"] == 0


CONFIG_REFUSALS = {
    "add_bias_linear": (True, "add_bias_linear=True: expert weights must be bias-free"),
    "moe_grouped_gemm": (False, "moe_grouped_gemm=False: set moe_grouped_gemm=True"),
}
ENTRY_POINTS = {"gpt": specs.torch_experts_gpt_spec,
                "hybrid": specs.torch_experts_hybrid_stack_spec}
# Every launcher entry point: (experts, MoE layer) it builds from a config without our fields.


@pytest.mark.parametrize("field", list(CONFIG_REFUSALS))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_entry_points_refuse_on_the_config_they_are_given(megatron_cpu, field, entry):
    value, message = CONFIG_REFUSALS[field]
    config = plain_config(transformer_impl="local")
    setattr(config, field, value)
    with pytest.raises(TorchExpertsConfigError, match=message):
        ENTRY_POINTS[entry](config)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_entry_points_refuse_a_misspelt_backend_field(megatron_cpu, entry):
    config = tiny_config(transformer_impl="local", moe_grouped_gemm=True)
    config.moe_expert_gemm_backend = "Torch"
    with pytest.raises(TorchExpertsConfigError,
                       match="moe_expert_gemm_backend='Torch' is not a backend"):
        ENTRY_POINTS[entry](config)


def moe_layer_specs(entry, spec):
    """The MoE layer specs of what a GPT or hybrid launcher entry point returned."""
    if entry.endswith("_gpt_spec"):
        return [layer.submodules.mlp for layer in spec.layer_specs[1:]]
    return [spec.submodules.moe_layer.submodules.mlp]


@pytest.mark.parametrize("entry", list(LAUNCHER_ENTRY_POINTS))
def test_each_launcher_entry_point_builds_what_its_name_says(megatron_cpu, entry):
    """Launchers record the import path alone (Bridge's run_config.yaml): it is the whole choice."""
    experts, layer = LAUNCHER_ENTRY_POINTS[entry]
    config = plain_config(transformer_impl="local")
    if entry.endswith("_gpt_spec"):
        megatron = [layer.submodules.mlp for layer in gpt_layer_specs.get_gpt_decoder_block_spec(
            config, False, normalization=config.normalization).layer_specs[1:]]
    else:
        megatron = [_compat.megatron_hybrid_stack_spec().submodules.moe_layer.submodules.mlp]
    megatron_experts = {_compat.spec_class(_compat.moe_submodules(m).experts) for m in megatron}
    assert TorchGroupedMLP not in megatron_experts
    built = moe_layer_specs(entry, getattr(specs, entry)(config))
    assert {_compat.spec_class(m) for m in built} == {layer}
    assert {_compat.spec_class(_compat.moe_submodules(m).experts) for m in built} == \
        ({TorchGroupedMLP} if experts == "torch" else megatron_experts)


PLAIN_SETTINGS = {"moe_expert_gemm_backend": "transformer_engine", "moe_combine_in_fp32": True,
                  "moe_combine_chunk_rows": 512, "moe_combine_backend": "torch",
                  "moe_expert_kernel": "grouped_mm"}


def test_the_plain_setting_cases_are_the_package_fields():
    assert set(PLAIN_SETTINGS) == {f.name for f in dataclasses.fields(
        TorchExpertsTransformerConfig)} - {f.name for f in dataclasses.fields(TransformerConfig)}


@pytest.mark.parametrize("field", list(PLAIN_SETTINGS))
@pytest.mark.parametrize("entry", list(LAUNCHER_ENTRY_POINTS))
def test_a_package_setting_held_as_a_plain_attribute_is_refused(megatron_cpu, entry, field):
    """Bridge's run_config.yaml records dataclass fields only: a provider rebuilt from it would
    build without the setting, so the first build refuses it, naming what to do instead."""
    value = PLAIN_SETTINGS[field]
    config = plain_config(transformer_impl="local", **{field: value})
    with pytest.raises(TorchExpertsConfigError) as refusal:
        getattr(specs, entry)(config)
    message = str(refusal.value)
    assert message.startswith(
        f"{entry} does not support {field}={value!r}: a plain attribute of TransformerConfig "
        "(not a dataclass field) is not recorded in Megatron-Bridge's run_config.yaml, so a "
        "provider rebuilt from it (NeMo-RL's policy and reference models are) would build "
        "without it; ")
    fix = {"moe_expert_gemm_backend": "fp32_combine_gpt_spec (Megatron's experts with the FP32 "
                                      "combine) or Megatron's own spec",
           "moe_combine_in_fp32": "name torch_experts_fp32_combine_gpt_spec",
           "moe_combine_chunk_rows": "set MCORE_TORCH_EXPERTS_COMBINE_CHUNK_ROWS",
           "moe_combine_backend": "remove it", "moe_expert_kernel": "remove it"}[field]
    assert fix in message


@pytest.mark.parametrize("entry_point", ["torch_experts_gpt_spec", "fp32_combine_gpt_spec",
                                         "torch_experts_hybrid_stack_spec",
                                         "fp32_combine_hybrid_stack_spec"])
def test_entry_points_refuse_the_inference_transformer_impl(megatron_cpu, entry_point):
    """Every launcher entry point, whatever experts it keeps, names itself (the GPT ones pick TE
    or local modules by transformer_impl; the hybrid ones build Transformer Engine layers)."""
    with pytest.raises(TorchExpertsConfigError,
                       match=f"^{entry_point} does not support "
                             "transformer_impl='inference_optimized': .* set "
                             "transformer_impl='transformer_engine' or 'local'.$"):
        getattr(specs, entry_point)(plain_config(transformer_impl="inference_optimized"))


def test_hybrid_stack_spec_without_the_backend_field_swaps_only_the_moe_experts(megatron_cpu):
    config = plain_config()
    ours = specs.torch_experts_hybrid_stack_spec(config)
    megatron = _compat.megatron_hybrid_stack_spec()
    assert experts_class(ours.submodules.moe_layer) is TorchGroupedMLP
    assert experts_class(megatron.submodules.moe_layer) is not TorchGroupedMLP
    others = [f.name for f in dataclasses.fields(megatron.submodules) if f.name != "moe_layer"]
    assert all(getattr(ours.submodules, name) is getattr(megatron.submodules, name)
               for name in others)
    unchanged = specs.torch_experts_hybrid_stack_spec(tiny_config(moe_grouped_gemm=True))
    assert experts_class(unchanged.submodules.moe_layer) is \
        experts_class(megatron.submodules.moe_layer)


def test_callbacks_reject_what_is_not_a_config():
    with pytest.raises(TypeError, match="a spec callback takes a TransformerConfig"):
        specs.torch_experts_gpt_spec({"num_layers": 2})


def test_model_from_the_gpt_entry_point_matches_the_sequential_mlp_model(megatron_cpu):
    config = plain_config(transformer_impl="local")
    ours = gpt(config, specs.torch_experts_gpt_spec(config), seed=1)
    ref_config = plain_config(transformer_impl="local", moe_grouped_gemm=False)
    reference = gpt(ref_config, gpt_layer_specs.get_gpt_decoder_block_spec(ref_config, False))
    assert mlp_kinds(ours)[1:] == [TorchGroupedMLP, TorchGroupedMLP]
    assert mlp_kinds(reference)[1:] == [SequentialMLP, SequentialMLP]
    ours.load_state_dict(sequential_to_grouped(reference.state_dict()), strict=False)
    assert_experts_built_frozen(ours)
    freeze_experts(reference)
    logits, loss, grads = forward_backward(ours)
    ref_logits, ref_loss, ref_grads = forward_backward(reference)
    assert rel_err(logits, ref_logits) < LOGITS_TOL
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) < GRAD_TOL, name


def _has_megatron_lm_gpt_builder() -> bool:
    """Whether megatron.training with Megatron-LM 0.19's GPTModelConfig/GPTModelBuilder is here."""
    training = importlib.util.find_spec("megatron.training")
    return training is not None and (Path(training.origin).parent / "models" / "gpt.py").exists()


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory):
    if not _has_megatron_lm_gpt_builder():
        pytest.skip("megatron.training has no GPTModelBuilder (it ships with megatron-core 0.19)")
    # The worker runs its tiny models on the CPU (gloo), on a CUDA host too.
    return run_worker(Path(__file__).parent / "megatron_lm_worker.py",
                      tmp_path_factory.mktemp("megatron_lm"), hide_gpus=True)


def test_megatron_lm_spec_flag_builds_torch_experts_from_parsed_arguments(megatron_lm):
    assert megatron_lm["config_class"] == "GPTModelConfig"
    assert megatron_lm["transformer_config_class"] == "TransformerConfig"  # no backend field
    assert megatron_lm["experts"] == ["TorchGroupedMLP", "TorchGroupedMLP"]
    assert megatron_lm["reference_experts"] == ["SequentialMLP", "SequentialMLP"]
    assert megatron_lm["trainable_expert_weights"] == []  # built frozen, nothing else freezes them


def test_megatron_lm_model_computes_what_megatrons_own_spec_computes(megatron_lm):
    assert megatron_lm["unexpected_keys"] == [] and megatron_lm["missing_weights"] == []
    assert megatron_lm["logits_rel_err"] < LOGITS_TOL
    assert megatron_lm["grad_names_equal"]
    assert megatron_lm["grads_max_rel_err"] < GRAD_TOL


def test_megatron_lm_refusals_run_on_the_transformer_config(megatron_lm):
    assert megatron_lm["bias_refusal"].startswith(
        "TorchExpertsConfigError: moe_expert_gemm_backend='torch' does not support "
        "add_bias_linear=True")


@pytest.fixture(scope="module")
def bridge_run(tmp_path_factory):
    if importlib.util.find_spec("megatron.bridge") is None or \
            importlib.util.find_spec("transformers") is None:
        pytest.skip("needs megatron-bridge and transformers (the Python 3.12 / megatron-core "
                    "0.19 leg)")
    return run_worker(Path(__file__).parents[1] / "bridge" / "bridge_launcher_worker.py",
                      tmp_path_factory.mktemp("bridge_launcher"), hide_gpus=True)


def test_bridge_autobridge_provider_naming_the_spec_builds_torch_experts(bridge_run):
    assert bridge_run["provider_class"] == "GPTModelProvider"  # what Qwen3-MoE's bridge returns
    assert not bridge_run["provider_has_backend_field"]
    assert bridge_run["experts"] == ["TorchGroupedMLP", "TorchGroupedMLP"]
    assert bridge_run["import_logits_max_abs"] < 1e-5  # HF weights in the packed buffers


def test_bridge_lora_trains_on_the_launcher_spec_model(bridge_run):
    assert bridge_run["adapter_wrappers"] == 4  # 2 layers x experts fc1, fc2
    losses = bridge_run["losses"]
    assert losses[-1] < losses[0] - 0.1
    assert bridge_run["adapter_shift_max_abs"] > 1e-2
    assert bridge_run["merged"] == 4 and bridge_run["merged_logits_max_abs"] < 1e-5


def test_bridge_run_config_keeps_the_spec_and_reloads_it_once_the_prefix_is_allowed(bridge_run):
    assert bridge_run["run_config_spec"] == {
        "_target_": "mcore_torch_experts.specs.torch_experts_gpt_spec", "_call_": False}
    assert "InstantiationException: Instantiation of 'mcore_torch_experts.specs." \
        "torch_experts_gpt_spec' is not allowed because it is not in the allowlist" in \
        bridge_run["reload_without_prefix"]
    assert bridge_run["reloaded_provider_class"] == "GPTModelProvider"
    assert bridge_run["reloaded_spec"] == "mcore_torch_experts.specs.torch_experts_gpt_spec"
    assert bridge_run["reloaded_experts"] == ["TorchGroupedMLP", "TorchGroupedMLP"]
    assert bridge_run["reloaded_logits_max_abs"] < 1e-5  # the trained weights, reloaded


@pytest.mark.parametrize("entry", list(LAUNCHER_ENTRY_POINTS))
def test_every_launcher_entry_point_survives_bridges_run_config_round_trip(bridge_run, entry):
    """What NeMo-RL does to the policy and reference models: the provider rebuilt from
    run_config.yaml resolves the MoE layers the original did, the ones the name says."""
    trip = bridge_run["entry_point_round_trips"][entry]
    assert trip["recorded"] == {"_target_": f"mcore_torch_experts.specs.{entry}", "_call_": False}
    experts, layer = LAUNCHER_ENTRY_POINTS[entry]
    assert trip["after"] == trip["before"] and trip["before"]
    assert {layer_class for layer_class, _ in trip["before"]} == {layer.__name__}
    assert ({experts_class for _, experts_class in trip["before"]} == {"TorchGroupedMLP"}) == \
        (experts == "torch")


def test_bridge_run_config_drops_a_plain_attribute_which_the_entry_point_refuses(bridge_run):
    assert not bridge_run["plain_attribute_recorded"]
    assert bridge_run["plain_attribute_refusal"].startswith(
        "TorchExpertsConfigError: torch_experts_gpt_spec does not support "
        "moe_combine_in_fp32=True: a plain attribute of GPTModelProvider (not a dataclass field)")


def test_bridge_hybrid_provider_keeps_the_hybrid_spec_through_its_run_config(bridge_run):
    assert bridge_run["hybrid_run_config_spec"] == {
        "_target_": "mcore_torch_experts.specs.torch_experts_hybrid_stack_spec", "_call_": False}
    assert bridge_run["hybrid_reloaded_provider_class"] == "HybridModelProvider"
    assert bridge_run["hybrid_reloaded_experts"] == "TorchGroupedMLP"


def test_nemo_rl_extension_worker_gives_its_import_the_spec(bridge_run):
    assert bridge_run["nemo_rl_import_experts"] == ["TorchGroupedMLP", "TorchGroupedMLP"]
    # The provider NeMo-RL rebuilds from run_config.yaml (the extension allowed the prefix).
    assert bridge_run["nemo_rl_provider_spec"] == "torch_experts_gpt_spec"
    # examples/nemo_rl_worker.py names the package's class and function.
    assert bridge_run["nemo_rl_example_reexports"]


def test_nemo_rl_extension_turns_megatrons_batch_invariant_kernels_on_where_the_mode_is_asked(
        bridge_run):
    """NeMo-RL never turns Megatron's batch-invariant kernels on, and our experts refuse a forward
    in the mode without them: the extension does it, with the backend our kernels were proven
    bitwise under, where policy.megatron_cfg.model_overrides asks for the mode (only there);
    before megatron-core 0.20 it refuses the override, naming the release."""
    from mcore_torch_experts import _compat

    turned_on = bridge_run["nemo_rl_batch_invariant_kernels"]
    assert turned_on["not asked"] == []
    if _compat.megatron_core_release() >= (0, 20):
        assert turned_on["asked"] == ["triton"]
        # NeMo-RL's recipes' FP64 router: refused before the kernels are turned on.
        for case in ("asked, FP64 router", "asked, FP64 router override"):
            assert turned_on[case] == (
                "TorchExpertsConfigError: policy.megatron_cfg.moe_router_dtype='fp64' with "
                "policy.megatron_cfg.model_overrides.batch_invariant_mode=True: Megatron's "
                "batch-invariant matmul has no FP64 kernel (the router's gating matmul fails "
                "inside it with KeyError: torch.float64). Set policy.megatron_cfg.moe_router_dtype: "
                "fp32 (NeMo-RL's Megatron recipes set fp64)."), turned_on[case]
    else:
        assert re.match(r"TorchExpertsConfigError: policy\.megatron_cfg\.model_overrides\."
                        r"batch_invariant_mode=True: batch-invariant MoE needs megatron-core "
                        r">= 0\.20 .*Upgrade megatron-core or remove the override\.$",
                        turned_on["asked"]), turned_on["asked"]


def test_nemo_rl_extension_refuses_a_megatron_lm_pretrained_checkpoint(bridge_run):
    assert bridge_run["nemo_rl_refusals"]["megatron_lm"] == (
        "TorchExpertsConfigError: policy.pretrained_checkpoint.format='megatron_lm' (path "
        "'/checkpoints/iter_0000010'): NeMo-RL builds such a checkpoint's model without its HF "
        "import, where TorchExpertsMegatronPolicyWorker puts the spec, so its experts would be "
        "Megatron's. Remove policy.pretrained_checkpoint and set policy.model_name to the HF "
        "checkpoint (export a Megatron checkpoint to HF first), with "
        "policy.megatron_cfg.force_reconvert_from_hf: true once.")
    assert bridge_run["nemo_rl_megatron_lm_left_unset"]  # nothing set on the worker


def test_nemo_rl_extension_takes_a_bridge_checkpoint_only_where_its_run_config_names_our_spec(
        bridge_run):
    """NeMo-RL rebuilds a megatron_bridge pretrained_checkpoint from its run_config.yaml: one
    saved with the package's spec has TorchGroupedMLP experts and is taken; one without any
    run_config.yaml, or recording the stock spec, is refused naming what it found."""
    assert bridge_run["nemo_rl_bridge_checkpoint_ours"] == [
        "_mamba_stack_spec", "_transformer_layer_spec"]
    stock = bridge_run["nemo_rl_bridge_checkpoint_stock"]
    assert stock.startswith("TorchExpertsConfigError: policy.pretrained_checkpoint.format="
                            "'megatron_bridge' (path ")
    assert "its run_config.yaml records the spec(s) [" in stock
    assert "mcore_torch_experts" not in stock.split("records the spec(s)")[1].split("]")[0]
    assert "transformer_layer_spec is mcore_torch_experts.specs.torch_experts_gpt_spec" in stock
    missing = bridge_run["nemo_rl_refusals"]["megatron_bridge"]
    assert missing.startswith("TorchExpertsConfigError: policy.pretrained_checkpoint.format="
                              "'megatron_bridge' (path '/checkpoints/iter_0000010'): it has no "
                              "run_config.yaml")
    assert bridge_run["nemo_rl_megatron_bridge_left_unset"]


@pytest.mark.parametrize("role", ["policy", "reference"])
def test_nemo_rl_policy_and_reference_models_have_torch_experts_and_shared_adapters(bridge_run,
                                                                                    role):
    assert bridge_run[f"nemo_rl_{role}_experts"] == ["TorchGroupedMLP", "TorchGroupedMLP"]
    # NeMo-RL builds LoRA from fixed keys: Bridge's default, one shared adapter per module.
    assert bridge_run[f"nemo_rl_{role}_expert_adapter"] == "ParallelLinearAdapter"
    # Base weights loaded before the (zero-initialised B) adapters: the HF model's logits.
    assert bridge_run[f"nemo_rl_{role}_logits_max_abs"] < 1e-5


def test_megatron_lm_run_used_the_documented_flags(megatron_lm):
    assert megatron_lm["documented_flags"][-3:] == [
        "--spec", "mcore_torch_experts.specs", "torch_experts_gpt_spec"]


def test_megatron_lm_hybrid_launcher_change_gives_torch_experts(megatron_lm):
    assert megatron_lm["hybrid_experts"] == "TorchGroupedMLP"


def test_bridge_peft_snippet_wraps_the_experts_per_expert(bridge_run):
    assert bridge_run["doc_peft_wrappers"] == 8  # 2 layers x (qkv, proj, experts fc1, fc2)
    assert bridge_run["doc_peft_expert_adapter"] == "GroupedExpertLinearAdapter"


@pytest.mark.te
def test_bridge_mtp_layers_inherit_the_named_spec(megatron_cpu):
    """Bridge's GPT provider derives its MTP block from the last layer of the named spec; it
    builds that block with Transformer Engine modules, so this runs where TE is installed."""
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("Bridge builds its MTP block spec from Transformer Engine modules")
    import_bridge_peft()
    from megatron.bridge.models.gpt_provider import GPTModelProvider, mtp_block_spec

    config = plain_config()
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    provider = GPTModelProvider(**{**fields, "mtp_num_layers": 1}, vocab_size=128,
                                transformer_layer_spec=specs.torch_experts_gpt_spec)
    provider.finalize()
    block = mtp_block_spec(provider)
    mlp = block.layer_specs[0].submodules.mtp_model_layer.submodules.mlp
    assert _compat.spec_class(_compat.moe_submodules(mlp).experts) is TorchGroupedMLP


@pytest.mark.te
def test_bridge_hybrid_provider_trains_bridge_lora_on_cuda(megatron_world, monkeypatch):
    """A Bridge HybridModelProvider (attention and MoE layers) naming the hybrid entry point
    builds TorchGroupedMLP experts with Megatron's TE hybrid stack and trains Bridge's LoRA on
    them (BF16 on CUDA, where Bridge puts the model: megatron_world, no CPU patches there;
    Megatron's hybrid stack spec needs Transformer Engine)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("needs CUDA and Transformer Engine (Megatron's hybrid stack spec)")
    import_bridge_peft()
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
    from megatron.bridge.peft.lora import LoRA
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnBackend

    model_parallel_cuda_manual_seed(0)
    # The provider asserts these are unset or match its attention backend.
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(name, raising=False)
    provider = HybridModelProvider(
        # The provider defaults to flash, which needs the flash-attn package; auto lets TE pick
        # the backend it has (the experts are what this test is about).
        attention_backend=AttnBackend.auto,
        num_layers=2, hybrid_layer_pattern="*E", hidden_size=256, num_attention_heads=4,
        ffn_hidden_size=512, num_moe_experts=8, moe_ffn_hidden_size=256, moe_router_topk=2,
        moe_grouped_gemm=True, moe_aux_loss_coeff=0.0, vocab_size=128, seq_length=64,
        hybrid_stack_spec=specs.torch_experts_hybrid_stack_spec,
        gradient_accumulation_fusion=False)  # Bridge's default needs APEX's CUDA extension
    provider.finalize()
    model, = provider.provide_distributed_model(wrap_with_ddp=False,
                                                mixed_precision_wrapper=None)
    moe_layer = next(layer for layer in model.decoder.layers if hasattr(layer, "mlp")
                     and hasattr(layer.mlp, "experts"))
    assert type(moe_layer.mlp.experts) is TorchGroupedMLP
    model = LoRA(target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                 dim=8, alpha=16, share_expert_adapters=False)(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    tokens = torch.randint(0, 128, (2, 65), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    positions = torch.arange(64, device="cuda").expand(2, 64)
    losses = []
    for _ in range(6):
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_nemo_rl_refit_export_gives_every_hf_tensor_back(bridge_run):
    assert bridge_run["nemo_rl_refit_keys_equal"]
    assert bridge_run["nemo_rl_refit_unequal"] == []
