"""The fused activation x probs kernel against FP64, forward and backward (Triton interpreter on
the CPU, in a child process: TRITON_INTERPRET=1 must be set before triton is first imported)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHECK = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from mcore_torch_experts.activation_triton import covers, fused_activation_probs
    from reference import make_config

    def fp64(config, h, probs):
        h = h.double()
        if config.gated_linear_unit:
            gate, up = h.chunk(2, dim=-1)
            a = config.activation_func(gate) * (up + config.glu_linear_offset)
        else:
            a = config.activation_func(h)
        return a * probs.double().unsqueeze(-1)

    torch.manual_seed(0)
    cases = [dict(activation="squared_relu", glu=False), dict(activation="silu", glu=True),
             dict(activation="silu", glu=True, glu_linear_offset=1.0),
             dict(activation="silu", glu=False)]
    for case in cases:
        config = make_config(**case)
        assert covers(config)
        for rows in (0, 1, 37):
            width = config.moe_ffn_hidden_size * (2 if config.gated_linear_unit else 1)
            h = torch.randn(rows, width).bfloat16().requires_grad_(True)
            probs = torch.rand(rows).requires_grad_(True)
            out = fused_activation_probs(config, h, probs)
            grad = torch.randn(out.shape).bfloat16()
            out.backward(grad)
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
    assert not covers(make_config(activation="gelu", glu=False))
    assert not covers(make_config(activation="silu", glu=True, activation_func_clamp_value=1.0))
    print("FUSED ACTIVATION OK")
""")


def test_fused_activation_matches_fp64_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed: the fused kernel is untested")
    tests = Path(__file__).parent
    child = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300,
        cwd=tests, env={**os.environ, "TRITON_INTERPRET": "1",
                        "PYTHONPATH": os.pathsep.join(
                            [str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")])})
    assert child.returncode == 0 and "FUSED ACTIVATION OK" in child.stdout, child.stderr[-3000:]
