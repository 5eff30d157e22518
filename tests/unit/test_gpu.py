"""The parity tests on CUDA in bf16: device splits, no host syncs, device-side split checks."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

from mcore_torch_experts import TorchGroupedMLP
from mcore_torch_experts.kernels.choice import KernelChoice
from mcore_torch_experts.lora import LoRAAdapter, LoRALinear, PerExpertLoRAAdapter
from support.reference import (
    copy_weights_to_sequential,
    fp64_experts,
    make_config,
    rel_err,
    sequential_mlp,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HIDDEN, FFN, EXPERTS = 256, 512, 8
SPLITS = {
    "uniform": [64] * 8,
    "skewed": [300, 100, 50, 30, 20, 8, 4, 0],
    "zero_first_middle_last": [0, 128, 0, 200, 0, 100, 84, 0],
}
CASES = {"swiglu": dict(activation="silu", glu=True),
         "squared_relu": dict(activation="squared_relu", glu=False)}


def build_pair(pg, **config_kw):
    torch.manual_seed(0)
    config = make_config(hidden=HIDDEN, ffn=FFN, num_experts=EXPERTS, **config_kw)
    experts = TorchGroupedMLP(EXPERTS, config, pg_collection=pg)
    seq = sequential_mlp(config, pg)
    copy_weights_to_sequential(experts, seq)
    experts.cuda()
    seq.cuda()
    for p in [*experts.parameters(), *seq.parameters()]:
        p.requires_grad_(False)
    return config, experts, seq


def forward_backward(module, x, splits, probs, grad_out):
    x = x.clone().requires_grad_(True)
    out, _ = module(x, splits, probs)
    out.backward(grad_out)
    return out, x.grad


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("splits_name", list(SPLITS))
def test_bf16_parity_on_cuda(megatron_world, case, splits_name):
    config, experts, seq = build_pair(megatron_world, **CASES[case])
    splits = SPLITS[splits_name]
    rows = sum(splits)
    x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    probs = torch.rand(rows, device="cuda")
    grad_out = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    device_splits = torch.tensor(splits, device="cuda")
    out, grad_x = forward_backward(experts, x, device_splits, probs, grad_out)
    out_cpu_splits, _ = forward_backward(experts, x, torch.tensor(splits), probs, grad_out)
    seq_out, seq_grad = forward_backward(seq, x, torch.tensor(splits), probs, grad_out)

    x64 = x.double().requires_grad_(True)
    ref = fp64_experts(config, experts.linear_fc1.packed_weight, experts.linear_fc2.packed_weight,
                       x64, splits, probs)
    ref.backward(grad_out.double())
    errors = dict(out_vs_seq=rel_err(out, seq_out), grad_vs_seq=rel_err(grad_x, seq_grad),
                  out_vs_fp64=rel_err(out, ref), grad_vs_fp64=rel_err(grad_x, x64.grad),
                  seq_out_vs_fp64=rel_err(seq_out, ref))
    print(f"\n[cuda parity] {case} {splits_name}: "
          + " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert torch.equal(out, out_cpu_splits)
    assert errors["out_vs_fp64"] < 1e-2 and errors["grad_vs_fp64"] < 1e-2
    assert errors["out_vs_seq"] < 1e-2 and errors["grad_vs_seq"] < 1e-2


def test_device_splits_cause_no_host_sync(megatron_world):
    _, experts, _ = build_pair(megatron_world, activation="silu", glu=True)
    splits = torch.tensor(SPLITS["skewed"], device="cuda")
    rows = sum(SPLITS["skewed"])
    x = torch.randn(rows, HIDDEN, device="cuda").bfloat16().requires_grad_(True)
    probs = torch.rand(rows, device="cuda")
    grad_out = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = experts(x, splits, probs)
        out.backward(grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert x.grad is not None


def test_fp32_input_on_cuda_is_refused(megatron_world):
    _, experts, _ = build_pair(megatron_world, activation="silu", glu=True)
    experts.float()
    with pytest.raises(TypeError, match="needs bfloat16"):
        experts(torch.randn(8, HIDDEN, device="cuda"), [1] * EXPERTS, torch.rand(8, device="cuda"))


def test_malformed_device_splits_trip_the_device_assert(tmp_path):
    """A device-side assert poisons the CUDA context, so it runs in a child process."""
    script = tmp_path / "bad_splits.py"
    script.write_text(textwrap.dedent("""
        import torch
        from mcore_torch_experts.kernels.grouped_gemm import group_offsets
        offs = group_offsets(torch.tensor([4, 4, 4], device="cuda"), 3, 10, torch.device("cuda"))
        torch.cuda.synchronize()
        print("NO ASSERT", offs.tolist())
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0, result.stdout
    assert "NO ASSERT" not in result.stdout
    assert "tokens_per_expert must be non-negative and sum to the row count" in result.stderr \
        or "device-side assert" in result.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_fused_activation_matches_eager_on_cuda(megatron_world, case):
    """The fused activation x probs kernel rounds once; the eager path rounds act(x) first."""
    _, experts, _ = build_pair(megatron_world, **CASES[case])
    assert experts.kernels.activation == "fused"
    splits = torch.tensor(SPLITS["skewed"], device="cuda")
    rows = sum(SPLITS["skewed"])
    x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    probs = torch.rand(rows, device="cuda")
    grad_out = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    fused_out, fused_grad = forward_backward(experts, x, splits, probs, grad_out)
    experts.kernels = dataclasses.replace(experts.kernels, activation="eager")
    eager_out, eager_grad = forward_backward(experts, x, splits, probs, grad_out)
    print(f"\n[cuda fused vs eager] {case}: out={rel_err(fused_out, eager_out):.2e} "
          f"grad={rel_err(fused_grad, eager_grad):.2e}")
    assert rel_err(fused_out, eager_out) < 1e-2 and rel_err(fused_grad, eager_grad) < 1e-2


@pytest.mark.parametrize("case", list(CASES))
def test_fused_activation_backward_adds_only_the_gradients_with_a_trainable_router(case):
    """Backward with trainable probs allocates d fc1_out, d probs and [T, column tiles] FP32 row
    sums: no [T, F] temporary (an FP32 one is 2x d fc1_out)."""
    from mcore_torch_experts.kernels.activation_triton import BLOCK_COLS, fused_activation_probs

    config = make_config(ffn=2048, **CASES[case])
    rows, width = 65536, 2048 * (2 if config.gated_linear_unit else 1)
    h = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(rows, device="cuda", requires_grad=True)
    out = fused_activation_probs(config, h, probs)
    grad = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out.backward(grad)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - start
    tiles = -(-out.shape[1] // BLOCK_COLS)
    assert extra <= h.numel() * 2 + rows * (tiles + 1) * 4 + 2**20, extra / h.numel()
    assert h.grad is not None and probs.grad is not None


# The clamp bound is a bf16 value: the grouped_mm path compares bf16 values with the bound
# rounded to bf16, the fused kernels (and the FP64 loop) with the bound itself.
FUSED_CASES = {
    "squared_relu": dict(activation="squared_relu", glu=False),
    "swiglu": dict(activation="silu", glu=True),
    "silu": dict(activation="silu", glu=False),
    "swiglu_offset_clamp": dict(activation="silu", glu=True, glu_linear_offset=1.0,
                                activation_func_clamp_value=0.375),
}


def _with_kernel(experts, kernel):
    experts.kernels = KernelChoice(kernel, kernel, experts.kernels.activation)
    return experts


@pytest.mark.parametrize("case", list(FUSED_CASES))
@pytest.mark.parametrize("splits_name", [*SPLITS, "empty"])
def test_fused_gemm_matches_fp64_and_grouped_mm(megatron_world, case, splits_name):
    """The fused GEMM path (forced) against the FP64 loop and the grouped_mm path: output, input
    gradient and the probs' gradient."""
    config, experts, _ = build_pair(megatron_world, **FUSED_CASES[case])
    splits = SPLITS.get(splits_name, [0] * EXPERTS)
    rows = sum(splits)
    x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    probs = torch.rand(rows, device="cuda")
    grad_out = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    results = {}
    for kernel in ("fused_gemm", "grouped_mm"):
        _with_kernel(experts, kernel)
        xk, pk = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        out, _ = experts(xk, torch.tensor(splits, device="cuda"), pk)
        out.backward(grad_out)
        results[kernel] = (out, xk.grad, pk.grad)
    out, grad_x, grad_p = results["fused_gemm"]
    assert out.shape == (rows, HIDDEN) and grad_x.shape == (rows, HIDDEN)
    if rows == 0:
        return
    x64 = x.double().requires_grad_(True)
    p64 = probs.double().requires_grad_(True)
    ref = fp64_experts(config, experts.linear_fc1.packed_weight, experts.linear_fc2.packed_weight,
                       x64, splits, p64, clamp_on_bf16=True)
    ref.backward(grad_out.double())
    errors = {f"{name}_{kernel}": rel_err(got, want)
              for kernel, got_all in results.items()
              for name, got, want in zip(("out", "grad_x", "grad_p"), got_all,
                                         (ref, x64.grad, p64.grad))}
    print(f"\n[cuda fused gemm] {case} {splits_name}: "
          + " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert max(errors.values()) < 1e-2, errors
    assert rel_err(out, results["grouped_mm"][0]) < 1e-2
    assert rel_err(grad_x, results["grouped_mm"][1]) < 1e-2


def no_sync_then_graph_replay(step, splits: torch.Tensor):
    """`step()` once under CUDA's sync debug mode "error", then captured in a CUDA graph (after
    two warm-ups on a side stream) and replayed with the zero-first-middle-last splits copied
    into `splits`: (the graph's outputs, an eager `step()`'s outputs after the replay)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    splits.copy_(torch.tensor(SPLITS["zero_first_middle_last"], device="cuda"))
    graph.replay()
    return captured, step()


def test_fused_gemm_no_sync_and_cuda_graph(megatron_world):
    """Device splits: no host sync in forward or backward; a CUDA graph of forward + backward
    replays the eager result bit for bit, also after other splits (zero-token experts) are
    copied in."""
    _, experts, _ = build_pair(megatron_world, activation="silu", glu=True)
    _with_kernel(experts, "fused_gemm")
    rows = sum(SPLITS["uniform"])
    static = [torch.randn(rows, HIDDEN, device="cuda").bfloat16().requires_grad_(True),
              torch.tensor(SPLITS["uniform"], device="cuda"), torch.rand(rows, device="cuda"),
              torch.randn(rows, HIDDEN, device="cuda").bfloat16()]

    def step():
        out, _ = experts(*static[:3])
        return out, torch.autograd.grad(out, static[0], static[3])[0]

    (g_out, g_grad), (eager_out, eager_grad) = no_sync_then_graph_replay(step, static[1])
    assert torch.equal(g_out, eager_out) and torch.equal(g_grad, eager_grad)


def _install_lora(experts, kind, rank=16, alpha=32.0, dropout=0.0):
    """Our LoRALinear on linear_fc1 and linear_fc2, B drawn non-zero; the adapters."""
    adapters = []
    for name in ("linear_fc1", "linear_fc2"):
        base = getattr(experts, name)
        if kind == "shared":
            adapter = LoRAAdapter(base.in_features, base.out_features, rank, alpha, dropout,
                                  torch.bfloat16, "cuda")
        else:
            adapter = PerExpertLoRAAdapter(EXPERTS, base.in_features, base.out_features, rank,
                                           alpha, dropout, torch.bfloat16, "cuda")
        with torch.no_grad():
            adapter.linear_out.weight.normal_(std=0.05)  # B starts at zero
        setattr(experts, name, LoRALinear(base, adapter))
        adapters.append(adapter)
    return adapters


def _update_pass(experts, adapters, x, splits, probs, grad_out):
    xk, pk = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    params = [p for adapter in adapters for p in (adapter.linear_in.weight,
                                                  adapter.linear_out.weight)]
    out, _ = experts(xk, splits, pk)
    grads = torch.autograd.grad(out, [xk, pk, *params], grad_out)
    return [out, *grads]


@pytest.mark.parametrize("kind", ["shared", "per_expert"])
@pytest.mark.parametrize("case", ["squared_relu", "swiglu"])
@pytest.mark.parametrize("splits_name", ["skewed", "zero_first_middle_last", "empty"])
def test_fused_gemm_with_adapters_matches_fp64_and_grouped_mm(megatron_world, kind, case,
                                                              splits_name):
    """Our LoRA adapters on both expert linears in the fused kernels (forced), against the FP64
    loop with weight + alpha / rank x B A per expert and against grouped_mm + adapters: output,
    input and probs gradients, every adapter factor's gradient; the logprob pass (no grad) gives
    the update pass's output bit for bit, and a second update pass repeats the first."""
    config, experts, _ = build_pair(megatron_world, **FUSED_CASES[case])
    w1, w2 = experts.linear_fc1.packed_weight, experts.linear_fc2.packed_weight
    adapters = _install_lora(experts, kind)
    splits = SPLITS.get(splits_name, [0] * EXPERTS)
    rows = sum(splits)
    x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    probs = torch.rand(rows, device="cuda")
    grad_out = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    device_splits = torch.tensor(splits, device="cuda")
    _with_kernel(experts, "fused_gemm")
    fused = _update_pass(experts, adapters, x, device_splits, probs, grad_out)
    again = _update_pass(experts, adapters, x, device_splits, probs, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(fused, again))
    with torch.no_grad():
        assert torch.equal(experts(x, device_splits, probs)[0], fused[0])
    _with_kernel(experts, "grouped_mm")
    grouped = _update_pass(experts, adapters, x, device_splits, probs, grad_out)
    if rows == 0:
        assert fused[0].shape == (0, HIDDEN)
        assert all(not g.any() for g in fused[3:])
        return
    x64 = x.double().requires_grad_(True)
    p64 = probs.double().requires_grad_(True)
    factors = [t.detach().double().requires_grad_(True) for adapter in adapters
               for t in (adapter.linear_in.weight, adapter.linear_out.weight)]
    a1, b1, a2, b2 = factors
    scale = adapters[0].scale
    ref = fp64_experts(config, w1.double() + scale * (b1 @ a1), w2.double() + scale * (b2 @ a2),
                       x64, splits, p64, clamp_on_bf16=True)
    ref.backward(grad_out.double())
    want = [ref, x64.grad, p64.grad, *(f.grad for f in factors)]
    names = ("out", "grad_x", "grad_p", "grad_a1", "grad_b1", "grad_a2", "grad_b2")
    errors = {f"{name}_{path}": rel_err(got, ref_value)
              for path, results in (("fused", fused), ("grouped_mm", grouped))
              for name, got, ref_value in zip(names, results, want)}
    print(f"\n[cuda fused gemm + LoRA] {kind} {case} {splits_name}: "
          + " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert max(v for k, v in errors.items() if k.endswith("_fused")) < 1e-2, errors
    for got, other in zip(fused, grouped):
        assert rel_err(got, other) < 1e-2


def test_fused_gemm_with_adapters_no_sync_and_cuda_graph(megatron_world):
    """Per-expert adapters on the fused path: no host sync with device splits, and a CUDA graph
    of the update pass replays the eager result bit for bit after other splits are copied in."""
    _, experts, _ = build_pair(megatron_world, activation="squared_relu", glu=False)
    adapters = _install_lora(experts, "per_expert")
    _with_kernel(experts, "fused_gemm")
    rows = sum(SPLITS["uniform"])
    static = [torch.randn(rows, HIDDEN, device="cuda").bfloat16(),
              torch.tensor(SPLITS["uniform"], device="cuda"), torch.rand(rows, device="cuda"),
              torch.randn(rows, HIDDEN, device="cuda").bfloat16()]

    def step():
        return _update_pass(experts, adapters, static[0], static[1], static[2], static[3])

    captured, eager = no_sync_then_graph_replay(step, static[1])
    assert all(torch.equal(g, e) for g, e in zip(captured, eager))


def test_adapters_with_dropout_stay_on_grouped_mm(megatron_world):
    """An adapter the kernels cannot compute (dropout): a forced fused_gemm refuses, naming it;
    "auto" takes grouped_mm, where the adapter runs as a module (its forward is called)."""
    _, experts, _ = build_pair(megatron_world, activation="squared_relu", glu=False)
    adapters = _install_lora(experts, "shared", dropout=0.1)
    splits = torch.tensor(SPLITS["skewed"], device="cuda")
    rows = sum(SPLITS["skewed"])
    x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    probs = torch.rand(rows, device="cuda")
    _with_kernel(experts, "fused_gemm")
    with pytest.raises(RuntimeError, match="carry adapters or hooks.*has dropout 0.1"):
        experts(x, splits, probs)
    experts.kernels = dataclasses.replace(experts.kernels, setting="auto")
    calls = []
    adapters[0].forward = lambda *args, f=adapters[0].forward: calls.append(1) or f(*args)
    experts(x, splits, probs)
    assert calls


def test_auto_kernel_choice(megatron_world):
    """"auto" takes the fused GEMM path only on sm90 and only for non-gated activations, where it
    measured faster; SwiGLU stays on grouped_mm."""
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    _, sq_relu, _ = build_pair(megatron_world, activation="squared_relu", glu=False)
    _, swiglu, _ = build_pair(megatron_world, activation="silu", glu=True)
    assert sq_relu.kernels.expert_kernel == ("fused_gemm" if sm90 else "grouped_mm")
    assert swiglu.kernels.expert_kernel == "grouped_mm"


@pytest.mark.parametrize("kind", ["shared", "per_expert"])
def test_auto_kernel_choice_with_our_adapters(megatron_world, monkeypatch, kind):
    """Our adapters on the experts change nothing in the choice: "auto" runs the fused kernels
    (with the adapters in them) exactly where it does without adapters, in the update pass and
    in the logprob pass."""
    from mcore_torch_experts.kernels import fused_experts as fused_module

    sm90 = torch.cuda.get_device_capability() == (9, 0)
    real, calls = fused_module.fused_experts, []
    monkeypatch.setattr(fused_module, "fused_experts",
                        lambda *args, **kwargs: calls.append(args[6:]) or real(*args, **kwargs))
    for case, fused_here in (("squared_relu", sm90), ("swiglu", False)):
        _, experts, _ = build_pair(megatron_world, **FUSED_CASES[case])
        adapters = _install_lora(experts, kind)
        splits = torch.tensor(SPLITS["skewed"], device="cuda")
        rows = sum(SPLITS["skewed"])
        x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
        probs = torch.rand(rows, device="cuda")
        calls.clear()
        _update_pass(experts, adapters, x, splits, probs, torch.randn_like(x))
        with torch.no_grad():
            experts(x, splits, probs)
        assert len(calls) == (2 if fused_here else 0), case
        assert all(term is not None for args in calls for term in args)
