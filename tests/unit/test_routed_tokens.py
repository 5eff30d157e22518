"""The experts read the routed rows in place: FP32CombineMoELayer on the allgather dispatcher hands
TorchGroupedMLP the tokens and the row index (RoutedTokens), no permuted copy; fc1's fused kernel
reads each row through the index; the rows' input gradients are summed per token in FP32.
Checked against the FP64 per-expert loop and Megatron's own MoELayer with the same weights."""

import pytest
import torch
from megatron.core.transformer.moe import token_dispatcher as megatron_dispatchers
from megatron.core.transformer.moe.moe_layer import MoELayer

from mcore_torch_experts import _compat
from mcore_torch_experts.combine import CombineOptions
from mcore_torch_experts.megatron.moe_layer import FP32CombineMoELayer
from mcore_torch_experts.routed_tokens import RoutedTokens, sum_rows_by_token
from mcore_torch_experts.specs import get_gpt_layer_local_spec
from support.reference import fp64_experts, make_config, rel_err

TORCH_COMBINE = CombineOptions(chunk_rows=5, backend="torch")
# Skipped on a CUDA host before a child interpreter starts: the compiled kernels are checked there
# (test_layer_on_cuda_reads_rows_in_place_with_compiled_kernels).
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="on a CUDA host the kernels run compiled (the CUDA test)")


def routed_rows(gen, num_tokens, splits):
    """token_ids [N]: for each expert in turn, its tokens ascending (a token at most once per
    expert), as Megatron's permute orders them; the last token is routed nowhere."""
    ids = [torch.randperm(num_tokens - 1, generator=gen)[:n].sort().values for n in splits]
    return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)


def skip_without_interpreted_kernels():
    pytest.importorskip("triton", reason="triton is not installed: the fused kernels are untested")
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no CPU grouped_mm for fc2 and fc1's input gradient")


def test_gathered_rows_sum_their_gradients_per_token_in_fp32():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(9, 6, generator=gen).bfloat16().requires_grad_(True)
    token_ids = routed_rows(gen, 9, [3, 0, 5, 2])
    routed = RoutedTokens(tokens, token_ids, TORCH_COMBINE)
    rows = routed.rows()
    assert torch.equal(rows, tokens.detach()[token_ids])
    grad = torch.randn(rows.shape, generator=gen).bfloat16()
    rows.backward(grad)
    exact = torch.zeros(9, 6, dtype=torch.float64).index_add_(0, token_ids, grad.double())
    assert torch.equal(tokens.grad, exact.bfloat16())  # one rounding of the exact sum
    assert not tokens.grad[8].any()  # routed nowhere
    empty = RoutedTokens(tokens, token_ids[:0], TORCH_COMBINE)
    assert empty.rows().shape == (0, 6)
    assert sum_rows_by_token(grad[:0], empty.token_ids, 9, TORCH_COMBINE).shape == (9, 6)


@pytest.mark.once_per_venv
@pytest.mark.triton_interpreter
@INTERPRETED
@pytest.mark.parametrize("glu", [False, True])
def test_fc1_kernel_reads_rows_through_the_index_bit_for_bit(glu):
    """fc1's kernel given the tokens and the index writes what it writes for the permuted copy."""
    skip_without_interpreted_kernels()
    from mcore_torch_experts.kernels.choice import KERNEL_ACTIVATIONS
    from mcore_torch_experts.kernels.fused_experts_triton import fc1_activation

    gen = torch.Generator().manual_seed(1)
    E, H, F, T = 4, 40, 24, 50
    act = KERNEL_ACTIVATIONS[torch.nn.functional.silu]
    w1 = (torch.randn(E, F * (2 if glu else 1), H, generator=gen) * 0.2).bfloat16()
    tokens = torch.randn(T, H, generator=gen).bfloat16()
    for splits in ([7, 0, 33, 2], [0, 0, 0, 0]):
        token_ids = routed_rows(gen, T, splits)
        offs = torch.tensor(splits).cumsum(0).int()
        probs = torch.rand(len(token_ids), generator=gen)
        gathered = fc1_activation(tokens, w1, offs, probs, act, glu, 0.0, None, save_h=True,
                                  token_ids=token_ids)
        copied = fc1_activation(tokens[token_ids], w1, offs, probs, act, glu, 0.0, None,
                                save_h=True)
        assert all(torch.equal(g, c) for g, c in zip(gathered, copied))


def _lora(kind, num_experts, in_features, out_features, rank, gen):
    lead = (num_experts,) if kind == "per_expert" else ()
    a = (torch.randn(*lead, rank, in_features, generator=gen) * 0.3).bfloat16()
    b = (torch.randn(*lead, out_features, rank, generator=gen) * 0.3).bfloat16()
    return a.requires_grad_(True), b.requires_grad_(True)


def forward_backward(fused_experts, args, routed, leaves, grad):
    """[output, each leaf's gradient] of one forward and backward."""
    for leaf in leaves:
        leaf.grad = None
    out = fused_experts(*args, routed=routed)
    out.backward(grad)
    return [out.detach()] + [leaf.grad.clone() for leaf in leaves]


@pytest.mark.once_per_venv
@pytest.mark.triton_interpreter
@INTERPRETED
@pytest.mark.parametrize("activation, glu, kind", [("squared_relu", False, None),
                                                   ("silu", True, "shared"),
                                                   ("squared_relu", False, "per_expert")])
def test_fused_experts_on_routed_tokens_match_fp64(activation, glu, kind):
    """fused_experts on RoutedTokens against the FP64 loop on the gathered rows: output, the
    tokens' gradient (each token's rows summed), the probs' and the adapters' gradients; a token
    routed nowhere gets a zero gradient, the no-grad pass gives the same output, a second run
    the same bits, an empty batch an empty output."""
    skip_without_interpreted_kernels()
    from mcore_torch_experts.kernels.fused_experts import LoRATerm, fused_experts

    gen = torch.Generator().manual_seed(2)
    E, H, F, T, rank = 4, 40, 24, 60, 8
    config = make_config(activation, glu, num_experts=E, hidden=H, ffn=F)
    width = F * (2 if glu else 1)
    scale = 2.0
    for splits in ([13, 0, 41, 6], [0] * E):
        token_ids = routed_rows(gen, T, splits)
        offs = torch.tensor(splits).cumsum(0).int()
        w1 = (torch.randn(E, width, H, generator=gen) * 0.2).bfloat16()
        w2 = (torch.randn(E, H, F, generator=gen) * 0.2).bfloat16()
        factors = (*_lora(kind, E, H, width, rank, gen), *_lora(kind, E, F, H, rank, gen)) \
            if kind else ()
        terms = (LoRATerm(*factors[:2], scale), LoRATerm(*factors[2:], scale)) if kind else ()
        tokens = torch.randn(T, H, generator=gen).bfloat16().requires_grad_(True)
        probs = torch.rand(len(token_ids), generator=gen).requires_grad_(True)
        grad = torch.randn(len(token_ids), H, generator=gen).bfloat16()
        leaves = (tokens, probs, *factors)
        routed = RoutedTokens(tokens, token_ids, TORCH_COMBINE)

        args = (config, tokens, probs, w1, w2, offs, *terms)
        first, second = (forward_backward(fused_experts, args, routed, leaves, grad)
                         for _ in range(2))
        assert all(torch.equal(f, s) for f, s in zip(first, second))
        with torch.no_grad():
            again = fused_experts(config, tokens, probs, w1, w2, offs, *terms, routed=routed)
        assert torch.equal(again, first[0])
        out, d_tokens, *grads = first
        assert out.shape == (len(token_ids), H) and d_tokens.shape == (T, H)
        assert not d_tokens[T - 1].any()
        if not token_ids.numel():
            assert not d_tokens.any()
            continue
        ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
        t64, p64, *f64 = ref_leaves
        fc1, fc2 = w1.double(), w2.double()
        if kind:
            fc1 = fc1 + scale * (f64[1] @ f64[0])
            fc2 = fc2 + scale * (f64[3] @ f64[2])
        ref = fp64_experts(config, fc1, fc2, t64[token_ids], splits, p64)
        ref.backward(grad.double())
        errors = {name: rel_err(got, want.grad if want is not ref else want)
                  for name, got, want in zip(("out", "tokens", "probs", "a1", "b1", "a2", "b2"),
                                             [out, d_tokens, *grads], [ref, *ref_leaves])}
        # the interpreter truncates to bf16 where the GPU rounds: 2e-2, not 1e-2
        assert max(errors.values()) < 2e-2, (splits, errors)


# --- the MoE layer ---------------------------------------------------------------------------

TOKENS, HIDDEN, EXPERTS, TOP_K = 40, 64, 8, 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def layer_pair(dispatcher="allgather", backend="torch", combine="torch", **overrides):
    """The same MoE layer as FP32CombineMoELayer and as Megatron's MoELayer (experts frozen), on
    DEVICE."""
    fields = dict(num_experts=EXPERTS, hidden=HIDDEN, ffn=48, moe_router_topk=TOP_K,
                  moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=0.0,
                  moe_grouped_gemm=backend == "torch")  # else the local spec's SequentialMLP
    config = make_config(**{**fields, **overrides})
    config.moe_expert_gemm_backend = backend
    config.moe_combine_backend = combine
    spec = get_gpt_layer_local_spec(config).submodules.mlp
    layers = []
    for layer_class in (FP32CombineMoELayer, MoELayer):
        torch.manual_seed(0)
        layers.append(_compat.build_moe_layer(_compat.with_moe_layer_class(spec, layer_class),
                                              config))
    ours, megatron = layers
    megatron.load_state_dict(ours.state_dict())
    for layer in layers:
        layer.experts.requires_grad_(False)
    return ours.to(DEVICE), megatron.to(DEVICE)


def record_expert_inputs(layer):
    inputs = []
    layer.experts.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    return inputs


def fp64_layer(layer, x):
    """The MoE layer in FP64 from its router's choices: y[t] = sum over t's experts e of
    probs[t, e] * expert_e(x[t]), TorchGroupedMLP's weights, an expert at a time."""
    with torch.no_grad():
        probs, routing_map = layer.router(x)
    x2 = x.view(-1, HIDDEN).double()
    out = torch.zeros_like(x2)
    fc1, fc2 = layer.experts.linear_fc1, layer.experts.linear_fc2
    for e in range(EXPERTS):
        rows = routing_map[:, e].nonzero().squeeze(1)
        w1, w2 = getattr(fc1, f"weight{e}").double(), getattr(fc2, f"weight{e}").double()
        ref = fp64_experts(layer.config, w1[None], w2[None], x2[rows], [len(rows)],
                           probs[rows, e].double())
        out.index_add_(0, rows, ref)
    return out


@pytest.mark.parametrize("adapters", [None, "shared", "per_expert"])
def test_allgather_layer_hands_torch_experts_the_tokens_in_place(megatron_world, monkeypatch,
                                                                 adapters):
    """No permuted copy: Megatron's permute is never called, the experts get RoutedTokens in
    Megatron's row order; the output matches the FP64 layer (without adapters), and the output
    and every gradient
    (input, router, adapters) match Megatron's MoELayer with the same weights."""
    from mcore_torch_experts import apply_lora

    ours, megatron = layer_pair()
    if adapters:
        for layer in (ours, megatron):
            torch.manual_seed(1)
            apply_lora(torch.nn.ModuleDict({"mlp": layer}), ["linear_fc1", "linear_fc2"],
                       rank=8, alpha=16, expert_adapter=adapters)  # named as in a model
            for name, p in layer.named_parameters():
                if "adapter" in name:
                    torch.nn.init.normal_(p, std=0.1)
            layer.router.requires_grad_(True)
    inputs = record_expert_inputs(ours)
    x = torch.randn(TOKENS, 1, HIDDEN, device=DEVICE).bfloat16()
    x_ours, x_theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_megatron, _ = megatron(x_theirs)
    megatron_rows = megatron.token_dispatcher.reversed_local_input_permutation_mapping

    def no_permute(*args, **kwargs):
        raise AssertionError("the allgather dispatcher made a permuted copy")

    monkeypatch.setattr(megatron_dispatchers, "permute", no_permute)
    out, _ = ours(x_ours)
    (routed,) = inputs
    assert isinstance(routed, RoutedTokens) and routed.tokens.shape == (TOKENS, HIDDEN)
    assert torch.equal(routed.token_ids, megatron_rows)  # the token of each row, in its order
    if adapters is None:
        assert rel_err(out.view(TOKENS, HIDDEN), fp64_layer(ours, x)) < 1e-2
    assert rel_err(out, out_megatron) < 1e-2

    grad = torch.randn_like(out)
    out.backward(grad)
    out_megatron.backward(grad)
    assert rel_err(x_ours.grad, x_theirs.grad) < 2e-2
    theirs = dict(megatron.named_parameters())
    trained = [(n, p) for n, p in ours.named_parameters() if p.requires_grad]
    assert len(trained) == (5 if adapters else 1)  # the router, and fc1's and fc2's A and B
    for name, p in trained:
        assert rel_err(p.grad, theirs[name].grad) < 2e-2, name


def test_in_place_rows_with_probs_on_the_input(megatron_world):
    """moe_apply_probs_on_input (top-1): the experts gather the rows before scaling them."""
    ours, megatron = layer_pair(moe_router_topk=1, moe_apply_probs_on_input=True,
                                moe_router_pre_softmax=True)
    x = torch.randn(TOKENS, 1, HIDDEN, device=DEVICE).bfloat16()
    x_ours, x_theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, _ = ours(x_ours)
    out_megatron, _ = megatron(x_theirs)
    assert rel_err(out, out_megatron) < 1e-2
    grad = torch.randn_like(out)
    out.backward(grad)
    out_megatron.backward(grad)
    assert rel_err(x_ours.grad, x_theirs.grad) < 2e-2


@pytest.mark.parametrize("dispatcher, backend", [("allgather", "transformer_engine"),
                                                 ("alltoall", "torch")])
def test_other_experts_and_the_alltoall_dispatcher_get_the_permuted_copy(
        megatron_world, cpu_cuda_streams, dispatcher, backend):
    """SequentialMLP experts (the local spec's without the torch backend) and the alltoall
    dispatcher, which permutes before its all-to-all, keep Megatron's permuted rows."""
    ours, megatron = layer_pair(dispatcher, backend)
    inputs = record_expert_inputs(ours)
    x = torch.randn(TOKENS, 1, HIDDEN, device=DEVICE).bfloat16()
    out, _ = ours(x)
    assert isinstance(inputs[0], torch.Tensor) and inputs[0].shape[0] == TOKENS * TOP_K
    assert rel_err(out, megatron(x)[0]) < 1e-2


@pytest.mark.triton_interpreter
@INTERPRETED
def test_layer_with_fused_kernels_reads_rows_in_place(megatron_world, monkeypatch):
    """moe_expert_kernel="fused_gemm" in the layer: fc1's kernel reads the tokens through the
    index (fused_experts gets RoutedTokens); output and input gradient match Megatron's layer."""
    skip_without_interpreted_kernels()
    from mcore_torch_experts.kernels import fused_experts as fused_module
    from mcore_torch_experts.kernels.choice import resolve_kernels

    ours, megatron = layer_pair(activation="squared_relu", glu=False)
    ours.config.moe_expert_kernel = "fused_gemm"  # one config object: both layers
    ours.experts.kernels = megatron.experts.kernels = resolve_kernels(ours.config)
    seen = []
    real = fused_module.fused_experts
    monkeypatch.setattr(fused_module, "fused_experts",
                        lambda *a, **k: seen.append(k.get("routed")) or real(*a, **k))
    x = torch.randn(TOKENS, 1, HIDDEN, device=DEVICE).bfloat16()
    x_ours, x_theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, _ = ours(x_ours)
    out_megatron, _ = megatron(x_theirs)
    assert isinstance(seen[0], RoutedTokens) and seen[1] is None
    assert rel_err(out, out_megatron) < 1e-2
    grad = torch.randn_like(out)
    out.backward(grad)
    out_megatron.backward(grad)
    assert rel_err(x_ours.grad, x_theirs.grad) < 2e-2


def test_built_moe_layers_convert_to_fp32_combine_in_place(megatron_world):
    """convert_moe_layers_to_fp32_combine on a model's MoELayer: the same module, parameters and
    state dict; then the layer FP32CombineMoELayer builds, bit for bit, its experts reading the
    rows in place."""
    from mcore_torch_experts import convert_moe_layers_to_fp32_combine

    built, converted = layer_pair()
    model = torch.nn.ModuleDict({"mlp": converted})
    before = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    state = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    assert convert_moe_layers_to_fp32_combine(model) == ["mlp"]
    assert type(model["mlp"]) is FP32CombineMoELayer and model["mlp"] is converted
    assert all(p is before[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    inputs = record_expert_inputs(converted)
    x = torch.randn(TOKENS, 1, HIDDEN, device=DEVICE).bfloat16()
    assert torch.equal(converted(x)[0], built(x)[0])
    assert isinstance(inputs[0], RoutedTokens)
    assert convert_moe_layers_to_fp32_combine(model) == []  # already converted


def test_model_chunks_convert_as_convert_experts_to_torch_takes_them(megatron_world):
    """docs/specs.md's two calls on a list of model chunks (what Megatron-LM's get_model and
    Bridge's providers return), each holding Megatron's MoELayer with SequentialMLP experts:
    convert_experts_to_torch, then convert_moe_layers_to_fp32_combine, both on the list. Every
    chunk's layer is converted and named as the first call names it; its TorchGroupedMLP experts
    read the rows in place and give the output and input gradient of Megatron's untouched layer."""
    from mcore_torch_experts import convert_experts_to_torch, convert_moe_layers_to_fp32_combine
    from mcore_torch_experts.experts import TorchGroupedMLP

    chunks = [torch.nn.ModuleDict({"mlp": layer_pair(backend="transformer_engine")[1]})
              for _ in range(2)]
    megatron = layer_pair(backend="transformer_engine")[1]
    assert type(megatron.experts).__name__ == "SequentialMLP"
    assert convert_experts_to_torch(chunks).names == ["0.mlp.experts", "1.mlp.experts"]
    assert convert_moe_layers_to_fp32_combine(chunks) == ["0.mlp", "1.mlp"]
    x = torch.randn(TOKENS, 1, HIDDEN, device=DEVICE).bfloat16()
    grad = torch.randn_like(x)
    x_theirs = x.clone().requires_grad_(True)
    out_megatron, _ = megatron(x_theirs)
    out_megatron.backward(grad)
    for chunk in chunks:
        layer = chunk["mlp"]
        assert type(layer) is FP32CombineMoELayer and type(layer.experts) is TorchGroupedMLP
        inputs = record_expert_inputs(layer)
        x_ours = x.clone().requires_grad_(True)
        out, _ = layer(x_ours)
        out.backward(grad)
        assert isinstance(inputs[0], RoutedTokens)
        assert rel_err(out, out_megatron) < 1e-2
        assert rel_err(x_ours.grad, x_theirs.grad) < 2e-2
    assert convert_moe_layers_to_fp32_combine(chunks) == []  # already converted


def test_conversion_refuses_before_it_changes_a_layer(megatron_world):
    """A layer whose config the combine cannot run is named, and no layer is converted."""
    from mcore_torch_experts import TorchExpertsConfigError, convert_moe_layers_to_fp32_combine

    good = layer_pair()[1]
    bad = layer_pair()[1]
    bad.config.moe_pad_expert_input_to_capacity = True
    model = torch.nn.ModuleList([good, bad])
    with pytest.raises(TorchExpertsConfigError,
                       match="convert_moe_layers_to_fp32_combine does not support "
                             "moe_pad_expert_input_to_capacity=True"):
        convert_moe_layers_to_fp32_combine(model)
    assert type(good) is MoELayer and type(bad) is MoELayer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layer_on_cuda_reads_rows_in_place_with_compiled_kernels(megatron_world, monkeypatch):
    """On CUDA, the compiled fused kernels and the triton combine: fused_experts gets
    RoutedTokens; output, input and router gradients match Megatron's layer and repeat bit for
    bit run to run."""
    from mcore_torch_experts.kernels import fused_experts as fused_module
    from mcore_torch_experts.kernels.choice import resolve_kernels

    ours, megatron = layer_pair(combine="triton", activation="squared_relu", glu=False)
    ours.config.moe_expert_kernel = "fused_gemm"
    ours.experts.kernels = resolve_kernels(ours.config)
    seen = []
    real = fused_module.fused_experts
    monkeypatch.setattr(fused_module, "fused_experts",
                        lambda *a, **k: seen.append(k.get("routed")) or real(*a, **k))
    x = torch.randn(TOKENS * 8, 1, HIDDEN, device=DEVICE).bfloat16()
    grad = torch.randn_like(x)

    def run(layer):
        layer.zero_grad(set_to_none=True)
        xk = x.clone().requires_grad_(True)
        out, _ = layer(xk)
        out.backward(grad)
        return out.detach(), xk.grad, layer.router.weight.grad.clone()

    first, second, theirs = run(ours), run(ours), run(megatron)
    assert isinstance(seen[0], RoutedTokens)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    for got, want in zip(first, theirs):
        assert rel_err(got, want) < 2e-2
