"""TorchGroupedMLP against every alternative at real MoE expert shapes, ceiling in the same run.

Per shape (REFERENCE.md section 4, rows per rank as in section 3) and routing (uniform, Zipf-skewed
with a fixed seed), forward and forward+input-gradient ("step") time of, all with the same frozen
BF16 weights:
  - TorchGroupedMLP called as MoELayer calls it, experts(x, tokens_per_expert, probs), with the
    splits on the CPU (what 0.16's dispatchers hand over) and on the GPU; and a CUDA graph of
    forward+backward with GPU splits, replayed (and replayed again after new splits are copied in);
  - TorchGroupedMLP with its activation x probs forced to eager torch ops (what the fused Triton
    kernel, `activation_impl == "fused"`, saves);
  - the raw grouped_mm pair written with plain torch ops (no module, no autograd), and its four
    GEMMs alone;
  - the dense GEMMs of the same FLOPs: the ceiling;
  - Megatron's SequentialMLP, TEGroupedMLP and legacy GroupedMLP ("not installed" when absent,
    "not available" where the installed megatron-core has no such module).
Also: extra peak memory over the inputs, memory held from forward to backward, host time per
step, host syncs (torch.cuda sync debug mode) and, for TorchGroupedMLP's paths, whether a step
blocks the host (queued behind a GPU sleep, it returns only after the sleep), relative error against
SequentialMLP, one-time packing cost, and a sweep of the local expert count at the Super shape.
Times: CUDA events around each call, warmup, median. Writes results.md, results.json, sweep.png
and ceiling.png to --out-dir. --tiny (automatic without CUDA) runs small shapes on the CPU.

    python benchmarks/bench_experts.py --out-dir runs/bench          # H200: about 3 minutes
    python benchmarks/bench_experts.py --shapes super-ep4 --quick
    python benchmarks/bench_experts.py --tiny                         # CPU smoke run (CI)
"""

import argparse
import json
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bench_common import MIB, fmt, median_ms, peak_bytes, pyplot, ratio, reset_peak, version
from bench_common import header as bench_header

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # runs from a checkout without installing the package
SLEEP_CYCLES = 500_000_000  # GPU sleep of ~0.25 s ahead of the host-blocking probe


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
TARGETS = "super-ep4"  # the targets are set at this shape, uniform routing

OURS_CPU = "TorchGroupedMLP (CPU splits)"
OURS_GPU = "TorchGroupedMLP (GPU splits)"
OURS_GRAPH = "TorchGroupedMLP CUDA graph (GPU splits)"
EAGER_ACT = "TorchGroupedMLP, eager activation"
FUSED = "TorchGroupedMLP, fused_gemm (CPU splits)"
GROUPED = "TorchGroupedMLP, grouped_mm (CPU splits)"
RAW = "raw grouped_mm pair"
GEMMS = "grouped_mm GEMMs alone"
DENSE = "dense GEMMs (ceiling)"
SEQUENTIAL = "SequentialMLP"
TE = "TEGroupedMLP"
LEGACY = "GroupedMLP (legacy)"


@dataclass
class Impl:
    """One way to run the experts: forward() -> (out, ctx); backward(ctx) -> grad of the input."""

    name: str
    forward: Callable
    backward: Callable
    module: bool = False  # an experts module: count host syncs
    ours: bool = False  # TorchGroupedMLP's path: also probe whether a step blocks the host
    computes_experts: bool = True  # False: GEMMs on stand-in data, nothing to compare


class NotInstalled(Exception):
    """An optional module that cannot run here; the message is the table's note."""


# --- setup ---------------------------------------------------------------------------------------

def init_megatron(device: torch.device, seed: int):
    """One-process Megatron parallel state (all sizes 1) over an in-memory store; its groups."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                             world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.cuda.set_device(device)
        model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def make_config(shape: Shape, experts: int, device: torch.device):
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    activation = {"squared_relu": squared_relu, "silu": F.silu}[shape.activation]
    return TransformerConfig(
        num_layers=1, hidden_size=shape.hidden, num_attention_heads=8, num_moe_experts=experts,
        moe_ffn_hidden_size=shape.ffn, ffn_hidden_size=shape.ffn, moe_router_topk=2,
        moe_grouped_gemm=True, gated_linear_unit=shape.glu, activation_func=activation,
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=device.type == "cpu")


def frozen(module):
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def weight_pairs(ours):
    """[(fc1 weight [out, in], fc2 weight [in, F])] per local expert of a TorchGroupedMLP."""
    fc1, fc2 = ours.linear_fc1.expert_weights(), ours.linear_fc2.expert_weights()
    return list(zip(fc1, fc2))


def build_sequential(config, pg):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return frozen(SequentialMLP(config.num_moe_experts, config, submodules, pg_collection=pg))


@torch.no_grad()
def copy_into_ours(seq, ours):
    """Pack a SequentialMLP's weights into TorchGroupedMLP (the copy path of a conversion)."""
    for expert, (w1, w2) in zip(seq.local_experts, weight_pairs(ours)):
        w1.copy_(expert.linear_fc1.weight)
        w2.copy_(expert.linear_fc2.weight)


def build_te(config, pg, ours):
    if ours.linear_fc1.packed_weight.device.type != "cuda":
        raise NotInstalled("not available: Transformer Engine needs CUDA (this run is on the CPU)")
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )
    except ImportError as exc:
        raise NotInstalled(f"not installed: {exc}") from exc
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    submodules = MLPSubmodules(linear_fc1=TEColumnParallelGroupedLinear,
                               linear_fc2=TERowParallelGroupedLinear)
    te = TEGroupedMLP(config.num_moe_experts, config, submodules, pg_collection=pg)
    with torch.no_grad():
        for i, (w1, w2) in enumerate(weight_pairs(ours)):
            getattr(te.linear_fc1, f"weight{i}").copy_(w1)
            getattr(te.linear_fc2, f"weight{i}").copy_(w2)
    return frozen(te)


def build_legacy(config, pg, ours):
    from mcore_torch_experts import _compat

    legacy_module = _compat.legacy_grouped_mlp()
    if legacy_module is None:
        raise NotInstalled(f"not available: megatron-core {version('megatron-core')} has no "
                           "legacy GroupedMLP (removed in 0.17)")
    GroupedMLP, grouped_gemm_is_available = legacy_module
    if not grouped_gemm_is_available():
        raise NotInstalled("not installed: grouped_gemm")
    legacy = GroupedMLP(config.num_moe_experts, config, pg_collection=pg)
    experts = config.num_moe_experts
    w1 = legacy.weight1.data.view(experts, config.hidden_size, -1)  # [E, in, out], transposed
    w2 = legacy.weight2.data.view(experts, -1, config.hidden_size)  # [E, F, in]
    with torch.no_grad():
        for i, (fc1, fc2) in enumerate(weight_pairs(ours)):
            w1[i].copy_(fc1.T)
            w2[i].copy_(fc2.T)
    return frozen(legacy)


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


# --- implementations -----------------------------------------------------------------------------

def module_impl(name, module, x, splits, probs, gy, call=None, ours=False):
    """An experts module called as MoELayer calls it; x requires grad, the weights do not."""
    call = call or (lambda: module(x, splits, probs)[0])

    def forward():
        out = call()
        return out, out

    return Impl(name, forward, lambda out: torch.autograd.grad(out, x, gy)[0], module=True,
                ours=ours)


def raw_pair_impl(config, shape, w1, w2, x, offs, probs, gy):
    """fc1 grouped_mm, activation, x probs (FP32, cast back), fc2 grouped_mm, and the two dgrad
    grouped_mms, as plain torch ops: no module, no autograd; the activation's derivative through
    the backward kernels autograd would use."""
    from mcore_torch_experts import find_grouped_mm

    gmm, act = find_grouped_mm().fn, config.activation_func
    x, p = x.detach(), probs.unsqueeze(-1)
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)

    def activation(h):
        if not shape.glu:
            return act(h)
        gate, up = h.chunk(2, -1)
        return act(gate) * up

    def activation_grad(h, grad):
        gate, up = h.chunk(2, -1) if shape.glu else (h, None)
        grad_gate = grad * up if shape.glu else grad
        if shape.activation == "silu":
            d_gate = torch.ops.aten.silu_backward(grad_gate, gate)
        else:  # squared ReLU: 2 relu(x) g
            d_gate = torch.relu(gate).mul_(2).mul_(grad_gate)
        return torch.cat([d_gate, grad * act(gate)], -1) if shape.glu else d_gate

    def forward():
        h = gmm(x, w1t, offs=offs)
        return gmm((activation(h) * p).to(h.dtype), w2t, offs=offs), h

    def backward(h):
        grad_act = (gmm(gy, w2, offs=offs) * p).to(h.dtype)
        return gmm(activation_grad(h, grad_act), w1, offs=offs)

    return Impl(RAW, forward, backward)


def gemm_impl(name, fc1, fc2, x, gy, fc1_out_like, act_like):
    """The four GEMMs of a step and nothing else: fc1(x), fc2(act), dgrad of fc2, dgrad of fc1.
    fc1/fc2(a, transposed) run one projection; act_like and fc1_out_like stand in for the
    activation and its gradient (same shapes, random values)."""
    x = x.detach()

    def forward():
        fc1(x, True)
        return fc2(act_like, True), None

    def backward(_):
        fc2(gy, False)
        return fc1(fc1_out_like, False)

    return Impl(name, forward, backward, computes_experts=False)


def graph_step(ours, x, splits, probs, gy):
    """A CUDA graph of TorchGroupedMLP forward + input gradient with GPU splits. Returns (graph,
    static (x, splits, probs, grad_out), static out, static grad)."""
    static = (x.detach().clone().requires_grad_(True), splits.clone(), probs.clone(), gy.clone())

    def step():
        out = ours(*static[:3])[0]
        return out, torch.autograd.grad(out, static[0], static[3])[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, grad = step()
    return graph, static, out, grad


# --- measurement ---------------------------------------------------------------------------------

class Meter:
    """Median times (CUDA events, or the wall clock on the CPU), memory, syncs, host blocking."""

    def __init__(self, device, warmup, reps, flush_l2):
        self.device, self.cuda = device, device.type == "cuda"
        self.warmup, self.reps = warmup, reps
        self.l2 = torch.empty(256 * 2 ** 20, dtype=torch.int8, device=device) if flush_l2 else None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn):
        """(median device ms, median host ms) of fn; on the CPU both are the wall clock."""
        return median_ms(fn, self.device, self.warmup, self.reps,
                         before=self.l2.zero_ if self.l2 is not None else None)

    def memory(self, impl):
        """(extra peak MiB over the step, MiB held from forward to backward) above the inputs."""
        base = reset_peak(self.device)
        out, ctx = impl.forward()
        self.sync()
        held = torch.cuda.memory_allocated() - base
        impl.backward(ctx)
        del out, ctx
        return (peak_bytes(self.device) - base) / MIB, held / MIB

    def count_syncs(self, fn):
        """Host syncs torch's sync debug mode reports while fn runs."""
        self.sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        self.sync()
        return sum("synchroniz" in str(w.message) for w in caught)

    def blocks_host(self, fn):
        """True if fn returns only after earlier GPU work (a ~0.25 s sleep) has finished."""
        self.sync()
        torch.cuda._sleep(SLEEP_CYCLES)
        slept = torch.cuda.Event()
        slept.record()
        fn()
        blocked = slept.query()
        self.sync()
        return blocked


def rel_err(actual, expected):
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def measure(meter, impl, reference, full=True):
    """One row: times, and with full=True memory, syncs, blocking and error against reference."""
    row = {"name": impl.name}

    def step():
        return impl.backward(impl.forward()[1])

    row["fwd_ms"], _ = meter.time(impl.forward)
    row["step_ms"], row["host_ms"] = meter.time(step)
    if not full:
        return row
    if meter.cuda:
        row["peak_mib"], row["held_mib"] = meter.memory(impl)
        if impl.module:
            held = []
            row["syncs_fwd"] = meter.count_syncs(lambda: held.append(impl.forward()))
            row["syncs_bwd"] = meter.count_syncs(lambda: impl.backward(held.pop()[1]))
        if impl.ours:  # a few dozen launches: well inside the launch queue while the GPU sleeps
            row["blocks_host"] = meter.blocks_host(step)
    if impl.computes_experts:
        out, ctx = impl.forward()
        row["err"] = max(rel_err(out, reference[0]), rel_err(impl.backward(ctx), reference[1]))
    return row


def error_note(exc):
    traceback.print_exc()
    return f"error: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"


def guarded(name, fn):
    """fn() -> row, or a row that says why it did not run; a failure never stops the run."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the table, traceback on stderr
        return {"name": name, "note": error_note(exc)}


def guarded_build(build, *args):
    """An optional module, or the note that says why there is none."""
    try:
        return build(*args)
    except NotInstalled as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001
        return error_note(exc)


def timed_build(meter, fn):
    """(result, {ms, extra peak MiB, MiB held after}) of a one-time step such as packing."""
    meter.sync()
    base = torch.cuda.memory_allocated() if meter.cuda else 0
    if meter.cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = fn()
    meter.sync()
    cost = {"ms": (time.perf_counter() - t0) * 1e3}
    if meter.cuda:
        cost["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
        cost["held_mib"] = (torch.cuda.memory_allocated() - base) / MIB
    return result, cost


def step_flops(shape: Shape) -> float:
    """Forward + input gradient: two GEMMs each way."""
    fc1_out = shape.ffn * (2 if shape.glu else 1)
    return 2 * 2 * shape.rows * shape.hidden * (fc1_out + shape.ffn)


# --- one shape -----------------------------------------------------------------------------------

class ShapeBench:
    """Everything measured at one shape: the modules are built once, then every routing runs."""

    def __init__(self, meter, pg, device, args):
        self.meter, self.pg, self.device, self.args = meter, pg, device, args

    def inputs(self, shape, splits):
        gen = torch.Generator(device=self.device).manual_seed(self.args.seed)
        rows = int(splits.sum())
        x = torch.randn(rows, shape.hidden, generator=gen, device=self.device).bfloat16()
        probs = torch.rand(rows, generator=gen, device=self.device)
        gy = torch.randn(rows, shape.hidden, generator=gen, device=self.device).bfloat16()
        return x.requires_grad_(True), probs, gy

    def dense(self, shape):
        """The ceiling: the four GEMMs of a step as plain dense matmuls over all rows."""
        fc1_out = shape.ffn * (2 if shape.glu else 1)
        randn = lambda *size: torch.randn(*size, device=self.device).bfloat16()  # noqa: E731
        w1, w2 = randn(fc1_out, shape.hidden) * 0.02, randn(shape.hidden, shape.ffn) * 0.02
        x, gy = randn(shape.rows, shape.hidden), randn(shape.rows, shape.hidden)
        fc1 = lambda a, fwd: a @ (w1.T if fwd else w1)  # noqa: E731
        fc2 = lambda a, fwd: a @ (w2.T if fwd else w2)  # noqa: E731
        impl = gemm_impl(DENSE, fc1, fc2, x, gy, randn(shape.rows, fc1_out),
                         randn(shape.rows, shape.ffn))
        return measure(self.meter, impl, None)

    def build(self, shape, experts, packing=None):
        """TorchGroupedMLP (Megatron-initialised) and SequentialMLP with the same weights."""
        from mcore_torch_experts import TorchGroupedMLP

        config = make_config(shape, experts, self.device)
        ours, cost = timed_build(self.meter, lambda: frozen(
            TorchGroupedMLP(experts, config, pg_collection=self.pg)))
        seq, seq_cost = timed_build(self.meter, lambda: build_sequential(config, self.pg))
        _, copy_cost = timed_build(self.meter, lambda: copy_into_ours(seq, ours))
        if packing is not None:
            packing.update({"TorchGroupedMLP build (Megatron init into the packed buffer)": cost,
                            "SequentialMLP build (Megatron init)": seq_cost,
                            "pack: copy SequentialMLP weights into TorchGroupedMLP": copy_cost,
                            "repack at first forward after every weightN was replaced":
                                self.repack_cost(ours)})
        return config, ours, seq

    def repack_cost(self, ours):
        """Replace every weightN by a new Parameter (as a loader may), then time the repack."""
        for linear in (ours.linear_fc1, ours.linear_fc2):
            for i, w in enumerate(linear.expert_weights()):
                setattr(linear, f"weight{i}", torch.nn.Parameter(w.detach().clone(),
                                                                 requires_grad=False))
        _, cost = timed_build(self.meter, lambda: (ours.linear_fc1.packed(),
                                                   ours.linear_fc2.packed()))
        return cost

    def routing(self, shape, routing, config, ours, seq, dense_row, extras=None, graph=None):
        """Rows for one routing. Without `extras` (dict name -> module or a note) a short run:
        times only, no GPU-splits row and no graph (the sweep)."""
        from mcore_torch_experts import group_offsets

        args, full = self.args, extras is not None
        splits = make_splits(shape.rows, config.num_moe_experts, routing, args.zipf, args.seed)
        x, probs, gy = self.inputs(shape, splits)
        gpu_splits = splits.to(self.device)
        offs = group_offsets(splits, config.num_moe_experts, shape.rows, self.device)
        seq_impl = module_impl(SEQUENTIAL, seq, x, splits, probs, gy)
        out, ctx = seq_impl.forward()
        reference = (out.detach(), seq_impl.backward(ctx))
        w1, w2 = ours.linear_fc1.packed(), ours.linear_fc2.packed()
        gmm = ours.linear_fc1._grouped_mm
        act_like = torch.randn(shape.rows, shape.ffn, device=self.device).bfloat16()
        fc1_out_like = torch.randn(shape.rows, shape.ffn * (2 if shape.glu else 1),
                                   device=self.device).bfloat16()
        impls = [
            (OURS_CPU, lambda: module_impl(OURS_CPU, ours, x, splits, probs, gy, ours=True)),
            (FUSED, lambda: module_impl(FUSED, ours, x, splits, probs, gy, ours=True,
                                        call=lambda: forced_forward(ours, x, splits, probs,
                                                                    "fused_gemm"))
             if self.meter.cuda else "not available: its Triton kernels run on CUDA"),
            (GROUPED, lambda: module_impl(GROUPED, ours, x, splits, probs, gy, ours=True,
                                          call=lambda: forced_forward(ours, x, splits, probs,
                                                                      "grouped_mm"))),
            (EAGER_ACT, lambda: module_impl(EAGER_ACT, ours, x, splits, probs, gy, ours=True,
                                            call=lambda: forced_forward(ours, x, splits, probs,
                                                                        "grouped_mm", "eager"))),
            (RAW, lambda: raw_pair_impl(config, shape, w1, w2, x, offs, probs, gy)),
            (GEMMS, lambda: gemm_impl(
                GEMMS, lambda a, fwd: gmm(a, w1.transpose(1, 2) if fwd else w1, offs=offs),
                lambda a, fwd: gmm(a, w2.transpose(1, 2) if fwd else w2, offs=offs),
                x, gy, fc1_out_like, act_like)),
            (SEQUENTIAL, lambda: seq_impl),
        ]
        if full and self.meter.cuda:
            impls.insert(1, (OURS_GPU, lambda: module_impl(OURS_GPU, ours, x, gpu_splits, probs,
                                                           gy, ours=True)))
        for name, module in (extras or {}).items():
            impls.append((name, lambda name=name, module=module: module_impl(
                name, module, x, splits, probs, gy) if not isinstance(module, str) else module))
        rows = []
        for name, make in impls:
            row = guarded(name, lambda: self.row(make(), name, reference, full))
            rows.append(row)
            self.progress(shape, routing, config.num_moe_experts, row)
        if full and graph is not None:
            row = guarded(OURS_GRAPH, lambda: self.graph_row(graph, ours, x, gpu_splits, probs, gy,
                                                             reference))
            rows.insert(2, row)
            self.progress(shape, routing, config.num_moe_experts, row)
        rows.append(dense_row)
        return {"shape": shape, "routing": routing, "experts": config.num_moe_experts,
                "rows": rows, "splits": splits.tolist()}

    def row(self, impl, name, reference, full):
        if isinstance(impl, str):  # what could not be built: its note
            return {"name": name, "note": impl}
        return measure(self.meter, impl, reference, full)

    def graph_row(self, graph, ours, x, splits, probs, gy, reference):
        """Capture once (first routing); copy this routing's inputs and splits into the static
        tensors, replay, compare with the eager module, time the replay."""
        if "captured" not in graph:
            graph["captured"] = graph_step(ours, x, splits, probs, gy)
        cuda_graph, static, out, grad = graph["captured"]
        with torch.no_grad():
            for buffer, value in zip(static, (x, splits, probs, gy)):
                buffer.copy_(value)
        cuda_graph.replay()
        eager_out = ours(x, splits, probs)[0]
        eager_grad = torch.autograd.grad(eager_out, x, gy)[0]
        row = {"name": OURS_GRAPH, "err": max(rel_err(out, reference[0]),
                                              rel_err(grad, reference[1])),
               "graph_matches_eager": bool(torch.equal(out, eager_out)
                                           and torch.equal(grad, eager_grad))}
        row["step_ms"], row["host_ms"] = self.meter.time(cuda_graph.replay)
        return row

    @staticmethod
    def progress(shape, routing, experts, row):
        if "note" in row:
            detail = row["note"]
        else:
            detail = f"fwd {row['fwd_ms']:.3f} ms, " if "fwd_ms" in row else ""
            detail += f"fwd+dgrad {row['step_ms']:.3f} ms, host {row['host_ms']:.3f} ms"
            for key in ("peak_mib", "syncs_fwd", "syncs_bwd", "blocks_host", "err",
                        "graph_matches_eager"):
                if key in row:
                    value = f"{row[key]:.3g}" if isinstance(row[key], float) else row[key]
                    detail += f", {key} {value}"
        print(f"[bench] {shape.label.split(' (')[0]} E={experts} {routing}: {row['name']}: "
              f"{detail}", flush=True)


# --- report --------------------------------------------------------------------------------------

def environment(args, device):
    """Header lines: command, machine and versions, and how this benchmark times."""
    from mcore_torch_experts import find_grouped_mm

    lines = bench_header(device)
    lines[-1] += f"; grouped GEMM: {find_grouped_mm().name}"
    lines.append(f"timing: warmup {args.warmup}, median of {args.reps}, L2 flush "
                 f"{'on' if args.flush_l2 else 'off'}; skewed routing: Zipf {args.zipf} over a "
                 f"seeded expert order (seed {args.seed}); weights frozen, bf16; probs FP32 "
                 "without grad")
    return lines


def matmul_tflops(device):
    """An 8192^3 bf16 matmul on random data: the card's dense rate today."""
    a = torch.randn(8192, 8192, device=device).bfloat16()
    b = torch.randn(8192, 8192, device=device).bfloat16()
    meter = Meter(device, 3, 10, False)
    ms, _ = meter.time(lambda: a @ b)
    return 2 * 8192 ** 3 / ms / 1e9


def table(results):
    """The main markdown table: one row per implementation, shape and routing."""
    head = ("| shape | routing | implementation | fwd ms | fwd+dgrad ms | TFLOP/s | / raw pair "
            "| ceiling fraction | x SequentialMLP | peak MiB | held MiB | host ms | syncs fwd/bwd "
            "| blocks host | rel err vs Sequential |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for res in results:
        by_name = {r["name"]: r for r in res["rows"]}
        base = {k: by_name.get(k, {}).get("step_ms") for k in (RAW, DENSE, SEQUENTIAL)}
        flops = step_flops(res["shape"])
        for r in res["rows"]:
            cells = [res["name"], res["routing"], r["name"]]
            if "note" in r:
                lines.append("| " + " | ".join(cells + [r["note"]] + [""] * 11) + " |")
                continue
            step = r["step_ms"]
            syncs = f"{r['syncs_fwd']}/{r['syncs_bwd']}" if "syncs_fwd" in r else None
            blocks = {True: "yes", False: "no"}.get(r.get("blocks_host"))
            err = "reference" if r["name"] == SEQUENTIAL else r.get("err")
            if r.get("graph_matches_eager") is not None:
                err = f"{err:.1e}, = eager: {'yes' if r['graph_matches_eager'] else 'NO'}"
            cells += [fmt(r.get("fwd_ms")), fmt(step), fmt(flops / step / 1e9, ".3g"),
                      fmt(ratio(step, base[RAW]), ".2f"), fmt(ratio(base[DENSE], step), ".2f"),
                      fmt(ratio(base[SEQUENTIAL], step), ".1f"), fmt(r.get("peak_mib"), ".0f"),
                      fmt(r.get("held_mib"), ".0f"), fmt(r.get("host_ms"), ".2f"),
                      syncs or "—", blocks or "—",
                      err if isinstance(err, str) else fmt(err, ".1e")]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def forced_forward(mlp, x, splits, probs, kernel, activation=None):
    """TorchGroupedMLP with its expert kernels forced to `kernel` ("fused_gemm" raises where it
    cannot run) and, when given, its activation_impl (grouped_mm path) forced too."""
    saved = mlp.expert_kernel_setting, mlp.expert_kernel_impl, mlp.activation_impl
    mlp.expert_kernel_setting = mlp.expert_kernel_impl = kernel
    mlp.activation_impl = activation or mlp.activation_impl
    try:
        return mlp(x, splits, probs)[0]
    finally:
        mlp.expert_kernel_setting, mlp.expert_kernel_impl, mlp.activation_impl = saved


def step_of(res, name):
    return next((r.get("step_ms") for r in res["rows"] if r["name"] == name), None)


def targets(results, sweep, target_shape):
    """The issue's targets at the target shape (uniform routing) and across the sweep; judged on
    TorchGroupedMLP as MoELayer calls it (CPU splits), with GPU splits and the eager activation beside."""
    names = (OURS_CPU, OURS_GPU, EAGER_ACT)
    lines = ["| target | " + " | ".join(names) + " | met |", "|---|---|---|---|---|"]
    main = next((r for r in results if r["name"] == target_shape and r["routing"] == "uniform"),
                None)
    if main is not None:
        raw, dense, seq = (step_of(main, n) for n in (RAW, DENSE, SEQUENTIAL))
        checks = [(f"{target_shape}: fwd+dgrad time / raw grouped_mm pair <= 1.05",
                   lambda t: ratio(t, raw), lambda v: v <= 1.05, ".3f"),
                  (f"{target_shape}: dense ceiling fraction >= 0.90",
                   lambda t: ratio(dense, t), lambda v: v >= 0.90, ".3f"),
                  (f"{target_shape}: x SequentialMLP >= 9", lambda t: ratio(seq, t),
                   lambda v: v >= 9, ".1f")]
        for label, value, ok, spec in checks:
            values = [value(step_of(main, n)) for n in names]
            met = "—" if values[0] is None else ("yes" if ok(values[0]) else "NO")
            lines.append(f"| {label} | " + " | ".join(fmt(v, spec) for v in values) + f" | {met} |")
        rows = {r["name"]: r for r in main["rows"]}
        if "syncs_fwd" in rows.get(OURS_GPU, {}):
            cells = [f"{rows[n]['syncs_fwd']}/{rows[n]['syncs_bwd']}, blocks host: "
                     f"{'yes' if rows[n]['blocks_host'] else 'no'}"
                     if "syncs_fwd" in rows.get(n, {}) else "—" for n in names]
            gpu = rows[OURS_GPU]
            ok = gpu["syncs_fwd"] == gpu["syncs_bwd"] == 0 and not gpu["blocks_host"]
            lines.append("| host syncs fwd/bwd = 0 with GPU splits | " + " | ".join(cells)
                         + f" | {'yes' if ok else 'NO'} |")
    for res in sweep:
        if res["experts"] <= 32:
            seq = step_of(res, SEQUENTIAL)
            values = [step_of(res, n) for n in names]
            met = "—" if None in (values[0], seq) else ("yes" if values[0] <= seq else "NO")
            lines.append(f"| {res['experts']} local experts: ms <= SequentialMLP's {fmt(seq)} ms | "
                         + " | ".join(fmt(v) for v in values) + f" | {met} |")
    return lines


def sweep_table(sweep):
    names = [OURS_CPU, FUSED, GROUPED, EAGER_ACT, RAW, GEMMS, SEQUENTIAL, DENSE]
    lines = ["| local experts | rows per expert | " + " | ".join(f"{n} ms" for n in names)
             + " | x SequentialMLP | ceiling fraction | fused_gemm ceiling fraction "
             "| fused_gemm / grouped_mm time |",
             "|" + "---|" * (len(names) + 6)]
    for res in sweep:
        ours, seq, dense, fused, grouped = (step_of(res, n) for n in (
            OURS_CPU, SEQUENTIAL, DENSE, FUSED, GROUPED))
        cells = [str(res["experts"]), str(res["shape"].rows // res["experts"])]
        cells += [fmt(step_of(res, n)) for n in names]
        cells += [fmt(ratio(seq, ours), ".1f"), fmt(ratio(dense, ours), ".2f"),
                  fmt(ratio(dense, fused), ".2f"), fmt(ratio(fused, grouped), ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plots(out_dir, results, sweep):
    """sweep.png (time against local experts) and ceiling.png (fraction of the ceiling)."""
    plt = pyplot()
    if plt is None:
        return []
    written = []
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        experts = [res["experts"] for res in sweep]
        for name in (OURS_CPU, FUSED, GROUPED, EAGER_ACT, RAW, SEQUENTIAL, DENSE):
            ys = [step_of(res, name) for res in sweep]
            if any(y is not None for y in ys):
                ax.plot(experts, [float("nan") if y is None else y for y in ys], marker="o",
                        label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(experts, [str(e) for e in experts])
        ax.set_xlabel("local experts (fixed total rows)")
        ax.set_ylabel("forward + input gradient, ms")
        ax.set_title(f"{sweep[0]['shape'].label.split(' (')[0]}: {sweep[0]['shape'].rows} rows")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "sweep.png", dpi=120)
        plt.close(fig)
        written.append("sweep.png")
    if results:
        names = (OURS_CPU, FUSED, GROUPED, EAGER_ACT, RAW, GEMMS)
        labels = [f"{r['name']}\n{r['routing']}" for r in results]
        fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(results)), 4.5))
        width = 0.8 / len(names)
        for k, name in enumerate(names):
            values = []
            for res in results:
                step, dense = step_of(res, name), step_of(res, DENSE)
                values.append(ratio(dense, step) or 0.0)
            ax.bar([i + (k - (len(names) - 1) / 2) * width for i in range(len(results))], values,
                   width, label=name)
        ax.axhline(0.9, color="k", linestyle="--", linewidth=1, label="target 0.90")
        ax.set_xticks(range(len(results)), labels, fontsize=7)
        ax.set_ylabel("dense ceiling time / time")
        ax.set_title("fraction of the dense-GEMM ceiling, forward + input gradient")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "ceiling.png", dpi=120)
        plt.close(fig)
        written.append("ceiling.png")
    return written


def packing_table(packing):
    lines = ["| shape | one-time step | ms | MiB held after (vs before) | transient MiB "
             "(peak above that) |", "|---|---|---|---|---|"]
    for name, steps in packing.items():
        for step, cost in steps.items():
            held = cost.get("held_mib")
            transient = None if held is None else cost["peak_mib"] - max(held, 0.0)
            lines.append(f"| {name} | {step} | {cost['ms']:.1f} | {fmt(held, '.0f')} | "
                         f"{fmt(transient, '.0f')} |")
    return lines


def fused_table(results):
    lines = ["| shape | routing | fused_gemm ms | grouped_mm ms | dense ms | fused_gemm ceiling "
             "fraction | grouped_mm ceiling fraction | fused / grouped_mm time | fused peak MiB "
             "| grouped_mm peak MiB |", "|" + "---|" * 10]
    for res in results:
        rows = {r["name"]: r for r in res["rows"]}
        fused, grouped, dense = (step_of(res, n) for n in (FUSED, GROUPED, DENSE))
        lines.append("| " + " | ".join([
            res["name"], res["routing"], fmt(fused), fmt(grouped), fmt(dense),
            fmt(ratio(dense, fused), ".2f"), fmt(ratio(dense, grouped), ".2f"),
            fmt(ratio(fused, grouped), ".3f"), fmt(rows.get(FUSED, {}).get("peak_mib"), ".0f"),
            fmt(rows.get(GROUPED, {}).get("peak_mib"), ".0f")]) + " |")
    return lines


def write_report(out_dir, header, results, sweep, packing, target_shape):
    lines = ["# TorchGroupedMLP benchmark", ""] + [f"- {h}" for h in header] + [""]
    lines += ["## Targets", "", "Judged on TorchGroupedMLP as MoELayer calls it (CPU splits); GPU "
              "splits and the eager-activation variant beside it.", ""]
    lines += targets(results, sweep, target_shape) + [""]
    lines += ["## All shapes", "",
              "Columns: fwd+dgrad = forward + input gradient (weights frozen). `/ raw pair` = time "
              "/ raw grouped_mm pair time (target <= 1.05); `ceiling fraction` = dense-GEMM time / "
              "time (target >= 0.90); `x SequentialMLP` = SequentialMLP time / time (target >= 9). "
              "Peak = extra peak memory of one step over its inputs; held = memory kept from "
              "forward to backward (output included). Syncs counted by torch.cuda's sync debug "
              "mode; 'blocks host' (TorchGroupedMLP paths): a step queued behind a GPU sleep "
              "returned only after the sleep ended. The CUDA graph is captured at the first "
              "routing and replayed with each routing's inputs and splits copied in; '= eager' "
              "says its output and gradient equal the eager module's bit for bit.", ""]
    lines += table(results) + [""]
    lines += ["## fused_gemm against grouped_mm", "",
              "TorchGroupedMLP with its kernels forced either way, in the same run: fraction of "
              "the dense ceiling (targets: uniform >= 0.90, skewed >= 0.85) and fused_gemm time / "
              "grouped_mm time (target: <= 1 everywhere).", ""]
    lines += fused_table(results) + [""]
    if sweep:
        lines += ["## Local expert count sweep (uniform routing, fixed total rows)", ""]
        lines += sweep_table(sweep) + [""]
    if packing:
        lines += ["## One-time packing", ""] + packing_table(packing) + [""]
    text = "\n".join(lines)
    (out_dir / "results.md").write_text(text)
    return text


def to_json(results):
    return [{**{k: v for k, v in res.items() if k != "shape"}, "shape": res["shape"].__dict__}
            for res in results]


# --- main ----------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "runs" / "bench")
    parser.add_argument("--shapes", default="all",
                        help=f"comma-separated names, or all: {', '.join(SHAPES)} "
                             f"(tiny: {', '.join(TINY_SHAPES)})")
    parser.add_argument("--routings", default=",".join(ROUTINGS))
    parser.add_argument("--sweep", default=None,
                        help="local expert counts for the sweep at the first sweep shape; '' skips "
                             f"(default {SWEEP['super-ep4']}; --quick 8,32,128)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, a shorter sweep")
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (automatic "
                                                            "without CUDA)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--flush-l2", action="store_true", help="zero 256 MiB before each call")
    parser.add_argument("--zipf", type=float, default=1.0, help="exponent of the skewed routing")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    args.tiny = args.tiny or not torch.cuda.is_available()
    if args.tiny:
        # One thread: tiny ops, often a busy CI host.
        torch.set_num_threads(1)
    device = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    catalog = TINY_SHAPES if args.tiny else SHAPES
    names = list(catalog) if args.shapes == "all" else args.shapes.split(",")
    unknown = [n for n in names if n not in catalog]
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {list(catalog)}")
    routings = args.routings.split(",")
    sweep_shape = next((n for n in names if n in SWEEP), None)
    if args.sweep is None:
        args.sweep = "8,32,128" if args.quick and not args.tiny else SWEEP.get(sweep_shape, "")
    sweep_counts = [int(e) for e in args.sweep.split(",") if e] if sweep_shape else []
    if args.warmup is None:
        args.warmup = 1 if args.tiny else (2 if args.quick else 5)
    if args.reps is None:
        args.reps = 2 if args.tiny else (10 if args.quick else 30)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    for noise in (".*Transformer Engine and Apex are not installed.*", "full scope is deprecated"):
        warnings.filterwarnings("ignore", message=noise)
    pg = init_megatron(device, args.seed)
    meter = Meter(device, args.warmup, args.reps, args.flush_l2)
    header = environment(args, device)
    if device.type == "cuda":
        header.append(f"8192^3 bf16 matmul on random data: {matmul_tflops(device):.0f} TFLOP/s")
    for line in header:
        print(f"[bench] {line}", flush=True)

    bench = ShapeBench(meter, pg, device, args)
    results, sweep, packing = [], [], {}
    started = time.perf_counter()
    for name in names:
        shape = catalog[name]
        packing[name] = {}
        config, ours, seq = bench.build(shape, shape.experts, packing[name])
        extras = {TE: guarded_build(build_te, config, pg, ours),
                  LEGACY: guarded_build(build_legacy, config, pg, ours)}
        dense_row = guarded(DENSE, lambda: bench.dense(shape))
        graph = {} if meter.cuda else None
        for routing in routings:
            res = bench.routing(shape, routing, config, ours, seq, dense_row, extras, graph)
            results.append({**res, "name": name})
        del config, ours, seq, extras, graph
        if name == sweep_shape:
            for experts in sweep_counts:
                config, ours, seq = bench.build(shape, experts)
                res = bench.routing(shape, "uniform", config, ours, seq, dense_row)
                sweep.append({**res, "name": name})
                del config, ours, seq
        if meter.cuda:
            torch.cuda.empty_cache()
        print(f"[bench] {name} done at {time.perf_counter() - started:.0f} s", flush=True)

    header.append(f"wall time of the measurements: {time.perf_counter() - started:.0f} s")
    text = write_report(args.out_dir, header, results, sweep, packing,
                        TARGETS if TARGETS in names else names[0])
    (args.out_dir / "results.json").write_text(json.dumps(
        {"header": header, "results": to_json(results), "sweep": to_json(sweep),
         "packing": packing}, indent=1, default=str))
    written = ["results.md", "results.json"] + plots(args.out_dir, results, sweep)
    print(text, flush=True)
    print(f"[bench] wrote {', '.join(written)} to {args.out_dir}", flush=True)


if __name__ == "__main__":
    main()
