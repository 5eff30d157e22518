"""Expert weights that change after construction: a torch.func.functional_call substitute lasts
one call, a registered replacement is cast into the packed buffer without touching the other
experts, and repacking under inference mode leaves no inference tensor behind. The reference is
the FP64 per-expert loop on the weights each call should see."""

import pytest
import torch
from torch.func import functional_call

from mcore_torch_experts import TorchGroupedMLP
from support.reference import (
    copy_weights_to_sequential,
    fp64_experts,
    make_config,
    rel_err,
    sequential_mlp,
)

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


def stacked_state(state):
    """fc1 [E, 2F, H], fc2 [E, H, F] in bf16: the expert weights of a state dict."""
    return [torch.stack([state[f"{linear}.weight{i}"] for i in range(EXPERTS)]).bfloat16()
            for linear in ("linear_fc1", "linear_fc2")]


@pytest.mark.parametrize("change", ["assign_same_dtype", "assign_fp32", "data_moved_one_by_one"])
def test_repack_under_inference_mode_leaves_a_trainable_module(megatron_cpu, change):
    """Repacked under inference mode, the buffers hold the weights given (halved, so dropped
    values show) and every call computes with them; no inference tensor is left, and it trains."""
    config, experts = build(megatron_cpu, torch.bfloat16)
    x, probs = inputs(torch.bfloat16)
    if change == "data_moved_one_by_one":
        fc1, fc2 = (w * 0.5 for w in weights(experts))
        for w in experts.parameters():
            w.data = w.data.float() * 0.5
    else:
        state = assigned_state(experts, torch.float32 if change == "assign_fp32" else torch.bfloat16)
        fc1, fc2 = stacked_state(state)
        experts.load_state_dict(state, strict=False, assign=True)

    with torch.inference_mode():
        out, _ = experts(x, SPLITS, probs)
    assert torch.equal(experts.linear_fc1.packed_weight, fc1)
    assert torch.equal(experts.linear_fc2.packed_weight, fc2)
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


# --- replacements that alias the buffer, or wait through a cast or a move ----------------------

def swapped(stacked, order):
    """stacked [E, ...] with expert i holding what expert order[i] held."""
    return stacked[list(order)].clone()


CYCLE = [1, 2, 3, 0]  # expert i takes expert i + 1's weights: a permutation that is not a swap


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_data_swap_of_two_experts_keeps_both(megatron_cpu, dtype):
    """`w0.data, w1.data = w1.data, w0.data`: each slot is read before any is written (as
    SequentialMLP, whose experts hold separate tensors, does the same swap)."""
    config, experts = build(megatron_cpu, dtype)
    x, probs = inputs(dtype)
    fc1, fc2 = weights(experts)
    seq = sequential_mlp(config, megatron_cpu)
    copy_weights_to_sequential(experts, seq)
    seq.requires_grad_(False)
    for linear in (experts.linear_fc1, experts.linear_fc2):
        linear.weight0.data, linear.weight1.data = linear.weight1.data, linear.weight0.data
    for name in ("linear_fc1", "linear_fc2"):
        a, b = (getattr(seq.local_experts[i], name) for i in (0, 1))
        a.weight.data, b.weight.data = b.weight.data, a.weight.data

    out, _ = experts(x, SPLITS, probs)

    order = [1, 0, 2, 3]
    assert torch.equal(experts.linear_fc1.packed_weight, swapped(fc1, order))
    assert torch.equal(experts.linear_fc2.packed_weight, swapped(fc2, order))
    assert_views_its_buffer(experts)
    assert_matches_fp64(config, out, swapped(fc1, order), swapped(fc2, order), x, probs)
    assert rel_err(out, seq(x, torch.tensor(SPLITS), probs)[0]) < TOL[dtype]


def test_swap_of_two_experts_by_new_parameters_keeps_both(megatron_cpu):
    """`w0, w1 = Parameter(w1), Parameter(w0)`: both new Parameters view the buffer, so neither
    is packed before the other is read."""
    config, experts = build(megatron_cpu)
    x, probs = inputs(torch.float32)
    fc1, fc2 = weights(experts)
    linear = experts.linear_fc1
    linear.weight0, linear.weight2 = (torch.nn.Parameter(linear.weight2.detach(), requires_grad=False),
                                      torch.nn.Parameter(linear.weight0.detach(), requires_grad=False))

    out, _ = experts(x, SPLITS, probs)

    assert torch.equal(linear.packed_weight, swapped(fc1, [2, 1, 0, 3]))
    assert_views_its_buffer(experts)
    assert_matches_fp64(config, out, swapped(fc1, [2, 1, 0, 3]), fc2, x, probs)


@pytest.mark.parametrize("assign", [True, False], ids=["assign", "copy"])
def test_load_state_dict_of_its_own_permuted_state_reorders_experts(megatron_cpu, assign):
    """A state dict of the module's own views, keys permuted: each expert gets the weights it
    was given, whatever order the keys are loaded in."""
    config, experts = build(megatron_cpu)
    x, probs = inputs(torch.float32)
    fc1, fc2 = weights(experts)
    own = experts.state_dict()
    permuted = {}
    for key, value in own.items():
        name, _, index = key.rpartition(".weight")
        permuted[key] = own[f"{name}.weight{CYCLE[int(index)]}"] if name and index.isdigit() \
            else value

    experts.load_state_dict(permuted, assign=assign)

    assert torch.equal(experts.linear_fc1.packed_weight, swapped(fc1, CYCLE))
    assert torch.equal(experts.linear_fc2.packed_weight, swapped(fc2, CYCLE))
    assert_views_its_buffer(experts)
    assert_matches_fp64(config, experts(x, SPLITS, probs)[0], swapped(fc1, CYCLE),
                        swapped(fc2, CYCLE), x, probs)


@pytest.mark.parametrize("then", ["new_parameter_elsewhere", "data_swap_elsewhere"])
def test_pending_data_swap_survives_a_later_write_to_its_source_slot(megatron_cpu, then):
    """weight0.data = weight1.data waits for the next forward; expert 1 then replaced (a new
    Parameter is packed at once, a .data swap waits too): expert 0 keeps expert 1's old values."""
    config, experts = build(megatron_cpu)
    x, probs = inputs(torch.float32)
    fc1, fc2 = weights(experts)
    linear = experts.linear_fc1
    new = torch.randn(2 * FFN, HIDDEN) * 0.1
    linear.weight0.data = linear.weight1.data
    if then == "new_parameter_elsewhere":
        linear.weight1 = torch.nn.Parameter(new.clone(), requires_grad=False)
    else:
        linear.weight1.data = new.clone()

    out, _ = experts(x, SPLITS, probs)

    expected = fc1.clone()
    expected[0], expected[1] = fc1[1], new
    assert torch.equal(linear.packed_weight, expected)
    assert_views_its_buffer(experts)
    assert_matches_fp64(config, out, expected, fc2, x, probs)


CASTS = {"float": lambda m: m.float(), "bfloat16": lambda m: m.bfloat16(),
         "to_cpu": lambda m: m.to("cpu")}


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("replacement", ["data", "data_swap_of_two"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_data_replacement_survives_a_cast_or_move_before_the_next_forward(
        megatron_cpu, dtype, replacement, cast):
    """`p.data = t`, then `model.float()` / `.bfloat16()` / `.to("cpu")`: the module holds `t`
    (in its new dtype), as SequentialMLP's Parameters do; not the slot's old values."""
    config, experts = build(megatron_cpu, dtype)
    fc1, fc2 = weights(experts)
    linear = experts.linear_fc1
    new = torch.randn(2 * FFN, HIDDEN) * 0.1
    expected = fc1.double()
    if replacement == "data":
        linear.weight3.data = new.to(dtype)
        expected[3] = new.to(dtype)
    else:
        linear.weight0.data, linear.weight3.data = linear.weight3.data, linear.weight0.data
        expected[0], expected[3] = fc1[3], fc1[0]

    CASTS[cast](experts)

    packed_dtype = experts.linear_fc1.packed_weight.dtype
    assert packed_dtype == {"float": torch.float32, "bfloat16": torch.bfloat16}.get(cast, dtype)
    assert torch.equal(linear.weight3, expected[3].to(packed_dtype))
    assert torch.equal(linear.packed_weight, expected.to(packed_dtype))
    assert_views_its_buffer(experts)
    x, probs = inputs(packed_dtype)
    assert_matches_fp64(config, experts(x, SPLITS, probs)[0], expected, fc2, x, probs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
@pytest.mark.parametrize("cast", ["cuda", "float"])
@pytest.mark.parametrize("how", ["new_parameter_on_cuda", "data"])
def test_replacement_waiting_survives_a_move_to_cuda(megatron_cpu, how, cast):
    """A new Parameter on CUDA for a CPU module, or a `.data` swap, waits for the next forward;
    `.cuda()` (the "p.data = t, then model.cuda()" loading pattern) or `.float()` before it
    keeps its values."""
    config, experts = build(megatron_cpu, torch.bfloat16)
    fc1, fc2 = weights(experts)
    linear = experts.linear_fc1
    new = (torch.randn(2 * FFN, HIDDEN) * 0.1).bfloat16()
    if how == "data":
        linear.weight3.data = new.clone()
    else:
        linear.weight3 = torch.nn.Parameter(new.cuda(), requires_grad=False)

    experts.cuda() if cast == "cuda" else experts.float()

    expected = fc1.clone()
    expected[3] = new
    packed = linear.packed_weight
    assert torch.equal(linear.weight3.cpu(), new.to(packed.dtype))
    assert torch.equal(packed.cpu(), expected.to(packed.dtype))
    assert_views_its_buffer(experts)
    x, probs = inputs(packed.dtype)
    out, _ = experts(x.to(packed.device), SPLITS, probs.to(packed.device))
    assert_matches_fp64(config, out.cpu(), expected, fc2, x, probs)


def test_move_to_meta_and_back_like_megatron_linears(megatron_cpu):
    """`.to("meta")` moves both projections (Megatron's linears move there too); `to_empty` and
    `load_state_dict` bring the module back with its weights."""
    config, experts = build(megatron_cpu)
    x, probs = inputs(torch.float32)
    fc1, fc2 = weights(experts)
    state = {k: v.clone() for k, v in experts.state_dict().items() if v is not None}
    attributes = {k: (p.tensor_model_parallel, p.partition_dim, p.allreduce)
                  for k, p in experts.named_parameters()}
    seq = sequential_mlp(config, megatron_cpu)
    seq.to("meta")

    experts.to("meta")

    assert {t.device.type for t in [*experts.parameters(), *experts.buffers()]} == {"meta"}
    assert_views_its_buffer(experts)
    assert {k: (p.tensor_model_parallel, p.partition_dim, p.allreduce)
            for k, p in experts.named_parameters()} == attributes
    experts.to_empty(device="cpu")
    experts.load_state_dict(state, strict=False)
    assert_views_its_buffer(experts)
    assert torch.equal(experts.linear_fc1.packed_weight, fc1)
    assert_matches_fp64(config, experts(x, SPLITS, probs)[0], fc1, fc2, x, probs)


def test_replacement_of_the_wrong_shape_is_carried_through_a_move_and_refused_at_forward(
        megatron_cpu):
    """A `.data` of the wrong shape does not stop `.float()` half-way (both projections move);
    the next forward refuses it by name."""
    _, experts = build(megatron_cpu, torch.bfloat16)
    experts.linear_fc2.weight1.data = torch.zeros(3, 3, dtype=torch.bfloat16)

    experts.float()

    assert {t.dtype for t in experts.buffers()} == {torch.float32}
    assert experts.linear_fc2.weight1.dtype == torch.float32
    x, probs = inputs(torch.float32)
    with pytest.raises(ValueError, match=r"linear_fc2\.weight1 has shape \[3, 3\], expected "
                                         r"\[32, 48\]"):
        experts(x, SPLITS, probs)


@pytest.mark.parametrize("assign", [True, False], ids=["assign", "copy"])
def test_load_state_dict_of_its_own_state_keeps_the_module(megatron_cpu, assign):
    """Each weight's own view loaded back (each entry lies in its own slot, so none is copied
    first): the same buffers, each weight a view of its slot, the values unchanged."""
    config, experts = build(megatron_cpu)
    fc1, fc2 = weights(experts)
    linears = (experts.linear_fc1, experts.linear_fc2)
    buffers = [linear.packed_weight for linear in linears]

    experts.load_state_dict(experts.state_dict(), assign=assign)

    assert all(linear.packed_weight is buffer for linear, buffer in zip(linears, buffers))
    assert_views_its_buffer(experts)
    assert torch.equal(experts.linear_fc1.packed_weight, fc1)
    assert torch.equal(experts.linear_fc2.packed_weight, fc2)
