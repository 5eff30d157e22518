"""The fused activation x probs kernel against FP64, forward and backward (on the CPU under the
Triton interpreter: the `triton_interpreter` marker, tests/support/triton_interpreter.py)."""

import pytest
import torch

from support.reference import make_config

# The kernel against FP64, the same on every release: one leg per venv (scripts/legs.sh).
pytestmark = pytest.mark.once_per_venv


def fp64(config, h, probs):
    h = h.double()
    if config.gated_linear_unit:
        gate, up = h.chunk(2, dim=-1)
        a = config.activation_func(gate) * (up + config.glu_linear_offset)
    else:
        a = config.activation_func(h)
    return a * probs.double().unsqueeze(-1)


@pytest.mark.triton_interpreter
def test_fused_activation_matches_fp64_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed: the fused kernel is untested")
    from mcore_torch_experts.kernels.activation_triton import fused_activation_probs
    from mcore_torch_experts.kernels.choice import activation_kernel_not_covered

    torch.manual_seed(0)
    cases = [dict(activation="squared_relu", glu=False), dict(activation="silu", glu=True),
             dict(activation="silu", glu=True, glu_linear_offset=1.0),
             dict(activation="silu", glu=False),
             # wider than one column tile (BLOCK_COLS = 256): d probs sums several tiles' shares
             dict(activation="squared_relu", glu=False, ffn=600),
             dict(activation="silu", glu=True, ffn=300)]
    for case in cases:
        config = make_config(**case)
        assert activation_kernel_not_covered(config) is None
        for rows in (0, 1, 37):
            width = config.moe_ffn_hidden_size * (2 if config.gated_linear_unit else 1)
            h = torch.randn(rows, width).bfloat16().requires_grad_(True)
            probs = torch.rand(rows).requires_grad_(True)
            out = fused_activation_probs(config, h, probs)
            grad = torch.randn(out.shape).bfloat16()
            out.backward(grad)
            frozen_probs = probs.detach()  # a frozen router: d fc1_out alone, the same values
            h_alone = h.detach().clone().requires_grad_(True)
            fused_activation_probs(config, h_alone, frozen_probs).backward(grad)
            assert torch.equal(h_alone.grad, h.grad) and frozen_probs.grad is None
            h64 = h.detach().double().requires_grad_(True)
            p64 = probs.detach().double().requires_grad_(True)
            ref = fp64(config, h64, p64)
            ref.backward(grad.double())
            assert out.shape == ref.shape and out.dtype == torch.bfloat16
            if rows == 0:
                continue
            # bf16 outputs: at most one bf16 ulp (2^-8 relative; the interpreter truncates).
            for got, want in ((out, ref), (h.grad, h64.grad), (probs.grad, p64.grad)):
                err = (got.double() - want).abs().max() / want.abs().max()
                assert err < 2.0 ** -7, (case, rows, float(err))
    assert activation_kernel_not_covered(make_config(activation="gelu", glu=False))
    assert activation_kernel_not_covered(make_config(activation="silu", glu=True,
                                                     activation_func_clamp_value=1.0))
