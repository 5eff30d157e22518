"""The parity tests on CUDA in bf16: device splits, no host syncs, device-side split checks."""

import subprocess
import sys
import textwrap

import pytest
import torch

from mcore_torch_experts import TorchGroupedMLP
from reference import copy_weights_to_sequential, fp64_experts, make_config, rel_err, sequential_mlp

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
def test_bf16_parity_on_cuda(megatron_cpu, case, splits_name):
    config, experts, seq = build_pair(megatron_cpu, **CASES[case])
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


def test_device_splits_cause_no_host_sync(megatron_cpu):
    _, experts, _ = build_pair(megatron_cpu, activation="silu", glu=True)
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


def test_fp32_input_on_cuda_is_refused(megatron_cpu):
    _, experts, _ = build_pair(megatron_cpu, activation="silu", glu=True)
    experts.float()
    with pytest.raises(TypeError, match="needs bfloat16"):
        experts(torch.randn(8, HIDDEN, device="cuda"), [1] * EXPERTS, torch.rand(8, device="cuda"))


def test_malformed_device_splits_trip_the_device_assert(tmp_path):
    """A device-side assert poisons the CUDA context, so it runs in a child process."""
    script = tmp_path / "bad_splits.py"
    script.write_text(textwrap.dedent("""
        import torch
        from mcore_torch_experts.grouped_gemm import group_offsets
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
def test_fused_activation_matches_eager_on_cuda(megatron_cpu, case):
    """The fused activation x probs kernel rounds once; the eager path rounds act(x) first."""
    _, experts, _ = build_pair(megatron_cpu, **CASES[case])
    assert experts.activation_impl == "fused"
    splits = torch.tensor(SPLITS["skewed"], device="cuda")
    rows = sum(SPLITS["skewed"])
    x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    probs = torch.rand(rows, device="cuda")
    grad_out = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    fused_out, fused_grad = forward_backward(experts, x, splits, probs, grad_out)
    experts.activation_impl = "eager"
    eager_out, eager_grad = forward_backward(experts, x, splits, probs, grad_out)
    print(f"\n[cuda fused vs eager] {case}: out={rel_err(fused_out, eager_out):.2e} "
          f"grad={rel_err(fused_grad, eager_grad):.2e}")
    assert rel_err(fused_out, eager_out) < 1e-2 and rel_err(fused_grad, eager_grad) < 1e-2
