"""Every setting the torch expert backend cannot honour is refused with one exception type whose
message names the field, its value and the fix; at config construction, at spec build and when
TorchGroupedMLP is built from a plain TransformerConfig."""

import pytest
import torch
import torch.nn.functional as F

from mcore_torch_experts import (
    TorchExpertsConfigError,
    TorchExpertsTransformerConfig,
    TorchGroupedMLP,
    validate_fp32_combine_config,
    validate_torch_experts_config,
)
from mcore_torch_experts.megatron.specs import torch_experts_spec
from support.reference import make_config

VALID = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
             moe_ffn_hidden_size=32, moe_router_topk=2, moe_grouped_gemm=True,
             add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16)

# (case, settings applied to a valid config, validate() arguments, "field=value" named, fix named).
# Settings are assigned after construction: Megatron's own __post_init__ refuses some of them
# first on this machine (fp8 needs Transformer Engine), and 0.18+ fields do not exist in 0.16.
REFUSALS = [
    ("no_experts", dict(num_moe_experts=None), {}, "num_moe_experts=None", "set num_moe_experts"),
    ("no_grouped_gemm", dict(moe_grouped_gemm=False), {}, "moe_grouped_gemm=False",
     "set moe_grouped_gemm=True"),
    ("inference_optimized", dict(transformer_impl="inference_optimized"), {},
     "transformer_impl='inference_optimized'",
     "set transformer_impl='transformer_engine' or 'local'."),
    ("fp8", dict(fp8="e4m3"), {}, "fp8='e4m3'", "set fp8=None"),
    ("fp4", dict(fp4="e2m1"), {}, "fp4='e2m1'", "set fp4=None"),
    ("fp16", dict(fp16=True, bf16=False), {}, "fp16=True", "set fp16=False, bf16=True"),
    ("fp16_params", dict(params_dtype=torch.float16), {}, "params_dtype=torch.float16",
     "params_dtype=torch.bfloat16"),
    ("fp32_params_on_cuda", dict(params_dtype=torch.float32), {}, "params_dtype=torch.float32",
     "grouped GEMM runs BF16 expert weights on CUDA"),
    ("bias", dict(add_bias_linear=True), {}, "add_bias_linear=True", "set add_bias_linear=False"),
    ("delay_wgrad", dict(delay_wgrad_compute=True), {}, "delay_wgrad_compute=True",
     "set delay_wgrad_compute=False"),
    ("legacy_grouped_gemm", dict(moe_use_legacy_grouped_gemm=True), {},
     "moe_use_legacy_grouped_gemm=True", "set moe_use_legacy_grouped_gemm=False"),
    ("te_op_fuser_0_18", dict(use_transformer_engine_op_fuser=True), {},
     "use_transformer_engine_op_fuser=True", "set use_transformer_engine_op_fuser=False"),
    ("te_op_fuser_spec_arg", dict(use_te_op_fuser=True), {}, "use_te_op_fuser=True",
     "set use_te_op_fuser=False"),
    ("glu_interleave_0_18", dict(moe_mlp_glu_interleave_size=32), {},
     "moe_mlp_glu_interleave_size=32", "set moe_mlp_glu_interleave_size=None"),
    ("single_grouped_weight_0_18", dict(moe_single_grouped_weight=True), {},
     "moe_single_grouped_weight=True", "set moe_single_grouped_weight=False"),
    ("fused_expert_lora", dict(moe_expert_lora_fusion=True), {}, "moe_expert_lora_fusion=True",
     "set moe_expert_lora_fusion off"),
    ("router_padding_for_quantization", dict(moe_router_padding_for_quantization=True), {},
     "moe_router_padding_for_quantization=True",
     "the torch backend runs BF16 segments of any length. Set "
     "moe_router_padding_for_quantization=False."),
    ("router_padding_for_fp8", dict(moe_router_padding_for_fp8=True), {},
     "moe_router_padding_for_fp8=True", "Set moe_router_padding_for_fp8=False."),
    ("paged_stash_0_19", dict(moe_paged_stash=True), {}, "moe_paged_stash=True",
     "keeps no paged stash; set moe_paged_stash=False."),
    ("te_activation_silu_without_glu",
     dict(use_te_activation_func=True, activation_func=F.silu, gated_linear_unit=False), {},
     "use_te_activation_func=True", "with activation_func=silu and gated_linear_unit=False, "
     "Transformer Engine's activation op is not the function TorchGroupedMLP computes (only "
     "SwiGLU is the same); set use_te_activation_func=False."),
    ("te_activation_geglu", dict(use_te_activation_func=True, activation_func=F.gelu,
                                 gated_linear_unit=True), {},
     "use_te_activation_func=True", "with activation_func=gelu and gated_linear_unit=True"),
    ("te_swiglu_with_offset", dict(use_te_activation_func=True, activation_func=F.silu,
                                   gated_linear_unit=True, glu_linear_offset=1.0), {},
     "use_te_activation_func=True", "with glu_linear_offset=1.0, Transformer Engine's SwiGLU op, "
     "which Megatron builds without an offset or a clamp, is not the function TorchGroupedMLP "
     "computes; set use_te_activation_func=False"),
    ("te_swiglu_with_clamp", dict(use_te_activation_func=True, activation_func=F.silu,
                                  gated_linear_unit=True, activation_func_clamp_value=7.0), {},
     "use_te_activation_func=True", "with activation_func_clamp_value=7.0, Transformer Engine's "
     "SwiGLU op"),
    ("expert_offloading", dict(fine_grained_activation_offloading=True,
                               offload_modules=["attn_norm", "moe_act", "expert_fc1"]), {},
     "offload_modules=['expert_fc1', 'moe_act']", "remove 'expert_fc1' and 'moe_act'"),
    ("moe_act_recompute", dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
     {}, "recompute_modules=['moe_act']", "use 'moe' (whole MoE layer)"),
    ("probs_on_input_top2", dict(moe_apply_probs_on_input=True), {},
     "moe_apply_probs_on_input=True",
     "it needs moe_router_topk=1 (got 2); set moe_router_topk=1 or moe_apply_probs_on_input=False"),
    ("experts_not_divisible_by_ep", dict(expert_model_parallel_size=3), {}, "num_moe_experts=4",
     "divisible by expert_model_parallel_size=3. Choose an expert_model_parallel_size"),
    ("ep_group_size", {}, dict(ep_size=8), "num_moe_experts=4",
     "divisible by expert_model_parallel_size=8"),
    ("1024_local_experts", dict(num_moe_experts=1024), {}, "num_moe_experts=1024",
     "1024 local experts per rank; grouped GEMM takes at most 1023"),
    ("ffn_not_divisible_by_etp", {}, dict(etp_size=3), "moe_ffn_hidden_size=32",
     "divisible by expert_tensor_parallel_size=3. Choose an expert_tensor_parallel_size"),
    ("etp_local_width", dict(moe_ffn_hidden_size=48), dict(etp_size=4), "moe_ffn_hidden_size=48",
     "the per-rank width 48/4=12 must be a multiple of 8 (grouped GEMM needs 16-byte strides); "
     "set expert_tensor_parallel_size=2 (per-rank width 24)."),
    ("ffn_alignment_at_etp1", dict(moe_ffn_hidden_size=44), {}, "moe_ffn_hidden_size=44",
     "the per-rank width 44/1=44 must be a multiple of 8 (grouped GEMM needs 16-byte strides); "
     "44 is not a multiple of 8, so no expert_tensor_parallel_size gives one. Choose a "
     "moe_ffn_hidden_size that is a multiple of 8, or keep "
     "moe_expert_gemm_backend='transformer_engine'"),
    ("ffn_alignment_at_etp2", dict(moe_ffn_hidden_size=36), dict(etp_size=2),
     "moe_ffn_hidden_size=36", "Choose a moe_ffn_hidden_size that is a multiple of 16"),
    ("hidden_alignment", dict(hidden_size=60), {}, "hidden_size=60",
     "a multiple of 8 (grouped GEMM needs 16-byte strides); keep moe_expert_gemm_backend="),
    ("latent_alignment", dict(moe_latent_size=36), {}, "moe_latent_size=36", "a multiple of 8"),
]


def valid_config():
    return TorchExpertsTransformerConfig(**VALID, moe_expert_gemm_backend="torch")


@pytest.mark.parametrize("settings, kwargs, named, fix",
                         [case[1:] for case in REFUSALS], ids=[case[0] for case in REFUSALS])
def test_refusal_names_field_value_and_fix(settings, kwargs, named, fix):
    config = valid_config()
    for field, value in settings.items():
        setattr(config, field, value)
    with pytest.raises(TorchExpertsConfigError) as refusal:
        validate_torch_experts_config(config, **kwargs)
    message = str(refusal.value)
    assert message.startswith(f"moe_expert_gemm_backend='torch' does not support {named}: ")
    assert fix in message


def test_unknown_backend_is_refused():
    config = valid_config()
    config.moe_expert_gemm_backend = "cutlass"
    message = "moe_expert_gemm_backend='cutlass' is not a backend: set it to one of"
    with pytest.raises(TorchExpertsConfigError, match=message):
        validate_torch_experts_config(config)
    with pytest.raises(TorchExpertsConfigError, match=message):
        TorchExpertsTransformerConfig(**VALID, moe_expert_gemm_backend="cutlass")


def test_one_exception_type_that_is_a_value_error():
    assert issubclass(TorchExpertsConfigError, ValueError)


@pytest.mark.parametrize("settings, named", [
    (dict(add_bias_linear=True), "add_bias_linear=True"),
    (dict(moe_grouped_gemm=False), "moe_grouped_gemm=False"),
    (dict(num_moe_experts=None, moe_ffn_hidden_size=None), "num_moe_experts=None"),
    (dict(params_dtype=torch.float32), "params_dtype=torch.float32"),
    (dict(use_cpu_initialization=True, hidden_size=60), "hidden_size=60"),
], ids=["bias", "no_grouped_gemm", "dense", "fp32_on_cuda", "hidden"])
def test_construction_with_the_torch_backend_validates(settings, named):
    with pytest.raises(TorchExpertsConfigError, match=f"does not support {named}: "):
        TorchExpertsTransformerConfig(**{**VALID, **settings}, moe_expert_gemm_backend="torch")


@pytest.mark.parametrize("settings, named, fix", [
    (dict(fp8="hybrid"), "fp8='hybrid'", "set fp8=None"),
    (dict(fp8="e4m3", fp8_recipe="delayed"), "fp8='e4m3'", "set fp8=None"),
    (dict(fp4="nvfp4"), "fp4='nvfp4'", "set fp4=None"),
    (dict(moe_router_padding_for_fp8=True, moe_token_dispatcher_type="alltoall"),
     "moe_router_padding_for_fp8=True", "Set moe_router_padding_for_fp8=False."),
    (dict(moe_router_padding_for_quantization=True, moe_token_dispatcher_type="alltoall"),
     "moe_router_padding_for_quantization=True",
     "Set moe_router_padding_for_quantization=False."),
], ids=["fp8_hybrid", "fp8_e4m3", "fp4", "router_padding_for_fp8",
        "router_padding_for_quantization"])
def test_construction_refuses_flags_before_megatron_checks_them(settings, named, fix):
    """Megatron's own __post_init__ fails on these first without naming our fix: fp8/fp4 without
    Transformer Engine (a TypeError comparing its missing version), routing-map padding without
    fp8/fp4 ("fp8/fp4 must be specified"). Ours runs first and names the fix."""
    with pytest.raises(TorchExpertsConfigError) as refusal:
        TorchExpertsTransformerConfig(**VALID, **settings, moe_expert_gemm_backend="torch")
    message = str(refusal.value)
    assert message.startswith(f"moe_expert_gemm_backend='torch' does not support {named}: ")
    assert fix in message


@pytest.mark.parametrize("settings, setting", [
    (dict(moe_expert_gemm_backend="torch"), "moe_expert_gemm_backend='torch'"),
    (dict(moe_combine_in_fp32=True), "moe_combine_in_fp32=True"),
    (dict(moe_expert_gemm_backend="torch", moe_combine_in_fp32=True),
     "moe_expert_gemm_backend='torch'"),
], ids=["torch_backend", "fp32_combine", "both"])
def test_construction_refuses_the_inference_transformer_impl_before_megatron_checks_it(
        settings, setting):
    """Megatron's own __post_init__ checks inference_optimized layers first (an empty
    AssertionError about RMSNorm on 0.16, its own errors on 0.19); ours names the fix."""
    with pytest.raises(TorchExpertsConfigError) as refusal:
        TorchExpertsTransformerConfig(**VALID, **settings, transformer_impl="inference_optimized")
    assert str(refusal.value) == (
        f"{setting} does not support transformer_impl='inference_optimized': Megatron's "
        "inference-optimized layers serve neither TorchGroupedMLP nor the FP32 combine (from "
        "megatron-core 0.17 their MoE layers call the experts with a routing map and swap in "
        "their own token dispatcher); set transformer_impl='transformer_engine' or 'local'.")


def test_construction_refuses_a_padded_fp32_combine_before_megatron_checks_it():
    """Megatron asks for moe_expert_capacity_factor first, which the combine would refuse next."""
    with pytest.raises(TorchExpertsConfigError, match=(
            "^moe_combine_in_fp32=True does not support moe_pad_expert_input_to_capacity=True: "
            r".*set moe_pad_expert_input_to_capacity=False\.$")):
        TorchExpertsTransformerConfig(**VALID, moe_combine_in_fp32=True,
                                      moe_pad_expert_input_to_capacity=True)


def test_fusions_on_the_moe_path_are_not_refused():
    """TE's fused permutation, router fusion and SwiGLU op, and Megatron's fused activations
    (weighted squared ReLU, bias SwiGLU) pass the torch backend's and the FP32 combine's checks;
    tests/unit/test_te_fusions.py runs them. Set after construction: Megatron's __post_init__ wants TE
    importable for the permute fusion."""
    config = valid_config()
    config.moe_combine_in_fp32 = True
    config.activation_func, config.gated_linear_unit = F.silu, True
    for field in ("moe_permute_fusion", "moe_router_fusion", "use_fused_weighted_squared_relu",
                  "bias_activation_fusion",
                  "use_te_activation_func"):  # SwiGLU: TE's op is the same function
        setattr(config, field, True)
    validate_torch_experts_config(config)
    validate_fp32_combine_config(config)
    TorchExpertsTransformerConfig(**VALID, moe_expert_gemm_backend="torch",
                                  moe_combine_in_fp32=True, moe_router_fusion=True,
                                  use_fused_weighted_squared_relu=True)


def test_valid_configs_build():
    config = valid_config()
    assert config.moe_expert_gemm_backend == "torch"
    validate_torch_experts_config(config)
    # float32 is fine on the CPU (tests); an EP x ETP layout that divides evenly is fine.
    TorchExpertsTransformerConfig(**{**VALID, "params_dtype": torch.float32, "bf16": False},
                                  use_cpu_initialization=True, moe_expert_gemm_backend="torch")
    eight_experts = TorchExpertsTransformerConfig(**{**VALID, "num_moe_experts": 8,
                                                      "moe_ffn_hidden_size": 64})
    validate_torch_experts_config(eight_experts, ep_size=4, etp_size=2)


def test_default_backend_checks_nothing():
    """"transformer_engine" (the default) builds Megatron's experts: none of the torch checks run."""
    config = TorchExpertsTransformerConfig(**{**VALID, "add_bias_linear": True,
                                              "moe_grouped_gemm": False})
    assert config.moe_expert_gemm_backend == "transformer_engine"
    dense = TorchExpertsTransformerConfig(num_layers=1, hidden_size=60, num_attention_heads=4)
    assert dense.num_moe_experts is None


def test_plain_transformer_config_is_validated_when_torch_grouped_mlp_is_built(megatron_cpu):
    config = make_config(add_bias_linear=True)
    with pytest.raises(TorchExpertsConfigError, match="add_bias_linear=True: expert weights"):
        TorchGroupedMLP(4, config, pg_collection=megatron_cpu)
    # Through the spec, as MoELayer builds it: build_module keeps the exception type.
    with pytest.raises(TorchExpertsConfigError, match="add_bias_linear=True"):
        torch_experts_spec()(4, config, pg_collection=megatron_cpu)


@pytest.mark.parametrize("ffn, etp, proposed", [(40, 8, 1), (96, 16, 4), (48, 4, 2), (80, 4, 2)])
def test_ffn_alignment_fix_proposes_a_divisor_of_the_current_expert_tp_size(ffn, etp, proposed):
    """The expert-TP size proposed for an unaligned per-rank FFN width divides the current one,
    so the same ranks still split into expert-TP groups (expert data parallelism grows)."""
    config = valid_config()
    config.moe_ffn_hidden_size = ffn
    with pytest.raises(TorchExpertsConfigError) as refusal:
        validate_torch_experts_config(config, etp_size=etp)
    assert (f"set expert_tensor_parallel_size={proposed} (per-rank width {ffn // proposed})."
            in str(refusal.value))
    assert etp % proposed == 0


@pytest.mark.parametrize("backend", ["torch", "transformer_engine"])
def test_forced_fused_gemm_for_an_activation_it_does_not_compute_is_refused_at_config_build(
        backend):
    """"fused_gemm" with GELU: a TorchExpertsConfigError naming the setting and the fix when the
    config is built, not a plain error when the module is."""
    pytest.importorskip("triton")
    import torch.nn.functional as F

    with pytest.raises(TorchExpertsConfigError,
                       match=r"moe_expert_kernel='fused_gemm' cannot run: .*activation_func="
                             r".*gelu.*Set moe_expert_kernel='grouped_mm' or 'auto'"):
        TorchExpertsTransformerConfig(**VALID, moe_expert_gemm_backend=backend,
                                      moe_expert_kernel="fused_gemm", activation_func=F.gelu,
                                      gated_linear_unit=False)


def test_forced_fused_gemm_on_a_plain_config_is_refused_when_the_module_is_built(megatron_cpu):
    pytest.importorskip("triton")
    config = make_config(activation="gelu", glu=False)
    config.moe_expert_kernel = "fused_gemm"
    with pytest.raises(TorchExpertsConfigError, match="moe_expert_kernel='fused_gemm' cannot run"):
        TorchGroupedMLP(config.num_moe_experts, config, pg_collection=megatron_cpu)


CHECKS = ("refuse_transformer_impl", "refuse_unrecorded_settings", "_check_batch_invariant",
          "_check_torch_experts", "_check_fp32_combine")


@pytest.fixture
def check_counts(monkeypatch):
    """How often each check of mcore_torch_experts.config, and ExpertSettings.read, runs."""
    import collections
    import functools

    from mcore_torch_experts import config as config_module
    from mcore_torch_experts.settings import ExpertSettings

    counts = collections.Counter()

    def counted(name, function):
        @functools.wraps(function)
        def run(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)
        return run

    for name in CHECKS:
        monkeypatch.setattr(config_module, name, counted(name, getattr(config_module, name)))
    read = ExpertSettings.read.__func__
    monkeypatch.setattr(ExpertSettings, "read",
                        classmethod(counted("ExpertSettings.read", read)))
    return counts


def test_a_launcher_route_reads_the_settings_once_and_runs_each_check_once(check_counts):
    from mcore_torch_experts.config import spec_choice

    config = valid_config()
    check_counts.clear()   # the config class's own checks
    choice = spec_choice(config, experts_absent="torch",
                         entry_point="torch_experts_fp32_combine_gpt_spec",
                         entry_point_combines=True)
    assert choice.torch_experts and choice.fp32_combine == "torch_experts_fp32_combine_gpt_spec"
    assert check_counts == {name: 1 for name in ("ExpertSettings.read", *CHECKS)}


def test_the_config_class_reads_its_settings_once_and_runs_each_check_once(check_counts):
    TorchExpertsTransformerConfig(**VALID, moe_expert_gemm_backend="torch",
                                  moe_combine_in_fp32=True, moe_token_dispatcher_type="alltoall")
    assert check_counts == {name: 1 for name in ("ExpertSettings.read", *CHECKS)
                            if name != "refuse_unrecorded_settings"}
