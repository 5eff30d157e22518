"""A Megatron-Bridge style model provider (a dataclass config with `provide()`) that declares
`moe_expert_gemm_backend` and names the reference spec that follows it: MoE layers get
TorchGroupedMLP experts when the field says "torch", set here with `dataclasses.replace` (as
NeMo-RL applies `model_overrides`). Runs a tiny GPT-MoE (on the GPU, or on the CPU through the
launcher below); Megatron-Bridge itself is not needed (the example never imports it).

    python examples/bridge_style_provider.py
    python tests/support/run_on_cpu.py examples/bridge_style_provider.py   (a host without CUDA)

With the real Megatron-Bridge no subclass is needed: name the launcher entry point on the
provider AutoBridge returns, `provider.transformer_layer_spec =
mcore_torch_experts.specs.torch_experts_gpt_spec` (docs/enable.md, "Megatron-Bridge"); Bridge
calls it as `transformer_layer_spec(provider, vp_stage=...)` inside `provide()`. A provider class
of your own, as below, is for code that builds its provider itself: NeMo-RL rebuilds providers
from a checkpoint's run_config.yaml, whose `_target_` Bridge admits only under its allowlisted
prefixes, and its `model_overrides` take only fields of the recorded class.
"""

import dataclasses
from typing import Callable, Optional, Union

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_torch_experts import TorchExpertsTransformerConfig
from mcore_torch_experts.specs import gpt_transformer_layer_spec
from single_process import describe_layers, init_megatron, shutdown_megatron, training_step_loss

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
    init_megatron()
    on_cpu = not torch.cuda.is_available()
    provider = TinyGPTMoEProvider(
        num_layers=3, moe_layer_freq=[0, 1, 1], hidden_size=64, num_attention_heads=4,
        ffn_hidden_size=256, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=on_cpu)
    provider = dataclasses.replace(provider, **MODEL_OVERRIDES)  # as NeMo-RL's model_overrides

    torch.manual_seed(0)
    model = provider.provide().to("cpu" if on_cpu else "cuda")
    device = next(model.parameters()).device
    loss = training_step_loss(model, provider.vocab_size, provider.seq_length)
    layers = describe_layers(model)
    print(f"bridge_style_provider (model_overrides {MODEL_OVERRIDES}): layers [{layers}]; "
          f"loss {loss:.3f} on {device}")


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown_megatron()
