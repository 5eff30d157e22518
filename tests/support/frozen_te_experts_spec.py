"""The control of the H200 Megatron-LM run (benchmarks/megatron_lm_run.py): Megatron's own GPT
decoder block spec with Transformer Engine modules whose TEGroupedMLP experts freeze their weights
when built, so that Megatron-LM trains the same parameters as with TorchGroupedMLP. Test code, not
part of the package; named as `--spec support.frozen_te_experts_spec frozen_te_experts_gpt_spec` with
tests/ on PYTHONPATH."""

import dataclasses
import functools

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.moe.experts import TEGroupedMLP

from mcore_torch_experts import _compat


class FrozenTEGroupedMLP(TEGroupedMLP):
    """TEGroupedMLP with its expert weights frozen at build."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requires_grad_(False)


def _with_frozen_experts(layer_spec):
    mlp = layer_spec.submodules.mlp
    if not _compat.is_moe_mlp_spec(mlp):
        return layer_spec
    moe = _compat.moe_submodules(mlp)
    experts = moe.experts
    assert _compat.spec_class(experts) is TEGroupedMLP, experts
    if isinstance(experts, functools.partial):
        experts = functools.partial(FrozenTEGroupedMLP, *experts.args, **experts.keywords)
    else:
        experts = dataclasses.replace(experts, module=FrozenTEGroupedMLP)
    mlp = _compat.with_moe_submodules(mlp, dataclasses.replace(moe, experts=experts))
    return dataclasses.replace(layer_spec,
                               submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp))


def frozen_te_experts_gpt_spec(config, vp_stage=None):
    """Megatron's TE decoder block spec for `config`, MoE experts FrozenTEGroupedMLP."""
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    return dataclasses.replace(block, layer_specs=[_with_frozen_experts(s)
                                                   for s in block.layer_specs])
