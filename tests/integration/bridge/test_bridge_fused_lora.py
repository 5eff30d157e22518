"""Megatron-Bridge's LoRA adapters on TorchGroupedMLP inside the fused expert kernels
(`moe_expert_kernel="fused_gemm"`): the shared (ParallelLinearAdapter) and per-expert
(GroupedExpertLinearAdapter) layouts run in the kernels, read through their parameters, against
the same module on "grouped_mm" (Bridge's own adapter forward) and against an FP64 per-expert
loop, on the CPU under the Triton interpreter; what the kernels cannot compute as Bridge does is
refused by a forced "fused_gemm", naming the linear and the setting."""

import pytest
import torch

from mcore_torch_experts import TorchGroupedLinear, TorchGroupedMLP, register_with_megatron_bridge
from mcore_torch_experts.kernels.choice import KernelChoice
from support.bridge import import_bridge_peft
from support.reference import fp64_experts, rel_err
from support.reference import make_config as _make_config

pytestmark = pytest.mark.bridge

LAYOUTS = {"shared": {}, "per_expert": dict(share_expert_adapters=False)}
SPLITS = [13, 0, 35, 8]  # a zero-token expert
HIDDEN, FFN, RANK, ALPHA = 64, 32, 8, 16.0  # 16-byte rows for Bridge's grouped path too


@pytest.fixture(scope="module")
def bridge():
    """Bridge's PEFT, imported (see bridge_support) and taught about TorchGroupedLinear."""
    import_bridge_peft()
    assert register_with_megatron_bridge()
    from megatron.bridge.peft import lora, utils

    return dict(LoRA=lora.LoRA, utils=utils)


def experts_with_bridge_lora(bridge, pg_collection, lora_kwargs, kernel="fused_gemm"):
    """TorchGroupedMLP (squared ReLU, BF16, 4 experts) under `mlp.experts`, which Bridge's expert
    rule matches, with Bridge's LoRA on linear_fc1 and linear_fc2 and random adapter weights
    (B starts at zero and would hide the term)."""
    config = _make_config(activation="squared_relu", glu=False, hidden=HIDDEN, ffn=FFN)
    config.moe_expert_kernel = kernel
    root = torch.nn.Module()
    root.mlp = torch.nn.Module()
    torch.manual_seed(0)
    root.mlp.experts = TorchGroupedMLP(config.num_moe_experts, config,
                                       pg_collection=pg_collection)
    bridge["LoRA"](target_modules=["linear_fc1", "linear_fc2"], dim=RANK, alpha=ALPHA,
                   **lora_kwargs)(root)
    experts = root.mlp.experts
    assert {type(m.to_wrap) for m in (experts.linear_fc1, experts.linear_fc2)} == {
        TorchGroupedLinear}
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in root.named_parameters():
            if "adapter" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return config, experts


def inputs(seed=2):
    generator = torch.Generator().manual_seed(seed)
    rows = sum(SPLITS)
    return (torch.randn(rows, HIDDEN, generator=generator).bfloat16(),
            torch.rand(rows, generator=generator),
            torch.randn(rows, HIDDEN, generator=generator).bfloat16())


def forward_backward(experts, x, probs, grad):
    """[output, input gradient, probs gradient, each adapter parameter's gradient]."""
    params = [p for p in experts.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    xk, pk = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    out, _ = experts(xk, torch.tensor(SPLITS), pk)
    out.backward(grad)
    return [out.detach(), xk.grad, pk.grad] + [p.grad.clone() for p in params]


def fp64_reference(config, experts, x, probs, grad):
    """FP64 loop with each expert's effective weight W_e + alpha/r * B_e @ A_e: output and input
    gradient."""
    effective = []
    for linear in (experts.linear_fc1, experts.linear_fc2):
        adapter = linear.adapter
        a = adapter.linear_in.weight.detach().double()
        b = adapter.linear_out.weight.detach().double()
        base = torch.stack(linear.to_wrap.expert_weights()).double()
        effective.append(base + adapter.alpha / adapter.dim * (b @ a))
    x64 = x.double().requires_grad_(True)
    out = fp64_experts(config, *effective, x64, SPLITS, probs)
    out.backward(grad.double())
    return out.detach(), x64.grad


def with_kernel(experts, kernel):
    experts.kernels = KernelChoice(kernel, kernel, experts.kernels.activation)


def check_bridge_adapters_run_in_the_kernels(bridge, pg, layout, monkeypatch, device):
    """One fused call with both adapter terms, Bridge's adapter forward never called; the
    output, the input and probs gradients and every adapter factor's gradient as on
    "grouped_mm" (Bridge's forward), the output and input gradient as the FP64 loop's, and the
    same bits run to run."""
    from mcore_torch_experts.kernels import fused_experts as fused_module

    config, experts = experts_with_bridge_lora(bridge, pg, LAYOUTS[layout])
    experts.to(device)
    calls, adapter_calls = [], []
    real = fused_module.fused_experts
    monkeypatch.setattr(fused_module, "fused_experts",
                        lambda *args, **kwargs: calls.append(args[6:]) or real(*args, **kwargs))
    for linear in (experts.linear_fc1, experts.linear_fc2):
        monkeypatch.setattr(linear.adapter, "forward", lambda *a, f=linear.adapter.forward, **k:
                            adapter_calls.append(1) or f(*a, **k))
    x, probs, grad = (t.to(device) for t in inputs())
    fused = forward_backward(experts, x, probs, grad)
    assert len(calls) == 1 and all(term is not None for term in calls[0]) and not adapter_calls
    assert torch.equal(forward_backward(experts, x, probs, grad)[0], fused[0])
    with_kernel(experts, "grouped_mm")
    bridges = forward_backward(experts, x, probs, grad)
    assert len(calls) == 2 and adapter_calls == [1, 1]  # Bridge's adapters ran as modules
    assert len(fused) == len(bridges) == 7
    errors = [rel_err(f, r) for f, r in zip(fused, bridges)]
    assert max(errors) < 2e-2, errors
    ref_out, ref_grad = fp64_reference(config, experts, x, probs, grad)
    assert rel_err(fused[0], ref_out) < 2e-2 and rel_err(fused[1], ref_grad) < 2e-2
    if layout == "per_expert":  # the zero-token expert's factors get no gradient
        idle = SPLITS.index(0)
        assert all(not g[idle].any() for g in fused[3:])


@pytest.mark.triton_interpreter
@pytest.mark.skipif(torch.cuda.is_available(),  # decided before a child interpreter starts
                    reason="on a CUDA host the kernels run compiled, on the GPU "
                    "(test_forced_fused_gemm_runs_bridges_adapters_on_cuda)")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forced_fused_gemm_runs_bridges_adapters_as_bridge_does(bridge, megatron_cpu, layout,
                                                                  monkeypatch):
    """Bridge's shared and per-expert LoRA in the fused kernels under the Triton interpreter:
    check_bridge_adapters_run_in_the_kernels on the CPU."""
    pytest.importorskip("triton", reason="triton is not installed: the fused kernels are untested")
    check_bridge_adapters_run_in_the_kernels(bridge, megatron_cpu, layout, monkeypatch, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forced_fused_gemm_runs_bridges_adapters_on_cuda(bridge, megatron_world, layout,
                                                         monkeypatch):
    """The same check with the kernels compiled, on the GPU."""
    check_bridge_adapters_run_in_the_kernels(bridge, megatron_world, layout, monkeypatch, "cuda")


@pytest.mark.triton_interpreter
@pytest.mark.skipif(torch.cuda.is_available(),  # decided before a child interpreter starts
                    reason="on a CUDA host the kernels run compiled, on the GPU (tests/unit/test_gpu.py)")
def test_a_disabled_bridge_adapter_adds_no_term(bridge, megatron_cpu, monkeypatch):
    """Bridge's disable_adapter_layers(): the kernels run the base alone, as Bridge's wrapper
    does, bitwise equal to the experts without the adapter."""
    pytest.importorskip("triton", reason="triton is not installed: the fused kernels are untested")
    from mcore_torch_experts.kernels import fused_experts as fused_module

    _, experts = experts_with_bridge_lora(bridge, megatron_cpu, LAYOUTS["shared"])
    x, probs, _ = inputs()
    with torch.no_grad():
        with_adapters = experts(x, torch.tensor(SPLITS), probs)[0]
        for linear in (experts.linear_fc1, experts.linear_fc2):
            linear.disable_adapter_layers()
        calls = []
        real = fused_module.fused_experts
        monkeypatch.setattr(fused_module, "fused_experts",
                            lambda *args, **kwargs: calls.append(args[6:]) or real(*args, **kwargs))
        disabled = experts(x, torch.tensor(SPLITS), probs)[0]
        experts.linear_fc1 = experts.linear_fc1.to_wrap
        experts.linear_fc2 = experts.linear_fc2.to_wrap
        plain = experts(x, torch.tensor(SPLITS), probs)[0]
    assert calls[0] == (None, None)
    assert torch.equal(disabled, plain) and not torch.equal(disabled, with_adapters)


def _dropout(bridge, pg):
    return experts_with_bridge_lora(bridge, pg, dict(dropout=0.1))[1], "has dropout 0.1"


def _shared_outer(bridge, pg):
    return (experts_with_bridge_lora(bridge, pg, dict(experts_shared_outer_loras=True))[1],
            "SharedOuterGroupedExpertAdapter")


def _fp32_adapters(bridge, pg):
    experts = experts_with_bridge_lora(bridge, pg, LAYOUTS["per_expert"])[1]
    experts.linear_fc1.adapter.float()
    return experts, "adapter weights are torch.float32/torch.float32 and the input torch.bfloat16"


def _hooked(bridge, pg):
    experts = experts_with_bridge_lora(bridge, pg, LAYOUTS["shared"])[1]
    experts.linear_fc1.adapter.linear_in.register_forward_hook(lambda *args: None)
    return experts, "adapter's linear_in carry hooks"


def _hooked_disabled(bridge, pg):
    """Bridge's wrapper with its adapter disabled still runs the wrapper's own hooks."""
    experts = experts_with_bridge_lora(bridge, pg, LAYOUTS["shared"])[1]
    experts.linear_fc1.disable_adapter_layers()
    experts.linear_fc1.register_forward_hook(lambda *args: None)
    return experts, "Bridge's LoRALinear carry hooks"


UNFUSABLE = {"dropout": _dropout, "shared_outer": _shared_outer, "fp32_adapters": _fp32_adapters,
             "hooked": _hooked, "hooked_disabled": _hooked_disabled}


@pytest.mark.parametrize("case", list(UNFUSABLE))
def test_forced_fused_gemm_refuses_bridge_adapters_it_cannot_compute(bridge, megatron_cpu, case):
    """Dropout, the shared-outer layout (mixed factors), adapters in another dtype, hooks on
    the adapter's linears or on the wrapper of a disabled adapter: a forced "fused_gemm"
    refuses, naming linear_fc1 and the setting, on the CPU too (the adapter check comes before
    the device check)."""
    pytest.importorskip("triton")
    experts, reason = UNFUSABLE[case](bridge, megatron_cpu)
    x, probs, _ = inputs()
    with pytest.raises(RuntimeError, match=f"carry adapters or hooks.*linear_fc1's.*{reason}"):
        experts(x, torch.tensor(SPLITS), probs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bridges_adapters_pass_the_adapter_check(bridge, megatron_cpu, layout):
    """Bridge's shared and per-expert LoRA on both linears pass the adapter check: on the CPU
    without the interpreter the forced call reaches the device check."""
    pytest.importorskip("triton")
    from mcore_torch_experts.kernels import TRITON_INTERPRETER

    if TRITON_INTERPRETER:
        pytest.skip("under the interpreter the kernels run on the CPU")
    experts = experts_with_bridge_lora(bridge, megatron_cpu, LAYOUTS[layout])[1]
    x, probs, _ = inputs()
    with pytest.raises(RuntimeError, match="runs Triton kernels on CUDA tensors"):
        experts(x, torch.tensor(SPLITS), probs)


@pytest.mark.triton_interpreter
@pytest.mark.skipif(torch.cuda.is_available(),  # decided before a child interpreter starts
                    reason="on a CUDA host the kernels run compiled (tests/unit/test_te_parity.py)")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_gpt_trains_bridges_adapters_in_the_fused_kernels_as_on_grouped_mm(bridge, megatron_cpu,
                                                                             layout):
    """A whole BF16 GPT (dense, MoE, MoE; 4 SwiGLU experts) with Bridge's LoRA on attention and
    experts: "fused_gemm" against "grouped_mm", the routes of the grouped_mm arm replayed in the
    fused arm (support/routing_replay.py; at these seeds the last MoE layer has a near-tied
    choice that the arms' rounding flips): the loss and every adapter's gradient agree."""
    from megatron.core.models.gpt import GPTModel

    from mcore_torch_experts.specs import get_gpt_decoder_block_spec
    from support.routing_replay import forget_routers, recorded_routes, replayed_routes
    from support.tiny_gpt import SEQ, VOCAB, batch, tiny_config

    inputs, positions, mask, labels = batch()
    results, adapters, routes = {}, None, None
    try:
        for kernel in ("grouped_mm", "fused_gemm"):
            config = tiny_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True,
                                 moe_expert_kernel=kernel, moe_enable_routing_replay=True)
            torch.manual_seed(0)
            model = GPTModel(config=config, vocab_size=VOCAB, max_sequence_length=SEQ,
                             transformer_layer_spec=get_gpt_decoder_block_spec(
                                 config, use_transformer_engine=False)).bfloat16()
            model = bridge["LoRA"](target_modules=["linear_qkv", "linear_proj", "linear_fc1",
                                                   "linear_fc2"], dim=8, alpha=16,
                                   **LAYOUTS[layout])(model, training=True)
            trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
            generator = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for name, p in trainable.items():
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.05 if adapters is None
                            else adapters[name])
            adapters = {n: p.detach().clone() for n, p in trainable.items()}
            routing = (recorded_routes(model) if routes is None
                       else replayed_routes(model, routes))
            with routing as recorded:
                loss = model(inputs, positions, mask, labels=labels).float().mean()
                loss.backward()
            routes = routes or recorded
            ran = {m.last_expert_kernel for m in model.modules() if isinstance(m, TorchGroupedMLP)}
            assert ran == {kernel}, ran
            results[kernel] = loss.item(), {n: p.grad for n, p in trainable.items()}
    finally:
        forget_routers()
    (loss, grads), (fused_loss, fused_grads) = results["grouped_mm"], results["fused_gemm"]
    assert fused_loss == pytest.approx(loss, rel=1e-3)
    assert any(".experts.linear_fc1.adapter" in name for name in grads)
    errors = {name: rel_err(fused_grads[name], grad) for name, grad in grads.items()}
    assert max(errors.values()) < 5e-2, sorted(errors.items(), key=lambda kv: -kv[1])[:4]
