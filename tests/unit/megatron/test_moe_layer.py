"""FP32CombineMoELayer sums each token's top-k expert rows in FP32: one rounding instead of k."""

import collections
import dataclasses

import pytest
import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import build_module

from mcore_torch_experts import _compat
from mcore_torch_experts.combine import fp32_combine
from mcore_torch_experts.megatron import moe_layer as moe_layer_module
from mcore_torch_experts.megatron.moe_layer import FP32CombineMoELayer
from mcore_torch_experts.specs import get_gpt_layer_local_spec
from support.reference import make_config, rel_err

TOKENS, HIDDEN, EXPERTS, TOP_K = 48, 64, 16, 8


def moe_layer(config, layer_class):
    spec = get_gpt_layer_local_spec(config).submodules.mlp
    return _compat.build_moe_layer(_compat.with_moe_layer_class(spec, layer_class), config)


def capture_expert_rows(layer):
    """Record what the experts hand to the combine: rows [N, H] and their token ids [N]."""
    seen = {}

    def hook(module, args, output):
        seen["rows"] = output[0].detach()
        seen["token_ids"] = layer.token_dispatcher.reversed_local_input_permutation_mapping

    layer.experts.register_forward_hook(hook)
    return seen


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("chunk_rows", [0, 7])
def test_top_k_sum_is_rounded_once(megatron_world, cpu_cuda_streams, monkeypatch, dispatcher,
                                  chunk_rows):
    config = make_config(num_experts=EXPERTS, hidden=HIDDEN, ffn=64, moe_router_topk=TOP_K,
                         moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=0.0)
    config.moe_expert_gemm_backend = "torch"
    config.moe_combine_chunk_rows = chunk_rows
    config.moe_combine_backend = "torch"
    torch.manual_seed(0)
    ours = moe_layer(config, FP32CombineMoELayer)
    torch.manual_seed(0)
    megatron = moe_layer(config, MoELayer)
    megatron.load_state_dict(ours.state_dict())
    for p in [*ours.experts.parameters(), *megatron.experts.parameters()]:
        p.requires_grad_(False)
    seen = capture_expert_rows(ours)
    calls = []
    monkeypatch.setattr(moe_layer_module, "fp32_combine",
                        lambda *a, **k: calls.append(k) or fp32_combine(*a, **k))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours.to(device)
    megatron.to(device)
    x = torch.randn(TOKENS, 1, HIDDEN, device=device).bfloat16()
    x_ours = x.clone().requires_grad_(True)
    x_theirs = x.clone().requires_grad_(True)
    out, _ = ours(x_ours)
    out_megatron, _ = megatron(x_theirs)

    assert calls == [dict(chunk_rows=chunk_rows, backend="torch")]
    exact = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64, device=device)
    exact.index_add_(0, seen["token_ids"], seen["rows"].double())
    ours_err = (out.view(TOKENS, HIDDEN).double() - exact).abs()
    bf16_err = (out_megatron.view(TOKENS, HIDDEN).double() - exact).abs()
    # One rounding of the FP32 sum: within half a bf16 ulp (2^-9 relative) of the exact sum.
    assert (ours_err <= exact.abs() * 2.0 ** -8 + 1e-30).all()
    if out.is_cuda:  # CUDA's bf16 scatter-add rounds k times; the CPU kernel accumulates in FP32
        assert ours_err.sum() < bf16_err.sum()
    else:
        assert ours_err.sum() <= bf16_err.sum()

    grad = torch.randn_like(out)
    out.backward(grad)
    out_megatron.backward(grad)
    assert torch.isfinite(x_ours.grad).all()
    rel = (x_ours.grad.float() - x_theirs.grad.float()).norm() / x_theirs.grad.float().norm()
    assert rel < 2e-2  # same math; the FP32 combine only changes the rounding of the sum


def test_unsupported_dispatcher_is_refused(megatron_world):
    with pytest.raises(TypeError, match="allgather and alltoall"):
        moe_layer_module.route_unpermute_through(object(), lambda *a: None)


@pytest.mark.parametrize("settings, named", [
    (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type='flex'"),
    (dict(moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0),
     "moe_pad_expert_input_to_capacity=True"),
], ids=["flex", "drop-and-pad"])
def test_the_layer_built_from_any_spec_refuses_before_megatron_builds_it(megatron_world,
                                                                        settings, named):
    """A spec of someone else's naming FP32CombineMoELayer: the combine's refusal, not Megatron's
    dispatcher's (flex wants DeepEP or HybridEP) nor a half-built layer's."""
    from mcore_torch_experts import TorchExpertsConfigError

    config = make_config(num_experts=EXPERTS, hidden=HIDDEN, ffn=64, moe_router_topk=TOP_K,
                         moe_aux_loss_coeff=0.0, **settings)
    config.moe_expert_gemm_backend = "torch"
    with pytest.raises(TorchExpertsConfigError,
                       match=f"^moe_combine_in_fp32=True does not support {named}: "):
        moe_layer(config, FP32CombineMoELayer)


def test_reference_spec_builds_fp32_combine_layers_when_asked():
    from mcore_torch_experts import TorchExpertsTransformerConfig, TorchGroupedMLP

    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                  moe_ffn_hidden_size=64, moe_grouped_gemm=True, add_bias_linear=False,
                  bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
                  moe_token_dispatcher_type="allgather", moe_expert_gemm_backend="torch")
    plain = get_gpt_layer_local_spec(TorchExpertsTransformerConfig(**fields)).submodules.mlp
    fp32 = get_gpt_layer_local_spec(
        TorchExpertsTransformerConfig(**fields, moe_combine_in_fp32=True)).submodules.mlp
    assert _compat.spec_class(plain) is MoELayer
    assert _compat.spec_class(fp32) is FP32CombineMoELayer
    assert _compat.spec_class(_compat.moe_submodules(fp32).experts) is TorchGroupedMLP


def test_fp32_combine_settings_are_validated():
    from mcore_torch_experts import TorchExpertsConfigError, TorchExpertsTransformerConfig

    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                  moe_ffn_hidden_size=64, moe_combine_in_fp32=True)
    with pytest.raises(TorchExpertsConfigError, match="moe_combine_chunk_rows=-1"):
        TorchExpertsTransformerConfig(**fields, moe_combine_chunk_rows=-1)
    with pytest.raises(TorchExpertsConfigError, match="moe_combine_backend='cuda'"):
        TorchExpertsTransformerConfig(**fields, moe_combine_backend="cuda")
    with pytest.raises(TorchExpertsConfigError, match="moe_token_dispatcher_type='flex'"):
        TorchExpertsTransformerConfig(**fields, moe_token_dispatcher_type="flex")
    # What Megatron's own checks of transformer_impl="inference_optimized" ask for, then ours.
    inference = dict(transformer_impl="inference_optimized", normalization="RMSNorm",
                     add_bias_linear=False, moe_router_dtype="fp32")
    with pytest.raises(TorchExpertsConfigError,
                       match="^moe_combine_in_fp32=True does not support "
                             "transformer_impl='inference_optimized': .* set "
                             "transformer_impl='transformer_engine' or 'local'.$"):
        TorchExpertsTransformerConfig(**fields, **inference)


@pytest.mark.parametrize("layer_class", [MoELayer, FP32CombineMoELayer])
def test_process_groups_a_transformer_layer_hands_its_moe_layer(megatron_cpu, layer_class):
    """A TransformerLayer built with its own pg_collection hands it to Megatron's MoELayer on every
    release, and to FP32CombineMoELayer from megatron-core 0.18. Before 0.18 it hands it only to
    the exact MoELayer class, so FP32CombineMoELayer, its router, token dispatcher and experts run
    on Megatron's global (mpu) groups (docs/guarantees.md, "FP32 top-k combine")."""
    config = make_config(moe_token_dispatcher_type="allgather")
    config.moe_expert_gemm_backend = "torch"
    config.moe_combine_in_fp32 = layer_class is FP32CombineMoELayer
    mpu = megatron_cpu
    own_group = torch.distributed.new_group([0])
    own = ProcessGroupCollection(**{field.name: own_group for field in dataclasses.fields(mpu)
                                    if getattr(mpu, field.name, None) is not None})

    moe = build_module(get_gpt_layer_local_spec(config), config=config, layer_number=1,
                       pg_collection=own).mlp

    assert type(moe) is layer_class
    used = {"moe_layer ep": moe.ep_group, "router tp": moe.router.tp_group,
            "dispatcher ep": moe.token_dispatcher.ep_group, "experts ep": moe.experts.ep_group,
            "experts expt_tp": moe.experts.tp_group}
    if layer_class is MoELayer or _compat.megatron_core_release() >= (0, 18):
        assert used == dict.fromkeys(used, own_group)
    else:
        assert used == {"moe_layer ep": mpu.ep, "router tp": mpu.tp, "dispatcher ep": mpu.ep,
                        "experts ep": mpu.ep, "experts expt_tp": mpu.expt_tp}


@pytest.mark.parametrize("layer_class", [MoELayer, FP32CombineMoELayer])
def test_mtp_flag_a_transformer_layer_hands_its_moe_layer(megatron_cpu, layer_class):
    """An MTP TransformerLayer (is_mtp_layer=True, megatron-core 0.17+) hands the flag to
    Megatron's MoELayer and its router, and to FP32CombineMoELayer from 0.18; 0.17 hands it only
    to the exact MoELayer class (docs/guarantees.md, "FP32 top-k combine")."""
    if _compat.megatron_core_release() < (0, 17):
        pytest.skip("TransformerLayer takes is_mtp_layer from megatron-core 0.17")
    config = make_config(moe_token_dispatcher_type="allgather")
    config.moe_expert_gemm_backend = "torch"
    config.moe_combine_in_fp32 = layer_class is FP32CombineMoELayer

    moe = build_module(get_gpt_layer_local_spec(config), config=config, layer_number=1,
                       pg_collection=megatron_cpu, is_mtp_layer=True).mlp

    assert type(moe) is layer_class
    handed = layer_class is MoELayer or _compat.megatron_core_release() >= (0, 18)
    assert (moe.is_mtp_layer, moe.router.is_mtp_layer) == (handed, handed)


class SharedExpertsRecorder:
    """Stands in for overlapped shared experts inside the alltoall dispatcher: counts each call the
    dispatcher makes and contributes a known output (0.5 everywhere)."""

    def __init__(self):
        self.calls = collections.Counter()
        self.like = None

    def pre_forward_comm(self, hidden_states):
        self.calls["pre_forward_comm"] += 1
        self.like = hidden_states

    def linear_fc1_forward_and_act(self, tokens):
        self.calls["linear_fc1_forward_and_act"] += 1

    def linear_fc2_forward(self, tokens):
        self.calls["linear_fc2_forward"] += 1

    def post_forward_comm(self):
        self.calls["post_forward_comm"] += 1

    def wait_current_stream(self):
        self.calls["wait_current_stream"] += 1

    def get_output(self):
        self.calls["get_output"] += 1
        return torch.full_like(self.like, 0.5)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def alltoall_pair(**overrides):
    """The same alltoall MoE layer as FP32CombineMoELayer and as Megatron's MoELayer, on DEVICE."""
    config = make_config(num_experts=EXPERTS, hidden=HIDDEN, ffn=64, moe_router_topk=TOP_K,
                         moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
                         **overrides)
    config.moe_expert_gemm_backend = "torch"
    config.moe_combine_backend = "torch"
    torch.manual_seed(0)
    ours = moe_layer(config, FP32CombineMoELayer)
    megatron = moe_layer(config, MoELayer)
    megatron.load_state_dict(ours.state_dict())
    for layer in (ours, megatron):
        layer.requires_grad_(False)
    return ours.to(DEVICE), megatron.to(DEVICE)


def test_alltoall_overlapped_shared_experts_run_once_per_forward(megatron_world, cpu_cuda_streams):
    """The FP32 combine keeps the dispatcher's shared-expert protocol: each call Megatron's own
    dispatcher makes happens exactly as often, on every supported release."""
    ours, megatron = alltoall_pair()
    recorders = [SharedExpertsRecorder(), SharedExpertsRecorder()]
    for layer, recorder in zip((ours, megatron), recorders):
        layer.token_dispatcher.shared_experts = recorder  # what set_shared_experts does
    x = torch.randn(TOKENS, 1, HIDDEN, device=DEVICE).bfloat16()
    out, _ = ours(x)
    out_megatron, _ = megatron(x)
    assert recorders[0].calls == recorders[1].calls
    assert recorders[0].calls["linear_fc2_forward"] == 1
    assert recorders[0].calls["get_output"] == 1
    assert rel_err(out, out_megatron) < 1e-2  # both include the shared output once


@pytest.mark.parametrize("overlap", [False, True])
def test_alltoall_with_shared_experts_matches_megatron(megatron_world, cpu_cuda_streams, overlap):
    """Real shared experts, run by the MoE layer (overlap off) or inside the dispatcher (overlap
    on): their fc2 runs once per forward and the output equals MoELayer's."""
    if overlap and not torch.cuda.is_available():
        pytest.skip("overlapped shared experts run on CUDA streams (Megatron's SharedExpertMLP)")
    ours, megatron = alltoall_pair(moe_shared_expert_intermediate_size=64,
                                   moe_shared_expert_overlap=overlap)
    calls = []
    for layer in (ours, megatron):
        assert layer.shared_experts is not None
        layer.shared_experts.linear_fc2.register_forward_hook(
            lambda module, args, output, layer=layer: calls.append(layer))
    x = torch.randn(TOKENS, 1, HIDDEN, device=DEVICE).bfloat16()
    out, _ = ours(x)
    out_megatron, _ = megatron(x)
    assert calls == [ours, megatron]
    assert rel_err(out, out_megatron) < 1e-2


@pytest.mark.parametrize("case", ["top_k", "an_expert_without_tokens", "padded_routing_map"])
def test_token_ids_rebuilt_for_the_fused_permutation_are_megatrons(case):
    """Under moe_permute_fusion the dispatcher keeps TE's row map, and the FP32 combine rebuilds
    each permuted row's token from the routing map: the rows Megatron's own (unfused) permute
    gathers, in its order, on every release."""
    from megatron.core.transformer.moe.moe_utils import permute

    num_tokens, num_experts, top_k = 37, 6, 2
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    if case == "an_expert_without_tokens":
        scores[:, 3] = -1.0
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map.scatter_(1, scores.topk(top_k, dim=1).indices, True)
    if case == "padded_routing_map":  # what routing-map padding adds: more tokens per expert
        routing_map[:5, 0] = True
    tokens = torch.randn(num_tokens, 8, generator=generator)
    num_rows = int(routing_map.sum())
    permuted, _, megatron_ids = permute(tokens, routing_map, num_out_tokens=num_rows)[:3]

    token_ids = moe_layer_module.permuted_token_ids(routing_map, num_rows)

    assert torch.equal(token_ids, megatron_ids)
    assert torch.equal(tokens[token_ids], permuted)


def test_fp32_combine_reads_the_routing_map_under_the_fused_permutation(megatron_world,
                                                                       monkeypatch):
    """The allgather dispatcher with moe_permute_fusion, TE's permute played by a stand-in that
    gathers the same rows and keeps a mapping that is not their token ids (as TE's row map is
    not): the FP32 combine gives what it gives without the fusion, bit for bit (the input
    gradient on CUDA up to the order of atomic additions)."""
    from megatron.core.transformer.moe import token_dispatcher

    unfused_permute = token_dispatcher.permute

    def permute(*args, fused=False, **kwargs):
        rows, probs, token_ids, *rest = unfused_permute(*args, fused=False, **kwargs)
        return (rows, probs, token_ids.flip(0) if fused else token_ids, *rest)

    monkeypatch.setattr(token_dispatcher, "permute", permute)
    config = make_config(num_experts=EXPERTS, hidden=HIDDEN, ffn=64, moe_router_topk=TOP_K,
                         moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0)
    config.moe_expert_gemm_backend, config.moe_combine_backend = "torch", "torch"
    torch.manual_seed(0)
    layer = moe_layer(config, FP32CombineMoELayer)
    layer.experts.requires_grad_(False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer.to(device)
    x = torch.randn(TOKENS, 1, HIDDEN, device=device).bfloat16()
    grad = torch.randn_like(x)
    results = []
    for fused in (False, True):  # set on the built layer: Megatron's config check wants TE
        config.moe_permute_fusion = fused
        x_in = x.clone().requires_grad_(True)
        out, _ = layer(x_in)
        out.backward(grad)
        results.append((out.detach(), x_in.grad))
    (out, dx), (fused_out, fused_dx) = results
    assert torch.equal(fused_out, out)
    if device == "cpu":
        assert torch.equal(fused_dx, dx)
    else:
        # The permutation's backward sums each token's rows with BF16 CUDA atomics, in an order
        # that differs run to run; where the sum nearly cancels, an elementwise tolerance fails
        # at random. Against the gradient's scale the two agree to BF16 rounding (a misread
        # routing map would be off by whole rows).
        error = (fused_dx.float() - dx.float()).abs().max() / dx.float().abs().max()
        assert error < 1e-2, error
