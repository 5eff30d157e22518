"""A launcher's own Megatron-LM style `model_provider` whose MoE layers get TorchGroupedMLP experts
(`--moe-expert-gemm-backend transformer_engine` keeps Megatron's). Runs a tiny GPT-MoE (on the GPU,
or on the CPU through the launcher below).

    python examples/megatron_lm_provider.py [--moe-expert-gemm-backend transformer_engine]
    python tests/support/run_on_cpu.py examples/megatron_lm_provider.py [...]   (a host without CUDA)

Stock Megatron-LM 0.19 needs none of this: `pretrain_gpt.py ... --spec mcore_torch_experts.specs
torch_experts_gpt_spec` (docs/enable.md). A launcher that keeps its own provider gives it the
signature Megatron-LM's `get_model` calls, `model_provider(pre_process, post_process, vp_stage,
config=None, pg_collection=None)`, and passes `torch_experts_gpt_spec(config, vp_stage)` as the
`transformer_layer_spec`; the spec follows `config.transformer_impl` (TE or local modules) and
the config's `moe_expert_gemm_backend`, which an argparse flag of the launcher's own
(`add_torch_experts_args`, given to `parse_and_validate_args(extra_args_provider=...)`) can set.
Megatron-LM's `get_args()` / `core_transformer_config_from_args` are stood in for below.
"""

import argparse
import json

import torch
from megatron.core.models.gpt import GPTModel

from mcore_torch_experts import TorchExpertsTransformerConfig
from mcore_torch_experts.config import ExpertGemmBackend
from mcore_torch_experts.specs import torch_experts_gpt_spec
from single_process import describe_layers, init_megatron, shutdown_megatron, training_step_loss

_ARGS = None  # Megatron-LM: megatron.training.get_args()


def add_torch_experts_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """An `extra_args_provider` for `parse_and_validate_args`: the flag lands in
    args.moe_expert_gemm_backend, the config field of the same name."""
    group = parser.add_argument_group(title="torch experts")
    group.add_argument("--moe-expert-gemm-backend", choices=[b.value for b in ExpertGemmBackend],
                       default=ExpertGemmBackend.TRANSFORMER_ENGINE.value,
                       help="'torch': frozen BF16 experts through torch grouped GEMM.")
    return parser


def core_transformer_config_from_args(args, config_class=TorchExpertsTransformerConfig):
    """Stands in for megatron.training.arguments.core_transformer_config_from_args at tiny size."""
    on_cpu = not torch.cuda.is_available()
    return config_class(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=4,
        ffn_hidden_size=4 * args.hidden_size, num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_layer_freq=args.moe_layer_freq,
        moe_router_topk=2, moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=args.moe_expert_gemm_backend == "torch",  # Megatron-LM: --moe-grouped-gemm
        moe_aux_loss_coeff=0.0, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=on_cpu, moe_expert_gemm_backend=args.moe_expert_gemm_backend,
        transformer_impl=args.transformer_impl,
    )


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None) -> GPTModel:
    """Build the model; the arguments are those Megatron-LM's `get_model` passes."""
    args = _ARGS
    if config is None:
        config = core_transformer_config_from_args(args, TorchExpertsTransformerConfig)
    return GPTModel(config=config, transformer_layer_spec=torch_experts_gpt_spec(config, vp_stage),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.seq_length,
                    pre_process=pre_process, post_process=post_process,
                    position_embedding_type="rope", vp_stage=vp_stage,
                    pg_collection=pg_collection)


def main():
    global _ARGS
    parser = add_torch_experts_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.set_defaults(moe_expert_gemm_backend="torch")  # this example shows the torch backend
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--moe-layer-freq", type=json.loads, default=[0, 1, 1])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=32)
    parser.add_argument("--padded-vocab-size", type=int, default=128)
    parser.add_argument("--seq-length", type=int, default=16)
    parser.add_argument("--transformer-impl", default="local",
                        choices=["local", "transformer_engine"])
    _ARGS = args = parser.parse_args()

    init_megatron()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = model_provider().to(device)
    loss = training_step_loss(model, args.padded_vocab_size, args.seq_length)
    print(f"megatron_lm_provider (--moe-expert-gemm-backend {args.moe_expert_gemm_backend}): "
          f"layers [{describe_layers(model)}]; loss {loss:.3f} on {device}")


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown_megatron()
