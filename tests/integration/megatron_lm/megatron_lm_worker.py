"""Run by test_launchers.py in its own process (Megatron-LM's argument parsing sets process-wide
globals): stock Megatron-LM 0.19 from parsed command-line arguments to a built GPT model, the way
`pretrain_gpt.py` does it (`parse_and_validate_args`, `gpt_config_from_args`, the model config's
builder), with the flags of docs/enable.md (`--spec mcore_torch_experts.specs
torch_experts_gpt_spec`); and the documented `pretrain_hybrid.py` change, up to the stack spec.
Writes what it measured as JSON to argv[2].

    python tests/integration/megatron_lm/megatron_lm_worker.py OUT_DIR RESULT_JSON
"""

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import torch

from support.cpu_support import init_single_process_megatron
from support.doc_snippets import run_snippet, snippet
from support.reference import rel_err
from support.tiny_gpt import freeze_experts, sequential_to_grouped

# A tiny model, plus what a CPU host needs (local modules, CPU initialisation, no fused kernels,
# no dropout) and the smallest data/tokenizer settings; the flags of docs/enable.md go on top.
MODEL_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--num-experts", "4", "--moe-ffn-hidden-size", "32",
    "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather", "--swiglu",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--seq-length", "16",
    "--max-position-embeddings", "16",
]
CPU_ARGS = [
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--no-rope-fusion", "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type",
    "NullTokenizer", "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "2",
    "--train-iters", "1", "--lr", "1e-4",
]


def documented_flags() -> list:
    """The flags the docs/enable.md command line adds after the user's own arguments."""
    words = shlex.split(snippet("megatron-lm").replace("\\\n", " "))
    return [w for w in words[words.index("pretrain_gpt.py") + 1:] if not w.startswith("${")]


def build(model_cfg):
    """One model stage, as Megatron-LM's setup_model_and_optimizer builds it from a model config."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    torch.manual_seed(0)
    builder = model_cfg.get_builder_cls()(model_cfg)
    return builder.build_model(ProcessGroupCollection.use_mpu_process_groups())


def forward_backward(model, vocab_size):
    """Logits and the gradients of the parameters that require grad."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (2, 17), generator=generator)
    positions = torch.arange(16).expand(2, 16)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)
    loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:])
    loss.sum().backward()
    logits = model(tokens[:, :-1], positions, mask).detach()
    return logits, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def hybrid_spec_experts(args) -> str:
    """pretrain_hybrid.py's model config for the same arguments (attention and MoE layers), with
    the docs/enable.md change applied: the experts class of its stack spec's MoE layer."""
    from megatron.training.argument_utils import hybrid_config_from_args

    from mcore_torch_experts import _compat

    args.hybrid_layer_pattern = "*E"
    model_cfg = hybrid_config_from_args(args)
    run_snippet("megatron-lm-hybrid", model_cfg=model_cfg)
    moe = model_cfg.hybrid_stack_spec.submodules.moe_layer.submodules.mlp
    return _compat.spec_class(_compat.moe_submodules(moe).experts).__name__


def main(out: Path, result_path: Path) -> None:
    init_single_process_megatron()
    # Test-only: Megatron-LM asserts a GPU of compute capability 8+ for --moe-grouped-gemm.
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args

    flags = documented_flags()
    sys.argv = ["pretrain_gpt.py", *MODEL_ARGS, *CPU_ARGS, *flags]
    args = parse_and_validate_args()
    result = {"documented_flags": flags}
    model_cfg = gpt_config_from_args(args)
    model = build(model_cfg)
    result.update({
        "config_class": type(model_cfg).__name__,
        "transformer_config_class": type(model_cfg.transformer).__name__,
        "experts": [type(layer.mlp.experts).__name__ for layer in model.decoder.layers],
    })
    # Megatron's own spec for the same arguments (no --spec), with SequentialMLP experts.
    reference_cfg = dataclasses.replace(
        model_cfg, transformer_layer_spec=None,
        transformer=dataclasses.replace(model_cfg.transformer, moe_grouped_gemm=False))
    reference = build(reference_cfg)
    result["reference_experts"] = [type(layer.mlp.experts).__name__
                                   for layer in reference.decoder.layers]
    missing, unexpected = model.load_state_dict(sequential_to_grouped(reference.state_dict()),
                                                strict=False)
    result["unexpected_keys"] = unexpected
    result["missing_weights"] = [k for k in missing if not k.endswith("_extra_state")]
    result["trainable_expert_weights"] = [n for n, p in model.named_parameters()
                                          if ".mlp.experts." in n and p.requires_grad]
    logits, grads = forward_backward(model, args.padded_vocab_size)
    freeze_experts(reference)  # Megatron's experts, frozen as ours are built
    ref_logits, ref_grads = forward_backward(reference, args.padded_vocab_size)
    result["logits_rel_err"] = rel_err(logits, ref_logits)
    result["grad_names_equal"] = sorted(grads) == sorted(ref_grads)
    result["grads_max_rel_err"] = max(rel_err(grads[n], ref_grads[n]) for n in grads)

    # A refused setting fails while the model is built, on the TransformerConfig itself.
    biased = dataclasses.replace(model_cfg, transformer=dataclasses.replace(
        model_cfg.transformer, add_bias_linear=True))
    try:
        build(biased)
        result["bias_refusal"] = None
    except ValueError as error:
        result["bias_refusal"] = f"{type(error).__name__}: {error}"
    result["hybrid_experts"] = hybrid_spec_experts(args)
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
