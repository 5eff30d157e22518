"""Megatron-Bridge's own PEFT (LoRA, CanonicalLoRA) on TorchGroupedMLP experts, against the real
megatron-bridge package: every expert-adapter layout against an FP64 per-expert loop (FP32 on the
CPU; BF16 on CUDA when a GPU is present) and against Bridge's LoRA on the same model built with
SequentialMLP; exclude mode; the pre-flight refusal; adapter-only distributed checkpoints; merging
(FP32 and BF16, CPU and CUDA); full recompute with both frozen-input guards."""

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from mcore_torch_experts import (
    TorchExpertsTransformerConfig,
    TorchGroupedLinear,
    TorchGroupedMLP,
    register_with_megatron_bridge,
)
from mcore_torch_experts.integrations.bridge import _ORIGINAL, merge_bridge_lora
from mcore_torch_experts.specs import get_gpt_decoder_block_spec
from support.bridge import import_bridge_peft
from support.reference import make_config, rel_err
from support.tiny_gpt import SEQ, VOCAB, fp32_moe_config, lm_batch, sequential_to_grouped

pytestmark = pytest.mark.bridge

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LAYOUTS = {  # Bridge LoRA arguments of each expert-adapter layout
    "shared": {},
    "per_expert": dict(share_expert_adapters=False),
    "shared_outer": dict(experts_shared_outer_loras=True),
    "shared_normalized": dict(normalize_moe_lora=True),
    "per_expert_normalized": dict(share_expert_adapters=False, normalize_moe_lora=True),
}
CUDA_LAYOUTS = dict(LAYOUTS, shared_outer_normalized=dict(experts_shared_outer_loras=True,
                                                         normalize_moe_lora=True))
SPLITS = {"uniform": [5, 5, 5, 5], "zero_experts": [0, 12, 0, 8], "empty_batch": [0, 0, 0, 0]}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA device (BF16 grouped GEMM on the GPU)")
BF16_TOL = 2e-2  # relative L2 against FP64 (BF16 on the CPU gives at most 8e-3 here)


def recompute_config(recompute_method=None) -> TorchExpertsTransformerConfig:
    """4 MoE layers (4 SwiGLU experts, top-2), FP32 on the CPU; full recompute with
    `recompute_method` over 2 layers per checkpoint when given."""
    recompute = dict(recompute_granularity="full", recompute_method=recompute_method,
                     recompute_num_layers=2) if recompute_method else {}
    return fp32_moe_config(**recompute)


@pytest.fixture(scope="module")
def bridge():
    """Bridge's PEFT modules, imported (see bridge_support) and taught about TorchGroupedLinear."""
    import_bridge_peft()
    assert register_with_megatron_bridge()
    from megatron.bridge.peft import canonical_lora, dora, lora, utils

    return dict(LoRA=lora.LoRA, CanonicalLoRA=canonical_lora.CanonicalLoRA, DoRA=dora.DoRA,
                utils=utils)


@pytest.fixture(autouse=True)
def bridge_per_expert_forward(bridge, monkeypatch):
    """Bridge's own GroupedExpertLinearAdapter.forward raises in every test of this module: its
    per-expert adapters on TorchGroupedLinear must take the grouped path. A test that needs
    Bridge's forward calls `allow()` (it then counts the calls in `calls`)."""
    forward = bridge["utils"].GroupedExpertLinearAdapter.forward  # ours, around Bridge's
    original, calls = getattr(forward, _ORIGINAL), []

    def refused(self, *args, **kwargs):
        raise AssertionError("Bridge's GroupedExpertLinearAdapter.forward ran on TorchGroupedLinear")

    def counted(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(forward, _ORIGINAL, refused)
    return type("BridgeForward", (), dict(calls=calls, allow=staticmethod(
        lambda: monkeypatch.setattr(forward, _ORIGINAL, counted))))


def randomize_adapters(model, seed=1):
    """B starts at zero; random adapter weights exercise every factor and gradient."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".adapter." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


# --- Experts module against an FP64 per-expert loop -------------------------------------------


def experts_holder(config, pg_collection):
    """TorchGroupedMLP under the name `mlp.experts`, which Bridge's expert rule matches."""
    root = torch.nn.Module()
    root.mlp = torch.nn.Module()
    torch.manual_seed(0)
    root.mlp.experts = TorchGroupedMLP(config.num_moe_experts, config, pg_collection=pg_collection)
    return root


def expert_factors(adapter, num_experts):
    """Per-expert A [E, r, in], B [E, out, r] of any of Bridge's three expert layouts."""
    a, b = adapter.linear_in.weight, adapter.linear_out.weight
    return (a if a.dim() == 3 else a.expand(num_experts, *a.shape),
            b if b.dim() == 3 else b.expand(num_experts, *b.shape))


def fp64_lora_experts(config, experts, x, splits, probs):
    """FP64 loop: per expert, fc_j(x) = x W_j^T + alpha/r * x A_j^T B_j^T, SwiGLU, probs, fc2."""
    fc = []
    for linear in (experts.linear_fc1, experts.linear_fc2):
        a, b = expert_factors(linear.adapter, config.num_moe_experts)
        a, b = (t.detach().double().requires_grad_(True) for t in (a, b))
        base = torch.stack(linear.to_wrap.expert_weights()).double()
        fc.append((base, a, b, linear.adapter.alpha / linear.adapter.dim))
    x = x.detach().double().requires_grad_(True)
    out, start = [], 0
    for e, count in enumerate(splits):
        h = x[start:start + count]
        for j, (base, a, b, scale) in enumerate(fc):
            h = h @ base[e].T + scale * (h @ a[e].T) @ b[e].T
            if j == 0:
                gate, up = h.chunk(2, dim=-1)
                h = config.activation_func(gate) * up * probs[start:start + count, None].double()
        out.append(h)
        start += count
    return torch.cat(out), x, [t for _, a, b, _ in fc for t in (a, b)]


def layout_errors(bridge, pg_collection, layout_kwargs, splits, dtype, device):
    """Relative L2 errors of Bridge's LoRA on a TorchGroupedMLP (`dtype` on `device`) against the
    FP64 loop with the same weights and inputs: output, input gradient, each adapter factor's
    gradient (its largest magnitude when the batch is empty). Returns (errors, output)."""
    config = make_config(dtype=dtype, hidden=64, ffn=64)
    root = experts_holder(config, pg_collection)
    bridge["LoRA"](target_modules=["linear_fc1", "linear_fc2"], dim=16, alpha=8,
                   **layout_kwargs)(root)
    experts = root.mlp.experts
    assert {type(m.to_wrap) for m in (experts.linear_fc1, experts.linear_fc2)} == {TorchGroupedLinear}
    randomize_adapters(root)
    root.to(device)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(sum(splits), config.hidden_size, generator=generator).to(device, dtype)
    x.requires_grad_(True)
    probs = torch.rand(sum(splits), generator=generator).to(device)
    out, _ = experts(x, torch.tensor(splits, device=device), probs)
    assert out.dtype == dtype and out.device.type == device
    grad_out = torch.randn(out.shape, generator=generator).to(device, dtype)
    out.backward(grad_out)
    ref, ref_x, ref_factors = fp64_lora_experts(config, experts, x, splits, probs)
    ref.backward(grad_out.double())

    errors = {"out": rel_err(out, ref), "grad_x": rel_err(x.grad, ref_x.grad)}
    for linear, (ref_a, ref_b) in zip((experts.linear_fc1, experts.linear_fc2),
                                      zip(ref_factors[::2], ref_factors[1::2])):
        for name, p, ref_p in (("A", linear.adapter.linear_in.weight, ref_a),
                               ("B", linear.adapter.linear_out.weight, ref_b)):
            expected = ref_p.grad if p.dim() == 3 else ref_p.grad.sum(0)  # shared: all experts
            errors[f"{linear.to_wrap.name}.{name}"] = rel_err(p.grad, expected) if sum(splits) else (
                float(p.grad.abs().max()) if p.grad is not None else 0.0)
    return errors, out


@pytest.mark.parametrize("splits_name", list(SPLITS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_matches_the_fp64_per_expert_loop(bridge, megatron_cpu, layout, splits_name):
    errors, out = layout_errors(bridge, megatron_cpu, LAYOUTS[layout], SPLITS[splits_name],
                                torch.float32, "cpu")
    print(layout, splits_name, {k: f"{v:.1e}" for k, v in errors.items()})
    assert len(errors) == 2 + 4 and max(errors.values()) < 1e-5, errors
    assert out.shape == (sum(SPLITS[splits_name]), 64)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("splits_name", list(SPLITS))
@pytest.mark.parametrize("layout", list(CUDA_LAYOUTS))
def test_each_layout_in_bf16_on_cuda_matches_the_fp64_per_expert_loop(bridge, megatron_world, layout,
                                                                      splits_name):
    """BF16 experts and BF16 adapters on the GPU (Bridge's per-expert adapters take its
    grouped-GEMM path there), every gradient against FP64."""
    errors, out = layout_errors(bridge, megatron_world, CUDA_LAYOUTS[layout], SPLITS[splits_name],
                                torch.bfloat16, "cuda")
    print(layout, splits_name, {k: f"{v:.1e}" for k, v in errors.items()})
    assert len(errors) == 2 + 4 and max(errors.values()) < BF16_TOL, errors
    assert out.shape == (sum(SPLITS[splits_name]), 64)


# --- Whole GPT-MoE: Bridge on TorchGroupedMLP vs Bridge on SequentialMLP ------------------------


def gpt(backend, seed=0, **overrides):
    """The 4-layer GPT-MoE of `recompute_config` (FP32), experts per `backend`; overrides set
    after construction."""
    config = recompute_config()
    for key, value in dict(overrides, moe_expert_gemm_backend=backend).items():
        setattr(config, key, value)
    if backend != "torch":
        config.moe_grouped_gemm = False  # Megatron's SequentialMLP
    torch.manual_seed(seed)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ)


def loss_and_grads(model):
    model.zero_grad()
    loss = model(**lm_batch()).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def copy_adapters_to_sequential(torch_model, seq_model):
    """Each local expert's adapter of the SequentialMLP model gets expert e's factors."""
    seq_params = dict(seq_model.named_parameters())
    with torch.no_grad():
        for name, module in torch_model.named_modules():
            if hasattr(module, "to_wrap") and isinstance(module.to_wrap, TorchGroupedLinear):
                a, b = expert_factors(module.adapter, module.to_wrap.num_experts)
                layer, linear = name.rsplit(".experts.", 1)
                for e in range(module.to_wrap.num_experts):
                    prefix = f"{layer}.experts.local_experts.{e}.{linear}.adapter"
                    seq_params[f"{prefix}.linear_in.weight"].copy_(a[e])
                    seq_params[f"{prefix}.linear_out.weight"].copy_(b[e])
            elif hasattr(module, "adapter") and not name.count(".experts."):
                for key, p in module.adapter.named_parameters():
                    seq_params[f"{name}.adapter.{key}"].copy_(p)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_matches_bridge_on_sequential_mlp(bridge, megatron_cpu_training, layout):
    ours, seq = gpt("torch"), gpt("transformer_engine")
    ours.load_state_dict(sequential_to_grouped(seq.state_dict()), strict=False)
    for model in (ours, seq):
        bridge["LoRA"](target_modules=TARGETS, dim=16, alpha=8, **LAYOUTS[layout])(model)
    randomize_adapters(ours)
    copy_adapters_to_sequential(ours, seq)
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == {
        n for n, _ in ours.named_parameters() if ".adapter." in n}

    loss, grads = loss_and_grads(ours)
    seq_loss, seq_grads = loss_and_grads(seq)
    errors = {"loss": rel_err(loss, seq_loss)}
    for name, module in ours.named_modules():
        if hasattr(module, "to_wrap") and isinstance(module.to_wrap, TorchGroupedLinear):
            layer, linear = name.rsplit(".experts.", 1)
            for side in ("linear_in", "linear_out"):
                grad = grads[f"{name}.adapter.{side}.weight"]
                per_expert = torch.stack([
                    seq_grads[f"{layer}.experts.local_experts.{e}.{linear}.adapter.{side}.weight"]
                    for e in range(module.to_wrap.num_experts)])
                errors[f"{name}.{side}"] = rel_err(grad, per_expert if grad.dim() == 3
                                                   else per_expert.sum(0))
    print(layout, {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) < 1e-5, errors


# --- Registration, matching and refusals --------------------------------------------------------


def test_registration_is_idempotent_and_every_binding_sees_it(bridge):
    import sys

    utils = bridge["utils"]
    wrapped = utils.get_adapter_attributes_from_linear
    assert register_with_megatron_bridge() and utils.get_adapter_attributes_from_linear is wrapped
    assert getattr(getattr(wrapped, _ORIGINAL), _ORIGINAL, None) is None  # wrapped once
    bindings = {name for name, module in sys.modules.items() if name.startswith("megatron.bridge")
                and getattr(module, "get_adapter_attributes_from_linear", None) is not None}
    assert {"megatron.bridge.peft.lora", "megatron.bridge.peft.canonical_lora",
            "megatron.bridge.peft.dora", "megatron.bridge.models.conversion.peft_bridge"} <= bindings
    assert all(sys.modules[n].get_adapter_attributes_from_linear is wrapped for n in bindings)


def test_attributes_are_those_of_te_grouped_linears(bridge, megatron_cpu):
    config = make_config(dtype=torch.float32)
    experts = experts_holder(config, megatron_cpu).mlp.experts
    get = bridge["utils"].get_adapter_attributes_from_linear
    fc1, fc2 = get(experts.linear_fc1, is_expert=True), get(experts.linear_fc2, is_expert=True)
    assert (fc1.input_is_parallel, fc1.in_features, fc1.out_features) == (False, 32, 96)
    assert (fc2.input_is_parallel, fc2.in_features, fc2.out_features) == (True, 48, 32)
    with pytest.raises(NotImplementedError, match="Layer type is unrecognized for LoRA"):
        getattr(get, _ORIGINAL)(experts.linear_fc1, is_expert=True)  # Bridge without us


def test_without_registration_bridge_fails_and_leaves_a_half_wrapped_model(
        bridge, megatron_cpu_training, monkeypatch):
    """What registration fixes: Bridge alone raises mid-way, after freezing and wrapping."""
    from megatron.bridge.peft import base, lora

    model = gpt("torch")  # built first: building TorchGroupedMLP registers (Bridge is loaded)
    monkeypatch.setattr(lora, "get_adapter_attributes_from_linear",
                        getattr(lora.get_adapter_attributes_from_linear, _ORIGINAL))
    monkeypatch.setattr(base.PEFT, "__call__", getattr(base.PEFT.__call__, _ORIGINAL))
    with pytest.raises(NotImplementedError, match="TorchGroupedLinear"):
        bridge["LoRA"](target_modules=TARGETS)(model)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".adapter." not in n)
    assert any(".adapter." in n for n, _ in model.named_parameters())  # the attention's


def test_exclude_mode_wraps_the_experts(bridge, megatron_cpu_training):
    model = gpt("torch")
    bridge["LoRA"](target_modules=[], exclude_modules=["linear_qkv"])(model)
    grouped = [n for n, m in model.named_modules() if isinstance(m, TorchGroupedLinear)]
    assert len(grouped) == 2 * 4 and all(n.endswith(".to_wrap") for n in grouped)
    assert not any("linear_qkv.adapter" in n for n, _ in model.named_parameters())


def test_dora_on_grouped_experts_is_refused_before_anything_changes(bridge, megatron_cpu_training):
    model = gpt("torch")
    state = {n: (p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    with pytest.raises(NotImplementedError, match=r"not changed:\n.*experts\.linear_fc1 "
                                                  r"\(TorchGroupedLinear\): DoRA needs"):
        bridge["DoRA"](target_modules=TARGETS)(model)
    assert dict(model.named_modules()) == modules
    assert all(p.requires_grad == state[n][0] and torch.equal(p, state[n][1])
               for n, p in model.named_parameters())
    bridge["DoRA"](target_modules=["linear_qkv", "linear_proj"])(model)  # attention: Bridge's DoRA


def test_an_unrecognised_target_is_refused_before_anything_changes(bridge, megatron_cpu_training):
    model = gpt("torch")
    model.decoder.layers[0].mlp.linear_fc2 = torch.nn.Sequential(torch.nn.Linear(64, 64))
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(NotImplementedError, match=r"layers\.0\.mlp\.linear_fc2 \(Sequential\)"):
        bridge["LoRA"](target_modules=TARGETS)(model)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == trainable
    assert not any(".adapter." in n for n, _ in model.named_parameters())


def test_canonical_lora_trains_the_experts(bridge, megatron_cpu_training):
    model = gpt("torch")
    with torch.no_grad():
        before = model(**lm_batch())
    bridge["CanonicalLoRA"]()(model)
    assert torch.equal(model(**lm_batch()).detach(), before)  # B = 0
    randomize_adapters(model)
    _, grads = loss_and_grads(model)
    expert_grads = [g for n, g in grads.items() if ".experts.linear_fc" in n]
    assert len(expert_grads) == 4 * 2 * 2 and all(g.abs().sum() > 0 for g in expert_grads)


# --- Checkpoints, merging, recompute ------------------------------------------------------------


@pytest.mark.parametrize("layout", ["shared", "per_expert"])
def test_adapter_only_distributed_checkpoint_round_trip(bridge, megatron_cpu_training, tmp_path,
                                                        layout):
    """Bridge's way (`training.checkpointing.apply_peft_adapter_filter_to_state_dict` and
    `peft.utils.load_peft_adapter_checkpoint`, whose module needs nvidia-modelopt, not installed
    on every leg): the model's sharded state dict filtered by `peft.adapter_key_filter`, extra states
    dropped, saved with dist_checkpointing; loaded the same way, then `load_state_dict(strict=False)`."""
    from megatron.core import dist_checkpointing

    models, pefts = [], []
    for seed in (0, 0):
        model = gpt("torch", seed=seed)
        peft = bridge["LoRA"](target_modules=TARGETS, dim=8, **LAYOUTS[layout])
        peft(model)
        peft.set_params_to_save(model)
        models.append(model), pefts.append(peft)
    randomize_adapters(models[0], seed=3)

    def adapter_state(model, peft):
        return {"model": {k: v for k, v in model.sharded_state_dict().items()
                          if peft.adapter_key_filter(k) and "_extra_state" not in k}}

    state = adapter_state(models[0], pefts[0])
    assert state["model"] and all(".adapter." in k for k in state["model"])
    dist_checkpointing.save(state, str(tmp_path))
    loaded = dist_checkpointing.load(adapter_state(models[1], pefts[1]), str(tmp_path))
    models[1].load_state_dict(loaded["model"], strict=False)
    saved = {n: p for n, p in models[0].named_parameters() if p.requires_grad}
    loaded = {n: p for n, p in models[1].named_parameters() if p.requires_grad}
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[n], loaded[n]) for n in saved)
    assert not all(torch.equal(saved[n], torch.zeros_like(saved[n])) for n in saved)


def test_shared_outer_checkpoint_is_bridge_s_own_limit(bridge, megatron_cpu_training):
    """Bridge 0.6.2's PackedPerExpertLinear.sharded_state_dict omits a required argument of its
    own helper, whatever the base (TE grouped linears alike); nothing of ours is involved."""
    model = gpt("torch")
    bridge["LoRA"](target_modules=TARGETS, dim=8, experts_shared_outer_loras=True)(model)
    with pytest.raises(TypeError, match="_make_grouped_expert_sharded_tensor.*pg_collection"):
        model.sharded_state_dict()


@pytest.mark.parametrize("dtype,device", [  # TorchGroupedMLP runs BF16 only on CUDA
    pytest.param(torch.float32, "cpu", id="fp32-cpu"),
    pytest.param(torch.bfloat16, "cpu", id="bf16-cpu"),
    pytest.param(torch.bfloat16, "cuda", id="bf16-cuda", marks=[pytest.mark.gpu, CUDA])])
@pytest.mark.parametrize("layout", ["shared", "per_expert", "shared_outer"])
def test_merge_folds_expert_adapters_into_the_packed_weights(bridge, megatron_world, layout, dtype,
                                                             device):
    config = make_config(dtype=dtype, moe_ffn_hidden_size=48)
    root = experts_holder(config, megatron_world)
    bridge["LoRA"](target_modules=["linear_fc1", "linear_fc2"], dim=16, alpha=8,
                   **LAYOUTS[layout])(root)
    randomize_adapters(root)
    root.to(device)
    folded = []  # FP64 W_e + alpha/r * B_e A_e of the weights and factors before the merge
    for linear in (root.mlp.experts.linear_fc1, root.mlp.experts.linear_fc2):
        a, b = expert_factors(linear.adapter, config.num_moe_experts)
        folded.append(linear.to_wrap.packed_weight.double()
                      + linear.adapter.alpha / linear.adapter.dim * b.double() @ a.double())
    generator = torch.Generator().manual_seed(2)
    splits = torch.tensor(SPLITS["zero_experts"])
    x = torch.randn(int(splits.sum()), config.hidden_size, generator=generator).to(device, dtype)
    probs = torch.rand(x.shape[0], generator=generator).to(device)
    with torch.no_grad():
        before, _ = root.mlp.experts(x, splits.to(device), probs)
        names = merge_bridge_lora(root)
        after, _ = root.mlp.experts(x, splits.to(device), probs)
    assert names == ["mlp.experts.linear_fc1", "mlp.experts.linear_fc2"]
    assert not any(".adapter." in n for n, _ in root.named_parameters())
    errors = {"out": rel_err(after, before)}
    for linear, expected in zip((root.mlp.experts.linear_fc1, root.mlp.experts.linear_fc2), folded):
        assert isinstance(linear, TorchGroupedLinear)
        assert linear.packed_weight.dtype == dtype and linear.packed_weight.device.type == device
        assert all(w.data_ptr() == linear.packed_weight[i].data_ptr()
                   for i, w in enumerate(linear.expert_weights()))
        errors[linear.name] = rel_err(linear.packed_weight, expected)
    print(layout, dtype, device, {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) < (BF16_TOL if dtype == torch.bfloat16 else 1e-5), errors


@pytest.mark.parametrize("layout", ["shared", "per_expert", "shared_outer"])
@pytest.mark.parametrize("method", ["uniform", "block"])
def test_full_recompute_with_both_guards_trains_every_adapter(bridge, megatron_cpu_training, method,
                                                              layout):
    from mcore_torch_experts.megatron.model import build_gpt_model
    from mcore_torch_experts.megatron.recompute import _ORIGINAL_FORWARD

    grads = []
    for recompute in (None, method):
        torch.manual_seed(0)
        model = build_gpt_model(recompute_config(recompute), vocab_size=VOCAB,
                                max_sequence_length=SEQ)  # our guard is installed
        bridge["LoRA"](target_modules=TARGETS, dim=8, **LAYOUTS[layout])(model)  # and Bridge's
        randomize_adapters(model)
        grads.append(loss_and_grads(model)[1])
    block = model.decoder
    assert _ORIGINAL_FORWARD in vars(block) and block.forward.__wrapped__.__func__.__name__ == \
        "_guarded_forward"  # Bridge's wrapper around ours, each once
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 4 * 4 * 2
    assert all(grads[1][n].abs().sum() > 0 and rel_err(grads[1][n], grads[0][n]) < 1e-5
               for n in grads[0])


@pytest.mark.parametrize("peft_class", ["LoRA", "CanonicalLoRA"])
def test_normalized_rank_not_divisible_by_topk_is_refused_before_anything_changes(
        bridge, megatron_cpu_training, peft_class):
    """`normalize_moe_lora` divides the expert rank by the router's top-k; Bridge raises on the
    first expert linear, after freezing the model and wrapping the attention. The pre-flight
    check refuses first, naming the modules and Bridge's reason."""
    model = gpt("torch")
    state = {n: (p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    kwargs = dict(target_modules=TARGETS) if peft_class == "LoRA" else {}
    with pytest.raises(ValueError, match=r"not changed:\n.*experts\.linear_fc1 "
                                         r"\(TorchGroupedLinear\): LoRA dim=15 must be divisible "
                                         r"by moe_router_topk=2"):
        bridge[peft_class](dim=15, normalize_moe_lora=True, **kwargs)(model)
    assert dict(model.named_modules()) == modules
    assert all(p.requires_grad == state[n][0] and torch.equal(p, state[n][1])
               for n, p in model.named_parameters())
    bridge[peft_class](dim=16, normalize_moe_lora=True, **kwargs)(model)  # divisible: wraps


def test_merge_refuses_a_wrapper_passed_as_the_root_and_changes_nothing(bridge, megatron_cpu):
    """A LoRA wrapper passed as `model` cannot be replaced by its base in the caller's hands: the
    merge is refused with the weights as they were (not folded into a still-active adapter)."""
    config = make_config(dtype=torch.float32, moe_ffn_hidden_size=48)
    root = experts_holder(config, megatron_cpu)
    bridge["LoRA"](target_modules=["linear_fc1", "linear_fc2"], dim=16, alpha=8)(root)
    randomize_adapters(root)
    wrapper = root.mlp.experts.linear_fc1
    packed = wrapper.to_wrap.packed_weight.clone()
    splits = torch.tensor(SPLITS["uniform"])
    x, probs = torch.randn(int(splits.sum()), config.hidden_size), torch.rand(int(splits.sum()))
    with torch.no_grad():
        before, _ = root.mlp.experts(x, splits, probs)
    for given in (wrapper, [wrapper]):
        with pytest.raises(ValueError, match=r"nothing was merged:\n  the model passed in is "
                                             r"itself a LoRA wrapper .*pass the module that holds it"):
            merge_bridge_lora(given)
        assert torch.equal(wrapper.to_wrap.packed_weight, packed)
        assert root.mlp.experts.linear_fc1 is wrapper
    with torch.no_grad():
        assert torch.equal(root.mlp.experts(x, splits, probs)[0], before)
        assert merge_bridge_lora(root.mlp.experts) == ["linear_fc1", "linear_fc2"]
        assert rel_err(root.mlp.experts(x, splits, probs)[0], before) < 1e-5


def test_merge_refuses_a_disabled_adapter_and_changes_nothing(bridge, megatron_cpu):
    """An adapter Bridge has disabled is not part of what the model computes: folding it in would
    change the model, so the merge is refused, naming it, with every weight and wrapper as it was."""
    config = make_config(dtype=torch.float32, moe_ffn_hidden_size=48)
    root = experts_holder(config, megatron_cpu)
    bridge["LoRA"](target_modules=["linear_fc1", "linear_fc2"], dim=16, alpha=8)(root)
    randomize_adapters(root)
    wrappers = [root.mlp.experts.linear_fc1, root.mlp.experts.linear_fc2]
    packed = [wrapper.to_wrap.packed_weight.clone() for wrapper in wrappers]
    wrappers[1].disable_adapter_layers()
    with pytest.raises(ValueError, match=r"nothing was merged:\n  mlp\.experts\.linear_fc2's "
                                         r"adapter is disabled .* Enable the adapters"):
        merge_bridge_lora(root)
    assert root.mlp.experts.linear_fc1 is wrappers[0] and root.mlp.experts.linear_fc2 is wrappers[1]
    assert all(torch.equal(wrapper.to_wrap.packed_weight, weights)
               for wrapper, weights in zip(wrappers, packed))



def gpt_logits(model):
    batch = lm_batch()
    batch.pop("labels")
    with torch.no_grad():
        return model.eval()(**batch)


@pytest.mark.parametrize("layout", ["shared", "per_expert", "shared_outer"])
def test_merge_folds_every_adapter_of_a_gpt(bridge, megatron_cpu, layout):
    """The docs' targets (attention and experts): every wrapper is folded, dense ones into the
    linear's weight as an FP64 W + alpha/r * B A of the weights before, expert ones into the
    packed buffer; the logits are those with the adapters live, and differ from the base's."""
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper

    model = gpt("torch")
    base_logits = gpt_logits(model)
    bridge["LoRA"](target_modules=TARGETS, dim=8, alpha=16, **LAYOUTS[layout])(model)
    randomize_adapters(model)
    wrappers = {n: m for n, m in model.named_modules() if isinstance(m, AdapterWrapper)}
    folded = {}
    for name, wrapper in wrappers.items():
        base, adapter = wrapper.to_wrap, wrapper.adapter
        scale = adapter.alpha / adapter.dim
        if isinstance(base, TorchGroupedLinear):
            a, b = expert_factors(adapter, base.num_experts)
            folded[name] = base.packed_weight.double() + scale * b.double() @ a.double()
        else:
            folded[name] = (base.weight.double() + scale * adapter.linear_out.weight.double()
                            @ adapter.linear_in.weight.double())
    live = gpt_logits(model)
    names = merge_bridge_lora(model)
    assert names == list(wrappers) and len(names) == 4 * 4
    assert not any(isinstance(m, AdapterWrapper) for m in model.modules())
    modules = dict(model.named_modules())
    for name, expected in folded.items():
        merged = modules[name]
        weight = merged.packed_weight if isinstance(merged, TorchGroupedLinear) else merged.weight
        assert merged is wrappers[name].to_wrap and rel_err(weight, expected) < 1e-6, name
    after = gpt_logits(model)
    assert rel_err(after, live) < 1e-5
    assert rel_err(after, base_logits) > 1e-2  # the adapters changed the model


def _refusal_case(bridge, case):
    """A GPT with Bridge adapters merge_bridge_lora must refuse, and the module it names."""
    model = gpt("torch")
    if case == "canonical":
        bridge["CanonicalLoRA"](dim=8)(model)
        return model, r"decoder\.layers\.0\.self_attention\.linear_qkv is a LoRALinearSplitQKV"
    if case == "dora":
        bridge["DoRA"](target_modules=["linear_qkv", "linear_proj"], dim=8)(model)
        return model, r"decoder\.layers\.0\.self_attention\.linear_qkv is a DoRALinear"
    if case == "router":
        bridge["LoRA"](target_modules=TARGETS + ["router"], dim=8)(model)
        return model, r"decoder\.layers\.0\.mlp\.router is a LoRATopKRouter"
    bridge["LoRA"](target_modules=TARGETS, dim=8)(model)
    if case == "activation":
        model.decoder.layers[1].self_attention.linear_proj.adapter.activation = torch.nn.SiLU()
        return model, r"decoder\.layers\.1\.self_attention\.linear_proj's adapter has a SiLU"
    assert case == "disabled"
    model.decoder.layers[2].self_attention.linear_qkv.disable_adapter_layers()
    return model, r"decoder\.layers\.2\.self_attention\.linear_qkv's adapter is disabled"


@pytest.mark.parametrize("case", ["canonical", "dora", "router", "activation", "disabled"])
def test_merge_refuses_what_it_cannot_fold_and_changes_nothing(bridge, megatron_cpu, case):
    """One wrapper it cannot fold: refused with its name and the fix, before any weight is
    written or any wrapper removed (the model also holds foldable dense and expert adapters)."""
    model, message = _refusal_case(bridge, case)
    randomize_adapters(model)
    modules = dict(model.named_modules())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=r"cannot be merged; nothing was merged:\n(.*\n)*  "
                                         + message):
        merge_bridge_lora(model)
    assert dict(model.named_modules()) == modules
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items() if k in state)


def test_merge_refuses_expert_tensor_parallelism_and_changes_nothing(bridge, megatron_cpu,
                                                                     monkeypatch):
    """Expert TP > 1 (the packed buffer is a shard of each expert): refused, naming the module
    and the setting. One process stands for it by answering 2 for the experts' ETP group."""
    import mcore_torch_experts.integrations.bridge as ours

    model = gpt("torch")
    bridge["LoRA"](target_modules=TARGETS, dim=8)(model)
    randomize_adapters(model)
    etp = model.decoder.layers[0].mlp.experts.linear_fc1.to_wrap._pg_collection.expt_tp
    size = ours.get_pg_size
    monkeypatch.setattr(ours, "get_pg_size", lambda group: 2 if group is etp else size(group))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.mlp\.experts\.linear_fc1 has "
                                         r"expert tensor parallelism > 1 .*"
                                         r"expert_tensor_parallel_size=1"):
        merge_bridge_lora(model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items() if k in state)


@pytest.mark.distributed
def test_merge_folds_tensor_parallel_dense_adapters(bridge, tmp_path):
    """TP=2 on two gloo processes (tests/distributed/bridge_merge_tensor_parallel.py): Bridge's
    LoRA on a column-parallel linear_qkv (A sharded) and a row-parallel linear_proj (B sharded)
    with random factors; after merge_bridge_lora each rank's weight is its shard of the FP64 fold
    of the gathered factors, and the output is the one with the adapters live."""
    import json

    from support.torchrun import ROOT, torchrun

    run = torchrun(ROOT / "tests" / "distributed" / "bridge_merge_tensor_parallel.py", 2, [],
                   tmp_path / "torchrun.log", timeout_s=240)
    assert run.returncode == 0, run.output[-4000:]
    reports = json.loads(next(line for line in reversed(run.output.splitlines())
                              if line.startswith("[{")))
    assert [report["rank"] for report in reports] == [0, 1]
    for report in reports:
        assert report["merged"] == ["self_attention.linear_qkv", "self_attention.linear_proj"]
        assert report["unwrapped"] == ["ColumnParallelLinear", "RowParallelLinear"]
        assert report["linear_qkv_factor_shapes"] == {"A": [2, 16], "B": [12, 4]}  # A sharded
        assert report["linear_proj_factor_shapes"] == {"A": [4, 12], "B": [8, 4]}  # B sharded
        assert report["linear_qkv_weight"] < 1e-6 and report["linear_proj_weight"] < 1e-6
        assert report["linear_qkv_change"] > 0.1 and report["linear_proj_change"] > 0.1
        assert report["output"] < 1e-6

# --- Bridge's per-expert adapters: one grouped GEMM per projection ------------------------------


def per_expert_experts(config, pg_collection, device, **lora_kwargs):
    """TorchGroupedMLP with Bridge's per-expert LoRA (dim 16 unless given), random factors, on
    `device`."""
    root = experts_holder(config, pg_collection)
    bridge_lora = import_lora()
    bridge_lora(target_modules=["linear_fc1", "linear_fc2"], **dict(dict(dim=16, alpha=8),
                **lora_kwargs), share_expert_adapters=False)(root)
    randomize_adapters(root)
    return root.to(device).mlp.experts


def import_lora():
    from megatron.bridge.peft.lora import LoRA

    return LoRA


def experts_inputs(experts, splits, dtype, device, seed=2, splits_on=None):
    """(x, tokens_per_expert, probs, output gradient) on the device: made apart from the call,
    since copying host tensors to the GPU is itself a synchronizing operation."""
    generator = torch.Generator().manual_seed(seed)
    rows, hidden = sum(splits), experts.config.hidden_size
    x = torch.randn(rows, hidden, generator=generator).to(device, dtype)
    probs = torch.rand(rows, generator=generator).to(device)
    grad = torch.randn(rows, hidden, generator=generator).to(device, dtype)
    return x, torch.tensor(splits, device=splits_on or device), probs, grad


def run_on(experts, x, tokens_per_expert, probs, grad):
    """Output and every gradient (input, each adapter factor) of one forward/backward."""
    x = x.detach().clone().requires_grad_(True)
    experts.zero_grad()
    out, _ = experts(x, tokens_per_expert, probs)
    out.backward(grad)
    return [out.detach(), x.grad] + [p.grad.clone() for n, p in sorted(experts.named_parameters())
                                     if p.requires_grad]


def run_experts(experts, splits, dtype, device, seed=2, splits_on=None):
    """run_on with fresh inputs (seeded)."""
    return run_on(experts, *experts_inputs(experts, splits, dtype, device, seed, splits_on))


def with_bridge_forward(experts, bridge_per_expert_forward, fn):
    """fn() with Bridge's own adapter_forward (and adapter forward) in place of the grouped path."""
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper

    bridge_per_expert_forward.allow()
    grouped = AdapterWrapper.adapter_forward
    AdapterWrapper.adapter_forward = getattr(grouped, _ORIGINAL)
    try:
        return fn()
    finally:
        AdapterWrapper.adapter_forward = grouped


@pytest.mark.parametrize("splits_name", list(SPLITS))
def test_per_expert_adapters_run_grouped_bitwise_run_to_run_and_as_bridge_s_path(
        bridge, megatron_cpu, bridge_per_expert_forward, splits_name, monkeypatch):
    """The grouped path runs (Bridge's forward is refused, ours counted), twice bitwise equal,
    and within FP32 rounding of Bridge's own per-expert loop on the same model and inputs."""
    from mcore_torch_experts.integrations import bridge_adapters as ours

    grouped_calls = []
    forward = ours.grouped_expert_adapter_forward
    monkeypatch.setattr(ours, "grouped_expert_adapter_forward",
                        lambda *a: grouped_calls.append(a[1].name) or forward(*a))
    experts = per_expert_experts(make_config(dtype=torch.float32, hidden=64, ffn=64),
                                 megatron_cpu, "cpu")
    hooked = []  # the adapter module is still called: its hooks (DDP's, a profiler's) run
    for linear in (experts.linear_fc1, experts.linear_fc2):
        linear.adapter.register_forward_pre_hook(lambda m, args: hooked.append(len(args)))
    splits = SPLITS[splits_name]
    first, second = (run_experts(experts, splits, torch.float32, "cpu") for _ in range(2))
    assert grouped_calls == ["linear_fc1", "linear_fc2"] * 2 and hooked == [2] * 4
    assert len(first) == 2 + 4 and all(torch.equal(a, b) for a, b in zip(first, second))
    bridge_s = with_bridge_forward(experts, bridge_per_expert_forward,
                                   lambda: run_experts(experts, splits, torch.float32, "cpu"))
    assert len(bridge_per_expert_forward.calls) == 2
    errors = [rel_err(a, b) if b.abs().sum() else float((a - b).abs().sum())  # empty batch: zeros
              for a, b in zip(first, bridge_s)]
    assert max(errors) < 1e-6, errors


def test_per_expert_adapters_read_no_split_on_the_host(bridge, megatron_cpu,
                                                       bridge_per_expert_forward, monkeypatch):
    """Forward and backward of both adapters read no tensor on the host (`tolist`, `item`, int,
    bool, float): on a GPU, such a read of the device splits is a host sync. Bridge's own
    forward, counted the same way, reads the splits."""
    experts = per_expert_experts(make_config(dtype=torch.float32, hidden=64, ffn=64),
                                 megatron_cpu, "cpu")
    splits = torch.tensor(SPLITS["zero_experts"])
    x = torch.randn(int(splits.sum()), 64, requires_grad=True)
    reads = []
    for name in ("tolist", "item", "__int__", "__index__", "__bool__", "__float__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _name=name, _f=original:
                            reads.append(_name) or _f(self, *a))

    def adapters_forward_backward():
        h = x
        for wrapper in (experts.linear_fc1, experts.linear_fc2):
            h = wrapper.adapter_forward(wrapper.adapter, h[:, :64].contiguous(), splits)
        h.sum().backward()

    adapters_forward_backward()
    assert reads == []
    with_bridge_forward(experts, bridge_per_expert_forward, adapters_forward_backward)
    assert "tolist" in reads and len(bridge_per_expert_forward.calls) == 2


@pytest.mark.parametrize("position", ["pre", "post"])
def test_per_expert_adapter_dropout_is_bridge_s(bridge, megatron_cpu, bridge_per_expert_forward,
                                                position):
    """dropout=0.5 in either position: `pre` draws Bridge's mask (its forward, same seed, gives
    the same output); `post` zeroes elements of the adapter output and scales the rest by 2."""
    experts = per_expert_experts(make_config(dtype=torch.float32, hidden=64, ffn=64), megatron_cpu,
                                 "cpu", dropout=0.5, dropout_position=position)
    wrapper = experts.linear_fc1
    splits = torch.tensor(SPLITS["zero_experts"])
    x = torch.randn(int(splits.sum()), 64)

    def adapter_out(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            return wrapper.adapter_forward(wrapper.adapter, x, splits)

    out = adapter_out(0)
    assert torch.equal(out, adapter_out(0)) and not torch.equal(out, adapter_out(1))
    wrapper.adapter.eval()
    plain = adapter_out(0)
    wrapper.adapter.train()
    if position == "pre":
        bridge_s = with_bridge_forward(experts, bridge_per_expert_forward, lambda: adapter_out(0))
        assert rel_err(out, bridge_s) < 1e-6 and rel_err(out, plain) > 0.1
    else:
        kept = out != 0
        assert 0.3 < kept.float().mean() < 0.7
        assert rel_err(out[kept], 2 * plain[kept]) < 1e-6


@pytest.mark.parametrize("dtype,dim,setting", [
    (torch.float32, 6, "{'dim': 6} in torch.float32"),
    (torch.bfloat16, 4, "{'dim': 4} in torch.bfloat16")])
def test_a_setting_grouped_gemm_cannot_take_runs_bridge_s_forward_and_says_so_once(
        bridge, megatron_cpu, bridge_per_expert_forward, caplog, dtype, dim, setting):
    """A rank whose rows are not 16-byte multiples: Bridge's own forward runs (results against
    the FP64 loop), and one warning names the setting."""
    import logging

    from mcore_torch_experts.integrations import bridge_adapters as ours

    ours._LOGGED_OBSTACLES.clear()
    bridge_per_expert_forward.allow()
    config = make_config(dtype=dtype, hidden=64, ffn=64)
    experts = per_expert_experts(config, megatron_cpu, "cpu", dim=dim)
    splits = SPLITS["zero_experts"]
    with caplog.at_level(logging.WARNING, logger="mcore_torch_experts"):
        for _ in range(2):
            out = run_experts(experts, splits, dtype, "cpu")[0]
    assert len(bridge_per_expert_forward.calls) == 4
    warnings = [r.getMessage() for r in caplog.records if "Bridge's own forward" in r.getMessage()]
    assert len(warnings) == 1 and setting in warnings[0], warnings
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(sum(splits), 64, generator=generator).to(dtype)
    probs = torch.rand(sum(splits), generator=generator)
    ref = fp64_lora_experts(config, experts, x, splits, probs)[0]
    assert rel_err(out, ref) < (BF16_TOL if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.gpu
@CUDA
def test_per_expert_adapters_on_cuda_sync_free_bitwise_and_as_bridge_s_grouped_path(
        bridge, megatron_world, bridge_per_expert_forward):
    """BF16 on the GPU with the splits on the device: forward and backward run under CUDA's
    sync debug mode "error", twice bitwise equal, and within BF16 rounding of Bridge's own
    grouped-GEMM path (output and every gradient)."""
    experts = per_expert_experts(make_config(dtype=torch.bfloat16, hidden=256, ffn=128),
                                 megatron_world, "cuda")
    splits = [0, 300, 17, 195]
    inputs = experts_inputs(experts, splits, torch.bfloat16, "cuda")
    run_on(experts, *inputs)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = run_on(experts, *inputs)
        second = run_on(experts, *inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    bridge_s = with_bridge_forward(experts, bridge_per_expert_forward,
                                   lambda: run_experts(experts, splits, torch.bfloat16, "cuda"))
    assert len(bridge_per_expert_forward.calls) == 2
    errors = [rel_err(a, b) for a, b in zip(first, bridge_s)]
    print("grouped vs Bridge's grouped path", [f"{e:.1e}" for e in errors],
          "bitwise" if all(torch.equal(a, b) for a, b in zip(first, bridge_s)) else "")
    assert max(errors) < BF16_TOL, errors
