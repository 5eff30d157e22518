"""A GPTModel built from the reference block spec, ready for adapter training under recompute."""

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from .recompute import install_frozen_input_guard
from .specs import get_gpt_decoder_block_spec


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
