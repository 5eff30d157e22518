"""LoRA on a tensor-parallel base, TP=2 on two gloo processes, against the same model
unsharded in plain torch; run by tests/unit/test_lora.py:

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/distributed/lora_tensor_parallel.py

Rank 0 prints one JSON line: for each rank, the relative L2 error of the output, the input
gradient and each adapter factor's gradient (replicated and sharded factors).
"""

import datetime
import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_torch_experts.lora import apply_lora
from tp_attention import Attention, gather

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a hang fails
parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
rank = parallel_state.get_tensor_model_parallel_rank()
IN, HIDDEN, RANK, ALPHA = 16, 24, 4, 8.0
config = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=2,
                           tensor_model_parallel_size=2, use_cpu_initialization=True,
                           add_bias_linear=False, params_dtype=torch.float64)

torch.manual_seed(0)
model = Attention(config, IN, HIDDEN)
apply_lora(model, ["linear_qkv", "linear_proj"], rank=RANK, alpha=ALPHA)
qkv, proj = model.linear_qkv, model.linear_proj
with torch.no_grad():  # B is zero at the start; the same random values on every rank, then sharded
    full_b = torch.randn(HIDDEN, RANK, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64)
    qkv.adapter.linear_out.weight.copy_(full_b.chunk(2)[rank])
    proj.adapter.linear_out.weight.normal_(generator=torch.Generator().manual_seed(2))
x = torch.randn(3, IN, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
grad_out = torch.randn(3, IN, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
x.requires_grad_(True)
out = model(x)
out.backward(grad_out)

# The same model unsharded, in plain torch: (weight, A, B) per linear.
w_qkv, w_proj = gather(qkv.to_wrap.weight.detach(), 0), gather(proj.to_wrap.weight.detach(), 1)
factors = [qkv.adapter.linear_in.weight, gather(qkv.adapter.linear_out.weight.detach(), 0),
           gather(proj.adapter.linear_in.weight.detach(), 1), proj.adapter.linear_out.weight]
x_ref, a_qkv, b_qkv, a_proj, b_proj = [t.detach().clone().requires_grad_(True)
                                       for t in [x, *factors]]
h = torch.tanh(x_ref @ w_qkv.T + x_ref @ a_qkv.T @ b_qkv.T * (ALPHA / RANK))
out_ref = h @ w_proj.T + h @ a_proj.T @ b_proj.T * (ALPHA / RANK)
out_ref.backward(grad_out)

pairs = {"out": (out, out_ref), "x": (x.grad, x_ref.grad),
         "A_qkv (replicated)": (qkv.adapter.linear_in.weight.grad, a_qkv.grad),
         "B_qkv (sharded)": (gather(qkv.adapter.linear_out.weight.grad, 0), b_qkv.grad),
         "A_proj (sharded)": (gather(proj.adapter.linear_in.weight.grad, 1), a_proj.grad),
         "B_proj (replicated)": (proj.adapter.linear_out.weight.grad, b_proj.grad)}
errors = [None, None]
dist.all_gather_object(errors, {k: float((a - b).norm() / b.norm()) for k, (a, b) in pairs.items()})
if rank == 0:
    print(json.dumps(errors))
# Tear the groups down before exit: gloo's threads aborting in the interpreter's shutdown
# ("terminate called without an active exception") would fail a run whose checks passed.
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
