"""Dense-to-MoE upcycling into TorchGroupedMLP experts gives what Megatron's own upcycling gives a
SequentialMLP model with the same settings: the same weights (in the packed buffers) and the same
logits; with granularity 1 both reproduce the dense model."""

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.moe import upcycling_utils

from mcore_torch_experts import TorchGroupedMLP
from mcore_torch_experts.megatron.upcycling import (
    load_and_upcycle_model,
    torch_experts_upcycling,
    upcycle_state_dict,
)
from mcore_torch_experts.specs import get_gpt_decoder_block_spec
from support.tiny_gpt import batch, gpt, sequential_to_grouped, tiny_config

DENSE_FFN, NUM_EXPERTS, LAYERS = 128, 4, 2


def models(granularity, activation="swiglu", dtype=torch.float32):
    """(dense, MoE with SequentialMLP experts, MoE with TorchGroupedMLP experts), every layer MoE;
    the two MoE models share their non-expert weights (router included)."""
    act = dict(swiglu=dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu),
               gelu=dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu))[activation]
    common = dict(num_layers=LAYERS, moe_layer_freq=1, bf16=dtype == torch.bfloat16,
                  params_dtype=dtype, **act)
    dense_config = tiny_config(**common, num_moe_experts=None, moe_ffn_hidden_size=None,
                               ffn_hidden_size=DENSE_FFN)
    # A block spec: a model built from a layer spec gets Megatron's TENorm as its final norm
    # wherever Transformer Engine is importable, and TENorm runs on CUDA only.
    dense = gpt(dense_config, gpt_layer_specs.get_gpt_decoder_block_spec(dense_config, False),
                seed=1)
    moe = dict(common, num_moe_experts=NUM_EXPERTS, moe_ffn_hidden_size=DENSE_FFN // granularity)
    seq_config = tiny_config(**moe, moe_grouped_gemm=False)
    sequential = gpt(seq_config, gpt_layer_specs.get_gpt_decoder_block_spec(seq_config, False))
    torch_config = tiny_config(**moe, moe_grouped_gemm=True, moe_expert_gemm_backend="torch")
    grouped = gpt(torch_config, get_gpt_decoder_block_spec(torch_config, False), seed=2)
    missing, unexpected = grouped.load_state_dict(sequential_to_grouped(sequential.state_dict()),
                                                  strict=False)
    assert not unexpected and all(key.endswith("._extra_state") for key in missing)
    return dense, sequential, grouped


def logits(model):
    inputs, positions, mask, _ = batch()
    with torch.no_grad():
        return model.eval()(inputs, positions, mask)


def experts(model):
    return [layer.mlp.experts for layer in model.decoder.layers]


def check_packed_views(model):
    for module in experts(model):
        assert isinstance(module, TorchGroupedMLP)
        for linear in (module.linear_fc1, module.linear_fc2):
            for i, weight in enumerate(linear.expert_weights()):
                assert weight.data_ptr() == linear.packed_weight[i].data_ptr()


@pytest.mark.parametrize("granularity,activation", [(1, "swiglu"), (2, "swiglu"), (2, "gelu")])
def test_upcycled_torch_experts_equal_megatrons_sequential_path(megatron_cpu, granularity,
                                                                activation):
    dense, sequential, grouped = models(granularity, activation)
    expected = upcycling_utils.upcycle_state_dict([sequential], [dense])["model"]
    sequential.load_state_dict(expected)

    state = upcycle_state_dict([grouped], [dense])["model"]
    grouped.load_state_dict(state)

    expected_grouped = sequential_to_grouped(expected)
    assert set(state) == set(expected_grouped) | {
        f"decoder.layers.{layer}.mlp.experts.linear_fc{j}._extra_state"
        for layer in range(LAYERS) for j in (1, 2)}
    loaded = grouped.state_dict()
    for key, value in expected_grouped.items():
        if torch.is_tensor(value):
            assert torch.equal(loaded[key], value), key
    # Each dense fc2 [H, ffn] is split into `granularity` expert slices: every slice is upcycled.
    dense_fc2 = dense.decoder.layers[0].mlp.linear_fc2.weight
    fc2 = experts(grouped)[0].linear_fc2.packed_weight
    assert fc2.shape == (NUM_EXPERTS, dense_fc2.shape[0], DENSE_FFN // granularity)
    check_packed_views(grouped)

    moe_logits = logits(grouped)
    assert torch.equal(moe_logits, logits(sequential))
    if granularity == 1:  # identical experts, top-k probs summing to 1: the dense model again
        torch.testing.assert_close(moe_logits, logits(dense), rtol=0, atol=1e-5)


def test_load_and_upcycle_model_from_a_dense_checkpoint(megatron_cpu, tmp_path):
    dense, sequential, grouped = models(granularity=2, dtype=torch.bfloat16)
    torch.save(dense.state_dict(), tmp_path / "dense.pt")
    fresh_dense = models(granularity=2, dtype=torch.bfloat16)[0]
    torch.manual_seed(3)
    for param in fresh_dense.parameters():  # the checkpoint, not these weights, must count
        torch.nn.init.normal_(param)

    def load_dense_checkpoint(path):
        fresh_dense.load_state_dict(torch.load(path))
        return 7, 1.5e9

    result = load_and_upcycle_model(load_dense_checkpoint, [grouped], [fresh_dense],
                                    load_args=(tmp_path / "dense.pt",))

    assert result == (7, 1.5e9)
    upcycling_utils.load_and_upcycle_model(lambda: (0, 0.0), [sequential], [dense])
    check_packed_views(grouped)
    assert torch.equal(logits(grouped), logits(sequential))


def test_megatron_refuses_outside_the_context_and_accepts_inside(megatron_cpu):
    dense, _, grouped = models(granularity=1)
    with pytest.raises(TypeError, match="is not supported by upcycling"):
        upcycling_utils.upcycle_state_dict([grouped], [dense])
    with torch_experts_upcycling(), torch_experts_upcycling():  # nesting keeps it accepted
        state = upcycling_utils.upcycle_state_dict([grouped], [dense])["model"]
        assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in state
    with pytest.raises(TypeError, match="is not supported by upcycling"):  # restored on exit
        upcycling_utils.upcycle_state_dict([grouped], [dense])
