"""Fusions on the MoE path of a megatron-core MoE config, with TorchGroupedMLP experts and with
FP32CombineMoELayer, on a GPT built from Megatron's TE spec (CUDA, BF16; the TE leg). Each works:
the model with it computes what the same model without it computes, and what Megatron's
TEGroupedMLP model with it computes.

- moe_permute_fusion: TE's fused permute / unpermute / chunk sort in the dispatchers (the FP32
  combine rebuilds the rows' token ids, which TE's row map replaces).
- moe_router_fusion: TE's fused top-k, scores and aux loss.
- use_te_activation_func (SwiGLU): TEGroupedMLP runs TE's SwiGLU op; TorchGroupedMLP computes the
  same function itself.
- use_fused_weighted_squared_relu, bias_activation_fusion: Megatron's fused activation x probs in
  TEGroupedMLP (squared ReLU, SwiGLU); TorchGroupedMLP computes the same math itself.
- moe_latent_size: the MoE layer's latent projections are TE linears; TorchGroupedMLP runs in the
  latent width (no "without it" model here: the TEGroupedMLP one is the reference).
Refused when the config is built (tests/unit/test_config.py, every leg): routing-map padding for
FP8/FP4, the TE op fuser, and TE's activation ops other than SwiGLU.
"""

import pytest
from megatron.core.activations import squared_relu
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_torch_experts import FP32CombineMoELayer, TorchGroupedMLP
from support.reference import rel_err
from support.te import needs_te, te_config, te_gpt
from support.tiny_gpt import MOE_LAYERS, forward_backward, freeze_experts

pytestmark = needs_te
SAME_TOL, SAME_GRAD_TOL = 1e-2, 5e-2  # BF16: a fused kernel against the unfused torch path
DISPATCHERS = ["allgather", "alltoall"]
SQUARED_RELU = dict(activation_func=squared_relu, gated_linear_unit=False)
FUSIONS = {  # name: (the setting, the model it applies to)
    "moe_permute_fusion": (dict(moe_permute_fusion=True), {}),
    "moe_router_fusion": (dict(moe_router_fusion=True), {}),
    "use_te_activation_func": (dict(use_te_activation_func=True), {}),
    "use_fused_weighted_squared_relu": (dict(use_fused_weighted_squared_relu=True), SQUARED_RELU),
    "bias_activation_fusion": (dict(bias_activation_fusion=True), {}),
}
LATENT = 32  # hidden 64 -> latent 32 -> the experts


def moe_layers(model):
    return [model.decoder.layers[i].mlp for i in MOE_LAYERS]


def run(config, state=None):
    """(model, logits, loss, grads) of a TE-spec GPT for `config` with the weights `state` (those
    it was built with when None), expert weights frozen."""
    model = te_gpt(config)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert unexpected == [] and all(key.endswith("_extra_state") for key in missing)
    freeze_experts(model)
    return (model, *forward_backward(model))


def assert_close(got, expected):
    _, logits, loss, grads = got
    _, ref_logits, ref_loss, ref_grads = expected
    assert rel_err(logits, ref_logits) < SAME_TOL and rel_err(loss, ref_loss) < SAME_TOL
    assert grads.keys() == ref_grads.keys() and "embedding.word_embeddings.weight" in grads
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) < SAME_GRAD_TOL, name


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_fusion_with_torch_grouped_mlp(te_world, fusion, dispatcher):
    setting, model_fields = FUSIONS[fusion]
    fields = dict(moe_token_dispatcher_type=dispatcher, **model_fields)
    plain = run(te_config(moe_expert_gemm_backend="torch", **fields))
    state = plain[0].state_dict()

    fused = run(te_config(moe_expert_gemm_backend="torch", **fields, **setting), state)
    theirs = run(te_config(**fields, **setting), state)  # TEGroupedMLP with the same setting

    assert all(type(layer.experts) is TorchGroupedMLP for layer in moe_layers(fused[0]))
    assert all(getattr(layer.config, fusion) for layer in moe_layers(fused[0]))
    assert_close(fused, plain)
    assert_close(fused, theirs)


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_fusion_with_fp32_combine(te_world, fusion, dispatcher):
    """use_fused_weighted_squared_relu is read by Megatron's experts only: `fused` and `plain`
    run the same code for it, and TEGroupedMLP with the fusion is the check that can fail."""
    setting, model_fields = FUSIONS[fusion]
    fields = dict(moe_token_dispatcher_type=dispatcher, **model_fields)
    ours = dict(moe_expert_gemm_backend="torch", moe_combine_in_fp32=True, **fields)
    plain = run(te_config(**ours))
    state = plain[0].state_dict()

    fused = run(te_config(**ours, **setting), state)
    theirs = run(te_config(**fields, **setting), state)  # TEGroupedMLP with the same setting

    # allgather: the experts read the routed rows in place (no permute, fused or not), the
    # combine reads fc2's rows; alltoall: Megatron's permute, the FP32 combine after it.
    combine = "combine_preprocess" if dispatcher == "allgather" else "combine_postprocess"
    route = "hand_tokens_in_place" if dispatcher == "allgather" else "route_unpermute_through"
    for layer in moe_layers(fused[0]):
        assert type(layer) is FP32CombineMoELayer
        assert route in getattr(layer.token_dispatcher, combine).__qualname__
        assert getattr(layer.token_dispatcher, "rows_in_place", False) == (dispatcher == "allgather")
    assert_close(fused, plain)
    assert_close(fused, theirs)


@pytest.mark.skipif("moe_latent_size" not in TransformerConfig.__dataclass_fields__,
                    reason="moe_latent_size arrived in a later megatron-core")
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_latent_moe_with_torch_grouped_mlp_and_fp32_combine(te_world, dispatcher):
    fields = dict(moe_token_dispatcher_type=dispatcher, moe_latent_size=LATENT)
    theirs = run(te_config(**fields))  # TEGroupedMLP between TE's latent projections
    state = theirs[0].state_dict()
    ours = run(te_config(moe_expert_gemm_backend="torch", **fields), state)
    fp32 = run(te_config(moe_expert_gemm_backend="torch", moe_combine_in_fp32=True, **fields),
               state)

    for layer in moe_layers(ours[0]) + moe_layers(fp32[0]):
        assert type(layer.experts) is TorchGroupedMLP
        fc1, fc2 = layer.experts.linear_fc1, layer.experts.linear_fc2
        assert fc1.in_features == fc2.out_features == LATENT
    assert all(type(layer) is FP32CombineMoELayer for layer in moe_layers(fp32[0]))
    assert_close(ours, theirs)
    assert_close(fp32, ours)
