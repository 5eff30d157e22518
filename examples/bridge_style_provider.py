"""A Megatron-Bridge style model provider (a dataclass config with `provide()`) whose
`transformer_layer_spec` gives MoE layers TorchGroupedMLP experts when
`moe_expert_gemm_backend="torch"`, switched on through NeMo-RL style model overrides. Runs a tiny
GPT-MoE on the CPU; Megatron-Bridge itself is not needed (and not imported).

    python examples/bridge_style_provider.py

With the real Megatron-Bridge, any GPTModelProvider subclass (e.g. Qwen3MoEModelProvider) takes
the same two fields:

    from dataclasses import dataclass
    from megatron.bridge.models.qwen import Qwen3MoEModelProvider
    from mcore_torch_experts.specs import gpt_transformer_layer_spec

    @dataclass
    class Qwen3MoETorchExpertsProvider(Qwen3MoEModelProvider):
        moe_expert_gemm_backend: str = "transformer_engine"      # "torch": TorchGroupedMLP
        transformer_layer_spec: Union[ModuleSpec, Callable] = gpt_transformer_layer_spec  # follows the flag

Bridge calls `transformer_layer_spec(provider, vp_stage=...)` inside `provide()`. On a provider
instance (e.g. from `AutoBridge.from_hf_pretrained(...).to_megatron_provider()`) set
`provider.moe_expert_gemm_backend = "torch"`, `provider.moe_grouped_gemm = True` and
`provider.transformer_layer_spec = gpt_transformer_layer_spec` before `provider.finalize()`.
NeMo-RL builds its provider as `dataclasses.replace(provider, **policy.megatron_cfg.model_overrides)`,
which accepts only fields the provider class declares: with the subclass above,

    policy:
      megatron_cfg:
        moe_grouped_gemm: true            # a first-class NeMo-RL key, not an override
        model_overrides:
          moe_expert_gemm_backend: torch

`main()` below applies the override (and moe_grouped_gemm) with `dataclasses.replace`, as
NeMo-RL does. See docs/enable.md.
"""

import dataclasses
from typing import Callable, Optional, Union

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec

from cpu_support import describe_layers, frozen_experts_step, init_single_process_megatron
from mcore_torch_experts import TorchExpertsTransformerConfig
from mcore_torch_experts.specs import gpt_transformer_layer_spec

MODEL_OVERRIDES = {"moe_expert_gemm_backend": "torch", "moe_grouped_gemm": True}


@dataclasses.dataclass
class TinyGPTMoEProvider(TorchExpertsTransformerConfig):
    """Stands in for megatron.bridge.models.GPTModelProvider: the model's settings are dataclass
    fields, `provide()` builds it."""

    vocab_size: int = 128
    seq_length: int = 16
    position_embedding_type: str = "rope"
    transformer_layer_spec: Union[ModuleSpec, Callable] = gpt_transformer_layer_spec

    def provide(self, pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                vp_stage: Optional[int] = None) -> GPTModel:
        spec = self.transformer_layer_spec
        if not isinstance(spec, ModuleSpec):
            spec = spec(self, vp_stage=vp_stage)
        return GPTModel(self, transformer_layer_spec=spec, vocab_size=self.vocab_size,
                        max_sequence_length=self.seq_length,
                        pre_process=True if pre_process is None else pre_process,
                        post_process=True if post_process is None else post_process,
                        position_embedding_type=self.position_embedding_type, vp_stage=vp_stage)


def main():
    init_single_process_megatron()
    on_cpu = not torch.cuda.is_available()
    provider = TinyGPTMoEProvider(
        num_layers=3, moe_layer_freq=[0, 1, 1], hidden_size=64, num_attention_heads=4,
        ffn_hidden_size=256, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=on_cpu)
    provider = dataclasses.replace(provider, **MODEL_OVERRIDES)  # NeMo-RL: model_overrides

    torch.manual_seed(0)
    model = provider.provide().to("cpu" if on_cpu else "cuda")
    device = next(model.parameters()).device
    loss = frozen_experts_step(model, provider.vocab_size, provider.seq_length)
    layers = describe_layers(model)
    print(f"bridge_style_provider (model_overrides {MODEL_OVERRIDES}): layers [{layers}]; "
          f"loss {loss:.3f} on {device}")


if __name__ == "__main__":
    main()
