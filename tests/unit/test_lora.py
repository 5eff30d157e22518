"""LoRA adapters: the math against FP64 loops, Megatron-Bridge's wrapper contract, apply_lora's
targeting and freezing, adapter-only checkpoints, and argument errors."""

import json

import pytest
import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from mcore_torch_experts import TorchExpertsTransformerConfig, TorchGroupedMLP
from mcore_torch_experts.lora import (
    LoRAAdapter,
    LoRALinear,
    PerExpertLoRAAdapter,
    apply_lora,
    load_lora_state_dict,
    lora_parameters,
    lora_state_dict,
)
from mcore_torch_experts.megatron.model import build_gpt_model
from support.reference import make_config, rel_err
from support.torchrun import ROOT, torchrun

IN, OUT, RANK, ALPHA, EXPERTS = 32, 48, 8, 16.0, 4
TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-5}
SPLITS = {
    "uniform": [5, 5, 5, 5],
    "zero_experts": [0, 12, 0, 8],
    "all_in_one": [0, 0, 20, 0],
    "empty_batch": [0, 0, 0, 0],
}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def with_random_b(adapter):
    """B starts at zero; give it values so that every factor and the output are exercised."""
    with torch.no_grad():
        adapter.linear_out.weight.normal_()
    return adapter


def run(adapter, x, *args):
    """Forward and backward with a fixed upstream gradient: out, x, A and B gradients, grad_out."""
    x = x.detach().clone().requires_grad_(True)
    out = adapter(x, *args)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(grad_out)
    return out, x.grad, adapter.linear_in.weight.grad, adapter.linear_out.weight.grad, grad_out


def fp64_lora(x, a, b, splits, grad_out):
    """Per-expert FP64 loop (one pair for all rows when `a` is [r, in]): out, x, A, B gradients."""
    x, a, b = (t.detach().double().requires_grad_(True) for t in (x, a, b))
    pieces, start = [], 0
    for e, count in enumerate(splits):
        a_e, b_e = (a[e], b[e]) if a.dim() == 3 else (a, b)
        pieces.append(x[start:start + count] @ a_e.T @ b_e.T * (ALPHA / RANK))
        start += count
    out = torch.cat(pieces)
    out.backward(grad_out.double())
    return out, x.grad, a.grad, b.grad


@DTYPES
@pytest.mark.parametrize("splits_name", list(SPLITS))
def test_per_expert_adapter_matches_fp64_loop(dtype, splits_name):
    torch.manual_seed(0)
    splits = SPLITS[splits_name]
    adapter = with_random_b(PerExpertLoRAAdapter(EXPERTS, IN, OUT, RANK, ALPHA, 0.0, dtype, "cpu"))
    x = torch.randn(sum(splits), IN).to(dtype)
    out, grad_x, grad_a, grad_b, grad_out = run(adapter, x, torch.tensor(splits))
    expected = fp64_lora(x, adapter.linear_in.weight, adapter.linear_out.weight, splits, grad_out)

    assert out.shape == (sum(splits), OUT) and out.dtype == dtype
    for actual, reference in zip((out, grad_x, grad_a, grad_b), expected):
        if reference.numel() and reference.norm() > 0:
            assert rel_err(actual, reference) < TOL[dtype]
    for e, count in enumerate(splits):  # an expert without tokens gets exactly zero gradient
        if count == 0:
            assert grad_a[e].abs().max() == 0 and grad_b[e].abs().max() == 0


@DTYPES
def test_per_expert_adapter_takes_a_column_major_input(dtype):
    """x [T, in] laid out column-major (x.t().contiguous().t()): the row-major result, exactly."""
    torch.manual_seed(0)
    splits = torch.tensor(SPLITS["zero_experts"])
    adapter = with_random_b(PerExpertLoRAAdapter(EXPERTS, IN, OUT, RANK, ALPHA, 0.0, dtype, "cpu"))
    x = torch.randn(int(splits.sum()), IN).to(dtype)
    expected = run(adapter, x, splits)
    adapter.zero_grad()
    got = run(adapter, x.t().contiguous().t(), splits)
    for actual, reference in zip(got, expected):
        assert torch.equal(actual, reference)


@DTYPES
def test_shared_adapter_matches_fp64_and_ignores_the_splits(dtype):
    torch.manual_seed(0)
    adapter = with_random_b(LoRAAdapter(IN, OUT, RANK, ALPHA, 0.0, dtype, "cpu"))
    splits = SPLITS["zero_experts"]
    x = torch.randn(sum(splits), IN).to(dtype)
    out, grad_x, grad_a, grad_b, grad_out = run(adapter, x, torch.tensor(splits))
    expected = fp64_lora(x, adapter.linear_in.weight, adapter.linear_out.weight, splits, grad_out)

    for actual, reference in zip((out, grad_x, grad_a, grad_b), expected):
        assert rel_err(actual, reference) < TOL[dtype]


@pytest.mark.parametrize("adapter_type", [LoRAAdapter, PerExpertLoRAAdapter])
def test_fp32_adapter_weights_run_in_the_input_dtype(adapter_type):
    sizes = (IN, OUT) if adapter_type is LoRAAdapter else (EXPERTS, IN, OUT)
    adapter = with_random_b(adapter_type(*sizes, RANK, ALPHA, 0.0, torch.float32, "cpu"))
    out, grad_x, grad_a, grad_b, _ = run(adapter, torch.randn(20, IN).bfloat16(),
                                         torch.tensor(SPLITS["uniform"]))
    assert out.dtype == grad_x.dtype == torch.bfloat16
    assert grad_a.dtype == grad_b.dtype == torch.float32


def test_wrapper_returns_base_output_plus_adapter_and_the_base_bias(megatron_cpu):
    config = make_config(dtype=torch.float32)
    base = ColumnParallelLinear(IN, OUT, config=config, init_method=torch.nn.init.normal_,
                                bias=True, skip_bias_add=True, tp_group=megatron_cpu.tp)
    adapter = LoRAAdapter(IN, OUT, RANK, ALPHA, 0.0, torch.float32, "cpu")
    wrapped = LoRALinear(base, adapter)
    x = torch.randn(5, 2, IN)

    out, bias = wrapped(x)
    base_out, base_bias = base(x)
    assert bias is base_bias
    assert torch.equal(out, base_out)  # B = 0: the wrapped layer starts as its base
    with_random_b(adapter)
    out, _ = wrapped(x)
    torch.testing.assert_close(out, base_out + adapter(x))


class NormThenLinear(torch.nn.Module):
    """The interface of TE's LayerNorm column linear (x -> RMSNorm -> linear, its layer-norm
    output switch), answering in the form Megatron's linears use for `form`: "plain" (out, bias),
    "nested" ((out, ln_out), bias) as TE with the switch on, "triple" (out, bias, ln_out)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.return_layernorm_output = False
        self.norm = torch.nn.RMSNorm(IN, eps=1e-5)
        self.weight = torch.nn.Parameter(torch.randn(OUT, IN))

    def forward(self, x):
        ln_out = self.norm(x)
        out = ln_out @ self.weight.T
        if not self.return_layernorm_output or self.form == "plain":
            return out, None
        return ((out, ln_out), None) if self.form == "nested" else (out, None, ln_out)


@pytest.mark.parametrize("form", ["nested", "triple"])
def test_wrapper_gives_the_adapter_the_layer_norm_output_in_every_form(form):
    base = NormThenLinear(form)
    adapter = LoRAAdapter(IN, OUT, RANK, ALPHA, 0.0, torch.float64, "cpu")
    with_random_b(adapter)
    wrapped = LoRALinear(base.double(), adapter)
    assert base.return_layernorm_output  # asked for, as Megatron-Bridge does
    x = torch.randn(5, 2, IN, dtype=torch.float64)

    out, bias = wrapped(x)
    ln = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * base.norm.weight
    expected = ln @ base.weight.T + ln @ adapter.linear_in.weight.T @ adapter.linear_out.weight.T \
        * (ALPHA / RANK)
    assert bias is None
    torch.testing.assert_close(out, expected)


def test_wrapper_passes_the_splits_to_a_grouped_base_and_its_adapter(megatron_cpu):
    config = make_config(dtype=torch.float32, hidden=IN)
    experts = TorchGroupedMLP(EXPERTS, config, pg_collection=megatron_cpu)
    experts.requires_grad_(False)
    base = experts.linear_fc1
    in_features, out_features = base.in_features, base.out_features
    adapter = with_random_b(PerExpertLoRAAdapter(EXPERTS, in_features, out_features, RANK,
                                                 ALPHA, 0.0, torch.float32, "cpu"))
    splits = torch.tensor(SPLITS["zero_experts"])
    x = torch.randn(int(splits.sum()), in_features)

    out, bias = LoRALinear(base, adapter)(x, splits)
    assert bias is None
    torch.testing.assert_close(out, base(x, splits)[0] + adapter(x, splits))


class LayerNormLinearLike(torch.nn.Module):
    """Stands in for TE's LayerNormColumnParallelLinear: norm inside, and the normalised input
    returned third when `return_layernorm_output` is set."""

    parallel_mode = "column"

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(IN)
        self.weight = torch.nn.Parameter(torch.randn(OUT, IN))
        self.return_layernorm_output = False

    def forward(self, x):
        normed = self.norm(x)
        out = normed @ self.weight.T
        return (out, None, normed) if self.return_layernorm_output else (out, None)


def test_adapter_on_a_layernorm_linear_sees_the_normalised_input():
    base = LayerNormLinearLike()
    adapter = with_random_b(LoRAAdapter(IN, OUT, RANK, ALPHA, 0.0, torch.float32, "cpu"))
    x = 3 + 2 * torch.randn(6, IN)

    out, bias = LoRALinear(base, adapter)(x)
    assert base.return_layernorm_output
    torch.testing.assert_close(out, base(x)[0] + adapter(base.norm(x)))


# --- apply_lora on a GPT model: a dense layer, then a MoE layer with a shared expert ---------


def gpt(seed=0):
    torch.manual_seed(seed)
    config = TorchExpertsTransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=EXPERTS,
        moe_layer_freq=[0, 1], moe_ffn_hidden_size=64, ffn_hidden_size=96,
        moe_shared_expert_intermediate_size=64, moe_router_topk=2, moe_grouped_gemm=True,
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32, use_cpu_initialization=True,
        moe_expert_gemm_backend="torch")
    return build_gpt_model(config, vocab_size=128, max_sequence_length=16).eval()


def logits(model):
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(tokens, torch.arange(16).expand(2, 16),
                     torch.ones(1, 1, 16, 16).triu(1).bool())


TARGETS = ["linear_qkv", "linear_fc1"]
WRAPPED = {
    "decoder.layers.0.self_attention.linear_qkv": LoRAAdapter,
    "decoder.layers.0.mlp.linear_fc1": LoRAAdapter,  # dense MLP
    "decoder.layers.1.self_attention.linear_qkv": LoRAAdapter,
    "decoder.layers.1.mlp.experts.linear_fc1": PerExpertLoRAAdapter,
    "decoder.layers.1.mlp.shared_experts.linear_fc1": LoRAAdapter,  # not a routed expert
}


def test_apply_lora_freezes_the_base_and_wraps_exactly_the_targets(megatron_cpu_training):
    model = gpt()
    names = apply_lora(model, TARGETS, rank=RANK, alpha=ALPHA, expert_adapter="per_expert")

    assert sorted(names) == sorted(WRAPPED)
    for name, adapter_type in WRAPPED.items():
        module = model.get_submodule(name)
        assert isinstance(module, LoRALinear) and type(module.adapter) is adapter_type
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if ".adapter." in n}
    assert len(trainable) == 2 * len(WRAPPED)
    experts_a = model.get_submodule("decoder.layers.1.mlp.experts.linear_fc1").adapter
    assert experts_a.linear_in.weight.shape == (EXPERTS, RANK, 64)


def test_a_pattern_target_matches_full_names(megatron_cpu_training):
    names = apply_lora(gpt(), ["*.layers.1.*.linear_fc1"], rank=RANK, alpha=ALPHA)
    assert sorted(names) == ["decoder.layers.1.mlp.experts.linear_fc1",
                             "decoder.layers.1.mlp.shared_experts.linear_fc1"]


@pytest.mark.parametrize("expert_adapter", ["shared", "per_expert"])
def test_fresh_adapters_leave_the_model_unchanged(megatron_cpu_training, expert_adapter):
    model = gpt()
    before = logits(model)
    apply_lora(model, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], rank=RANK,
               alpha=ALPHA, expert_adapter=expert_adapter)
    assert torch.equal(logits(model), before)


def test_base_state_dict_keys_survive_wrapping(megatron_cpu_training):
    plain, wrapped = gpt(), gpt()
    apply_lora(wrapped, TARGETS, rank=RANK, alpha=ALPHA)
    base_state = plain.state_dict()
    state = wrapped.state_dict()
    adapter_keys = set(lora_state_dict(wrapped))

    assert state.keys() - adapter_keys == base_state.keys()
    wrapped.load_state_dict(state, strict=True)


def test_adapter_state_dict_round_trip(megatron_cpu_training):
    trained = gpt()
    apply_lora(trained, TARGETS, rank=RANK, alpha=ALPHA, expert_adapter="per_expert")
    with torch.no_grad():
        for p in lora_parameters(trained).values():
            p.normal_(std=0.05)
    state = {k: v.clone() for k, v in lora_state_dict(trained).items()}
    assert all(".adapter.linear_" in key for key in state) and len(state) == 2 * len(WRAPPED)

    fresh = gpt()
    apply_lora(fresh, TARGETS, rank=RANK, alpha=ALPHA, expert_adapter="per_expert")
    assert not torch.equal(logits(fresh), logits(trained))
    load_lora_state_dict(fresh, state)
    assert torch.equal(logits(fresh), logits(trained))


def test_loading_adapter_state_is_strict(megatron_cpu_training):
    model = gpt()
    apply_lora(model, TARGETS, rank=RANK, alpha=ALPHA)
    state = dict(lora_state_dict(model))
    first = next(iter(state))

    with pytest.raises(KeyError, match="missing"):
        load_lora_state_dict(model, {k: v for k, v in state.items() if k != first})
    with pytest.raises(KeyError, match="unexpected.*extra.adapter"):
        load_lora_state_dict(model, {**state, "extra.adapter.linear_in.weight": state[first]})
    with pytest.raises(ValueError, match="shape"):
        load_lora_state_dict(model, {**state, first: state[first][:1]})


@pytest.mark.parametrize("kwargs, argument", [
    (dict(expert_adapter="per_token"), "expert_adapter"),
    (dict(rank=0), "rank"),
    (dict(rank=-4), "rank"),
    (dict(rank=4, expert_adapter="per_expert"), "rank"),
    (dict(dropout=1.0), "dropout"),
    (dict(targets=["linear_nowhere"]), "targets"),
    (dict(targets="linear_qkv"), "targets"),
])
def test_bad_arguments_name_the_argument(megatron_cpu_training, kwargs, argument):
    arguments = {**dict(targets=TARGETS, rank=RANK, alpha=ALPHA), **kwargs}
    with pytest.raises(ValueError, match=f"^{argument}="):
        apply_lora(gpt(), **arguments)


def test_a_target_that_is_not_a_linear_is_refused(megatron_cpu_training):
    with pytest.raises(TypeError, match="decoder.layers.1.mlp.experts .*TorchGroupedMLP"):
        apply_lora(gpt(), ["experts"], rank=RANK, alpha=ALPHA)


def test_applying_lora_twice_is_refused(megatron_cpu_training):
    model = gpt()
    apply_lora(model, TARGETS, rank=RANK, alpha=ALPHA)
    with pytest.raises(ValueError, match="already carry LoRA"):
        apply_lora(model, TARGETS, rank=RANK, alpha=ALPHA)


def test_a_second_call_keeps_the_first_calls_adapters_training(megatron_cpu_training):
    model = gpt().train()
    first = apply_lora(model, ["linear_qkv"], rank=RANK, alpha=ALPHA)
    second = apply_lora(model, ["linear_fc1", "*linear_in"], rank=RANK, alpha=ALPHA)
    assert set(second) == {name for name in WRAPPED if name not in first}  # no adapter re-wrapped

    params = lora_parameters(model)
    assert len(params) == 2 * len(WRAPPED)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(params)
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith("linear_out.weight"):
                p.normal_(std=0.1)  # B = 0 would leave every A without gradient
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens, torch.arange(16).expand(2, 16), torch.ones(1, 1, 16, 16).triu(1).bool(),
          labels=tokens).sum().backward()
    starved = [n for n, p in params.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not starved


@pytest.mark.distributed
def test_tensor_parallel_layout_matches_the_unsharded_model(tmp_path):
    """TP=2 on two gloo processes: a column-parallel and a row-parallel base with adapters give
    the unsharded model's output and gradients, on both ranks (replicated factors included)."""
    run = torchrun(ROOT / "tests" / "distributed" / "lora_tensor_parallel.py", 2, [],
                   tmp_path / "torchrun.log", timeout_s=240)
    assert run.returncode == 0, run.output[-4000:]
    # rank 0's one JSON line: a report per rank
    reports = json.loads(next(line for line in reversed(run.output.splitlines())
                              if line.startswith("[{")))
    for report in reports:
        assert all(err < 1e-12 for err in report.values()), report
