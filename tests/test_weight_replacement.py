"""Expert weights that change after construction: a torch.func.functional_call substitute lasts
one call, a registered replacement is cast into the packed buffer without touching the other
experts, and repacking under inference mode leaves no inference tensor behind. The reference is
the FP64 per-expert loop on the weights each call should see."""

import pytest
import torch
from torch.func import functional_call

from mcore_torch_experts import TorchGroupedMLP
from reference import fp64_experts, make_config, rel_err

HIDDEN, FFN, EXPERTS = 32, 48, 4
SPLITS = [3, 5, 0, 4]
TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-5}


def build(pg, dtype=torch.float32):
    torch.manual_seed(0)
    config = make_config(hidden=HIDDEN, ffn=FFN, num_experts=EXPERTS, dtype=dtype)
    experts = TorchGroupedMLP(EXPERTS, config, pg_collection=pg)
    experts.requires_grad_(False)
    return config, experts


def inputs(dtype):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(sum(SPLITS), HIDDEN, generator=generator).to(dtype)
    return x, torch.rand(sum(SPLITS), generator=generator)


def weights(experts):
    """fc1 [E, 2F, H], fc2 [E, H, F]: clones of what the module's Parameters hold now."""
    return [torch.stack([w.detach().clone() for w in linear.expert_weights()])
            for linear in (experts.linear_fc1, experts.linear_fc2)]


def assert_matches_fp64(config, out, fc1, fc2, x, probs):
    expected = fp64_experts(config, fc1, fc2, x, SPLITS, probs)
    assert rel_err(out, expected) < TOL[x.dtype]


def assert_views_its_buffer(experts):
    for linear in (experts.linear_fc1, experts.linear_fc2):
        packed = linear.packed_weight
        for i, w in enumerate(linear.expert_weights()):
            assert w.dtype == packed.dtype and w.data_ptr() == packed[i].data_ptr()


# --- torch.func.functional_call ------------------------------------------------------------------

@pytest.mark.parametrize("as_parameter", [False, True], ids=["tensor", "parameter"])
def test_functional_call_substitute_lasts_one_call(megatron_cpu, as_parameter):
    config, experts = build(megatron_cpu)
    x, probs = inputs(torch.float32)
    fc1, fc2 = weights(experts)
    state = {k: v.clone() for k, v in experts.state_dict().items() if v is not None}
    originals = experts.linear_fc1.expert_weights()
    substitute = torch.randn(2 * FFN, HIDDEN) * 0.1
    given = torch.nn.Parameter(substitute.clone(), requires_grad=False) if as_parameter \
        else substitute.clone()
    given_pointer = given.data_ptr()

    out, _ = functional_call(experts, {"linear_fc1.weight1": given}, (x, SPLITS, probs))

    substituted_fc1 = fc1.clone()
    substituted_fc1[1] = substitute
    assert_matches_fp64(config, out, substituted_fc1, fc2, x, probs)
    assert given.data_ptr() == given_pointer and torch.equal(given, substitute)
    # The module is as it was: same Parameters, still views of an unchanged buffer.
    assert all(a is b for a, b in zip(experts.linear_fc1.expert_weights(), originals))
    assert_views_its_buffer(experts)
    assert all(torch.equal(experts.state_dict()[k], v) for k, v in state.items())
    assert_matches_fp64(config, experts(x, SPLITS, probs)[0], fc1, fc2, x, probs)


def test_functional_call_substituting_the_buffer_neither_uses_nor_writes_it(megatron_cpu):
    """`functional_call(model, {**params, **buffers})` with copied buffers: the copy of the
    internal packed buffer is ignored (the weights count), and the module keeps its own."""
    config, experts = build(megatron_cpu)
    x, probs = inputs(torch.float32)
    fc1, fc2 = weights(experts)
    own = experts.linear_fc1.packed_weight
    given = torch.zeros_like(own)

    out, _ = functional_call(experts, {"linear_fc1.packed_weight": given}, (x, SPLITS, probs))

    assert_matches_fp64(config, out, fc1, fc2, x, probs)
    assert torch.equal(given, torch.zeros_like(own))
    assert experts.linear_fc1.packed_weight is own
    assert_views_its_buffer(experts)


def test_functional_call_with_a_trainable_substitute_is_refused_under_grad_mode(megatron_cpu):
    _, experts = build(megatron_cpu)
    x, probs = inputs(torch.float32)
    substitute = torch.randn(2 * FFN, HIDDEN, requires_grad=True)
    with pytest.raises(RuntimeError, match="linear_fc1.weight0 requires grad"):
        functional_call(experts, {"linear_fc1.weight0": substitute}, (x, SPLITS, probs))


# --- registered replacements -------------------------------------------------------------------

def test_replacement_of_another_dtype_is_cast_into_the_buffer(megatron_cpu):
    config, experts = build(megatron_cpu, torch.bfloat16)
    x, probs = inputs(torch.bfloat16)
    linear = experts.linear_fc1
    buffer, nbytes = linear.packed_weight, linear.packed_weight.nbytes
    others = {i: (w, w.data_ptr(), w.detach().clone())
              for i, w in enumerate(linear.expert_weights()) if i != 2}
    replacement = torch.randn(2 * FFN, HIDDEN) * 0.1

    linear.weight2 = torch.nn.Parameter(replacement.clone(), requires_grad=False)  # FP32

    assert linear.packed_weight is buffer and buffer.nbytes == nbytes
    assert linear.weight2.dtype == torch.bfloat16
    assert torch.equal(linear.weight2, replacement.bfloat16())
    for i, (w, pointer, values) in others.items():
        assert getattr(linear, f"weight{i}") is w and w.data_ptr() == pointer
        assert torch.equal(w, values)
    assert_views_its_buffer(experts)
    fc1, fc2 = weights(experts)
    assert_matches_fp64(config, experts(x, SPLITS, probs)[0], fc1, fc2, x, probs)


def test_replacement_of_the_wrong_shape_is_refused_naming_it(megatron_cpu):
    _, experts = build(megatron_cpu)
    linear = experts.linear_fc2
    old = linear.weight3
    with pytest.raises(ValueError, match=r"linear_fc2\.weight3: a replacement must be a "
                                         r"Parameter of shape \[32, 48\].*got \[48, 32\]"):
        linear.weight3 = torch.nn.Parameter(torch.zeros(FFN, HIDDEN), requires_grad=False)
    assert linear.weight3 is old
    assert_views_its_buffer(experts)


# --- repacking under torch.inference_mode --------------------------------------------------------

def assigned_state(experts, dtype):
    """A state dict of fresh tensors (not views of the buffer), scaled so loading shows."""
    return {k: (v * 0.5).to(dtype) for k, v in experts.state_dict().items() if v is not None}


@pytest.mark.parametrize("change", ["assign_same_dtype", "assign_fp32", "data_moved_one_by_one"])
def test_repack_under_inference_mode_leaves_a_trainable_module(megatron_cpu, change):
    config, experts = build(megatron_cpu, torch.bfloat16)
    x, probs = inputs(torch.bfloat16)
    if change == "data_moved_one_by_one":
        for w in experts.parameters():
            w.data = w.data.float()
    else:
        state = assigned_state(experts, torch.float32 if change == "assign_fp32" else torch.bfloat16)
        experts.load_state_dict(state, strict=False, assign=True)
    fc1, fc2 = (w.bfloat16() for w in weights(experts))

    with torch.inference_mode():
        out, _ = experts(x, SPLITS, probs)
    assert_matches_fp64(config, out, fc1, fc2, x, probs)

    tensors = [*experts.buffers(), *experts.parameters()]
    assert not any(t.is_inference() for t in tensors)
    assert {t.dtype for t in tensors} == {torch.bfloat16}
    assert_views_its_buffer(experts)
    x_train = x.clone().requires_grad_(True)
    out, _ = experts(x_train, SPLITS, probs)  # a training step: saves the buffer for backward
    out.float().square().sum().backward()
    assert x_train.grad is not None and torch.isfinite(x_train.grad).all()
    assert_matches_fp64(config, out.detach(), fc1, fc2, x, probs)
