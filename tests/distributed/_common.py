"""What the torchrun workers share: process setup, the global expert weights and their shards,
MoE layers built from the package's specs (local, or Transformer Engine's where it runs), and an
FP64 reference of the whole MoE layer.

Every rank builds the same global weights from a seed and installs its own shard, so any rank can
compute the one-process answer for any token: the reference needs no communication and none of
the package's code.
"""

import argparse
import importlib.util
import json
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn.functional as F

from support.cpu_support import apply, megatron_patches

COLLECTIVE_TIMEOUT = timedelta(seconds=150)  # a stuck collective raises before the launcher's kill


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo, CPU tensors; cuda: NCCL, one GPU per rank")
    parser.add_argument("--out", required=True, help="folder for one JSON result file per rank")
    return parser


# --- processes ---------------------------------------------------------------------------------


def init_processes(device: str, host_streams: bool = False) -> torch.device:
    """Join the torchrun world: gloo on the CPU, NCCL with one GPU per local rank on CUDA; the
    patches of support.cpu_support.megatron_patches for this device applied (`host_streams`:
    the alltoall dispatcher's CUDA streams too, on a CPU-only host)."""
    apply(megatron_patches(on_cpu=device == "cpu", host_streams=host_streams))
    if device == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        # no device_id: NCCL communicators are made lazily, not for each of Megatron's groups
        torch.distributed.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT)
        return torch.device("cuda", local_rank)
    torch.distributed.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    return torch.device("cpu")


def init_parallel(device: str, tp: int = 1, ep: int = 1, etp: int = 1):
    """(Re)build Megatron's parallel state for this layout; returns its ProcessGroupCollection."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    if device == "cuda":  # needs CUDA; on the CPU the weights are built with CPU initialisation
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    return ProcessGroupCollection.use_mpu_process_groups()


def group_ranks(group) -> list:
    return torch.distributed.get_process_group_ranks(group)


def write_result(out_dir: str, result: dict) -> None:
    """Each rank writes `rank{R}.json`; the launcher compares them."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(result, f, indent=1)


# --- model -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    hidden: int = 32
    ffn: int = 64
    experts: int = 8
    topk: int = 2
    tokens: int = 16  # per rank, before the dispatcher gathers
    glu: bool = True

    def activation(self):
        return F.silu if self.glu else squared_relu


def squared_relu(x):
    return torch.relu(x).pow(2)


def moe_config(backend: str, sizes: Sizes, device: str, *, tp=1, ep=1, etp=1, sp=False,
               dispatcher="allgather", **overrides):
    """A one-layer MoE config: backend "torch" builds TorchGroupedMLP as the experts,
    "transformer_engine" (the flag's default) Megatron's SequentialMLP (moe_grouped_gemm=False)."""
    from mcore_torch_experts import TorchExpertsTransformerConfig

    fields = dict(
        num_layers=1, hidden_size=sizes.hidden, num_attention_heads=4,
        num_moe_experts=sizes.experts, moe_ffn_hidden_size=sizes.ffn, ffn_hidden_size=sizes.ffn,
        moe_router_topk=sizes.topk, moe_token_dispatcher_type=dispatcher,
        moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        gated_linear_unit=sizes.glu, activation_func=sizes.activation(), add_bias_linear=False,
        bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=device == "cpu",
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, sequence_parallel=sp,
        moe_grouped_gemm=backend == "torch", moe_expert_gemm_backend=backend,
    )
    fields.update(overrides)
    return TorchExpertsTransformerConfig(**fields)


def moe_layer(config, pg, device, te_spec=False):
    """The MoE layer of the package's reference GPT layer spec, the local one or (te_spec)
    Transformer Engine's; the experts follow the flag."""
    from mcore_torch_experts import _compat, build_moe_layer, specs

    torch.manual_seed(0)
    if te_spec:
        mlp = specs.get_gpt_layer_with_transformer_engine_spec(config).submodules.mlp
        return _compat.build_moe_layer(mlp, config, pg_collection=pg).to(device)
    return build_moe_layer(config, pg_collection=pg).to(device)


# experts: (moe_expert_gemm_backend, moe_grouped_gemm, built from the TE layer spec, the class)
EXPERTS = {
    "torch": ("torch", True, False, "TorchGroupedMLP"),
    "sequential": ("transformer_engine", False, False, "SequentialMLP"),
    "te": ("transformer_engine", True, True, "TEGroupedMLP"),
    "torch-te": ("torch", True, True, "TorchGroupedMLP"),  # in the TE spec's layer
}


def experts_layer(experts: str, sizes: "Sizes", pg, device: torch.device, **fields):
    """The MoE layer with these experts (EXPERTS); `fields` go to moe_config (parallel sizes,
    dispatcher, overrides)."""
    backend, grouped, te_spec, name = EXPERTS[experts]
    config = moe_config(backend, sizes, device.type, moe_grouped_gemm=grouped, **fields)
    layer = moe_layer(config, pg, device, te_spec=te_spec)
    assert type(layer.experts).__name__ == name, (experts, type(layer.experts))
    return layer


def te_unavailable(device: str):
    """Why this launch cannot build TEGroupedMLP (the "te" and "torch-te" experts), or None."""
    if importlib.util.find_spec("transformer_engine") is None:
        return ("Transformer Engine is not importable (scripts/gpu_distributed.sh runs the "
                "TEGroupedMLP checks on GPUs with TE installed)")
    if device != "cuda":
        return "TEGroupedMLP runs on CUDA only and this launch is --device cpu"
    return None


# --- global weights and their shards -----------------------------------------------------------


@dataclass
class GlobalWeights:
    """router [E, H]; fc1 [E, F*(2 if GLU), H] laid out [gate; up]; fc2 [E, H, F]; all bf16."""

    router: torch.Tensor
    fc1: torch.Tensor
    fc2: torch.Tensor

    @classmethod
    def make(cls, sizes: Sizes, seed: int = 1234) -> "GlobalWeights":
        g = torch.Generator().manual_seed(seed)
        e, h, f = sizes.experts, sizes.hidden, sizes.ffn
        fc1_rows = 2 * f if sizes.glu else f
        return cls(router=(torch.randn(e, h, generator=g) / h ** 0.5).bfloat16(),
                   fc1=(torch.randn(e, fc1_rows, h, generator=g) / h ** 0.5).bfloat16(),
                   fc2=(torch.randn(e, h, f, generator=g) / f ** 0.5).bfloat16())

    def fc1_shard(self, expert: int, etp_rank: int, etp: int, glu: bool) -> torch.Tensor:
        """Rows of one ETP rank: [gate shard; up shard] for GLU, else the plain row shard."""
        if not glu:
            return self.fc1[expert].chunk(etp, dim=0)[etp_rank]
        gate, up = self.fc1[expert].chunk(2, dim=0)
        return torch.cat([gate.chunk(etp, dim=0)[etp_rank], up.chunk(etp, dim=0)[etp_rank]])

    def fc2_shard(self, expert: int, etp_rank: int, etp: int) -> torch.Tensor:
        return self.fc2[expert].chunk(etp, dim=1)[etp_rank]

    def local_shards(self, pg, glu: bool):
        """[(fc1 shard, fc2 shard)] for this rank's local experts (EP rank, ETP rank of `pg`)."""
        ep, ep_rank = pg.ep.size(), pg.ep.rank()
        etp, etp_rank = pg.expt_tp.size(), pg.expt_tp.rank()
        local = self.fc1.shape[0] // ep
        return [(self.fc1_shard(e, etp_rank, etp, glu), self.fc2_shard(e, etp_rank, etp))
                for e in range(ep_rank * local, (ep_rank + 1) * local)]


def expert_weight_params(experts):
    """[(fc1 weight, fc2 weight)] per local expert, TorchGroupedMLP or SequentialMLP."""
    if hasattr(experts, "local_experts"):
        return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in experts.local_experts]
    return [(getattr(experts.linear_fc1, f"weight{i}"), getattr(experts.linear_fc2, f"weight{i}"))
            for i in range(experts.num_local_experts)]


@torch.no_grad()
def install(layer, weights: GlobalWeights, pg, glu: bool) -> None:
    """Router weights everywhere, this rank's expert shards into its experts; freeze experts."""
    layer.router.weight.copy_(weights.router)
    for (fc1, fc2), (fc1_shard, fc2_shard) in zip(expert_weight_params(layer.experts),
                                                  weights.local_shards(pg, glu)):
        fc1.copy_(fc1_shard)
        fc2.copy_(fc2_shard)
    for p in layer.experts.parameters():
        p.requires_grad_(False)  # the frozen expert base of adapter training


# --- the one-process reference -----------------------------------------------------------------


def routing(x: torch.Tensor, weights: GlobalWeights, topk: int):
    """Top-k experts by FP64 logits, softmax over the chosen k (Megatron's default routing)."""
    logits = x.double() @ weights.router.double().T
    top, idx = logits.topk(topk, dim=-1)
    return idx, top.softmax(dim=-1)


def reference_layer_with_adapters(x64, weights: GlobalWeights, factors, sizes: Sizes,
                                  scale: float):
    """FP64 MoE layer over all tokens [N, H] whose expert e's linears carry the LoRA update
    scale * B[e] @ A[e] (`factors`: {linear_fc1 / linear_fc2: (A [E, r, in], B [E, out, r])})."""
    idx, probs = routing(x64, weights, sizes.topk)
    out = torch.zeros_like(x64)
    (a1, b1), (a2, b2) = factors["linear_fc1"], factors["linear_fc2"]
    for e in range(sizes.experts):
        token, slot = (idx == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        w1 = weights.fc1[e].double() + scale * b1[e] @ a1[e]
        w2 = weights.fc2[e].double() + scale * b2[e] @ a2[e]
        h = sizes.activation()(x64[token] @ w1.T)
        out = out.index_add(0, token, (h @ w2.T) * probs[token, slot].unsqueeze(-1))
    return out


def reference_moe(x: torch.Tensor, grad_out: torch.Tensor, weights: GlobalWeights, sizes: Sizes):
    """FP64 output and input gradient of the whole MoE layer (router included), all experts in
    one process: x, grad_out [..., H] -> (out, grad_x), both float64 of x's shape."""
    x64 = x.detach().reshape(-1, sizes.hidden).double().requires_grad_(True)
    idx, probs = routing(x64, weights, sizes.topk)
    out = torch.zeros_like(x64)
    for e in range(sizes.experts):
        token, slot = (idx == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = x64[token] @ weights.fc1[e].double().T
        if sizes.glu:
            gate, up = h.chunk(2, dim=-1)
            h = sizes.activation()(gate) * up
        else:
            h = sizes.activation()(h)
        y = (h @ weights.fc2[e].double().T) * probs[token, slot].unsqueeze(-1)
        out = out.index_add(0, token, y)
    out.backward(grad_out.reshape(-1, sizes.hidden).double())
    return out.detach().reshape(x.shape), x64.grad.reshape(x.shape)


# parity rows: (result key, the other experts, their short name in the table, the block's title)
PARITY_BLOCKS = (("parity", "sequential", "seq", "TorchGroupedMLP vs SequentialMLP"),
                 ("te_parity", "te", "TE", "TE spec: TorchGroupedMLP vs TEGroupedMLP"))


def parity_table(ranks: list) -> str:
    """One line per (layout, dispatcher, case) of each block (TorchGroupedMLP against
    SequentialMLP; in the TE spec's layer against TEGroupedMLP): the worst relative L2 error
    over ranks; then what was skipped, and why."""
    lines = []
    for key, other, short, title in PARITY_BLOCKS:
        columns = (f"out_vs_{other}", f"grad_vs_{other}", "out_vs_reference",
                   "grad_vs_reference", f"{other}_out_vs_reference", f"{other}_grad_vs_reference")
        worst = {}
        for rank in ranks:
            for row in rank[key]:
                line = worst.setdefault((rank["layout"], row["dispatcher"], row["case"]),
                                        dict.fromkeys(columns, 0.0))
                for name in columns:
                    line[name] = max(line[name], row[name])
        if not worst:
            continue
        heads = (f"out/{short}", f"grad/{short}", "out/ref", "grad/ref", f"{short} out/ref",
                 f"{short} grad/ref")
        lines += [f"{'layout':<16} {'dispatcher':<10} {'case':<13} "
                  + " ".join(f"{h:>12}" for h in heads)
                  + f"   {title}: max relative L2 error over ranks"]
        lines += [f"{layout:<16} {dispatcher:<10} {case:<13} "
                  + " ".join(f"{line[name]:12.2e}" for name in columns)
                  for (layout, dispatcher, case), line in worst.items()]
    skipped = {(rank["layout"], skip["dispatcher"], skip["reason"])
               for rank in ranks for skip in rank["skipped"]}
    lines += [f"{layout:<16} {dispatcher:<10} skipped: {reason}"
              for layout, dispatcher, reason in sorted(skipped)]
    te_skipped = {(rank["layout"], rank["te_skipped"]) for rank in ranks if rank["te_skipped"]}
    lines += [f"{layout:<16} TEGroupedMLP skipped: {reason}"
              for layout, reason in sorted(te_skipped)]
    return "\n".join(lines)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def global_inputs(world: int, sizes: Sizes, seed: int):
    """Every rank's layer input and output gradient [tokens, 1, H] (bf16), the same on all ranks."""
    g = torch.Generator().manual_seed(seed)
    shape = (world, sizes.tokens, 1, sizes.hidden)
    return torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16()
