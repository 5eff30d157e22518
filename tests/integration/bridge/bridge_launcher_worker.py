"""Run by test_launchers.py in its own process (Bridge's import needs a Transformer Engine stand-in,
see support.bridge_imports.import_megatron_bridge, that must not reach other tests): Megatron-Bridge
0.6 end to end with the launcher spec named on the provider. A tiny local HF Qwen3-MoE checkpoint
through `AutoBridge` into a provider whose `transformer_layer_spec` is
`mcore_torch_experts.specs.torch_experts_gpt_spec`, Bridge's LoRA on the experts, a few training
steps, the adapters merged, the provider written as Bridge's run_config.yaml and rebuilt from it
the way Bridge's `load_model_config` and NeMo-RL do (`instantiate`), the weights through a
torch_dist checkpoint. Writes what it measured as JSON to argv[2].

    python tests/integration/bridge/bridge_launcher_worker.py OUT_DIR RESULT_JSON
"""

import json
import sys
from pathlib import Path

import torch

import hf_roundtrip as example
from support.bridge_imports import import_megatron_bridge
from support.cpu_support import init_single_process_megatron
from support.doc_snippets import run_snippet, snippet


def experts_classes(model) -> list:
    return [type(layer.mlp.experts).__name__ for layer in model.decoder.layers]


def provider_for(path: Path):
    """docs/enable.md, "Megatron-Bridge": the provider AutoBridge makes for the checkpoint, with
    the launcher spec named on it (the docs' snippet); plus what a CPU host needs (local
    modules, the allgather dispatcher, no fused kernels)."""
    names = run_snippet("bridge-gpt", hf_path=path)
    bridge, provider = names["bridge"], names["provider"]
    provider.transformer_impl = "local"  # CPU: no Transformer Engine
    provider.moe_token_dispatcher_type = "allgather"
    provider.moe_permute_fusion = False
    provider.masked_softmax_fusion = False
    provider.cross_entropy_loss_fusion = False
    provider.gradient_accumulation_fusion = False
    return bridge, provider


def write_run_config(provider, path: Path) -> None:
    """The `model` section of Bridge's run_config.yaml, serialised as Bridge's ConfigContainer
    (`to_yaml`: its `_convert_value_to_dict`, dumped under Megatron's safe YAML representers)."""
    import yaml
    from megatron.bridge.training.utils.config_utils import _ConfigContainerBase
    from megatron.training.config.yaml_utils import safe_yaml_representers

    config = {"model": _ConfigContainerBase._convert_value_to_dict(provider)}
    with safe_yaml_representers():
        path.write_text(yaml.safe_dump(config, default_flow_style=False))


def read_provider(path: Path):
    """The provider rebuilt from run_config.yaml as Bridge's load_model_config (and NeMo-RL's
    policy worker) do: `instantiate(run_config["model"])` after the backward-compat pass."""
    import yaml
    from megatron.bridge.training.utils.config_utils import apply_run_config_backward_compat
    from megatron.bridge.utils.instantiate_utils import instantiate

    run_config = apply_run_config_backward_compat(yaml.safe_load(path.read_text()))
    return instantiate(run_config["model"])


def run_config_entry(path: Path, field: str) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())["model"][field]


def save_weights(model, path: Path) -> None:
    """The model's distributed checkpoint (torch_dist), as Bridge writes its weights."""
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(path))


def load_weights(model, path: Path) -> None:
    from megatron.core import dist_checkpointing

    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(path)),
                          strict=False)


def hybrid_round_trip(out: Path) -> dict:
    """A Bridge HybridModelProvider (attention and MoE layers) naming the hybrid launcher spec,
    through run_config.yaml and back: the experts of the stack spec it resolves. (Building the
    model needs Transformer Engine: Megatron's hybrid stack spec is TE-only.)"""
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider

    from mcore_torch_experts import _compat

    provider = HybridModelProvider(
        num_layers=2, hybrid_layer_pattern="*E", hidden_size=64, num_attention_heads=4,
        ffn_hidden_size=128, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
        moe_grouped_gemm=True, vocab_size=128, apply_rope_fusion=False)  # CPU: no TE
    run_snippet("bridge-hybrid", provider=provider)
    write_run_config(provider, out / "hybrid_run_config.yaml")
    reloaded = read_provider(out / "hybrid_run_config.yaml")
    reloaded.finalize()
    stack = reloaded._resolve_hybrid_stack_spec()  # what HybridModelProvider.provide() builds
    moe = stack.submodules.moe_layer.submodules.mlp
    return {"hybrid_run_config_spec": run_config_entry(out / "hybrid_run_config.yaml",
                                                       "hybrid_stack_spec"),
            "hybrid_reloaded_provider_class": type(reloaded).__name__,
            "hybrid_reloaded_experts": _compat.spec_class(_compat.moe_submodules(moe).experts)
            .__name__}


def moe_classes(layer_specs) -> list:
    """[MoE layer class, experts class] of each MoE layer spec among `layer_specs`."""
    from mcore_torch_experts import _compat

    mlps = [layer.submodules.mlp for layer in layer_specs]
    return [[_compat.spec_class(mlp).__name__,
             _compat.spec_class(_compat.moe_submodules(mlp).experts).__name__]
            for mlp in mlps if _compat.is_moe_mlp_spec(mlp)]


def entry_point_round_trips(provider, out: Path) -> dict:
    """Every launcher entry point named on a GPT provider (`transformer_layer_spec`) or a hybrid
    one (`hybrid_stack_spec`), through run_config.yaml and back: what the YAML records, and the
    MoE layers of the spec the provider resolves before and after (the prefix is allowed)."""
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider

    from mcore_torch_experts import specs

    trips = {}
    for name in ("torch_experts_gpt_spec", "torch_experts_fp32_combine_gpt_spec",
                 "fp32_combine_gpt_spec"):
        provider.transformer_layer_spec = getattr(specs, name)
        before = moe_classes(provider.transformer_layer_spec(provider).layer_specs)
        write_run_config(provider, out / f"{name}.yaml")
        reloaded = read_provider(out / f"{name}.yaml")
        reloaded.finalize()
        trips[name] = {"recorded": run_config_entry(out / f"{name}.yaml", "transformer_layer_spec"),
                       "before": before,
                       "after": moe_classes(reloaded.transformer_layer_spec(reloaded).layer_specs)}
    provider.transformer_layer_spec = specs.torch_experts_gpt_spec
    for name in ("torch_experts_hybrid_stack_spec", "torch_experts_fp32_combine_hybrid_stack_spec",
                 "fp32_combine_hybrid_stack_spec"):
        hybrid = HybridModelProvider(
            num_layers=2, hybrid_layer_pattern="*E", hidden_size=64, num_attention_heads=4,
            ffn_hidden_size=128, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
            moe_grouped_gemm=True, vocab_size=128, apply_rope_fusion=False,
            hybrid_stack_spec=getattr(specs, name))
        hybrid.finalize()
        before = moe_classes([hybrid._resolve_hybrid_stack_spec().submodules.moe_layer])
        write_run_config(hybrid, out / f"{name}.yaml")
        reloaded = read_provider(out / f"{name}.yaml")
        reloaded.finalize()
        trips[name] = {
            "recorded": run_config_entry(out / f"{name}.yaml", "hybrid_stack_spec"),
            "before": before,
            "after": moe_classes([reloaded._resolve_hybrid_stack_spec().submodules.moe_layer])}
    return trips


def plain_attribute(provider, out: Path) -> dict:
    """A package setting put on the provider as a plain attribute: absent from run_config.yaml,
    and refused by the entry point the provider names."""
    provider.moe_combine_in_fp32 = True
    write_run_config(provider, out / "plain_attribute.yaml")
    try:
        provider.transformer_layer_spec(provider)
        refusal = None
    except Exception as error:
        refusal = f"{type(error).__name__}: {error}"
    del provider.moe_combine_in_fp32
    import yaml

    model = yaml.safe_load((out / "plain_attribute.yaml").read_text())["model"]
    return {"plain_attribute_recorded": "moe_combine_in_fp32" in model,
            "plain_attribute_refusal": refusal}


def load_nemo_rl_extension():
    """mcore_torch_experts.integrations.nemo_rl, imported where NeMo-RL and Ray are not installed:
    stand-ins for the three names it imports exist only during its import (its worker class is
    not run), and the module, bound to them, is taken out of sys.modules afterwards. Also
    returns whether examples/nemo_rl_worker.py, imported under the same stand-ins, re-exports
    the module's class and function."""
    import importlib
    import importlib.util
    import types

    ray = types.ModuleType("ray")
    ray.remote = lambda **options: (lambda cls: cls)
    utils = types.ModuleType("nemo_rl.models.policy.utils")
    utils.get_runtime_env_for_policy_worker = lambda name: {}
    workers = types.ModuleType("nemo_rl.models.policy.workers.megatron_policy_worker")
    workers.MegatronPolicyWorkerImpl = type("MegatronPolicyWorkerImpl", (), {})
    stand_ins = {"ray": ray, "nemo_rl": types.ModuleType("nemo_rl"),
                 "nemo_rl.models": types.ModuleType("nemo_rl.models"),
                 "nemo_rl.models.policy": types.ModuleType("nemo_rl.models.policy"),
                 "nemo_rl.models.policy.utils": utils,
                 "nemo_rl.models.policy.workers": types.ModuleType("nemo_rl.models.policy.workers"),
                 "nemo_rl.models.policy.workers.megatron_policy_worker": workers}
    name = "mcore_torch_experts.integrations.nemo_rl"
    assert not (set(stand_ins) | {name}) & set(sys.modules)
    sys.modules.update(stand_ins)
    try:
        module = importlib.import_module(name)
        path = Path(__file__).parents[3] / "examples" / "nemo_rl_worker.py"
        spec = importlib.util.spec_from_file_location("nemo_rl_worker", path)
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
    finally:
        for stood_in in [*stand_ins, name]:
            sys.modules.pop(stood_in, None)
        vars(sys.modules["mcore_torch_experts.integrations"]).pop("nemo_rl", None)
    reexported = all(getattr(example, name) is getattr(module, name)
                     for name in ("TorchExpertsMegatronPolicyWorker", "enable_torch_experts"))
    return module, reexported


def batch_invariant_kernels_turned_on(extension) -> dict:
    """{case: the backends enable_torch_experts turned Megatron's batch-invariant kernels on with,
    or its refusal} for docs/enable.md's policy block for the mode, one without the mode, and the
    block with NeMo-RL's recipes' FP64 router (in megatron_cfg or in its overrides).
    Megatron's enable_batch_invariant_mode patches Transformer Engine's kernels and runs on CUDA
    only: on this CPU host the call is recorded in its place, not run."""
    import types

    import yaml
    from megatron.core.transformer.custom_layers import batch_invariant_kernels

    documented = yaml.safe_load(snippet("nemo-rl-batch-invariant"))["policy"]["megatron_cfg"]
    overrides = documented["model_overrides"]
    calls, original = [], batch_invariant_kernels.enable_batch_invariant_mode
    batch_invariant_kernels.enable_batch_invariant_mode = (
        lambda backend="deepgemm": calls.append(backend))
    turned_on = {}
    try:
        for case, megatron_cfg in (
                ("asked", documented),  # docs/enable.md's block for the mode
                ("not asked", {"moe_router_dtype": "fp64", "model_overrides": {}}),
                ("asked, FP64 router", {**documented, "moe_router_dtype": "fp64"}),
                ("asked, FP64 router override", {**documented, "model_overrides": {
                    **overrides, "moe_router_dtype": "fp64"}})):
            try:
                extension.enable_torch_experts(types.SimpleNamespace(), {
                    "pretrained_checkpoint": None, "megatron_cfg": megatron_cfg})
                turned_on[case] = list(calls)
            except Exception as error:  # noqa: BLE001 - recorded for the test
                turned_on[case] = f"{type(error).__name__}: {error}"
            calls[:] = []
    finally:
        batch_invariant_kernels.enable_batch_invariant_mode = original
    return turned_on


def nemo_rl_calls(out: Path) -> dict:
    """NeMo-RL's Megatron policy setup, call for call (nemo_rl/models/megatron/community_import.py
    `import_model_from_hf_name`, setup.py `setup_model_config`, `setup_model_and_optimizer`,
    `setup_reference_model_state`), on a worker that `enable_torch_experts` prepared. What the
    CPU host needs is added where the provider is first made; checkpoints are written as in
    main() (Bridge's save_megatron_model / load_model_config cannot be imported here)."""
    import dataclasses
    import types

    import yaml
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.model_provider import get_model
    from megatron.bridge.peft.lora import LoRA
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    megatron_cfg = yaml.safe_load(snippet("nemo-rl-config"))["policy"]["megatron_cfg"]
    extension, reexported = load_nemo_rl_extension()
    worker = types.SimpleNamespace()
    result = {"nemo_rl_refusals": {}, "nemo_rl_example_reexports": reexported}
    for fmt in ("megatron_bridge", "megatron_lm"):  # NeMo-RL skips the HF import for them
        refused = types.SimpleNamespace()
        try:
            extension.enable_torch_experts(refused, {"pretrained_checkpoint": {
                "format": fmt, "path": "/checkpoints/iter_0000010"}})
        except Exception as error:  # noqa: BLE001 - recorded for the test
            result["nemo_rl_refusals"][fmt] = f"{type(error).__name__}: {error}"
        result[f"nemo_rl_{fmt}_left_unset"] = not vars(refused)
    result["nemo_rl_batch_invariant_kernels"] = batch_invariant_kernels_turned_on(extension)
    extension.enable_torch_experts(worker, {"pretrained_checkpoint": None})
    # MegatronPolicyWorkerImpl.__init__ -> handle_model_import -> import_model_from_hf_name
    transformer_layer_spec = getattr(worker, "_transformer_layer_spec", None)
    mamba_stack_spec = getattr(worker, "_mamba_stack_spec", None)
    hf_path = out / "hf_tiny"
    bridge = AutoBridge.from_hf_pretrained(str(hf_path), trust_remote_code=True)
    model_provider = bridge.to_megatron_provider(load_weights=True)
    model_provider.transformer_impl = "local"  # CPU host, as in provider_for()
    model_provider.moe_token_dispatcher_type = "allgather"
    model_provider.moe_permute_fusion = False
    model_provider.masked_softmax_fusion = False
    model_provider.cross_entropy_loss_fusion = False
    model_provider.gradient_accumulation_fusion = False
    if transformer_layer_spec is not None:
        model_provider.transformer_layer_spec = transformer_layer_spec
    if mamba_stack_spec is not None and hasattr(model_provider, "hybrid_stack_spec"):
        model_provider.hybrid_stack_spec = mamba_stack_spec
    model_provider.finalize()
    megatron_model = model_provider.provide_distributed_model(
        wrap_with_ddp=False, post_wrap_hook=None, use_cpu_initialization=True,
        mixed_precision_wrapper=None)
    result["nemo_rl_import_experts"] = experts_classes(megatron_model[0])
    write_run_config(megatron_model[0].config, out / "nemo_rl_run_config.yaml")
    save_weights(megatron_model[0], out / "nemo_rl_weights")
    # Bridge checkpoints (the run_config.yaml of an iteration folder, the tracker naming it) of
    # this provider and of the same model's stock provider, as policy.pretrained_checkpoint.
    stock = bridge.to_megatron_provider(load_weights=False)
    for name, provider in (("ours", megatron_model[0].config), ("stock", stock)):
        (out / f"ckpt_{name}" / "iter_0000002").mkdir(parents=True)
        (out / f"ckpt_{name}" / "latest_checkpointed_iteration.txt").write_text("2")
        write_run_config(provider, out / f"ckpt_{name}" / "iter_0000002" / "run_config.yaml")
        taken = types.SimpleNamespace()
        try:
            extension.enable_torch_experts(taken, {"pretrained_checkpoint": {
                "format": "megatron_bridge", "path": str(out / f"ckpt_{name}")}})
            result[f"nemo_rl_bridge_checkpoint_{name}"] = sorted(vars(taken))
        except Exception as error:  # noqa: BLE001 - recorded for the test
            result[f"nemo_rl_bridge_checkpoint_{name}"] = f"{type(error).__name__}: {error}"

    # setup_model_config: load_model_config -> instantiate; model_overrides -> dataclasses.replace
    model_cfg = read_provider(out / "nemo_rl_run_config.yaml")
    model_cfg = dataclasses.replace(model_cfg, moe_aux_loss_coeff=0.0)
    if "moe_grouped_gemm" in megatron_cfg:  # _apply_moe_config
        model_cfg.moe_grouped_gemm = megatron_cfg["moe_grouped_gemm"]
    model_cfg.finalize()
    result["nemo_rl_provider_spec"] = model_cfg.transformer_layer_spec.__qualname__

    # setup_model_and_optimizer / setup_reference_model_state: LoRA from NeMo-RL's fixed keys
    # (the docs' policy.megatron_cfg.peft), its PEFT pre-wrap hook after the base weights load.
    peft_cfg = megatron_cfg["peft"]
    result["nemo_rl_peft_enabled"] = peft_cfg["enabled"]
    tokens = torch.randint(0, example.TINY_QWEN3_MOE["vocab_size"], (2, 16),
                           generator=torch.Generator().manual_seed(7))
    hf = example.hf_logits(hf_path, tokens)
    policy_init = (peft_cfg["lora_A_init_method"], peft_cfg["lora_B_init_method"])
    models = {}
    for role, init in (("policy", policy_init), ("reference", ("zero", "zero"))):
        peft = LoRA(target_modules=peft_cfg["target_modules"],
                    exclude_modules=peft_cfg["exclude_modules"], dim=peft_cfg["dim"],
                    alpha=peft_cfg["alpha"], dropout=peft_cfg["dropout"],
                    dropout_position=peft_cfg["dropout_position"],
                    lora_A_init_method=init[0], lora_B_init_method=init[1],
                    a2a_experimental=peft_cfg["a2a_experimental"],
                    lora_dtype=peft_cfg["lora_dtype"])

        def peft_hook(model, peft=peft):  # Bridge's PEFT pre-wrap hook: base weights, then PEFT
            load_weights(model[0], out / "nemo_rl_weights")
            return peft(model, training=True)

        model, = get_model(model_cfg, DistributedDataParallelConfig(), pre_wrap_hook=[peft_hook],
                           mixed_precision_wrapper=None, wrap_with_ddp=False,
                           use_cpu_initialization=True,
                           pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        models[role] = model
        experts = model.decoder.layers[0].mlp.experts
        result[f"nemo_rl_{role}_experts"] = experts_classes(model)
        result[f"nemo_rl_{role}_expert_adapter"] = type(experts.linear_fc1.adapter).__name__
        result[f"nemo_rl_{role}_logits_max_abs"] = example.max_abs(
            example.megatron_logits(model, tokens), hf)
    # The policy's refit to the generation engine (MegatronPolicyWorkerImpl): Bridge's export
    # with the conversion tasks it caches; the adapters (B = 0) merged, every HF tensor back.
    from safetensors.torch import load_file

    tasks = bridge.get_conversion_tasks([models["policy"]])
    exported = dict(bridge.export_hf_weights([models["policy"]], show_progress=False,
                                             conversion_tasks=tasks))
    original = load_file(hf_path / "model.safetensors")
    result["nemo_rl_refit_keys_equal"] = sorted(exported) == sorted(original)
    result["nemo_rl_refit_unequal"] = [k for k in original
                                       if not torch.equal(exported.get(k).cpu(), original[k])]
    return result


def bridge_peft_snippet(provider) -> dict:
    """The docs' Bridge PEFT snippet on a fresh model from `provider`."""
    model, = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                                mixed_precision_wrapper=None)
    model = run_snippet("bridge-peft", model=model)["model"]
    experts = model.decoder.layers[0].mlp.experts
    return {"doc_peft_wrappers": sum(type(m).__name__ == "LoRALinear" for m in model.modules()),
            "doc_peft_expert_adapter": type(experts.linear_fc1.adapter).__name__}


def main(out: Path, result_path: Path) -> None:
    import_megatron_bridge()
    init_single_process_megatron()
    from megatron.bridge.peft.lora import LoRA

    from mcore_torch_experts.integrations.bridge import merge_bridge_lora

    example.make_tiny_checkpoint(out / "hf_tiny", seed=4)
    bridge, provider = provider_for(out / "hf_tiny")
    result = {"provider_class": type(provider).__name__,
              "provider_has_backend_field": hasattr(provider, "moe_expert_gemm_backend")}
    provider.finalize()
    model, = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                                mixed_precision_wrapper=None)
    result["experts"] = experts_classes(model)
    tokens = torch.randint(0, example.TINY_QWEN3_MOE["vocab_size"], (2, 16),
                           generator=torch.Generator().manual_seed(6))
    base = example.megatron_logits(model, tokens)
    result["import_logits_max_abs"] = example.max_abs(base, example.hf_logits(out / "hf_tiny",
                                                                              tokens))

    torch.manual_seed(0)
    lora = LoRA(target_modules=["linear_fc1", "linear_fc2"], dim=8, alpha=16,
                share_expert_adapters=False)
    model = lora(model)
    result["adapter_wrappers"] = sum(type(m).__name__ == "LoRALinear" for m in model.modules())
    trainable = [p for p in model.parameters() if p.requires_grad]
    result["losses"] = example.train(model, trainable, steps=8)
    trained = example.megatron_logits(model, tokens)
    result["adapter_shift_max_abs"] = example.max_abs(trained, base)
    result["merged"] = len(merge_bridge_lora(model))
    result["merged_logits_max_abs"] = example.max_abs(example.megatron_logits(model, tokens),
                                                      trained)

    # Bridge's checkpoint: the provider as run_config.yaml's `model` section, the weights as a
    # torch_dist checkpoint. Bridge's own save_megatron_model / load_model_config are not imported
    # here (they import nvidia-modelopt and HF datasets, not on every leg); their steps are run.
    run_config = out / "run_config.yaml"
    write_run_config(provider, run_config)
    result["run_config_spec"] = run_config_entry(run_config, "transformer_layer_spec")
    save_weights(model, out / "weights")
    try:
        read_provider(run_config)
        result["reload_without_prefix"] = None
    except Exception as error:  # Bridge's InstantiationException
        result["reload_without_prefix"] = f"{type(error).__name__}: {error}"
    # NeMo-RL's calls, on a worker prepared by mcore_torch_experts.integrations.nemo_rl, which
    # registers the package's prefix in this process (nothing else has yet).
    result.update(nemo_rl_calls(out))
    run_snippet("bridge-reload")
    reloaded_provider = read_provider(run_config)
    spec = reloaded_provider.transformer_layer_spec
    result["reloaded_provider_class"] = type(reloaded_provider).__name__
    result["reloaded_spec"] = f"{spec.__module__}.{spec.__qualname__}"
    reloaded_provider.finalize()
    reloaded, = reloaded_provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None)
    result["reloaded_experts"] = experts_classes(reloaded)
    load_weights(reloaded, out / "weights")
    result["reloaded_logits_max_abs"] = example.max_abs(example.megatron_logits(reloaded, tokens),
                                                        trained)
    result.update(hybrid_round_trip(out))
    result["entry_point_round_trips"] = entry_point_round_trips(reloaded_provider, out)
    result.update(plain_attribute(reloaded_provider, out))
    result.update(bridge_peft_snippet(reloaded_provider))
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
