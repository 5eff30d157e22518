"""TorchGroupedMLP behaves like Megatron's SequentialMLP and an FP64 per-expert loop."""

import pytest
import torch

from mcore_torch_experts import TorchGroupedMLP
from mcore_torch_experts.kernels import grouped_gemm
from support.reference import (
    copy_weights_to_sequential,
    fp64_experts,
    make_config,
    rel_err,
    sequential_mlp,
)

HIDDEN = 32
# bf16 inputs/weights, FP32 accumulation inside the GEMMs: a few bf16 ulps of relative L2 error.
TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-5}


def build_pair(pg, seed=0, **config_kw):
    """TorchGroupedMLP and SequentialMLP holding the same frozen weights."""
    torch.manual_seed(seed)
    config = make_config(hidden=HIDDEN, **config_kw)
    experts = TorchGroupedMLP(config.num_moe_experts, config, pg_collection=pg)
    seq = sequential_mlp(config, pg)
    copy_weights_to_sequential(experts, seq)
    for p in [*experts.parameters(), *seq.parameters()]:
        p.requires_grad_(False)
    return config, experts, seq


def run(module, x, splits, probs):
    x = x.detach().clone().requires_grad_(True)
    out, bias = module(x, splits, probs)
    assert bias is None
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(grad_out)
    return out, x.grad, grad_out


def fp64_reference(config, experts, x, splits, probs, grad_out):
    x64 = x.detach().double().requires_grad_(True)
    out = fp64_experts(config, experts.linear_fc1.packed_weight, experts.linear_fc2.packed_weight,
                       x64, list(splits), probs)
    out.backward(grad_out.double())
    return out, x64.grad


CASES = [
    dict(activation="silu", glu=True),
    dict(activation="squared_relu", glu=False),
    dict(activation="gelu", glu=False),
    dict(activation="silu", glu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.2),
    dict(activation="silu", glu=True, moe_apply_probs_on_input=True, moe_router_topk=1,
         moe_router_pre_softmax=True),
]
SPLITS = {
    "uniform": [5, 5, 5, 5],
    "skewed": [17, 1, 0, 2],
    "zero_first": [0, 6, 7, 7],
    "zero_middle": [6, 0, 0, 14],
    "zero_last": [9, 6, 5, 0],
    "all_in_one": [0, 0, 20, 0],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("splits_name", list(SPLITS))
def test_matches_sequential_mlp_and_fp64_loop(megatron_cpu, dtype, case, splits_name):
    config, experts, seq = build_pair(megatron_cpu, dtype=dtype, **case)
    splits = SPLITS[splits_name]
    x = torch.randn(sum(splits), HIDDEN).to(dtype)
    probs = torch.rand(sum(splits))
    out, grad_x, grad_out = run(experts, x, torch.tensor(splits), probs)
    seq_out, seq_grad_x, _ = run(seq, x, torch.tensor(splits), probs)
    ref_out, ref_grad_x = fp64_reference(config, experts, x, splits, probs, grad_out)

    assert out.dtype == dtype and grad_x.dtype == dtype
    assert rel_err(out, ref_out) < TOL[dtype]
    assert rel_err(grad_x, ref_grad_x) < TOL[dtype]
    # Megatron's own module computes each expert with a plain GEMM: same math, same rounding.
    assert rel_err(out, seq_out) < TOL[dtype]
    assert rel_err(grad_x, seq_grad_x) < TOL[dtype]


@pytest.mark.parametrize("as_type", ["list", "cpu_tensor", "int32_tensor"])
def test_accepts_splits_as_list_or_tensor(megatron_cpu, as_type):
    _, experts, seq = build_pair(megatron_cpu)
    splits = [3, 0, 4, 1]
    converted = {"list": splits, "cpu_tensor": torch.tensor(splits),
                 "int32_tensor": torch.tensor(splits, dtype=torch.int32)}[as_type]
    x, probs = torch.randn(8, HIDDEN).bfloat16(), torch.rand(8)
    out, _, _ = run(experts, x, converted, probs)
    seq_out, _, _ = run(seq, x, torch.tensor(splits), probs)
    torch.testing.assert_close(out, seq_out)


def test_empty_batch_keeps_the_graph(megatron_cpu):
    _, experts, _ = build_pair(megatron_cpu)
    x = torch.randn(0, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    out, _ = experts(x, torch.zeros(4, dtype=torch.long), torch.rand(0))
    assert out.shape == (0, HIDDEN) and out.requires_grad
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, HIDDEN)


def test_stride_zero_grad_output(megatron_cpu):
    """`.sum().backward()` hands backward an expanded (stride-0) gradient."""
    config, experts, _ = build_pair(megatron_cpu)
    splits = [4, 2, 0, 6]
    x = torch.randn(12, HIDDEN).bfloat16().requires_grad_(True)
    probs = torch.rand(12)
    out, _ = experts(x, splits, probs)
    out.sum().backward()
    _, ref_grad = fp64_reference(config, experts, x, splits, probs, torch.ones(out.shape))
    assert rel_err(x.grad, ref_grad) < TOL[torch.bfloat16]


def test_poisoned_weights_of_idle_experts_do_not_leak(megatron_cpu):
    config, experts, _ = build_pair(megatron_cpu)
    splits = [6, 0, 6, 0]
    with torch.no_grad():
        for i in (1, 3):
            getattr(experts.linear_fc1, f"weight{i}").fill_(float("nan"))
            getattr(experts.linear_fc2, f"weight{i}").fill_(float("nan"))
    x, probs = torch.randn(12, HIDDEN).bfloat16(), torch.rand(12)
    out, grad_x, grad_out = run(experts, x, splits, probs)
    ref_out, ref_grad = fp64_reference(config, experts, x, splits, probs, grad_out)
    assert torch.isfinite(out).all() and torch.isfinite(grad_x).all()
    assert rel_err(out, ref_out) < TOL[torch.bfloat16]
    assert rel_err(grad_x, ref_grad) < TOL[torch.bfloat16]


@pytest.mark.parametrize("splits, message", [
    ([4, 4, 4], "one count per local expert"),
    ([4, 4, 4, 4, 0], "one count per local expert"),
    ([8, -2, 4, 2], "negative"),
    ([4, 4, 4, 4], "sums to 16 but the input has 12 rows"),
    (torch.tensor([3.0, 3.0, 3.0, 3.0]), "integer"),
    ([3.5, 3.5, 3.0, 3.0], r"integer counts, got 3\.5 \(float\)"),  # truncated, would sum to 12
    ([True, 3, 4, 4], r"integer counts, got True \(bool\)"),
    (torch.tensor([[6, 6], [0, 0]]), "one count per local expert"),
])
def test_malformed_splits_raise(megatron_cpu, splits, message):
    _, experts, _ = build_pair(megatron_cpu)
    with pytest.raises(ValueError, match=message):
        experts(torch.randn(12, HIDDEN).bfloat16(), splits, torch.rand(12))


def test_a_list_of_0d_integer_tensors_is_counts(megatron_cpu):
    """`list(tokens_per_expert)` gives 0-d int64 tensors: the same split as the tensor itself."""
    _, experts, _ = build_pair(megatron_cpu)
    splits = torch.tensor([5, 0, 4, 3])
    x, probs = torch.randn(12, HIDDEN).bfloat16(), torch.rand(12)
    expected = experts(x, splits, probs)[0]
    for as_list in (list(splits), list(splits.int()), [5, torch.tensor(0), 4, splits[3]]):
        assert torch.equal(experts(x, as_list, probs)[0], expected)


@pytest.mark.parametrize("splits, message", [
    (list(torch.tensor([3.0, 3.0, 3.0, 3.0])), r"integer counts, got tensor\(3\.\)"),
    (list(torch.tensor([True, False, True, True])), r"integer counts, got tensor\(True\)"),
    ([torch.tensor([6]), 6, 0, 0], r"integer counts, got tensor\(\[6\]\)"),
])
def test_a_list_of_float_bool_or_non_scalar_tensors_is_refused(megatron_cpu, splits, message):
    _, experts, _ = build_pair(megatron_cpu)
    with pytest.raises(ValueError, match=message):
        experts(torch.randn(12, HIDDEN).bfloat16(), splits, torch.rand(12))


def test_wrong_input_width_and_dtype_raise(megatron_cpu):
    _, experts, _ = build_pair(megatron_cpu)
    with pytest.raises(ValueError, match=r"expects input \[T, 32\]"):
        experts(torch.randn(4, HIDDEN + 8).bfloat16(), [1, 1, 1, 1], torch.rand(4))
    with pytest.raises(TypeError, match="dtype"):
        experts(torch.randn(4, HIDDEN), [1, 1, 1, 1], torch.rand(4))


def test_expert_weights_are_built_frozen_and_a_grad_mode_forward_runs(megatron_cpu):
    """A client that trains every weight it is given (Megatron-LM, a full-parameter recipe)
    gets frozen experts: the module builds them so, and the input gradient flows."""
    torch.manual_seed(0)
    config = make_config(hidden=HIDDEN)
    experts = TorchGroupedMLP(4, config, pg_collection=megatron_cpu)
    assert not any(p.requires_grad for p in experts.parameters())
    x = torch.randn(4, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    out, _ = experts(x, [1, 1, 1, 1], torch.rand(4))
    out.float().sum().backward()
    assert x.grad.abs().sum() > 0


def test_base_weights_made_trainable_after_the_build_are_refused_under_grad_mode(megatron_cpu):
    torch.manual_seed(0)
    config = make_config(hidden=HIDDEN)
    experts = TorchGroupedMLP(4, config, pg_collection=megatron_cpu)
    experts.linear_fc2.weight3.requires_grad_(True)
    x, probs = torch.randn(4, HIDDEN).bfloat16(), torch.rand(4)
    with pytest.raises(RuntimeError, match=r"linear_fc2.weight3 requires grad .* Keep the expert "
                                           r"base frozen"):
        experts(x, [1, 1, 1, 1], probs)
    with torch.no_grad():
        out, _ = experts(x, [1, 1, 1, 1], probs)
    assert out.shape == (4, HIDDEN)


@pytest.fixture
def fresh_entry_point():
    """The seam's entry point found anew in the test, and again after it."""
    grouped_gemm._entry_point.cache_clear()
    yield
    grouped_gemm._entry_point.cache_clear()


@pytest.mark.parametrize("available", ["both", "private_only"])
def test_both_grouped_gemm_entry_points(megatron_cpu, monkeypatch, fresh_entry_point, available):
    """The public entry point is preferred; with it hidden the private one runs. Same answer.
    (The seam, kernels.grouped_gemm.grouped_mm, finds its entry point once per process: the test
    has it found again here, and again after.)"""
    calls = []
    if available == "both":
        owner, name, expected = torch.nn.functional, "grouped_mm", "torch.nn.functional.grouped_mm"
    else:
        monkeypatch.delattr(torch.nn.functional, "grouped_mm")
        owner, name, expected = torch, "_grouped_mm", "torch._grouped_mm"
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    config, experts, seq = build_pair(megatron_cpu)
    assert experts.grouped_mm_name == expected
    assert experts.linear_fc2.grouped_mm_name == expected
    x, probs = torch.randn(10, HIDDEN).bfloat16(), torch.rand(10)
    out, _, _ = run(experts, x, [4, 0, 5, 1], probs)
    assert len(calls) == 4  # fc1 and fc2, forward and backward
    seq_out, _, _ = run(seq, x, torch.tensor([4, 0, 5, 1]), probs)
    torch.testing.assert_close(out, seq_out)


def test_no_grouped_gemm_is_a_clear_error_at_construction(megatron_cpu, monkeypatch):
    monkeypatch.delattr(torch.nn.functional, "grouped_mm", raising=False)
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    with pytest.raises(RuntimeError, match="needs torch >= 2.9"):
        TorchGroupedMLP(4, make_config(hidden=HIDDEN), pg_collection=megatron_cpu)
    with pytest.raises(RuntimeError, match="grouped_mm"):
        grouped_gemm.find_grouped_mm()


def test_state_dict_keys_are_te_grouped_mlp_keys_without_the_buffer(megatron_cpu):
    _, experts, _ = build_pair(megatron_cpu)
    expected = {f"linear_fc{j}.weight{i}" for j in (1, 2) for i in range(4)}
    expected |= {"linear_fc1._extra_state", "linear_fc2._extra_state"}
    assert set(experts.state_dict()) == expected
    assert not any("packed" in k for k in experts.state_dict())
    assert [n for n, _ in experts.named_buffers()] == ["linear_fc1.packed_weight",
                                                      "linear_fc2.packed_weight"]


def test_one_storage_per_projection(megatron_cpu):
    _, experts, _ = build_pair(megatron_cpu)
    for linear in (experts.linear_fc1, experts.linear_fc2):
        storage = linear.packed_weight.untyped_storage().data_ptr()
        for i, w in enumerate(linear.expert_weights()):
            assert w.untyped_storage().data_ptr() == storage
            assert w.data_ptr() == linear.packed_weight[i].data_ptr()
        assert linear.packed_weight.is_contiguous()


def test_parameters_carry_megatron_expert_attributes(megatron_cpu):
    _, experts, _ = build_pair(megatron_cpu)
    for linear, dim in ((experts.linear_fc1, 0), (experts.linear_fc2, 1)):
        for w in linear.expert_weights():
            assert w.allreduce is True  # EP == 1: expert grads reduce with the dense ones
            assert w.tensor_model_parallel is True and w.partition_dim == dim


@pytest.mark.parametrize("how", ["new_parameter", "data_swap"])
def test_replaced_middle_expert_is_repacked(megatron_cpu, how):
    config, experts, _ = build_pair(megatron_cpu)
    new_fc1 = torch.randn(2 * 48, HIDDEN).bfloat16() * 0.05
    if how == "new_parameter":
        experts.linear_fc1.weight2 = torch.nn.Parameter(new_fc1.clone(), requires_grad=False)
    else:
        experts.linear_fc1.weight2.data = new_fc1.clone()
    splits = [2, 3, 4, 1]
    x, probs = torch.randn(10, HIDDEN).bfloat16(), torch.rand(10)
    out, _, grad_out = run(experts, x, splits, probs)
    torch.testing.assert_close(experts.linear_fc1.packed_weight[2], new_fc1)
    assert experts.linear_fc1.weight2.data_ptr() == experts.linear_fc1.packed_weight[2].data_ptr()
    ref_out, _ = fp64_reference(config, experts, x, splits, probs, grad_out)
    assert rel_err(out, ref_out) < TOL[torch.bfloat16]


def test_load_state_dict_writes_into_the_buffer(megatron_cpu):
    _, source, _ = build_pair(megatron_cpu, seed=1)
    _, target, _ = build_pair(megatron_cpu, seed=2)
    pointers = [w.data_ptr() for w in target.linear_fc1.expert_weights()]
    target.load_state_dict(source.state_dict(), strict=True)
    assert [w.data_ptr() for w in target.linear_fc1.expert_weights()] == pointers
    torch.testing.assert_close(target.linear_fc1.packed_weight, source.linear_fc1.packed_weight)
    torch.testing.assert_close(target.linear_fc2.packed_weight, source.linear_fc2.packed_weight)


def test_dtype_cast_keeps_parameters_as_views(megatron_cpu):
    _, experts, _ = build_pair(megatron_cpu)
    before = experts.linear_fc2.packed_weight.float()
    experts.float()
    linear = experts.linear_fc2
    assert linear.packed_weight.dtype == torch.float32
    assert all(w.data_ptr() == linear.packed_weight[i].data_ptr()
               for i, w in enumerate(linear.expert_weights()))
    torch.testing.assert_close(linear.packed_weight, before)


def test_backward_dw_is_a_no_op(megatron_cpu):
    _, experts, _ = build_pair(megatron_cpu)
    assert experts.backward_dw() is None


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_column_major_input_and_gradient(megatron_cpu, case):
    """A [T, H] input laid out column-major (`x.t().contiguous().t()`, strides (1, T)) and a
    column-major output gradient: grouped GEMM needs 16-byte strides, SequentialMLP takes any."""
    config, experts, seq = build_pair(megatron_cpu, **case)
    splits = [3, 5, 0, 3]  # T = 11 rows: a column-major bf16 stride of 22 bytes
    x = torch.randn(sum(splits), HIDDEN).bfloat16().t().contiguous().t()
    probs = torch.rand(sum(splits))
    grad_out = torch.randn(sum(splits), HIDDEN).bfloat16().t().contiguous().t()
    results = []
    for module in (experts, seq):
        x_in = x.detach().clone(memory_format=torch.preserve_format).requires_grad_(True)
        assert x_in.stride() == (1, sum(splits))
        out, _ = module(x_in, torch.tensor(splits), probs)
        out.backward(grad_out)
        results.append((out, x_in.grad))
    ref_out, ref_grad = fp64_reference(config, experts, x, splits, probs, grad_out)
    for out, grad in results:
        assert rel_err(out, ref_out) < TOL[torch.bfloat16]
        assert rel_err(grad, ref_grad) < TOL[torch.bfloat16]


def test_the_first_forward_logs_once_what_this_process_runs(megatron_cpu, monkeypatch, caplog):
    """One line per rank says that TorchGroupedMLP runs, in how many layers, and how many of
    its expert weights are frozen; later forwards add nothing."""
    import weakref

    from mcore_torch_experts import experts as experts_module

    monkeypatch.setattr(experts_module, "_BUILT", weakref.WeakSet())
    monkeypatch.setattr(experts_module, "_summary_logged", False)
    config = make_config(hidden=HIDDEN)
    layers = [TorchGroupedMLP(4, config, pg_collection=megatron_cpu) for _ in range(2)]
    layers[1].linear_fc1.weight2.requires_grad_(True)
    x, probs = torch.randn(4, HIDDEN).bfloat16(), torch.rand(4)
    with caplog.at_level("INFO", logger="mcore_torch_experts"), torch.no_grad():
        for layer in layers:
            layer(x, [1, 1, 1, 1], probs)
    lines = [r.getMessage() for r in caplog.records if r.name == "mcore_torch_experts"]
    assert len(lines) == 1
    gib = 2 * 4 * (2 * 48 * HIDDEN + HIDDEN * 48) * 2 / 2**30
    assert lines[0].startswith(
        f"mcore_torch_experts: rank 0 runs TorchGroupedMLP experts in 2 MoE layer(s): 16 expert "
        f"weights ({gib:.2f} GiB packed), 15 of them frozen; ")


def test_the_log_line_names_the_path_the_first_forward_takes(megatron_cpu, monkeypatch, caplog):
    """On the CPU the activation runs as torch ops even where the Triton activation kernel covers
    the config (kernels.activation "fused", for CUDA tensors): the line says so; the output is
    the FP64 loop's."""
    import weakref

    from mcore_torch_experts import experts as experts_module

    monkeypatch.setattr(experts_module, "_BUILT", weakref.WeakSet())
    monkeypatch.setattr(experts_module, "_summary_logged", False)
    config = make_config(hidden=HIDDEN)
    module = TorchGroupedMLP(4, config, pg_collection=megatron_cpu)
    pytest.importorskip("triton", reason="without triton the activation is eager everywhere")
    assert module.kernels.activation == "fused"  # resolved for CUDA tensors
    x, probs = torch.randn(8, HIDDEN).bfloat16(), torch.rand(8)
    splits = [2, 3, 0, 3]
    with caplog.at_level("INFO", logger="mcore_torch_experts"), torch.no_grad():
        out, _ = module(x, splits, probs)
    lines = [r.getMessage() for r in caplog.records if r.name == "mcore_torch_experts"]
    assert len(lines) == 1
    assert lines[0].endswith(f"; {module.grouped_mm_name}, expert kernel grouped_mm, "
                             "activation eager"), lines[0]
    weights = [torch.stack(linear.expert_weights()).double()
               for linear in (module.linear_fc1, module.linear_fc2)]
    assert rel_err(out, fp64_experts(config, *weights, x.double(), splits, probs)) < TOL[
        torch.bfloat16]
