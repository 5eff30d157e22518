"""Models built from the reference specs: a GPTModel ready for adapter training under recompute,
and one MoE layer."""

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from .. import _compat
from .recompute import install_frozen_input_guard
from .specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec


def build_gpt_model(config: TransformerConfig, *, vocab_size: int, max_sequence_length: int,
                    use_transformer_engine: bool = False, **gpt_kwargs) -> GPTModel:
    """GPTModel whose layers come from `specs.get_gpt_decoder_block_spec` (MoE experts follow
    `moe_expert_gemm_backend`), with the frozen-input guard installed on its decoder.

    `gpt_kwargs` go to GPTModel (e.g. `position_embedding_type`).
    """
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_transformer_engine)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                     max_sequence_length=max_sequence_length, **gpt_kwargs)
    install_frozen_input_guard(model)
    return model


def build_moe_layer(config: TransformerConfig, **kwargs):
    """The MoE layer of `specs.get_gpt_layer_local_spec(config)` (experts follow
    `moe_expert_gemm_backend`: TorchGroupedMLP, or Megatron's choice), built with `config` and
    `kwargs` (e.g. `pg_collection`)."""
    return _compat.build_moe_layer(get_gpt_layer_local_spec(config).submodules.mlp, config,
                                   **kwargs)
