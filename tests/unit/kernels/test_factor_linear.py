"""A shared LoRA factor's products (kernels/factor_linear.py): the plain torch ops unless
`chunked`; chunked (what callers ask while Megatron's batch-invariant kernels are on, through
`_compat.batch_invariant_kernels_on()`), the same forward and input gradient and the weight
gradient from factor_grad's fixed chunks of rows, against FP64."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from mcore_torch_experts import _compat
from mcore_torch_experts.kernels import factor_linear as fl
from mcore_torch_experts.kernels.factor_grad_triton import chunked_sums

HAS_KERNELS = importlib.util.find_spec(
    "megatron.core.transformer.custom_layers.batch_invariant_kernels") is not None
needs_kernels = pytest.mark.skipif(
    not HAS_KERNELS, reason="Megatron's batch-invariant kernels came with megatron-core 0.19 "
                            "(this leg is older)")


@pytest.fixture
def kernels_on(monkeypatch):
    """The mode's flag only (its aten::mm needs CUDA or the interpreter): what the switch reads."""
    from megatron.core.transformer.custom_layers import batch_invariant_kernels

    monkeypatch.setattr(batch_invariant_kernels, "_batch_invariant_MODE", True)


def grads(fn, x, w, grad_y):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fn(x, w)
    y.backward(grad_y)
    return y, x.grad, w.grad


def test_the_switch_follows_megatrons_kernels():
    if not HAS_KERNELS:
        assert _compat.batch_invariant_kernels_on() is False
        return
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import (
        is_batch_invariant_mode_enabled,
    )

    assert _compat.batch_invariant_kernels_on() is is_batch_invariant_mode_enabled() is False


@needs_kernels
def test_the_switch_reads_the_modes_flag(kernels_on):
    assert _compat.batch_invariant_kernels_on() is True


def chunked(x, w):
    return fl.factor_linear(x, w, True)


def test_unless_chunked_the_products_are_torchs_own():
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 32).bfloat16(), torch.randn(16, 32).bfloat16()
    grad_y = torch.randn(3, 5, 16).bfloat16()
    plain = grads(lambda x, w: fl.factor_linear(x, w, False), x, w, grad_y)
    for got, want in zip(plain, grads(F.linear, x, w, grad_y)):
        assert torch.equal(got, want)
    left, right = torch.randn(40, 16).bfloat16(), torch.randn(40, 24).bfloat16()
    assert torch.equal(fl.factor_product_grad(left, right, False), left.t() @ right)


@pytest.mark.parametrize("shape", [(3, 5, 32), (2100, 32), (0, 32)], ids=["3d", "rows", "empty"])
def test_chunked_the_weight_gradient_is_the_chunked_sum(shape):
    torch.manual_seed(1)
    x, w = torch.randn(shape).bfloat16(), torch.randn(16, 32).bfloat16()
    grad_y = torch.randn(*shape[:-1], 16).bfloat16()
    y, dx, dw = grads(chunked, x, w, grad_y)
    y_ref, dx_ref, _ = grads(F.linear, x, w, grad_y)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert dw.dtype == w.dtype
    assert torch.equal(dw, chunked_sums(grad_y.reshape(-1, 16), x.reshape(-1, 32)).to(w.dtype))
    want = grad_y.reshape(-1, 16).double().t() @ x.reshape(-1, 32).double()
    assert (dw.double() - want).abs().max() <= 2 ** -8 * max(1.0, want.abs().max())
    left, right = grad_y.reshape(-1, 16), x.reshape(-1, 32)
    assert torch.equal(fl.factor_product_grad(left, right, True),
                       chunked_sums(left, right).to(left.dtype))


def test_a_frozen_factor_or_no_grad_keeps_the_plain_linear():
    x, w = torch.randn(4, 8), torch.randn(2, 8)
    assert chunked(x.requires_grad_(True), w).grad_fn.name() != "FactorLinearBackward"
    w.requires_grad_(True)
    assert chunked(x, w).grad_fn.name() == "FactorLinearBackward"
    with torch.no_grad():
        assert torch.equal(chunked(x, w), F.linear(x, w))


@needs_kernels
@pytest.mark.parametrize("adapter", ["shared", "per_expert"])
def test_our_adapters_take_the_chunked_gradient_while_the_kernels_are_on(kernels_on, adapter):
    """LoRAAdapter asks the switch at each forward: a shared factor's gradient node is
    FactorLinear's; a per-expert adapter's grouped GEMMs are batch-invariant by themselves."""
    from mcore_torch_experts.lora import LoRAAdapter, PerExpertLoRAAdapter

    if adapter == "shared":
        module = LoRAAdapter(32, 24, 8, 16.0, 0.0, torch.bfloat16, "cpu")
        x = torch.randn(50, 32).bfloat16()
        out = module(x)
        assert out.grad_fn.next_functions[0][0].name() == "FactorLinearBackward"
    else:
        module = PerExpertLoRAAdapter(2, 32, 24, 8, 16.0, 0.0, torch.bfloat16, "cpu")
        out = module(torch.randn(50, 32).bfloat16(), torch.tensor([20, 30]))
        assert "FactorLinear" not in str(out.grad_fn.next_functions)
