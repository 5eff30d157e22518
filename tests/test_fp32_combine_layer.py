"""FP32CombineMoELayer sums each token's top-k expert rows in FP32: one rounding instead of k."""

import dataclasses

import pytest
import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import build_module

from mcore_torch_experts import moe_layer as moe_layer_module
from mcore_torch_experts.combine import fp32_combine
from mcore_torch_experts.moe_layer import FP32CombineMoELayer
from mcore_torch_experts.specs import get_gpt_layer_local_spec
from reference import make_config

TOKENS, HIDDEN, EXPERTS, TOP_K = 48, 64, 16, 8


def moe_layer(config, layer_class):
    spec = get_gpt_layer_local_spec(config).submodules.mlp
    spec = dataclasses.replace(spec, module=layer_class)
    return build_module(spec, config=config)


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
def test_top_k_sum_is_rounded_once(megatron_cpu, monkeypatch, dispatcher, chunk_rows):
    if dispatcher == "alltoall" and not torch.cuda.is_available():
        pytest.skip("megatron-core 0.16's alltoall dispatcher needs CUDA streams")
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


def test_unsupported_dispatcher_is_refused(megatron_cpu):
    from mcore_torch_experts import _compat

    with pytest.raises(TypeError, match="allgather and alltoall"):
        _compat.route_unpermute_through(object(), lambda *a: None)


def test_reference_spec_builds_fp32_combine_layers_when_asked():
    from mcore_torch_experts import TorchExpertsTransformerConfig, TorchGroupedMLP

    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                  moe_ffn_hidden_size=64, moe_grouped_gemm=True, add_bias_linear=False,
                  bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
                  moe_token_dispatcher_type="allgather", moe_expert_gemm_backend="torch")
    plain = get_gpt_layer_local_spec(TorchExpertsTransformerConfig(**fields)).submodules.mlp
    fp32 = get_gpt_layer_local_spec(
        TorchExpertsTransformerConfig(**fields, moe_combine_in_fp32=True)).submodules.mlp
    assert plain.module is MoELayer and fp32.module is FP32CombineMoELayer
    assert fp32.submodules.experts.module is TorchGroupedMLP


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
