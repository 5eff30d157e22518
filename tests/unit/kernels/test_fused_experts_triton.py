"""The fused expert GEMM kernels against the FP64 loop (on the CPU under the Triton interpreter: the
`triton_interpreter` marker, tests/support/triton_interpreter.py), and how TorchGroupedMLP chooses and
refuses them."""

import os

import pytest
import torch

from mcore_torch_experts import TorchGroupedMLP
from mcore_torch_experts.kernels.choice import (
    ExpertKernel,
    KernelChoice,
    fused_gemm_not_covered,
    resolve_kernels,
)
from mcore_torch_experts.lora import LoRAAdapter, LoRALinear, PerExpertLoRAAdapter
from support.reference import fp64_experts, rel_err
from support.reference import make_config as _make_config


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
    from mcore_torch_experts.kernels.choice import KERNEL_ACTIVATIONS
    from mcore_torch_experts.kernels.fused_experts_triton import (
        fc1_activation,
        fc2_dgrad_activation,
    )

    SILU = KERNEL_ACTIVATIONS[torch.nn.functional.silu]

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


@pytest.mark.once_per_venv
@pytest.mark.triton_interpreter
@pytest.mark.skipif(torch.cuda.is_available(),  # decided before a child interpreter starts
                    reason="on a CUDA host the kernels run compiled, on the GPU (tests/unit/test_gpu.py)")
def test_fused_experts_match_fp64_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed: the fused kernels are untested")
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no CPU grouped_mm for fc2 and fc1's input gradient")
    from mcore_torch_experts.kernels.fused_experts import fused_experts

    torch.manual_seed(0)
    E, H, F = 5, 40, 24  # K = 40 is not a multiple of the block: the masked K loop runs
    cases = [dict(activation="squared_relu", glu=False), dict(activation="silu", glu=True),
             dict(activation="silu", glu=False),
             dict(activation="silu", glu=True, glu_linear_offset=1.0,
                  activation_func_clamp_value=0.5)]
    for case in cases:
        config = _make_config(num_experts=E, hidden=H, ffn=F, **case)
        clamped = config.activation_func_clamp_value is not None
        assert fused_gemm_not_covered(config) is None
        for splits in ([0, 37, 0, 130, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 3]):
            rows = sum(splits)
            offs = torch.tensor(splits).cumsum(0).int()
            w1 = (torch.randn(E, F * (2 if config.gated_linear_unit else 1), H) * 0.2).bfloat16()
            w2 = (torch.randn(E, H, F) * 0.2).bfloat16()
            x = torch.randn(rows, H).bfloat16().requires_grad_(True)
            probs = torch.rand(rows).requires_grad_(True)
            out = fused_experts(config, x, probs, w1, w2, offs)
            grad = torch.randn(rows, H).bfloat16()
            out.backward(grad)
            with torch.no_grad():  # the inference path writes no fc1 output
                out_nograd = fused_experts(config, x, probs, w1, w2, offs)
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
    assert fused_gemm_not_covered(_make_config(activation="gelu", glu=False))
    assert fused_gemm_not_covered(_make_config(activation="silu", glu=False, moe_apply_probs_on_input=True,
                                   moe_router_topk=1, moe_router_pre_softmax=True))


def test_kernel_setting_is_checked():
    from mcore_torch_experts import TorchExpertsConfigError, TorchExpertsTransformerConfig

    with pytest.raises(TorchExpertsConfigError, match="moe_expert_kernel='nope' is not a kernel"):
        TorchExpertsTransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                      moe_expert_kernel="nope")
    with pytest.raises(TorchExpertsConfigError, match="moe_expert_kernel='nope' is not a kernel"):
        resolve_kernels(make_config(moe_expert_kernel="nope"))
    with pytest.raises(ValueError, match="moe_expert_kernel='fused_gemm' cannot run"):
        resolve_kernels(make_config(activation="gelu", glu=False, moe_expert_kernel="fused_gemm"))
    forced = resolve_kernels(make_config(moe_expert_kernel="grouped_mm"))
    assert (forced.setting, forced.expert_kernel) == ("grouped_mm", "grouped_mm")
    uncovered = resolve_kernels(make_config(activation="gelu", glu=False))
    assert (uncovered.setting, uncovered.expert_kernel) == (ExpertKernel.AUTO, "grouped_mm")
    assert uncovered.activation == "eager"  # neither Triton kernel computes GELU


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the interpreter runs the kernels on the CPU")
def test_forced_fused_gemm_refuses_cpu_tensors(megatron_cpu):
    pytest.importorskip("triton")
    config = make_config(moe_expert_kernel="fused_gemm")
    experts = TorchGroupedMLP(config.num_moe_experts, config, pg_collection=megatron_cpu)
    assert experts.kernels.expert_kernel == ExpertKernel.FUSED_GEMM
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


def _adapter(kind, base, rank=8, dropout=0.0):
    if kind == "shared":
        return LoRAAdapter(base.in_features, base.out_features, rank, 16.0, dropout,
                           torch.bfloat16, "cpu")
    return PerExpertLoRAAdapter(base.num_experts, base.in_features, base.out_features, rank, 16.0,
                                dropout, torch.bfloat16, "cpu")


class OtherWrapper(LoRALinear):
    """An adapter wrapper that is not ours (Bridge's AdapterWrapper, a subclass): its forward
    may do anything."""


class NotLoRA(torch.nn.Module):
    def forward(self, x, *args):
        return torch.zeros(x.shape[0], 1)


def _wrap_other(experts, linear):
    base = getattr(experts, linear)
    setattr(experts, linear, OtherWrapper(base, _adapter("per_expert", base)))


def _dropout_adapter(experts, linear):
    base = getattr(experts, linear)
    setattr(experts, linear, LoRALinear(base, _adapter("shared", base, dropout=0.1)))


def _foreign_adapter(experts, linear):
    setattr(experts, linear, LoRALinear(getattr(experts, linear), NotLoRA()))


def _hooked_adapter(experts, linear):
    base = getattr(experts, linear)
    wrapper = LoRALinear(base, _adapter("per_expert", base))
    wrapper.adapter.linear_in.register_forward_hook(lambda *args: None)
    setattr(experts, linear, wrapper)


UNFUSABLE = {"other_wrapper": (_wrap_other, "is a OtherWrapper"),
             "dropout": (_dropout_adapter, "has dropout 0.1"),
             "not_lora": (_foreign_adapter, "adapter is a NotLoRA"),
             "hooked_adapter": (_hooked_adapter, "linear_in carry hooks")}


@pytest.mark.parametrize("linear", ["linear_fc1", "linear_fc2"])
@pytest.mark.parametrize("kind", list(UNFUSABLE))
def test_forced_fused_gemm_refuses_adapters_it_cannot_compute(megatron_cpu, linear, kind):
    """Adapters the kernels do not compute (another wrapper, dropout, another adapter module,
    hooks on the adapter): a forced "fused_gemm" refuses, naming the linear and the reason, on
    the CPU too (the adapter check comes before the device check)."""
    pytest.importorskip("triton")
    config = make_config(activation="squared_relu", glu=False, moe_expert_kernel="fused_gemm")
    experts = TorchGroupedMLP(config.num_moe_experts, config, pg_collection=megatron_cpu)
    experts.requires_grad_(False)
    wrap, reason = UNFUSABLE[kind]
    wrap(experts, linear)
    x = torch.randn(8, config.hidden_size).bfloat16()
    with pytest.raises(RuntimeError, match=f"carry adapters or hooks.*{linear}.*{reason}"):
        experts(x, [2, 2, 2, 2], torch.rand(8))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the interpreter runs the kernels on the CPU")
@pytest.mark.parametrize("kind", ["shared", "per_expert"])
def test_forced_fused_gemm_takes_our_adapters(megatron_cpu, kind):
    """Our LoRA adapters on both linears pass the adapter check: on the CPU (no interpreter) the
    call reaches the device check, and the choice of the kernel is the config's alone."""
    pytest.importorskip("triton")
    config = make_config(activation="squared_relu", glu=False, moe_expert_kernel="fused_gemm")
    experts = TorchGroupedMLP(config.num_moe_experts, config, pg_collection=megatron_cpu)
    experts.requires_grad_(False)
    for linear in ("linear_fc1", "linear_fc2"):
        base = getattr(experts, linear)
        setattr(experts, linear, LoRALinear(base, _adapter(kind, base)))
    with pytest.raises(RuntimeError, match="runs Triton kernels on CUDA tensors"):
        experts(torch.randn(8, config.hidden_size).bfloat16(), [2, 2, 2, 2], torch.rand(8))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused kernels run on CUDA")])])
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
    assert experts.last_expert_kernel == ExpertKernel.GROUPED_MM


def test_auto_says_once_per_reason_when_a_call_leaves_the_fused_kernels(megatron_cpu, caplog,
                                                                       monkeypatch):
    """Where "auto" picked the fused kernels (on sm90; set here as the chooser would) and a call
    cannot take them, the call runs grouped_mm and a warning names why, once per reason;
    `last_expert_kernel` says which path each call took."""
    from mcore_torch_experts import experts as experts_module

    monkeypatch.setattr(experts_module, "_LOGGED_AUTO_FALLBACKS", set())
    config = make_config(activation="squared_relu", glu=False, moe_expert_kernel="auto")
    experts = TorchGroupedMLP(config.num_moe_experts, config, pg_collection=megatron_cpu)
    experts.requires_grad_(False)
    experts.kernels = KernelChoice("auto", "fused_gemm", experts.kernels.activation)
    assert experts.last_expert_kernel is None
    x = torch.randn(8, config.hidden_size).bfloat16()
    handle = HOOKS["forward"](experts.linear_fc1, [])
    try:
        with caplog.at_level("WARNING", logger="mcore_torch_experts"):
            for _ in range(3):
                experts(x, [2, 2, 2, 2], torch.rand(8))
    finally:
        handle.remove()
    said = [r.getMessage() for r in caplog.records if "moe_expert_kernel='auto'" in r.getMessage()]
    assert said == ["mcore_torch_experts: moe_expert_kernel='auto' runs grouped_mm, not the fused "
                    "GEMM kernels it picked for this config, in calls where linear_fc1 carries "
                    "hooks that it would skip"], said
    assert experts.last_expert_kernel == ExpertKernel.GROUPED_MM


def _fused_experts_with_lora(pg_collection, kind):
    """Frozen squared-ReLU experts (4 x 40 -> 24) forced onto "fused_gemm", our rank-8 LoRA
    (`kind`) on both linears, B made non-zero (it starts at zero and would hide the term); skips
    where triton or the CPU grouped_mm is missing."""
    pytest.importorskip("triton", reason="triton is not installed: the fused kernels are untested")
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no CPU grouped_mm for fc2 and fc1's input gradient")
    from mcore_torch_experts.lora import lora_parameters

    config = make_config(activation="squared_relu", glu=False, num_experts=4, hidden=40, ffn=24,
                         moe_expert_kernel="fused_gemm")
    experts = TorchGroupedMLP(config.num_moe_experts, config, pg_collection=pg_collection)
    experts.requires_grad_(False)
    for linear in ("linear_fc1", "linear_fc2"):
        base = getattr(experts, linear)
        setattr(experts, linear, LoRALinear(base, _adapter(kind, base, rank=8)))
    with torch.no_grad():
        for p in lora_parameters(experts).values():
            p.normal_(std=0.3)
    return experts


@pytest.mark.triton_interpreter
@pytest.mark.skipif(torch.cuda.is_available(),  # decided before a child interpreter starts
                    reason="on a CUDA host the kernels run compiled, on the GPU (tests/unit/test_gpu.py)")
@pytest.mark.parametrize("kind", ["shared", "per_expert"])
def test_the_fused_path_names_its_work_for_a_profiler(megatron_cpu, kind, monkeypatch):
    """While a torch profiler runs, the fused path opens the ranges of enums.ProfileRange around
    its expert GEMMs and its adapters' GEMMs, in the forward and inside the backward's autograd
    nodes; the results are the same bits as without a profiler, and without one no range is
    opened."""
    from torch.profiler import ProfilerActivity, profile

    from mcore_torch_experts.enums import ProfileRange

    torch.manual_seed(5)
    experts = _fused_experts_with_lora(megatron_cpu, kind)
    splits = [13, 0, 21, 6]
    x = torch.randn(sum(splits), 40).bfloat16()
    probs = torch.rand(sum(splits))
    grad = torch.randn(sum(splits), 40).bfloat16()
    opened = []
    real_record = torch.profiler.record_function
    monkeypatch.setattr(torch.profiler, "record_function",
                        lambda name, *a: opened.append(name) or real_record(name, *a))
    plain = _forward_backward(experts, x, splits, probs, grad)
    assert not opened and experts.last_expert_kernel == ExpertKernel.FUSED_GEMM
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = _forward_backward(experts, x, splits, probs, grad)
    assert len(plain) == len(profiled) == 7
    assert all(torch.equal(a, b) for a, b in zip(plain, profiled))
    events = [e for e in prof.events() if e.name in set(ProfileRange)]

    def in_backward(event):
        while (event := event.cpu_parent) is not None:
            if event.name.startswith("autograd::engine::evaluate_function"):
                return True
        return False

    seen = {(e.name, in_backward(e)) for e in events}
    assert seen == {(r.value, b) for r in ProfileRange for b in (False, True)}, seen


# --- LoRA adapters in the fused kernels --------------------------------------------------------

def _lora_factors(kind, num_experts, in_features, out_features, rank, gen):
    """Random A [r, in], B [out, r] (or per expert [E, ...]), bf16 leaves that train; B non-zero
    (a fresh adapter's B is zero and would hide its term)."""
    lead = (num_experts,) if kind == "per_expert" else ()
    a = (torch.randn(*lead, rank, in_features, generator=gen) * 0.3).bfloat16()
    b = (torch.randn(*lead, out_features, rank, generator=gen) * 0.3).bfloat16()
    return a.requires_grad_(True), b.requires_grad_(True)


def _fp64_effective(weight, a, b, scale):
    """weight [E, out, in] + scale * B @ A (per expert, or one B @ A for all): the base plus the
    adapter term as one FP64 weight per expert, differentiable in A and B."""
    return weight.double() + scale * (b @ a)


# (activation case, expert adapter, rank, adapters on fc1 / fc2): masked rank loops (rank 4, and
# 72: three 32-wide steps, the last masked), per-expert ranks that are multiples of 8.
LORA_CASES = [
    (dict(activation="squared_relu", glu=False), "shared", 4, (True, True)),
    (dict(activation="squared_relu", glu=False), "per_expert", 8, (True, True)),
    (dict(activation="silu", glu=True), "shared", 72, (True, True)),
    (dict(activation="silu", glu=True), "per_expert", 16, (True, False)),
    (dict(activation="silu", glu=False), "per_expert", 8, (False, True)),
]


@pytest.mark.once_per_venv
@pytest.mark.triton_interpreter
@pytest.mark.skipif(torch.cuda.is_available(),  # decided before a child interpreter starts
                    reason="on a CUDA host the kernels run compiled, on the GPU (tests/unit/test_gpu.py)")
def test_fused_experts_with_lora_match_fp64_in_the_interpreter():
    """fused_experts with LoRA terms on fc1 and/or fc2 against the FP64 per-expert loop with
    weight + scale * B @ A: output, input gradient, probs gradient and every adapter factor's
    gradient; random splits with zero-token experts (their per-expert factors get exactly zero
    gradient) and an empty batch; the no-grad pass gives the grad pass's output bit for bit, and
    a second run repeats the first bit for bit."""
    pytest.importorskip("triton", reason="triton is not installed: the fused kernels are untested")
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no CPU grouped_mm for fc2 and fc1's input gradient")
    from mcore_torch_experts.kernels.fused_experts import LoRATerm, fused_experts

    gen = torch.Generator().manual_seed(7)
    E, H, F = 4, 40, 24
    for case, kind, rank, (on_fc1, on_fc2) in LORA_CASES:
        config = _make_config(num_experts=E, hidden=H, ffn=F, **case)
        width = F * (2 if config.gated_linear_unit else 1)
        counts = torch.randint(1, 60, (E,), generator=gen)
        counts[int(torch.randint(0, E, (1,), generator=gen))] = 0  # a zero-token expert
        for splits in (counts.tolist(), [0] * E):
            rows = sum(splits)
            offs = torch.tensor(splits).cumsum(0).int()
            w1 = (torch.randn(E, width, H, generator=gen) * 0.2).bfloat16()
            w2 = (torch.randn(E, H, F, generator=gen) * 0.2).bfloat16()
            a1, b1 = _lora_factors(kind, E, H, width, rank, gen)
            a2, b2 = _lora_factors(kind, E, F, H, rank, gen)
            scale = 16.0 / rank
            terms = (LoRATerm(a1, b1, scale) if on_fc1 else None,
                     LoRATerm(a2, b2, scale) if on_fc2 else None)
            x = torch.randn(rows, H, generator=gen).bfloat16().requires_grad_(True)
            probs = torch.rand(rows, generator=gen).requires_grad_(True)
            grad = torch.randn(rows, H, generator=gen).bfloat16()
            leaves = (x, probs, a1, b1, a2, b2)

            def run():
                for leaf in leaves:
                    leaf.grad = None
                out = fused_experts(config, x, probs, w1, w2, offs, *terms)
                out.backward(grad)
                return [out.detach()] + [None if leaf.grad is None else leaf.grad.clone()
                                         for leaf in leaves]

            first, second = run(), run()
            assert all(f is s is None or torch.equal(f, s) for f, s in zip(first, second))
            with torch.no_grad():  # the logprob pass: the same kernels, no fc1 output saved
                assert torch.equal(fused_experts(config, x, probs, w1, w2, offs, *terms),
                                   first[0])
            out, *grads = first
            assert out.shape == (rows, H) and grads[0].shape == (rows, H)
            for on, factors in ((on_fc1, (2, 3)), (on_fc2, (4, 5))):
                for i in factors:
                    assert (grads[i] is not None) == on, (case, kind, i)
            if rows == 0:
                assert all(g is None or not g.any() for g in grads[2:])
                continue
            ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
            x64, p64, a1_64, b1_64, a2_64, b2_64 = ref_leaves
            fc1 = _fp64_effective(w1, a1_64, b1_64, scale) if on_fc1 else w1
            fc2 = _fp64_effective(w2, a2_64, b2_64, scale) if on_fc2 else w2
            ref = fp64_experts(config, fc1, fc2, x64, splits, p64)
            ref.backward(grad.double())
            errors = {name: rel_err(got, want.grad if want is not ref else want)
                      for name, got, want in zip(("out", "x", "probs", "a1", "b1", "a2", "b2"),
                                                 [out, *grads], [ref, *ref_leaves])
                      if got is not None}
            # the interpreter truncates to bf16 where the GPU rounds: 2e-2, not 1e-2
            assert max(errors.values()) < 2e-2, (case, kind, splits, errors)
            if kind == "per_expert":
                idle = splits.index(0)
                for g in grads[2:]:
                    assert g is None or not g[idle].any(), (case, splits)


def _forward_backward(experts, x, splits, probs, grad):
    params = [p for p in experts.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    xk, pk = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    out, _ = experts(xk, splits, pk)
    out.backward(grad)
    return [out.detach(), xk.grad, pk.grad] + [p.grad.clone() for p in params]


@pytest.mark.triton_interpreter
@pytest.mark.skipif(torch.cuda.is_available(),  # decided before a child interpreter starts
                    reason="on a CUDA host the kernels run compiled, on the GPU (tests/unit/test_gpu.py)")
@pytest.mark.parametrize("kind", ["shared", "per_expert"])
def test_torch_grouped_mlp_fused_gemm_with_adapters_matches_grouped_mm(megatron_cpu, kind,
                                                                        monkeypatch):
    """TorchGroupedMLP with our LoRA adapters on linear_fc1 and linear_fc2 (apply_lora's
    wrappers, B made non-zero), forced onto "fused_gemm", against the same module on
    "grouped_mm" (the adapters called as modules): output, input and probs gradients, every
    adapter factor's gradient; the fused call runs the kernels (never the adapters' forward)."""
    from mcore_torch_experts.kernels import choice
    from mcore_torch_experts.kernels import fused_experts as fused_module
    from mcore_torch_experts.lora import lora_parameters

    torch.manual_seed(3)
    experts = _fused_experts_with_lora(megatron_cpu, kind)
    splits = [13, 0, 41, 6]
    rows = sum(splits)
    x = torch.randn(rows, 40).bfloat16()
    probs = torch.rand(rows)
    grad = torch.randn(rows, 40).bfloat16()
    calls = []
    real = fused_module.fused_experts
    monkeypatch.setattr(fused_module, "fused_experts",
                        lambda *args, **kwargs: calls.append(args[6:]) or real(*args, **kwargs))
    adapter_calls = []
    for linear in (experts.linear_fc1, experts.linear_fc2):
        monkeypatch.setattr(linear.adapter, "forward", lambda *a, f=linear.adapter.forward:
                            adapter_calls.append(1) or f(*a))
    reads = []  # each linear is read once per call: the plan's views feed the kernels
    real_read = choice.read_fused_adapter
    monkeypatch.setattr(choice, "read_fused_adapter",
                        lambda linear, *a: reads.append(linear) or real_read(linear, *a))
    fused = _forward_backward(experts, x, splits, probs, grad)
    assert len(calls) == 1 and all(t is not None for t in calls[0]) and not adapter_calls
    assert reads == [experts.linear_fc1, experts.linear_fc2], reads
    assert torch.equal(_forward_backward(experts, x, splits, probs, grad)[0], fused[0])
    experts.kernels = KernelChoice("grouped_mm", "grouped_mm", experts.kernels.activation)
    reference = _forward_backward(experts, x, splits, probs, grad)
    assert len(calls) == 2 and adapter_calls  # the grouped_mm path calls the adapters
    assert len(fused) == len(reference) == 7
    errors = [rel_err(f, r) for f, r in zip(fused, reference)]
    assert max(errors) < 2e-2, errors
    # Frozen adapters (a reference model, say): the same kernels, the input gradient unchanged.
    experts.kernels = KernelChoice("fused_gemm", "fused_gemm", experts.kernels.activation)
    for p in lora_parameters(experts).values():
        p.requires_grad_(False)
    frozen = _forward_backward(experts, x, splits, probs, grad)
    assert len(frozen) == 3 and len(calls) == 3
    assert all(torch.equal(a, b) for a, b in zip(frozen, fused[:3]))


# --- Megatron's DistributedDataParallel ----------------------------------------------------------

@pytest.mark.triton_interpreter
@pytest.mark.skipif(torch.cuda.is_available(),  # decided before a child interpreter starts
                    reason="on a CUDA host the kernels run compiled, on the GPU (tests/unit/test_gpu.py)")
@pytest.mark.parametrize("kind", ["shared", "per_expert"])
def test_forced_fused_gemm_runs_megatron_ddps_param_all_gather_hooks(megatron_cpu, kind,
                                                                      monkeypatch):
    """Megatron's DistributedDataParallel with the distributed optimizer and overlap_param_gather
    puts a forward pre-hook on every module; on the adapters' linears (the trainable parameters)
    it waits for their all-gather. A forced "fused_gemm" runs those hooks itself, for every module
    it does not call, before the kernels read the weights: each bucket's all-gather is finished
    by then, and output and gradients match the FP64 loop. Another hook beside DDP's still
    refuses."""
    pytest.importorskip("triton", reason="triton is not installed: the fused kernels are untested")
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from mcore_torch_experts import apply_lora
    from mcore_torch_experts.kernels import fused_experts as fused_module

    config = make_config(activation="squared_relu", glu=False, moe_expert_kernel="fused_gemm")
    root = torch.nn.Module()
    root.mlp = torch.nn.Module()
    root.mlp.experts = TorchGroupedMLP(config.num_moe_experts, config, pg_collection=megatron_cpu)
    apply_lora(root, ["linear_fc1", "linear_fc2"], rank=8, alpha=16.0, expert_adapter=kind)
    experts = root.mlp.experts
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in root.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                              overlap_grad_reduce=True, overlap_param_gather=True),
        root)
    adapter_params = [p for p in root.parameters() if p.requires_grad]
    groups = {id(ddp.param_to_bucket_group[p]): ddp.param_to_bucket_group[p]
              for p in adapter_params}
    assert groups and all(experts.linear_fc1.to_wrap._forward_pre_hooks.values())
    events = []
    for group in groups.values():
        real_finish = group.finish_param_sync
        monkeypatch.setattr(group, "finish_param_sync", lambda *a, f=real_finish, **k:
                            events.append("all-gather finished") or f(*a, **k))
    real = fused_module.fused_experts
    monkeypatch.setattr(fused_module, "fused_experts",
                        lambda *a, **k: events.append("kernels") or real(*a, **k))
    ddp.zero_grad_buffer()  # a new iteration: the parameters' all-gathers are pending again
    assert not any(group.param_gather_dispatched for group in groups.values())
    splits = [5, 0, 7, 4]
    x = torch.randn(sum(splits), config.hidden_size, generator=gen).bfloat16()
    probs, grad = torch.rand(sum(splits), generator=gen), torch.randn(x.shape, generator=gen)
    xk = x.clone().requires_grad_(True)
    out, _ = experts(xk, splits, probs)
    out.backward(grad.bfloat16())
    assert events[-1] == "kernels" and "all-gather finished" in events[:-1], events
    assert all(g.param_gather_dispatched and g.param_gather_handle is None
               for g in groups.values())
    effective = []
    for linear in (experts.linear_fc1, experts.linear_fc2):
        adapter = linear.adapter
        a, b = adapter.linear_in.weight.detach(), adapter.linear_out.weight.detach()
        effective.append(_fp64_effective(torch.stack(linear.to_wrap.expert_weights()), a.double(),
                                         b.double(), adapter.scale))
    x64 = x.double().requires_grad_(True)
    ref = fp64_experts(config, *effective, x64, splits, probs)
    ref.backward(grad.double())
    assert rel_err(out, ref) < 2e-2 and rel_err(xk.grad, x64.grad) < 2e-2
    assert all(p.main_grad.abs().sum() > 0 for p in adapter_params)  # DDP's buffers got them
    experts.linear_fc2.adapter.linear_in.register_forward_pre_hook(lambda *args: None)
    with pytest.raises(RuntimeError, match="linear_fc2's adapter's linear_in carry hooks"):
        experts(x, splits, probs)
