"""The attention stand-in of the tensor-parallel workers (TP=2 on gloo): a column-parallel
linear_qkv [in -> hidden / 2 per rank], tanh, a row-parallel linear_proj back to [in]; and the
gather of a tensor's two shards."""

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class Attention(torch.nn.Module):
    def __init__(self, config, in_features: int, hidden: int):
        super().__init__()
        init = torch.nn.init.normal_
        self.linear_qkv = ColumnParallelLinear(in_features, hidden, config=config, bias=False,
                                               init_method=init, gather_output=False)
        self.linear_proj = RowParallelLinear(hidden, in_features, config=config, bias=False,
                                             init_method=init, input_is_parallel=True,
                                             skip_bias_add=True)

    def forward(self, x):
        return self.linear_proj(torch.tanh(self.linear_qkv(x)[0]))[0]


def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The two ranks' shards of `t`, concatenated along `dim`."""
    parts = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)
