"""merge_bridge_lora on Megatron-Bridge LoRA over tensor-parallel dense linears, TP=2 on two gloo
processes; run by tests/integration/bridge/test_bridge_lora.py:

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/distributed/bridge_merge_tensor_parallel.py

A column-parallel linear_qkv and a row-parallel linear_proj carry Bridge's LoRA with random
factors (each rank its own shards). Before the merge, the output of the model with the adapters
live; after `merge_bridge_lora` (Bridge's LoRAMerge, gathering the sharded factor over the TP
group), the output of the merged model and each rank's merged weight against an FP64 fold built
from the factors gathered here. Rank 0 prints one JSON line, a report per rank.
"""

import datetime
import json

import torch
import torch.distributed as dist

from support.bridge_imports import import_megatron_bridge
from support.cpu_support import apply, megatron_patches

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a hang fails
import_megatron_bridge()
from megatron.bridge.peft.lora import LoRA  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mcore_torch_experts import merge_bridge_lora, register_with_megatron_bridge  # noqa: E402
from tp_attention import Attention, gather  # noqa: E402

parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
apply(megatron_patches(on_cpu=True))
register_with_megatron_bridge()
rank = parallel_state.get_tensor_model_parallel_rank()
IN, HIDDEN, DIM, ALPHA = 16, 24, 4, 8
config = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=2,
                           tensor_model_parallel_size=2, use_cpu_initialization=True,
                           add_bias_linear=False, params_dtype=torch.float32)

torch.manual_seed(0)
root = torch.nn.Module()
root.self_attention = Attention(config, IN, HIDDEN)
LoRA(target_modules=["linear_qkv", "linear_proj"], dim=DIM, alpha=ALPHA)(root)
generator = torch.Generator().manual_seed(1 + rank)  # each rank its own shard values
with torch.no_grad():
    for name, p in sorted(root.named_parameters()):
        if ".adapter." in name:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
attention = root.self_attention
folded = {}
for name in ("linear_qkv", "linear_proj"):
    wrapper = getattr(attention, name)
    a, b = wrapper.adapter.linear_in.weight.double(), wrapper.adapter.linear_out.weight.double()
    if a.shape[0] != DIM:  # A sharded over its rank dimension (column-parallel base)
        a = gather(a, 0)
    if name == "linear_proj" and b.shape[0] != IN:  # B sharded over the output (row-parallel)
        b = gather(b, 0)
    folded[name] = (wrapper.to_wrap.weight.double() + ALPHA / DIM * b @ a,
                    wrapper.to_wrap.weight.detach().clone(),
                    {"A": list(wrapper.adapter.linear_in.weight.shape),
                     "B": list(wrapper.adapter.linear_out.weight.shape)})
x = torch.randn(3, IN, generator=torch.Generator().manual_seed(3))
with torch.no_grad():
    live = attention(x)
    names = merge_bridge_lora(root)
    merged = attention(x)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


report = {"rank": rank, "merged": names, "output": rel(merged, live),
          "unwrapped": [type(getattr(attention, n)).__name__ for n in ("linear_qkv", "linear_proj")]}
for name, (expected, before, shapes) in folded.items():
    report[f"{name}_weight"] = rel(getattr(attention, name).weight, expected)
    report[f"{name}_factor_shapes"] = shapes
    report[f"{name}_change"] = rel(getattr(attention, name).weight, before)
reports = [None, None]
dist.all_gather_object(reports, report)
if rank == 0:
    print(json.dumps(reports))
# Tear the groups down before exit, after both ranks are past the gather: gloo's threads of
# Megatron's subgroups aborting in the interpreter's shutdown ("terminate called without an
# active exception") would fail a run whose checks passed.
dist.barrier()
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
