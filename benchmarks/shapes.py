"""The benchmarks' one shape catalogue (sizes from REFERENCE.md section 4): the experts module's
shapes with the rows one rank sees (bench_experts.py, fused_tiles_sweep.py), the FP32 combine's
(combine_bench.py) and the model slices of the RL cycle (bench_cycle.py), with the routings.
"""

from dataclasses import dataclass
from typing import Optional

import torch

# --- the experts module: one rank's local experts and routed rows --------------------------------


@dataclass(frozen=True)
class Shape:
    label: str
    experts: int  # local experts on one rank
    hidden: int  # what the experts see (the latent size when there is one)
    ffn: int
    glu: bool
    activation: str
    rows: int  # routed rows on one rank


SHAPES = {
    "super-ep4": Shape("Nemotron-3 Super EP4, latent 1024 (11.9k tokens x top-22 / 4)", 128, 1024,
                       2688, False, "squared_relu", 65536),
    "nano": Shape("Nemotron-3 Nano (8k tokens x top-6)", 128, 2688, 1856, False, "squared_relu",
                  49152),
    "qwen3-30b": Shape("Qwen3-30B-A3B (8k tokens x top-8)", 128, 2048, 768, True, "silu", 65536),
    "deepseek-v3-ep8": Shape("DeepSeek-V3 EP8 (32k tokens x top-8 / 8)", 32, 7168, 2048, True,
                             "silu", 32768),
    "mixtral": Shape("Mixtral-like (8k tokens x top-2)", 8, 4096, 14336, True, "silu", 16384),
}
TINY_SHAPES = {
    "tiny-sqrelu": Shape("tiny squared ReLU", 4, 32, 64, False, "squared_relu", 64),
    "tiny-swiglu": Shape("tiny SwiGLU", 4, 32, 48, True, "silu", 64),
}
SWEEP = {"super-ep4": "8,16,32,64,128", "tiny-sqrelu": "2,4"}
ROUTINGS = ("uniform", "skewed")


def make_splits(rows: int, experts: int, routing: str, zipf: float, seed: int):
    """Rows per local expert: equal, or Zipf(zipf) weights over a seeded random expert order."""
    if routing == "uniform":
        weights = torch.ones(experts, dtype=torch.float64)
    else:
        rank = torch.randperm(experts, generator=torch.Generator().manual_seed(seed))
        weights = (rank + 1).double() ** -zipf
    share = rows * weights / weights.sum()
    counts = share.floor().long()
    extra = (share - counts).argsort(descending=True)[: rows - int(counts.sum())]
    counts[extra] += 1
    return counts


# --- the FP32 combine ----------------------------------------------------------------------------

# name: (tokens, top_k, hidden, experts)
COMBINE_SHAPES = {
    "deepseek-v3": (16384, 8, 7168, 256),
    "nemotron-3-super-latent": (16384, 22, 1024, 512),
}
TINY_COMBINE_SHAPES = {
    "tiny-top8": (64, 8, 2048, 32),
    "tiny-top22": (24, 22, 1024, 64),
}


# --- model slices of the RL cycle ----------------------------------------------------------------


@dataclass(frozen=True)
class ModelSlice:
    """The sizes of a model's layers; `layers` MoE layers are built (hybrid: each after an
    attention layer, pattern "*E" repeated)."""
    label: str
    hidden: int
    heads: int
    query_groups: int
    head_dim: int
    experts: int  # the model's routed experts
    topk: int
    moe_ffn: int
    vocab: int
    activation: str  # "swiglu" or "squared_relu"
    hybrid: bool = False
    latent: Optional[int] = None  # moe_latent_size: the experts see this width
    shared_ffn: Optional[int] = None  # shared expert width
    qk_layernorm: bool = False
    rotary_base: Optional[int] = None  # None: no position embedding
    router: str = "softmax"
    note: str = ""
    # Set: every rank holds this many experts, the share of one rank of the model at
    # EP = experts / local_experts; below that EP the slice builds fewer experts than the model.
    local_experts: Optional[int] = None

    def built_experts(self, ep: int) -> int:
        """The routed experts built at expert parallelism `ep`: the model's, or with
        `local_experts`, local_experts x ep of them (at most the model's)."""
        if self.local_experts is None:
            return self.experts
        return min(self.experts, self.local_experts * ep)


SLICES = {
    "qwen3-30b-a3b": ModelSlice(
        "Qwen3-30B-A3B", 2048, 32, 4, 128, 128, 8, 768, 151936, "swiglu", qk_layernorm=True,
        rotary_base=1_000_000),
    "nemotron-3-super": ModelSlice(
        "Nemotron-3 Super-like (128 experts per rank)", 4096, 32, 2, 128, 512, 22,
        2688, 131072, "squared_relu", hybrid=True, latent=1024, shared_ffn=5376,
        router="sigmoid", local_experts=128,
        note="attention and MoE layers only (no Mamba); no position embedding"),
    "tiny": ModelSlice("tiny", 64, 4, 2, 16, 8, 2, 32, 128, "swiglu", qk_layernorm=True,
                       rotary_base=10_000),
    "tiny-hybrid": ModelSlice("tiny hybrid", 128, 4, 2, 32, 8, 4, 64, 256, "squared_relu",
                              hybrid=True, latent=64, shared_ffn=128, router="sigmoid"),
}
