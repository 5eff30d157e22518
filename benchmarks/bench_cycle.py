"""One RL cycle of a slice of a real MoE model: frozen BF16 base, LoRA, full recompute.

A cycle is a logprob pass (eval, no grad) over N micro-batches, then an update pass over the same
data (train: forward + backward of a clipped policy-gradient loss per micro-batch, then one AdamW
step on the adapters). The model is a few layers of Qwen3-30B-A3B at its true sizes (hidden 2048,
GQA 32/4 heads of 128, QK layer norm, 128 SwiGLU experts of 768, top-8, vocab 151936, RoPE), built
from the reference spec without Transformer Engine: attention is Megatron's local
DotProductAttention, which materialises the [b*heads, s, s] scores (no flash attention). LoRA
(FP32 weights) sits on linear_qkv, linear_proj and the experts' linear_fc1/linear_fc2, one adapter
per expert; full recompute is uniform, one layer per checkpoint, as RL jobs run it.

Arms (same weights, same adapters, same data): the experts as TorchGroupedMLP, as Megatron's
SequentialMLP, and as TEGroupedMLP when Transformer Engine is importable. TorchGroupedMLP's
per-expert adapters run as grouped GEMMs; SequentialMLP's are one dense adapter per expert linear
(the same factors). Prints (and writes to --out-dir as results.md / results.json) logprob, update
and cycle time, tokens/s, peak memory per phase and the speed-up over SequentialMLP; with
--profile, the update pass's GPU time by component (torch profiler; ranges from forward hooks,
backward kernels attributed through autograd sequence numbers) and breakdown.png.

    python benchmarks/bench_cycle.py --out-dir runs/cycle --profile            # one H200
    torchrun --nproc-per-node 2 benchmarks/bench_cycle.py --ep 2 --profile     # EP=2, alltoall
    python benchmarks/bench_cycle.py --smoke                                   # CPU smoke (CI)
"""

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from bench_common import (GIB, Stopwatch, fmt, header, markdown_table, peak_bytes, pyplot, ratio,
                          reset_peak, sync)

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "examples")]  # a checkout, and cpu_support


@dataclasses.dataclass(frozen=True)
class ModelShape:
    label: str
    hidden: int
    heads: int
    query_groups: int
    head_dim: int
    experts: int
    topk: int
    moe_ffn: int
    vocab: int
    rotary_base: int


MODELS = {
    "qwen3-30b-a3b": ModelShape("Qwen3-30B-A3B", 2048, 32, 4, 128, 128, 8, 768, 151936, 1_000_000),
    "tiny": ModelShape("tiny", 64, 4, 2, 16, 8, 2, 32, 128, 10_000),
}
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
ARMS = {"torch": "TorchGroupedMLP", "sequential": "SequentialMLP", "te": "TEGroupedMLP"}
REFERENCE = "sequential"
CLIP = 0.2

# Profile components, in the order of the table and the plot.
ATTENTION, ROUTER, DISPATCH, GEMMS, ACTIVATION = ("attention", "router", "permute/dispatch",
                                                  "expert GEMMs", "expert activation")
COMBINE, ADAPTERS, RECOMPUTE, OPTIMIZER = ("combine/unpermute", "adapters", "recompute (forward)",
                                           "optimizer")
HEAD, NORMS, OTHER, IDLE = ("embedding, output layer, loss", "norms, residuals", "other",
                            "GPU idle")
COMPONENTS = [ATTENTION, ROUTER, DISPATCH, GEMMS, ACTIVATION, COMBINE, ADAPTERS, RECOMPUTE,
              OPTIMIZER, HEAD, NORMS, OTHER, IDLE]
RANGE = "bench::"
EVALUATE = "autograd::engine::evaluate_function: "
DISPATCH_METHODS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess")
COMBINE_METHODS = ("combine_preprocess", "token_combine", "combine_postprocess")


# --- setup ---------------------------------------------------------------------------------------

def init_parallel(ep: int, device: torch.device) -> None:
    """The process group (torchrun's environment, else one process) and Megatron's parallel
    state with expert parallelism `ep`; then the single-process example's Megatron fixes (the
    router without Transformer Engine; CPU patches on a CPU-only host)."""
    from megatron.core import parallel_state

    from cpu_support import init_single_process_megatron

    if "WORLD_SIZE" in os.environ and not torch.distributed.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    elif ep > 1:
        raise SystemExit("--ep > 1 needs torchrun (one process per expert-parallel rank)")
    if torch.distributed.is_initialized() and not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    init_single_process_megatron()


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def make_config(shape: ModelShape, args, device):
    from mcore_torch_experts import TorchExpertsTransformerConfig

    return TorchExpertsTransformerConfig(
        num_layers=args.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.query_groups, kv_channels=shape.head_dim, qk_layernorm=True,
        ffn_hidden_size=shape.moe_ffn, num_moe_experts=shape.experts,
        moe_ffn_hidden_size=shape.moe_ffn, moe_router_topk=shape.topk, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=args.dispatcher, moe_grouped_gemm=False,
        expert_model_parallel_size=args.ep, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=device.type == "cpu", recompute_granularity="full",
        recompute_method="uniform", recompute_num_layers=1)


def build_arm(arm: str, shape: ModelShape, config, args, device):
    """The model of one arm: built with SequentialMLP experts from the seed (so every arm starts
    from the same weights), converted for the other arms, then LoRA with the shared factors."""
    from mcore_torch_experts import apply_lora, build_gpt_model, convert_experts_to_torch

    if arm == "te":
        try:
            import transformer_engine  # noqa: F401
        except ImportError as exc:
            raise NotAvailable(f"not available: transformer_engine is not importable ({exc})")
    seed_all(args.seed)
    model = build_gpt_model(config, vocab_size=shape.vocab, max_sequence_length=args.seq,
                            position_embedding_type="rope", rotary_base=shape.rotary_base)
    model = model.to(device)
    if arm in ("torch", "te"):
        convert_experts_to_torch(model)
    if arm == "te":
        to_te_experts(model)
    model.requires_grad_(False)
    apply_lora(model, TARGETS, rank=args.rank, alpha=args.alpha, expert_adapter="per_expert",
               dtype=torch.float32)
    fill_adapters(model, args.seed)
    return model


def to_te_experts(model) -> None:
    """Replace every TorchGroupedMLP by a TEGroupedMLP (Megatron's TE spec) with its weights."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import build_module

    from mcore_torch_experts import TorchGroupedMLP, _compat

    for name, experts in list(model.named_modules()):
        if not isinstance(experts, TorchGroupedMLP):
            continue
        config = dataclasses.replace(experts.config, moe_grouped_gemm=True,
                                     moe_expert_gemm_backend="transformer_engine")
        builder = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
        layer_spec = builder(**_compat.gpt_layer_spec_kwargs(builder, config))
        spec = _compat.moe_submodules(layer_spec.submodules.mlp).experts
        te = build_module(spec, experts.num_local_experts, config,
                          pg_collection=_compat.default_pg_collection(None))
        missing, unexpected = te.load_state_dict(experts.state_dict(), strict=False)
        if unexpected or [k for k in missing if not k.endswith("_extra_state")]:
            raise RuntimeError(f"{name}: TEGroupedMLP keys differ: {missing} {unexpected}")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, te.to(experts.linear_fc1.packed_weight.device))


class NotAvailable(Exception):
    """An arm that cannot run on this machine; the message is the table's note."""


SEQUENTIAL_EXPERT = re.compile(r"(.*\.experts\.)local_experts\.(\d+)\.(linear_fc[12])$")


def adapter_factors(model) -> dict:
    """{(grouped module name, expert or -1): (A, B)} for every adapter. SequentialMLP's
    `experts.local_experts.E.linear_fcN` is keyed as the grouped module `experts.linear_fcN`,
    expert E; per-expert factors [E, ...] are split by expert."""
    from mcore_torch_experts import LoRALinear

    factors = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        a, b = module.adapter.linear_in.weight, module.adapter.linear_out.weight
        match = SEQUENTIAL_EXPERT.match(name)
        if match:
            factors[match[1] + match[3], int(match[2])] = (a, b)
        elif a.dim() == 3:
            factors.update({(name, e): (a[e], b[e]) for e in range(a.shape[0])})
        else:
            factors[name, -1] = (a, b)
    return factors


@torch.no_grad()
def fill_adapters(model, seed: int) -> None:
    """The same adapter values in every arm (B non-zero, as for a trained adapter)."""
    generator = torch.Generator().manual_seed(seed)
    for _, (a, b) in sorted(adapter_factors(model).items()):
        a.copy_(torch.randn(a.shape, generator=generator) / math.sqrt(a.shape[-1]))
        b.copy_(torch.randn(b.shape, generator=generator) * 1e-2)


def make_batches(shape: ModelShape, args, device):
    """N micro-batches of (tokens, labels, advantages [mbs, 1]), seeded per data-parallel rank."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    generator = torch.Generator().manual_seed(args.seed + 1000 * rank)
    batches = []
    for _ in range(args.micro_batches):
        tokens = torch.randint(0, shape.vocab, (args.micro_batch_size, args.seq + 1),
                               generator=generator)
        advantages = torch.randn(args.micro_batch_size, 1, generator=generator)
        batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device), advantages.to(device)))
    return batches


# --- the cycle -----------------------------------------------------------------------------------

class Cycle:
    """The logprob and update passes of one arm, on fixed data."""

    def __init__(self, model, batches, args, device):
        from mcore_torch_experts import lora_parameters

        self.model, self.batches, self.device = model, batches, device
        mbs, seq = batches[0][0].shape
        self.positions = torch.arange(seq, device=device).expand(mbs, seq)
        self.mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).triu(1)
        self.params = list(lora_parameters(model).values())
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr, weight_decay=0.0)
        self.old_logprobs = None

    def logprobs(self, tokens, labels):
        """Per-token log-probabilities of the labels [mbs, seq] (the model returns -log p)."""
        return -self.model(tokens, self.positions, self.mask, labels=labels)

    @torch.no_grad()
    def logprob_pass(self):
        self.model.eval()
        self.old_logprobs = [self.logprobs(t, l) for t, l, _ in self.batches]
        return self.old_logprobs

    def update_pass(self):
        """Clipped policy-gradient loss per micro-batch, backward, then one optimizer step."""
        from torch.profiler import record_function

        self.model.train()
        for (tokens, labels, advantages), old in zip(self.batches, self.old_logprobs):
            logprobs = self.logprobs(tokens, labels)
            with record_function(RANGE + HEAD):
                ratio_ = torch.exp(logprobs - old)
                loss = -torch.min(ratio_ * advantages,
                                  ratio_.clamp(1 - CLIP, 1 + CLIP) * advantages).mean()
                loss = loss / len(self.batches)
            loss.backward()
        with record_function(RANGE + OPTIMIZER):
            reduce_adapter_grads(self.params)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def reduce_adapter_grads(params) -> None:
    """Average adapter gradients over data-parallel ranks (expert adapters over the expert
    data-parallel group), as DDP would; nothing on one process."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return
    groups = {True: parallel_state.get_data_parallel_group(),
              False: parallel_state.get_expert_data_parallel_group()}
    for dense, group in groups.items():
        grads = [p.grad for p in params if p.grad is not None and getattr(p, "allreduce", True) == dense]
        if grads and torch.distributed.get_world_size(group) > 1:
            flat = torch.cat([g.flatten() for g in grads])
            torch.distributed.all_reduce(flat, group=group)
            flat /= torch.distributed.get_world_size(group)
            parts = flat.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(parts, grads)])


def measure(cycle: Cycle, args, device) -> dict:
    """Median logprob / update / cycle ms over the measured cycles (CUDA events per phase) and the
    peak memory of each phase."""
    phases = {"logprob": cycle.logprob_pass, "update": cycle.update_pass}
    times = {name: [] for name in phases}
    peaks = dict.fromkeys(phases, 0)
    for i in range(args.warmup + args.cycles):
        this = {}
        for name, run in phases.items():
            reset_peak(device)
            watch = Stopwatch(device)
            run()
            this[name] = watch.stop().ms()
            if i >= args.warmup:
                times[name].append(this[name])
                peaks[name] = max(peaks[name], peak_bytes(device) or 0)
        print(f"[cycle]   cycle {i + 1}/{args.warmup + args.cycles}"
              f"{' (warm-up)' if i < args.warmup else ''}: logprob {this['logprob']:.1f} ms, "
              f"update {this['update']:.1f} ms", flush=True)
    row = {f"{name}_ms": statistics.median(values) for name, values in times.items()}
    row["cycle_ms"] = statistics.median(a + b for a, b in zip(times["logprob"], times["update"]))
    row.update({f"{name}_peak_gib": peaks[name] / GIB if device.type == "cuda" else None
                for name in phases})
    return row


# --- the profile breakdown -----------------------------------------------------------------------

def component_ranges(model):
    """(module -> component) for the forward hooks, and (dispatcher, method, component) for the
    token dispatchers' phases. The innermost range decides an op's component."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mcore_torch_experts import LoRALinear

    modules, methods = {model: HEAD, model.decoder: OTHER}, []
    for name, module in model.named_modules():
        if isinstance(module, TransformerLayer):
            modules[module] = NORMS
            modules[module.self_attention] = ATTENTION
        elif isinstance(module, MoELayer):
            modules[module] = OTHER
            modules[module.router] = ROUTER
            modules[module.experts] = ACTIVATION
            methods += [(module.token_dispatcher, m, DISPATCH) for m in DISPATCH_METHODS]
            methods += [(module.token_dispatcher, m, COMBINE) for m in COMBINE_METHODS]
        elif isinstance(module, LoRALinear):
            modules[module.adapter] = ADAPTERS
            if ".experts." in name:
                modules[module.to_wrap] = GEMMS
    if getattr(model.decoder, "final_layernorm", None) is not None:
        modules[model.decoder.final_layernorm] = NORMS
    return modules, methods


class Ranges:
    """Forward hooks (and dispatcher method wrappers) that open a `bench::<component>` profiler
    range around each module's forward; removed on exit."""

    def __init__(self, model):
        self.modules, self.methods = component_ranges(model)
        self.handles, self.wrapped = [], []

    def __enter__(self):
        from torch.profiler import record_function

        for module, component in self.modules.items():
            stack = []

            def pre(_module, _args, stack=stack, component=component):
                stack.append(record_function(RANGE + component).__enter__())

            def post(_module, _args, _out, stack=stack):
                stack.pop().__exit__(None, None, None)

            self.handles += [module.register_forward_pre_hook(pre),
                             module.register_forward_hook(post)]
        for owner, method, component in self.methods:
            original = getattr(owner, method)

            def wrapper(*args, original=original, component=component, **kwargs):
                with record_function(RANGE + component):
                    return original(*args, **kwargs)

            self.wrapped.append((owner, method, vars(owner).get(method)))
            setattr(owner, method, wrapper)
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        for owner, method, own in self.wrapped:
            if own is None:
                delattr(owner, method)
            else:
                setattr(owner, method, own)


def _ancestors(event):
    while event is not None:
        yield event
        event = event.cpu_parent


def _innermost_range(chain):
    return next((e.name[len(RANGE):] for e in chain if e.name.startswith(RANGE)), OTHER)


def _is_backward_node(event) -> bool:
    parent = event.cpu_parent
    return event.name.startswith(EVALUATE) or (parent is not None
                                               and parent.name == EVALUATE + event.name)


def classify(events, cuda: bool):
    """{component: µs} of the profiled ops' own GPU time (kernels they launched; on the CPU their
    own CPU time), the recompute's µs by the component it re-runs, and the total device time of
    the profile (None on the CPU).

    Forward ops (and the recompute's) take their innermost bench:: range. A backward op takes the
    component of the forward op with its autograd node's sequence number; ops that the
    re-entrant checkpoint's backward runs outside a nested backward node are the recompute; a
    gradient accumulation into a leaf goes to the adapters (the only trainable leaves)."""
    from torch.autograd import DeviceType

    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    forward = {}
    for event in cpu_events:
        if event.sequence_nr >= 0 and not _is_backward_node(event):
            forward.setdefault((event.thread, event.sequence_nr),
                               _innermost_range(_ancestors(event)))
    totals, recompute = dict.fromkeys(COMPONENTS, 0.0), dict.fromkeys(COMPONENTS, 0.0)
    for event in cpu_events:
        if getattr(event, "is_user_annotation", False):
            continue  # a range: its device span holds its ops' kernels, counted with those ops
        own = (sum(k.duration for k in event.kernels if not k.name.startswith(RANGE)) if cuda
               else event.self_cpu_time_total)
        if not own:
            continue
        chain = list(_ancestors(event))
        node = next((e for e in chain if e.name.startswith(EVALUATE)), None)
        if any(e.name == RANGE + OPTIMIZER for e in chain):
            component = OPTIMIZER
        elif node is None:
            component = _innermost_range(chain)
        elif node.name.endswith("CheckpointFunctionBackward"):
            component = RECOMPUTE
            recompute[_innermost_range(chain)] += own
        elif node.name.endswith("AccumulateGrad"):
            component = ADAPTERS
        else:
            component = forward.get((node.fwd_thread, node.sequence_nr), OTHER)
        totals[component] += own
    device_total = (sum(e.time_range.elapsed_us() for e in events
                        if e.device_type == DeviceType.CUDA
                        and not getattr(e, "is_user_annotation", False)
                        and not e.name.startswith(RANGE)) if cuda else None)
    return totals, recompute, device_total


def profile_update(cycle: Cycle, update_ms: float, device) -> dict:
    """One profiled update pass: {component: ms} (the GPU idle share = the measured update time
    minus the profiled device time), the recompute's ms by component, and the profiled device
    time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with Ranges(cycle.model), profile(activities=activities) as prof:
        cycle.update_pass()
        sync(device)
    started = time.perf_counter()
    totals, recompute, device_total = classify(prof.events(), device.type == "cuda")
    attributed = sum(totals.values())
    if device_total is not None:  # device time no op claimed (e.g. kernels launched elsewhere)
        totals[OTHER] += max(0.0, device_total - attributed)
    busy_ms = (device_total if device_total is not None else attributed) / 1e3
    ms = {k: v / 1e3 for k, v in totals.items()}
    ms[IDLE] = max(0.0, update_ms - busy_ms) if device.type == "cuda" else 0.0
    print(f"[cycle]   profile parsed in {time.perf_counter() - started:.1f} s", flush=True)
    return {"ms": ms, "recompute_ms": {k: v / 1e3 for k, v in recompute.items()},
            "busy_ms": busy_ms}


# --- report --------------------------------------------------------------------------------------

def results_table(rows) -> list:
    reference = next((r for r in rows if r["arm"] == REFERENCE and "note" not in r), None)
    headers = ["experts", "logprob ms", "update ms", "cycle ms", "tokens/s", "logprob peak GiB",
               "update peak GiB", "x SequentialMLP logprob", "x SequentialMLP update",
               "x SequentialMLP cycle", "mean abs logprob diff vs SequentialMLP"]
    lines = []
    for r in rows:
        if "note" in r:
            lines.append([r["module"], r["note"]] + [""] * (len(headers) - 2))
            continue
        speedups = [fmt(ratio(reference and reference[k], r[k]), ".2f")
                    for k in ("logprob_ms", "update_ms", "cycle_ms")]
        lines.append([r["module"], fmt(r["logprob_ms"], ".1f"), fmt(r["update_ms"], ".1f"),
                      fmt(r["cycle_ms"], ".1f"), fmt(r["tokens_per_s"], ".0f"),
                      fmt(r["logprob_peak_gib"], ".1f"), fmt(r["update_peak_gib"], ".1f"),
                      *speedups, fmt(r.get("logprob_diff"), ".2e")])
    return markdown_table(headers, lines)


def breakdown_table(rows) -> list:
    profiled = [r for r in rows if "profile" in r]
    headers = ["component"] + [f"{r['module']} {unit}" for r in profiled
                               for unit in ("ms", "share", "recompute ms")]
    lines = []
    for component in COMPONENTS + ["total"]:
        cells = [component]
        for r in profiled:
            total = sum(r["profile"]["ms"].values())
            value = r["profile"]["ms"].get(component, total)
            again = r["profile"]["recompute_ms"]
            again = sum(again.values()) if component in (RECOMPUTE, "total") else again[component]
            cells += [f"{value:.1f}", f"{100 * value / total:.1f}%" if total else "—",
                      f"{again:.1f}" if again else ""]
        lines.append(cells)
    return markdown_table(headers, lines)


def plot_breakdown(rows, path) -> bool:
    """Stacked bars of the update pass by component, one bar per arm."""
    profiled = [r for r in rows if "profile" in r]
    plt = pyplot()
    if plt is None or not profiled:
        return False
    fig, ax = plt.subplots(figsize=(4.5 + 1.8 * len(profiled), 5))
    colors = plt.get_cmap("tab20").colors
    bottoms = [0.0] * len(profiled)
    for i, component in enumerate(COMPONENTS):
        values = [r["profile"]["ms"][component] for r in profiled]
        ax.bar([r["module"] for r in profiled], values, 0.6, bottom=bottoms, label=component,
               color="lightgrey" if component == IDLE else colors[i % len(colors)])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_ylabel("update pass, ms")
    ax.set_title("update pass by component", fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def describe(shape, args, world) -> list:
    tokens = args.micro_batches * args.micro_batch_size * args.seq
    return [
        f"model: {shape.label} slice, {args.layers} MoE layers: hidden {shape.hidden}, GQA "
        f"{shape.heads}/{shape.query_groups} heads of {shape.head_dim}, QK RMSNorm, "
        f"{shape.experts} SwiGLU experts of {shape.moe_ffn}, top-{shape.topk}, vocab "
        f"{shape.vocab}, RoPE; BF16 base, frozen",
        "attention: Megatron's local DotProductAttention (no Transformer Engine): unfused, the "
        "[b*heads, s, s] scores are materialised; no flash attention",
        f"MoE: {args.dispatcher} dispatcher, EP={args.ep}, router FP32 softmax top-k, no "
        "auxiliary loss; permute fusion off (needs Transformer Engine)",
        f"LoRA: rank {args.rank}, alpha {args.alpha}, FP32 adapter weights on "
        f"{', '.join(TARGETS)}; one adapter per expert (grouped GEMM on TorchGroupedMLP, one "
        "dense adapter per expert linear on SequentialMLP, same factors)",
        "full recompute: uniform, 1 layer per checkpoint (re-entrant), frozen-input guard",
        f"cycle: logprob pass (eval, no grad) over {args.micro_batches} micro-batches of "
        f"{args.micro_batch_size} x {args.seq} tokens, then the update pass over the same data "
        "(forward + backward of a clipped policy-gradient loss per micro-batch, one AdamW step "
        f"on the adapters); {tokens} tokens per rank and cycle, {world} rank(s)",
        f"timing: CUDA events around each phase, median of {args.cycles} cycles after "
        f"{args.warmup} warm-up; peak = torch.cuda.max_memory_allocated, reset per phase; "
        "tokens/s = tokens of all ranks per cycle / cycle time",
    ]


def write_report(out_dir, lines_header, rows) -> str:
    lines = ["# RL cycle benchmark", ""] + [f"- {h}" for h in lines_header] + [""]
    lines += ["## Cycle", ""] + results_table(rows) + [""]
    if any("profile" in r for r in rows):
        lines += ["## Update pass by component (torch profiler)", "",
                  "GPU time of the kernels each component launched in one profiled update pass "
                  "(forward, recompute, backward, optimizer step; backward kernels go to the "
                  "component whose forward op made the autograd node; `recompute (forward)` is "
                  "the forward the checkpoint re-runs); `other` is the device time no component "
                  "claimed; `GPU idle` is the measured update time minus the profiled device "
                  "time. Shares of the sum, which is the measured update time when the GPU is "
                  "never oversubscribed. `recompute ms`: the recompute's part by the component "
                  "it re-runs (its total on the recompute row).", ""]
        lines += breakdown_table(rows) + [""]
    text = "\n".join(lines)
    (out_dir / "results.md").write_text(text)
    return text


# --- main ----------------------------------------------------------------------------------------

def run_arm(arm, shape, config, batches, args, device, reference_logprobs):
    """One arm's row: times, memory, the profile; an arm that cannot run gives its note."""
    row = {"arm": arm, "module": ARMS[arm]}
    started = time.perf_counter()
    try:
        model = build_arm(arm, shape, config, args, device)
        cycle = Cycle(model, batches, args, device)
        print(f"[cycle] {ARMS[arm]}: built in {time.perf_counter() - started:.1f} s", flush=True)
        first = [lp.float().cpu() for lp in cycle.logprob_pass()]
        if reference_logprobs:
            row["logprob_diff"] = statistics.mean(
                float((a - b).abs().mean()) for a, b in zip(first, reference_logprobs))
        row.update(measure(cycle, args, device))
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        tokens = args.micro_batches * args.micro_batch_size * args.seq * world
        row["tokens_per_s"] = tokens / (row["cycle_ms"] / 1e3)
        if args.profile and arm in args.profile_arms.split(","):
            row["profile"] = profile_update(cycle, row["update_ms"], device)
        return row, first
    except NotAvailable as exc:
        row["note"] = str(exc)
    except torch.cuda.OutOfMemoryError as exc:
        row["note"] = f"out of memory: {str(exc).splitlines()[0][:100]}"
    finally:
        model = cycle = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"[cycle] {ARMS[arm]}: done after {time.perf_counter() - started:.1f} s", flush=True)
    return row, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "runs" / "cycle")
    parser.add_argument("--model", choices=list(MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--arms", default="sequential,torch,te",
                        help=f"comma-separated, from {', '.join(ARMS)}")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (a multiple of 8)")
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--dispatcher", choices=["alltoall", "allgather"], default="alltoall")
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism (under torchrun)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="break one update pass down by component; writes breakdown.png")
    parser.add_argument("--profile-arms", default="torch,te",
                        help="arms to profile (SequentialMLP's update pass at 128 experts makes "
                             "about a million profiler events: minutes to parse)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model on the CPU (seconds): 2 layers, seq 32, 2 micro-batches "
                             "of 2, 1 measured cycle, allgather dispatcher, every arm profiled")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.layers, args.seq, args.micro_batch_size = "tiny", 2, 32, 2
        args.micro_batches, args.rank, args.warmup, args.cycles = 2, 8, 1, 1
        args.profile, args.profile_arms = True, ",".join(ARMS)
        args.dispatcher = "allgather"  # the alltoall dispatcher needs CUDA streams
        torch.set_num_threads(1)
    arms = args.arms.split(",")
    if set(arms) - set(ARMS):
        parser.error(f"unknown arms {sorted(set(arms) - set(ARMS))}; choose from {list(ARMS)}")
    arms.sort(key=lambda a: a != REFERENCE)  # the reference first: the others compare with it
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    for noise in (".*Transformer Engine and Apex are not installed.*", "full scope is deprecated"):
        warnings.filterwarnings("ignore", message=noise)

    init_parallel(args.ep, device)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    shape = MODELS[args.model]
    config = make_config(shape, args, device)
    batches = make_batches(shape, args, device)
    lines_header = header(device) + describe(shape, args, world)
    if rank0:
        print("\n".join(f"[cycle] {line}" for line in lines_header), flush=True)

    rows, reference = [], None
    for arm in arms:
        try:
            row, first = run_arm(arm, shape, config, batches, args, device, reference)
        except Exception as exc:  # noqa: BLE001 - reported in the table, traceback on stderr
            traceback.print_exc()
            row, first = {"arm": arm, "module": ARMS[arm],
                          "note": f"error: {type(exc).__name__}: {str(exc)[:120]}"}, None
        if arm == REFERENCE:
            reference = first
        rows.append(row)
        if rank0:  # after every arm: a run cut short still leaves the arms it finished
            text, written = write_results(args, lines_header, rows)
    if rank0:
        print(text, flush=True)
        print(f"[cycle] wrote {', '.join(written)} to {args.out_dir}", flush=True)


def write_results(args, lines_header, rows):
    """results.md, results.json and (with a profile) breakdown.png under --out-dir: the report's
    text and the names written."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    text = write_report(args.out_dir, lines_header, rows)
    (args.out_dir / "results.json").write_text(json.dumps(
        {"header": lines_header, "args": {k: str(v) for k, v in vars(args).items()},
         "rows": rows}, indent=1))
    written = ["results.md", "results.json"]
    if plot_breakdown(rows, args.out_dir / "breakdown.png"):
        written.append("breakdown.png")
    return text, written

if __name__ == "__main__":
    main()
