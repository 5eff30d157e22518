"""TorchGroupedMLP against every alternative at real MoE expert shapes, ceiling in the same run.

Per shape (REFERENCE.md section 4, rows per rank as in section 3) and routing (uniform, Zipf-skewed
with a fixed seed), forward and forward+input-gradient ("step") time of, all with the same frozen
BF16 weights:
  - TorchGroupedMLP called as MoELayer calls it, experts(x, tokens_per_expert, probs), with the
    splits on the CPU (what 0.16's dispatchers hand over) and on the GPU; and a CUDA graph of
    forward+backward with GPU splits, replayed (and replayed again after new splits are copied in);
  - TorchGroupedMLP with our LoRA adapters on both linears (--lora-rank, --lora-adapter), its
    kernels forced to fused_gemm and to grouped_mm; their step is the update pass (adapter
    gradients included);
  - TorchGroupedMLP with its activation x probs forced to eager torch ops (what the fused Triton
    kernel, `kernels.activation == "fused"`, saves);
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
import time
import warnings
from pathlib import Path

import torch

from experts_impls import (
    DENSE,
    EAGER_ACT,
    FUSED,
    GEMMS,
    GROUPED,
    LEGACY,
    LORA_FUSED,
    LORA_GROUPED,
    OURS_CPU,
    OURS_GPU,
    OURS_GRAPH,
    RAW,
    SEQUENTIAL,
    TE,
    build_legacy,
    build_sequential,
    build_te,
    copy_into_ours,
    forced_forward,
    frozen,
    gemm_impl,
    graph_step,
    guarded_build,
    init_megatron,
    lora_agreement,
    lora_impl,
    lora_wrappers,
    make_config,
    measure,
    module_impl,
    raw_pair_impl,
    rel_err,
)
from experts_report import plots, report_body, to_json
from harness import REPO_ROOT, Meter, guarded, header, write_report
from shapes import ROUTINGS, SHAPES, SWEEP, TINY_SHAPES, make_splits

TARGETS = "super-ep4"  # the targets are set at this shape, uniform routing


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
        ours, cost = self.meter.one_time(lambda: frozen(
            TorchGroupedMLP(experts, config, pg_collection=self.pg)))
        seq, seq_cost = self.meter.one_time(lambda: build_sequential(config, self.pg))
        _, copy_cost = self.meter.one_time(lambda: copy_into_ours(seq, ours))
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
        _, cost = self.meter.one_time(lambda: (ours.linear_fc1.packed(),
                                                   ours.linear_fc2.packed()))
        return cost

    def routing(self, shape, routing, config, ours, seq, dense_row, extras=None, graph=None):
        """Rows for one routing. Without `extras` (dict name -> module or a note) a short run:
        times only, no GPU-splits row and no graph (the sweep)."""
        from mcore_torch_experts import group_offsets
        from mcore_torch_experts.kernels import grouped_gemm

        args, full = self.args, extras is not None
        splits = make_splits(shape.rows, config.num_moe_experts, routing, args.zipf, args.seed)
        x, probs, gy = self.inputs(shape, splits)
        gpu_splits = splits.to(self.device)
        offs = group_offsets(splits, config.num_moe_experts, shape.rows, self.device)
        seq_impl = module_impl(SEQUENTIAL, seq, x, splits, probs, gy)
        out, ctx = seq_impl.forward()
        reference = (out.detach(), seq_impl.backward(ctx))
        w1, w2 = ours.linear_fc1.packed(), ours.linear_fc2.packed()
        gmm = grouped_gemm.grouped_mm   # the seam every grouped GEMM of the experts takes
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
        if full and args.lora_rank:
            wrappers = lora_wrappers(ours, args.lora_adapter, args.lora_rank, 2.0 * args.lora_rank,
                                     args.seed)
            lora = {kernel: lambda kernel=kernel, name=name: lora_impl(
                        name, ours, wrappers, x, splits, probs, gy, kernel)
                    for kernel, name in (("fused_gemm", LORA_FUSED), ("grouped_mm", LORA_GROUPED))}
            impls += [(LORA_FUSED, lora["fused_gemm"] if self.meter.cuda else
                       lambda: "not available: its Triton kernels run on CUDA"),
                      (LORA_GROUPED, lora["grouped_mm"])]
        if full and self.meter.cuda:
            impls.insert(1, (OURS_GPU, lambda: module_impl(OURS_GPU, ours, x, gpu_splits, probs,
                                                           gy, ours=True)))
        for name, module in (extras or {}).items():
            impls.append((name, lambda name=name, module=module: module_impl(
                name, module, x, splits, probs, gy) if not isinstance(module, str) else module))
        rows = []
        for name, make in impls:
            row = guarded(name, lambda: self.row(make(), name, reference, full))  # noqa: B023 - called at once
            rows.append(row)
            self.progress(shape, routing, config.num_moe_experts, row)
        if full and args.lora_rank and self.meter.cuda:
            fused_row = next(r for r in rows if r["name"] == LORA_FUSED)
            if "note" not in fused_row:
                fused_row["lora_diff"] = guarded("LoRA agreement", lambda: lora_agreement(
                    lora["fused_gemm"](), lora["grouped_mm"]()))
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


# --- header --------------------------------------------------------------------------------------

def environment(args, device):
    """Header lines: command, machine and versions, and how this benchmark times."""
    from mcore_torch_experts import find_grouped_mm

    lines = header(device)
    lines[-1] += f"; grouped GEMM: {find_grouped_mm().name}"
    lines.append(f"timing: warmup {args.warmup}, median of {args.reps}, L2 flush "
                 f"{'on' if args.flush_l2 else 'off'}; skewed routing: Zipf {args.zipf} over a "
                 f"seeded expert order (seed {args.seed}); weights frozen, bf16; probs FP32 "
                 "without grad")
    if args.lora_rank:
        lines.append(f"'+ LoRA' rows: {args.lora_adapter} adapters on linear_fc1 and linear_fc2, "
                     f"rank {args.lora_rank}, alpha {2 * args.lora_rank}; their fwd+dgrad is "
                     "the update pass (adapter gradients included)")
    return lines


def matmul_tflops(device):
    """An 8192^3 bf16 matmul on random data: the card's dense rate today."""
    a = torch.randn(8192, 8192, device=device).bfloat16()
    b = torch.randn(8192, 8192, device=device).bfloat16()
    meter = Meter(device, 3, 10)
    ms, _ = meter.time(lambda: a @ b)
    return 2 * 8192 ** 3 / ms / 1e9


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
    parser.add_argument("--lora-rank", type=int, default=16,
                        help="rank of the LoRA adapters of the '+ LoRA' rows (alpha = 2 x rank); "
                             "0 leaves the rows out")
    parser.add_argument("--lora-adapter", choices=("per_expert", "shared"), default="per_expert",
                        help="one adapter per expert or one shared by the experts")
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
        dense_row = guarded(DENSE, lambda: bench.dense(shape))  # noqa: B023 - called at once
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
    body = report_body(results, sweep, packing, TARGETS if TARGETS in names else names[0])
    text = write_report(args.out_dir, "results", "TorchGroupedMLP benchmark", header, body,
                        {"results": to_json(results), "sweep": to_json(sweep),
                         "packing": packing})
    written = ["results.md", "results.json"] + plots(args.out_dir, results, sweep)
    print(text, flush=True)
    print(f"[bench] wrote {', '.join(written)} to {args.out_dir}", flush=True)


if __name__ == "__main__":
    main()
