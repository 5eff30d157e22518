"""The parity gate with Transformer Engine: TorchGroupedMLP against TEGroupedMLP (today's experts)
with the same weights, BF16 on CUDA.

- The experts modules alone, against an FP64 per-expert loop: uniform and skewed routing,
  experts without tokens, an empty batch. TorchGroupedMLP's error is no larger than
  TEGroupedMLP's (within a small margin: both round to BF16 in different places).
- The MoE layer of Megatron's TE spec (TE router GEMM, TE norm), allgather and alltoall
  dispatchers: TEGroupedMLP experts against the same layer converted with
  `convert_experts_to_torch`, output and input gradient.
- The downstream gate: a GPT built from the TE spec with Megatron-Bridge's LoRA (the real TE) on
  both experts modules, same weights and adapters, full recompute with Bridge's recompute hook and
  the frozen-input guard: loss and every adapter gradient; then `merge_bridge_lora` folds the
  expert adapters without changing the logits.
"""

import pytest
import torch

from mcore_torch_experts import TorchGroupedMLP, _compat, convert_experts_to_torch, specs
from support.reference import fp64_experts, rel_err
from support.te import needs_te, te_config, te_gpt

pytestmark = needs_te

HIDDEN, FFN, EXPERTS = 128, 64, 8
SPLITS = {
    "uniform": [16] * EXPERTS,
    "skewed": [61, 1, 0, 30, 2, 0, 9, 25],
    "zero_first_middle_last": [0, 40, 24, 0, 30, 10, 24, 0],
    "empty": [0] * EXPERTS,
}
PARITY_TOL = 2e-2  # TorchGroupedMLP vs TEGroupedMLP, both BF16
MARGIN = 1.1  # ours against FP64 may exceed TE's by this factor (different rounding points)


def activation_fields(name):
    if name == "squared_relu":
        from megatron.core.activations import squared_relu

        return dict(gated_linear_unit=False, activation_func=squared_relu)
    return dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu)


def moe_layer(config, pg_collection, seed=0):
    """The MoE layer of Megatron's TE layer spec (experts follow the config's backend), on CUDA."""
    torch.manual_seed(seed)
    spec = specs.get_gpt_layer_with_transformer_engine_spec(config).submodules.mlp
    return _compat.build_moe_layer(spec, config, pg_collection=pg_collection).cuda()


def parity_config(activation="swiglu", **overrides):
    fields = dict(hidden_size=HIDDEN, moe_ffn_hidden_size=FFN, num_moe_experts=EXPERTS)
    fields.update(overrides)
    return te_config(**activation_fields(activation), **fields)


def expert_pair(pg_collection, activation, **shape):
    """(TEGroupedMLP, TorchGroupedMLP) with the same weights, frozen."""
    te_layer = moe_layer(parity_config(activation, **shape), pg_collection)
    ours_layer = moe_layer(parity_config(activation, moe_expert_gemm_backend="torch", **shape),
                           pg_collection, seed=1)
    te, ours = te_layer.experts, ours_layer.experts
    assert type(te).__name__ == "TEGroupedMLP" and isinstance(ours, TorchGroupedMLP)
    missing, unexpected = ours.load_state_dict(te.state_dict(), strict=False)
    assert all("_extra_state" in key for key in [*missing, *unexpected]), (missing, unexpected)
    te.requires_grad_(False)
    ours.requires_grad_(False)
    return te, ours


def stacked(linear):
    return torch.stack([getattr(linear, f"weight{i}") for i in range(linear.num_gemms)])


def compare_with_fp64(te, ours, splits, label):
    """Runs both experts modules forward and backward on the same random BF16 rows; checks
    TorchGroupedMLP against TEGroupedMLP and both against the FP64 per-expert loop."""
    rows, hidden = sum(splits), te.linear_fc1.weight0.shape[1]
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    probs = torch.rand(rows, device="cuda", generator=generator)
    grad_out = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    results = {}
    for name, module in (("te", te), ("ours", ours)):
        xi = x.clone().requires_grad_(True)
        out, bias = module(xi, torch.tensor(splits), probs)
        assert bias is None
        out.backward(grad_out)
        results[name] = out.detach(), xi.grad
    if rows == 0:
        for out, dgrad in results.values():
            assert out.shape == (0, hidden) and dgrad.shape == (0, hidden)
        return
    x64 = x.double().requires_grad_(True)
    exact = fp64_experts(ours.config, stacked(te.linear_fc1), stacked(te.linear_fc2), x64, splits,
                         probs)
    exact.backward(grad_out.double())
    (te_out, te_dgrad), (out, dgrad) = results["te"], results["ours"]
    errors = dict(parity_out=rel_err(out, te_out), parity_dgrad=rel_err(dgrad, te_dgrad),
                  ours_out=rel_err(out, exact), te_out=rel_err(te_out, exact),
                  ours_dgrad=rel_err(dgrad, x64.grad), te_dgrad=rel_err(te_dgrad, x64.grad))
    print(f"\n[te parity] {label}: " + " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert errors["parity_out"] < PARITY_TOL and errors["parity_dgrad"] < PARITY_TOL, errors
    assert errors["ours_out"] <= MARGIN * errors["te_out"], errors
    assert errors["ours_dgrad"] <= MARGIN * errors["te_dgrad"], errors
    assert torch.isfinite(out).all() and torch.isfinite(dgrad).all()


@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
@pytest.mark.parametrize("splits_name", list(SPLITS))
def test_experts_match_te_grouped_mlp_and_are_as_close_to_fp64(te_world, activation, splits_name):
    te, ours = expert_pair(te_world, activation)
    compare_with_fp64(te, ours, SPLITS[splits_name], f"{activation} {splits_name}")


MODEL_SHAPES = {  # 128 local experts each (Nemotron-3 Super at EP4: the experts see latent 1024)
    "qwen3_30b_a3b": ("swiglu", dict(hidden_size=2048, moe_ffn_hidden_size=768)),
    "nemotron3_super_ep4": ("squared_relu", dict(hidden_size=1024, moe_ffn_hidden_size=2688)),
}


@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_experts_at_model_shapes_match_te_grouped_mlp(te_world, model):
    """8192 rows routed unevenly over 128 experts, a tenth of them without tokens."""
    activation, shape = MODEL_SHAPES[model]
    te, ours = expert_pair(te_world, activation, num_moe_experts=128, **shape)
    generator = torch.Generator().manual_seed(1)
    weights = torch.rand(128, generator=generator).pow(3)
    weights[torch.randperm(128, generator=generator)[:13]] = 0
    choice = torch.multinomial(weights, 8192, replacement=True, generator=generator)
    splits = torch.bincount(choice, minlength=128).tolist()
    compare_with_fp64(te, ours, splits, f"{model} (128 experts, 8192 rows)")


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_te_spec_moe_layer_with_converted_experts_matches_te_grouped_mlp(te_world, dispatcher):
    config = parity_config(moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=0.0)
    te_layer = moe_layer(config, te_world)
    ours_layer = moe_layer(config, te_world)
    ours_layer.load_state_dict(te_layer.state_dict())
    summary = convert_experts_to_torch(ours_layer)
    assert summary.names == ["experts"] and isinstance(ours_layer.experts, TorchGroupedMLP)
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 2, HIDDEN, device="cuda", generator=generator).bfloat16()
    grad_out = torch.randn(64, 2, HIDDEN, device="cuda", generator=generator).bfloat16()
    results = []
    for layer in (te_layer, ours_layer):
        layer.experts.requires_grad_(False)
        xi = x.clone().requires_grad_(True)
        out, _ = layer(xi)
        out.backward(grad_out)
        results.append((out.detach(), xi.grad))
    (te_out, te_dgrad), (out, dgrad) = results
    assert rel_err(out, te_out) < PARITY_TOL and rel_err(dgrad, te_dgrad) < PARITY_TOL
    router_grads = [layer.router.weight.grad for layer in (te_layer, ours_layer)]
    assert rel_err(router_grads[1], router_grads[0]) < 5 * PARITY_TOL


# --- Megatron-Bridge's LoRA with the real Transformer Engine -----------------------------------

BRIDGE_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@pytest.fixture(scope="module")
def bridge():
    """Bridge's PEFT, imported with the real Transformer Engine, taught about TorchGroupedLinear."""
    from mcore_torch_experts import register_with_megatron_bridge
    from support.bridge import import_bridge_peft

    import_bridge_peft()
    assert register_with_megatron_bridge()
    from megatron.bridge.peft.lora import LoRA

    return LoRA


def bridge_lora_model(lora_class, backend, share_expert_adapters, adapters=None):
    """A TE-spec GPT (the same weights for either experts backend) with Bridge's LoRA on
    attention and experts, under full uniform recompute with Bridge's recompute hook (its PEFT
    call installs it) and the frozen-input guard; its routers can record and replay their routes
    (support/routing_replay.py). Adapter weights: `adapters` (by name) or random (Bridge starts
    B at zero)."""
    from mcore_torch_experts.megatron.recompute import install_frozen_input_guard

    model = te_gpt(te_config(recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=1, moe_enable_routing_replay=True))
    if backend == "torch":
        convert_experts_to_torch(model)  # installs the guard too
    else:
        install_frozen_input_guard(model)
    model = lora_class(target_modules=BRIDGE_TARGETS, dim=8, alpha=16,
                       share_expert_adapters=share_expert_adapters)(model, training=True)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(".adapter." in n for n in trainable) and trainable
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in trainable.items():
            if adapters is None:
                p.normal_(std=0.05)
            else:
                p.copy_(adapters[name])
    return model


@pytest.mark.parametrize("share_expert_adapters", [True, False], ids=["shared", "per-expert"])
def test_bridge_lora_on_te_spec_gpt_torch_experts_match_te_experts(te_world, bridge,
                                                                   share_expert_adapters):
    from mcore_torch_experts import merge_bridge_lora
    from support.routing_replay import forget_routers, recorded_routes, replayed_routes
    from support.tiny_gpt import batch

    inputs, positions, mask, labels = (t.cuda() for t in batch())
    results, adapters, routes = {}, None, None
    try:
        for backend in ("transformer_engine", "torch"):
            model = bridge_lora_model(bridge, backend, share_expert_adapters, adapters)
            adapters = {n: p.detach().clone() for n, p in model.named_parameters()
                        if p.requires_grad}
            # TEGroupedMLP's routes replayed: a near-tied choice would flip with our rounding
            routing = recorded_routes(model) if routes is None else replayed_routes(model, routes)
            with routing as recorded:
                loss = model(inputs, positions, mask, labels=labels).float().mean()
                loss.backward()
            routes = routes or recorded
            grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            results[backend] = model, loss.item(), grads
    finally:
        forget_routers()
    (_, te_loss, te_grads), (ours, loss, grads) = results["transformer_engine"], results["torch"]
    assert grads.keys() == te_grads.keys() and len(grads) > 0
    assert any(".experts.linear_fc1.adapter" in name for name in grads)
    assert loss == pytest.approx(te_loss, rel=1e-3)
    for name, grad in grads.items():
        assert grad is not None and te_grads[name] is not None, name
        assert rel_err(grad, te_grads[name]) < 5e-2, name

    ours.eval()
    with torch.no_grad():
        before = ours(inputs, positions, mask)
        merged = merge_bridge_lora(ours)
        after = ours(inputs, positions, mask)
    assert any(".experts." in name for name in merged)
    assert not any(type(m).__name__ == "LoRALinear" for m in ours.modules())
    assert rel_err(after, before) < PARITY_TOL
