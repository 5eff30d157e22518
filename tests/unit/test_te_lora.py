"""`apply_lora` on every linear Megatron's TE spec builds: TE's LayerNorm column linear (its
layer-norm output switch on or off before wrapping), TE's column and row linears (attention, the
dense MLP, shared experts) and TEGroupedMLP's grouped linears (shared and per-expert adapters).

Each wrapped module is run on its own, BF16 on CUDA. The reference is the same math with the
adapter in FP64: the base's own output and input gradient (the base is TE's module, frozen) plus
`alpha / rank * adapter_in @ A.T @ B.T`, where adapter_in is x, or for the LayerNorm linear the FP64
RMSNorm of x with the module's own norm weight. Forward, input gradient and both factors'
gradients are compared."""

import pytest
import torch

from mcore_torch_experts.lora import LoRALinear, apply_lora, lora_parameters
from support.reference import rel_err
from support.te import needs_te, te_config, te_gpt

pytestmark = needs_te

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
RANK, ALPHA = 8, 16
SPLITS = [5, 0, 11, 8]  # rows per expert, one expert without tokens
TOL = 2e-2  # BF16 module and BF16 adapter math against the FP64 adapter


def fp64_rmsnorm(base, x64: torch.Tensor, config) -> torch.Tensor:
    weight = base.layer_norm_weight.double()
    if config.layernorm_zero_centered_gamma:
        weight = weight + 1
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * weight


def fp64_adapter(adapter, adapter_in64: torch.Tensor, splits, per_expert: bool):
    """(out [.., out] float64, A64, B64): the adapter's math in FP64 with the alpha / rank
    apply_lora was given, factors as leaves."""
    a = adapter.linear_in.weight.detach().double().requires_grad_(True)
    b = adapter.linear_out.weight.detach().double().requires_grad_(True)
    if not per_expert:
        return adapter_in64 @ a.T @ b.T * (ALPHA / RANK), a, b
    rows = adapter_in64.split(splits)
    out = torch.cat([r @ a[e].T @ b[e].T for e, r in enumerate(rows)]) * (ALPHA / RANK)
    return out, a, b


def check_wrapped(name, wrapper, config):
    """Runs `wrapper` (LoRALinear over a TE module) on random BF16 inputs and compares output,
    input gradient and factor gradients with the FP64 reference; returns the errors."""
    base, adapter = wrapper.to_wrap, wrapper.adapter
    grouped = hasattr(base, "weight0")
    in_features = base.weight0.shape[1] if grouped else base.weight.shape[1]
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (sum(SPLITS), in_features) if grouped else (6, 2, in_features)
    x = torch.randn(*shape, device="cuda", generator=generator).bfloat16().requires_grad_(True)
    args = (list(SPLITS),) if grouped else ()

    out, bias = wrapper(x, *args)
    assert bias is None, name
    grad_out = torch.randn(out.shape, device="cuda", generator=generator).bfloat16()
    out.backward(grad_out)

    # The base alone (as wrapped: a LayerNorm linear returns its norm output too).
    x_base = x.detach().clone().requires_grad_(True)
    base_out = base(x_base, *args)[0]
    if isinstance(base_out, tuple):
        base_out = base_out[0]
    base_out.backward(grad_out)

    x64 = x.detach().double().requires_grad_(True)
    layer_norm = hasattr(base, "layer_norm_weight")
    adapter_in64 = fp64_rmsnorm(base, x64, config) if layer_norm else x64
    lora64, a64, b64 = fp64_adapter(adapter, adapter_in64, SPLITS, per_expert=a_is_grouped(adapter))
    lora64.backward(grad_out.double())
    errors = {
        "out": rel_err(out, base_out.detach().double() + lora64.detach()),
        "dgrad": rel_err(x.grad, x_base.grad.double() + x64.grad),
        "A": rel_err(adapter.linear_in.weight.grad, a64.grad),
        "B": rel_err(adapter.linear_out.weight.grad, b64.grad),
    }
    assert all(err < TOL for err in errors.values()), (name, type(base).__name__, errors)
    return errors


def a_is_grouped(adapter) -> bool:
    return adapter.linear_in.weight.dim() == 3


@pytest.mark.parametrize("layernorm_output_preset", [False, True],
                         ids=["switch-off", "switch-already-on"])
@pytest.mark.parametrize("expert_adapter", ["shared", "per_expert"])
def test_every_te_linear_gets_a_working_adapter(te_world, expert_adapter,
                                                layernorm_output_preset):
    config = te_config(moe_shared_expert_intermediate_size=32)
    model = te_gpt(config)
    layernorm_linears = [m for m in model.modules() if hasattr(m, "return_layernorm_output")]
    assert layernorm_linears  # linear_qkv and the dense layer's linear_fc1
    for module in layernorm_linears:
        module.return_layernorm_output = layernorm_output_preset

    wrapped = apply_lora(model, TARGETS, rank=RANK, alpha=ALPHA, expert_adapter=expert_adapter)
    bases = {type(model.get_submodule(name).to_wrap).__name__ for name in wrapped}
    assert bases == {"TELayerNormColumnParallelLinear", "TERowParallelLinear",
                     "TEColumnParallelLinear", "TEColumnParallelGroupedLinear",
                     "TERowParallelGroupedLinear"}, bases
    torch.manual_seed(1)
    with torch.no_grad():  # B starts at zero: a non-zero B gives A a gradient
        for key, p in lora_parameters(model).items():
            if key.endswith("linear_out.weight"):
                p.normal_(std=0.1)
    for name in wrapped:
        wrapper = model.get_submodule(name)
        assert isinstance(wrapper, LoRALinear)
        expert = ".experts.linear_fc" in name and "shared_experts" not in name
        assert a_is_grouped(wrapper.adapter) == (expert and expert_adapter == "per_expert"), name
        check_wrapped(name, wrapper, config)


def test_te_model_with_adapters_trains_every_adapter_under_full_recompute(te_world):
    """The whole TE-spec model with the frozen-input guard: under full recompute (uniform and
    block) the loss and every adapter's gradient are those of the run without recompute."""
    from mcore_torch_experts.megatron.recompute import install_frozen_input_guard
    from support.tiny_gpt import batch

    def adapter_grads(**recompute):
        model = te_gpt(te_config(moe_expert_gemm_backend="torch", **recompute))
        install_frozen_input_guard(model)
        apply_lora(model, TARGETS, rank=RANK, alpha=ALPHA, expert_adapter="per_expert")
        torch.manual_seed(1)
        with torch.no_grad():
            for p in lora_parameters(model).values():
                p.normal_(std=0.05)
        inputs, positions, mask, labels = (t.cuda() for t in batch())
        loss = model(inputs, positions, mask, labels=labels).float().mean()
        loss.backward()
        return loss.item(), {k: p.grad for k, p in lora_parameters(model).items()}

    loss, expected = adapter_grads()
    assert all(g is not None for g in expected.values())
    for method in ("uniform", "block"):
        got_loss, got = adapter_grads(recompute_granularity="full", recompute_method=method,
                                      recompute_num_layers=1)
        assert got_loss == pytest.approx(loss, rel=1e-3), method
        for key, grad in expected.items():
            assert got[key] is not None, (method, key)
            assert rel_err(got[key], grad) < TOL, (method, key)
