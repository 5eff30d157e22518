"""The fused expert GEMM kernels against the FP64 loop (on the CPU under the Triton interpreter: the
`triton_interpreter` marker, tests/triton_interpreter.py), and how TorchGroupedMLP chooses and
refuses them."""

import os

import pytest
import torch

from mcore_torch_experts import TorchGroupedMLP
from mcore_torch_experts.kernel_choice import choose_expert_kernel
from mcore_torch_experts.lora import LoRALinear, PerExpertLoRAAdapter
from reference import fp64_experts, rel_err
from reference import make_config as _make_config


def make_config(moe_expert_kernel=None, **kw):
    """A tiny config; `moe_expert_kernel` set as TorchExpertsTransformerConfig would hold it."""
    config = _make_config(**kw)
    if moe_expert_kernel is not None:
        config.moe_expert_kernel = moe_expert_kernel
    return config


def check_clamp_backward(config, x, probs, w1, w2, offs, splits, grad):
    """The interpreter truncates fc1's output to bf16, so which values pass the clamp's bound
    differs from a rounded reference: the backward kernel against FP64 autograd from the h the
    forward kernel saved."""
    from mcore_torch_experts.activation_triton import SILU
    from mcore_torch_experts.fused_experts_triton import fc1_activation, fc2_dgrad_activation

    clamp, offset = config.activation_func_clamp_value, config.glu_linear_offset
    _, h = fc1_activation(x, w1, offs, probs, SILU, True, offset, clamp, save_h=True)
    dh, dprobs = fc2_dgrad_activation(grad, w2, offs, probs, h, SILU, True, offset, clamp, True)
    h64 = h.double().requires_grad_(True)
    p64 = probs.double().requires_grad_(True)
    gate, up = h64.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate.clamp(max=clamp)) * (up.clamp(-clamp, clamp) + offset)
    ends = offs.tolist()
    grad_act = torch.cat([grad[e - n:e].double() @ w2[i].double()
                          for i, (n, e) in enumerate(zip(splits, ends))])
    (act * p64[:, None] * grad_act).sum().backward()
    assert rel_err(dh, h64.grad) < 2e-2 and rel_err(dprobs, p64.grad) < 2e-2


@pytest.mark.triton_interpreter
def test_fused_experts_match_fp64_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed: the fused kernels are untested")
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no CPU grouped_mm for fc2 and fc1's input gradient")
    if torch.cuda.is_available():
        pytest.skip("on a CUDA host the kernels run compiled, on the GPU (tests/test_gpu.py)")
    from mcore_torch_experts.fused_experts_triton import covers, fused_experts
    from mcore_torch_experts.grouped_gemm import find_grouped_mm

    torch.manual_seed(0)
    E, H, F = 5, 40, 24  # K = 40 is not a multiple of the block: the masked K loop runs
    cases = [dict(activation="squared_relu", glu=False), dict(activation="silu", glu=True),
             dict(activation="silu", glu=False),
             dict(activation="silu", glu=True, glu_linear_offset=1.0,
                  activation_func_clamp_value=0.5)]
    gmm = find_grouped_mm().fn
    for case in cases:
        config = _make_config(num_experts=E, hidden=H, ffn=F, **case)
        clamped = config.activation_func_clamp_value is not None
        assert covers(config)
        for splits in ([0, 37, 0, 130, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 3]):
            rows = sum(splits)
            offs = torch.tensor(splits).cumsum(0).int()
            w1 = (torch.randn(E, F * (2 if config.gated_linear_unit else 1), H) * 0.2).bfloat16()
            w2 = (torch.randn(E, H, F) * 0.2).bfloat16()
            x = torch.randn(rows, H).bfloat16().requires_grad_(True)
            probs = torch.rand(rows).requires_grad_(True)
            out = fused_experts(config, x, probs, w1, w2, offs, gmm)
            grad = torch.randn(rows, H).bfloat16()
            out.backward(grad)
            with torch.no_grad():  # the inference path writes no fc1 output
                out_nograd = fused_experts(config, x, probs, w1, w2, offs, gmm)
            assert torch.equal(out_nograd, out)
            assert out.shape == (rows, H) and x.grad.shape == (rows, H)
            if rows == 0:
                continue
            x64 = x.detach().double().requires_grad_(True)
            p64 = probs.detach().double().requires_grad_(True)
            ref = fp64_experts(config, w1, w2, x64, splits, p64, clamp_on_bf16=True)
            ref.backward(grad.double())
            # the interpreter truncates to bf16 where the GPU rounds: 2e-2, not 1e-2
            checked = ((out, ref),) if clamped else ((out, ref), (x.grad, x64.grad),
                                                      (probs.grad, p64.grad))
            for got, want in checked:
                assert rel_err(got, want) < 2e-2, (case, splits, rel_err(got, want))
            if clamped:
                check_clamp_backward(config, x.detach(), probs.detach(), w1, w2, offs, splits,
                                     grad)
    assert not covers(_make_config(activation="gelu", glu=False))
    assert not covers(_make_config(activation="silu", glu=False, moe_apply_probs_on_input=True,
                                   moe_router_topk=1, moe_router_pre_softmax=True))


def test_kernel_setting_is_checked():
    from mcore_torch_experts import TorchExpertsConfigError, TorchExpertsTransformerConfig

    with pytest.raises(TorchExpertsConfigError, match="moe_expert_kernel='nope' is not a kernel"):
        TorchExpertsTransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                      moe_expert_kernel="nope")
    with pytest.raises(TorchExpertsConfigError, match="moe_expert_kernel='nope' is not a kernel"):
        choose_expert_kernel(make_config(moe_expert_kernel="nope"))
    with pytest.raises(ValueError, match="moe_expert_kernel='fused_gemm' cannot run"):
        choose_expert_kernel(make_config(activation="gelu", glu=False,
                                         moe_expert_kernel="fused_gemm"))
    assert choose_expert_kernel(make_config(moe_expert_kernel="grouped_mm")) == "grouped_mm"
    assert choose_expert_kernel(make_config(activation="gelu", glu=False)) == "grouped_mm"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the interpreter runs the kernels on the CPU")
def test_forced_fused_gemm_refuses_cpu_tensors(megatron_cpu):
    pytest.importorskip("triton")
    config = make_config(moe_expert_kernel="fused_gemm")
    experts = TorchGroupedMLP(config.num_moe_experts, config, pg_collection=megatron_cpu)
    assert experts.expert_kernel_impl == "fused_gemm"
    x = torch.randn(8, config.hidden_size).bfloat16()
    with pytest.raises(RuntimeError, match="runs Triton kernels on CUDA tensors"):
        experts(x, [2, 2, 2, 2], torch.rand(8))


def _recorder(module, calls):
    """A hook that notes calls for `module` only (global hooks see every module)."""
    return lambda hooked, *args: calls.append(hooked) if hooked is module else None


_GLOBAL = torch.nn.modules.module
HOOKS = {
    "forward": lambda m, calls: m.register_forward_hook(_recorder(m, calls)),
    "forward_pre": lambda m, calls: m.register_forward_pre_hook(_recorder(m, calls)),
    "full_backward": lambda m, calls: m.register_full_backward_hook(_recorder(m, calls)),
    "backward_pre": lambda m, calls: m.register_full_backward_pre_hook(_recorder(m, calls)),
    "global_forward": lambda m, calls: _GLOBAL.register_module_forward_hook(_recorder(m, calls)),
    "global_full_backward": lambda m, calls: _GLOBAL.register_module_full_backward_hook(
        _recorder(m, calls)),
}


@pytest.mark.parametrize("hook", list(HOOKS))
def test_forced_fused_gemm_refuses_linears_with_hooks(megatron_cpu, hook):
    """The fused path calls the packed weights directly and would skip linear_fc1's hooks (its
    own, forward or backward, or global module hooks): a forced "fused_gemm" refuses."""
    pytest.importorskip("triton")
    config = make_config(activation="squared_relu", glu=False, moe_expert_kernel="fused_gemm")
    experts = TorchGroupedMLP(config.num_moe_experts, config, pg_collection=megatron_cpu)
    experts.requires_grad_(False)
    handle = HOOKS[hook](experts.linear_fc1, [])
    x = torch.randn(8, config.hidden_size).bfloat16().requires_grad_(True)
    try:
        with pytest.raises(RuntimeError, match="carry adapters or hooks"):
            experts(x, [2, 2, 2, 2], torch.rand(8))
    finally:
        handle.remove()


@pytest.mark.parametrize("linear", ["linear_fc1", "linear_fc2"])
def test_forced_fused_gemm_refuses_linears_with_adapters(megatron_cpu, linear):
    """The fused path would skip a LoRA adapter on either expert linear: a forced "fused_gemm"
    refuses, on the CPU too (the adapter check comes before the device check)."""
    pytest.importorskip("triton")
    config = make_config(activation="squared_relu", glu=False, moe_expert_kernel="fused_gemm")
    experts = TorchGroupedMLP(config.num_moe_experts, config, pg_collection=megatron_cpu)
    experts.requires_grad_(False)
    base = getattr(experts, linear)
    adapter = PerExpertLoRAAdapter(config.num_moe_experts, base.in_features, base.out_features,
                                   8, 16.0, 0.0, torch.bfloat16, "cpu")
    setattr(experts, linear, LoRALinear(base, adapter))
    x = torch.randn(8, config.hidden_size).bfloat16()
    with pytest.raises(RuntimeError, match="carry adapters or hooks"):
        experts(x, [2, 2, 2, 2], torch.rand(8))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused kernels run on CUDA"))])
@pytest.mark.parametrize("hook", list(HOOKS))
def test_auto_calls_every_hook_of_the_linears(megatron_cpu, hook, device):
    """Under "auto" (fused_gemm on sm90 for squared ReLU, grouped_mm on the CPU) a linear with
    hooks takes grouped_mm, where the hooks run."""
    config = make_config(activation="squared_relu", glu=False, moe_expert_kernel="auto")
    experts = TorchGroupedMLP(config.num_moe_experts, config, pg_collection=megatron_cpu)
    experts.to(device).requires_grad_(False)
    calls = []
    handle = HOOKS[hook](experts.linear_fc1, calls)
    x = torch.randn(8, config.hidden_size, device=device).bfloat16().requires_grad_(True)
    try:
        out, _ = experts(x, [2, 2, 2, 2], torch.rand(8, device=device))
        out.float().sum().backward()
    finally:
        handle.remove()
    assert calls and x.grad is not None
