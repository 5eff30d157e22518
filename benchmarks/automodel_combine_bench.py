"""NeMo Automodel's own GroupedExperts (nemo-automodel 0.7.0, backend.experts="torch_mm", BF16,
SwiGLU) with each way to sum its expert outputs into the tokens in FP32: time and peak memory of
forward and forward + backward, errors against FP64 and run-to-run reproducibility.

The ways, on one module (same weights, same inputs):
  - shipped: `y.scatter_add_(0, ids, output2.float())`, as released,
  - fork loop: the reported workaround (NEMO_AUTOMODEL_MOE_SCATTER_CHUNK_ROWS=4096): the same cast
    and scatter --chunk-rows rows at a time, through ordinary autograd (combine_bench's loop),
  - fp32_combine torch / triton: `mcore_torch_experts.integrations.automodel.install_fp32_combine`.
Up to output2 the module runs as shipped in all of them (`install_combine` swaps the last step).
Experts frozen (adapter training) or trainable (full fine-tuning, the report's GRPO run); the
hidden states and routing weights require grad in both. One rank's shape, DeepSeek-V3-like by
default: hidden 7168, expert FFN 2048, 32 local experts, top-8, 16,384 and 65,536 tokens.

Times: median of --iters calls, --repeats times (variants interleaved; the median and range of
the repeats); ratios to shipped from the same run. Peak memory above what is allocated at the
call (weights, inputs); an OOM is recorded and the run goes on; --reserve-gib holds memory aside
for the whole run, standing in for the rest of a model; --headroom-gib H instead holds aside all
the GPU has free once the module and inputs are built but H GiB, so a variant whose call needs
more than H GiB runs out of memory (the report's OOM, on any GPU). FP64 reference and
reproducibility (two runs, bitwise) at --check-tokens tokens. On a CPU-only machine use --tiny (wall clock, peak RSS,
the triton kernel interpreted: checked, not measured). Writes automodel_combine_bench.md and
.json to --out-dir. Needs nemo-automodel (installed without its dependencies), not Megatron-Core.

    python benchmarks/automodel_combine_bench.py --out-dir runs/automodel_combine_bench
    python benchmarks/automodel_combine_bench.py --tiny
"""

import argparse
import statistics
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from combine_bench import autograd_loop_combine
from harness import (
    CPU_ENV,
    GIB,
    MIB,
    OOM,
    Meter,
    catch_oom,
    error_note,
    guarded,
    markdown_table,
    package_module,
    ratio,
    rerun_with_cpu_env,
    write_report,
)
from harness import header as bench_header

SHAPE = dict(hidden=7168, ffn=2048, experts=32, top_k=8, tokens=[16384, 65536], chunk_rows=4096,
             check_tokens=4096)
TINY = dict(hidden=64, ffn=32, experts=4, top_k=2, tokens=[256, 512], chunk_rows=64,
            check_tokens=256)
MODES = ("frozen", "trainable")
INTERPRETED = "interpreted (TRITON_INTERPRET=1): checked, not timed or measured"


def build_experts(args, device):
    """GroupedExperts in BF16 on `device`, weights ~ N(0, 1 / fan-in). GroupedExperts reads
    backend.experts and backend.compile_router_weight only (Automodel's BackendConfig would
    import transformers, which nothing here needs)."""
    from nemo_automodel.components.moe.config import MoEConfig
    from nemo_automodel.components.moe.experts import GroupedExperts

    config = MoEConfig(n_routed_experts=args.experts, n_shared_experts=0,
                       n_activated_experts=args.top_k, n_expert_groups=1, n_limited_groups=1,
                       train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
                       score_func="softmax", route_scale=1.0, dim=args.hidden,
                       inter_dim=args.ffn, moe_inter_dim=args.ffn, norm_topk_prob=True,
                       dtype=torch.bfloat16)
    backend = types.SimpleNamespace(experts="torch_mm", compile_router_weight=False)
    with torch.device(device):
        module = GroupedExperts(config, backend=backend)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():  # [E, in, out]
            param.normal_(0.0, param.shape[1] ** -0.5, generator=gen)
    return module


def make_inputs(tokens, args, device, seed=1):
    """x bf16 [T, H], token_mask [T], routing weights fp32 [T, k] and indices [T, k] of a random
    top-k routing, grad_y bf16 [T, H]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, args.hidden, generator=gen, device=device).bfloat16()
    scores, indices = torch.rand(tokens, args.experts, generator=gen,
                                 device=device).topk(args.top_k, dim=1)
    weights = scores / scores.sum(dim=1, keepdim=True)
    grad_y = torch.randn(tokens, args.hidden, generator=gen, device=device).bfloat16()
    token_mask = torch.ones(tokens, dtype=torch.bool, device=device)
    return x.requires_grad_(), token_mask, weights.requires_grad_(), indices, grad_y


def variants(automodel, chunk_rows, triton_note):
    """name -> (install(module), measured). The first is the shipped module."""
    def fork_loop(out, ids, num_tokens):
        return autograd_loop_combine(out, ids, num_tokens, None, chunk_rows)

    out = {
        "shipped (scatter_add_)": (lambda module: None, True),
        f"fork loop {chunk_rows}": (lambda module: automodel.install_combine(module, fork_loop),
                                    True),
        f"fp32_combine torch {chunk_rows}": (lambda module: automodel.install_fp32_combine(
            module, chunk_rows=chunk_rows, backend="torch"), True),
    }
    if triton_note in ("compiled", INTERPRETED):
        out["fp32_combine triton"] = (lambda module: automodel.install_fp32_combine(
            module, backend="triton"), triton_note == "compiled")
    return out


def triton_status(device):
    try:
        package_module("kernels.combine_triton")
    except ImportError as error:
        return f"skipped: triton not importable ({error})"
    if device.type == "cuda":
        return "compiled"
    interpreted = package_module("kernels").TRITON_INTERPRETER
    return INTERPRETED if interpreted else "skipped: no interpreter"


class Bench:
    """One module and its inputs in one mode; every call runs with one variant installed."""

    def __init__(self, automodel, module, inputs, mode):
        self.automodel, self.module, self.inputs = automodel, module, inputs
        self.trainable = mode == "trainable"

    def clear_grads(self):
        self.module.zero_grad(set_to_none=True)
        self.inputs[0].grad = self.inputs[2].grad = None

    def forward(self):
        x, token_mask, weights, indices, _ = self.inputs
        return self.module(x, token_mask, weights, indices)

    def forward_backward(self):
        self.clear_grads()
        self.forward().backward(self.inputs[4])

    def with_variant(self, install, fn):
        """fn() with the variant installed; the shipped method back afterwards."""
        self.module.requires_grad_(self.trainable)
        install(self.module)
        try:
            return fn()
        finally:
            self.automodel.remove_combine(self.module)
            self.clear_grads()

    def outputs_and_grads(self):
        """[y, grad x, grad weights] (+ [grad W1, grad W2] when trainable), copies."""
        self.clear_grads()
        y = self.forward()
        y.backward(self.inputs[4])
        grads = [self.inputs[0].grad, self.inputs[2].grad, self.module.gate_and_up_projs.grad,
                 self.module.down_projs.grad]
        return [t.detach().clone() for t in [y] + grads if t is not None]

    def fp64_reference(self):
        """outputs_and_grads in float64, expert by expert: each token's sum over its top-k
        experts of (silu(gate) * up * p) W2_e, with [gate | up] = x W1_e."""
        x, token_mask, weights, indices, grad_y = self.inputs
        x64, w64 = (t.detach().double().requires_grad_() for t in (x, weights))
        w1, w2 = (p.detach().double().requires_grad_(self.trainable)
                  for p in (self.module.gate_and_up_projs, self.module.down_projs))
        tokens, slots = torch.where(token_mask.unsqueeze(1).expand_as(indices))
        y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        for expert in range(self.module.n_routed_experts):
            chosen = indices[tokens, slots] == expert
            rows_t, rows_s = tokens[chosen], slots[chosen]
            gate, up = (x64[rows_t] @ w1[expert]).chunk(2, dim=1)
            y.index_add_(0, rows_t, (F.silu(gate) * up * w64[rows_t, rows_s, None]) @ w2[expert])
        y.backward(grad_y.double())
        return [t for t in (y.detach(), x64.grad, w64.grad, w1.grad, w2.grad) if t is not None]


def measure(bench, installs, meter, repeats, mode):
    """A row per variant: extra peak bytes of forward and of forward + backward, then `repeats`
    medians of each (variants interleaved repeat by repeat); OOM where the GPU ran out, and the
    first error as the row's note."""
    steps = {"fwd": bench.forward, "fwd+bwd": bench.forward_backward}
    rows = {name: {"variant": name, "fwd ms": [], "fwd+bwd ms": []} for name in installs}

    def warm_peak(fn):
        fn()  # compiles the activation at a new shape, warms the allocator
        # The warm call's gradients would sit in the base and be freed inside the measured call,
        # taking their bytes off its peak.
        bench.clear_grads()
        return meter.peak_extra_bytes(fn)

    def run(name, what):
        row, (install, measured) = rows[name], installs[name]
        if not measured or "note" in row:
            return
        try:
            for key, fn in steps.items():
                times = row[f"{key} ms"]
                if what == "peak":
                    row[f"{key} peak"] = bench.with_variant(
                        install, lambda: catch_oom(lambda: warm_peak(fn)))  # noqa: B023 - called at once
                    if row[f"{key} peak"] == OOM:
                        times.append(OOM)
                elif OOM not in times:
                    times.append(bench.with_variant(
                        install, lambda: catch_oom(lambda: meter.time(fn)[0])))  # noqa: B023 - called at once
        except Exception as exc:  # noqa: BLE001 - reported in the table, traceback on stderr
            row["note"] = error_note(exc)
        suffix = " peak" if what == "peak" else " ms"
        print(f"    {mode} {name}, {what}: "
              + ", ".join(f"{key} {cell(row, key + suffix)}" for key in steps), flush=True)

    for name in installs:
        run(name, "peak")
    for repeat in range(repeats):
        for name in installs:
            run(name, f"repeat {repeat + 1}")
    shipped = rows[next(iter(installs))]
    for row in rows.values():
        for key in ("fwd ms", "fwd+bwd ms", "fwd peak", "fwd+bwd peak"):
            row[f"{key} / shipped"] = ratio(number(row.get(key)), number(shipped.get(key)))
    return list(rows.values())


def check(bench, installs):
    """Per variant: max |error| / max |reference| against FP64 of y and every gradient, the
    largest |y - shipped y|, and whether a second run is bitwise the same."""
    reference = bench.fp64_reference()
    shipped = bench.with_variant(installs[next(iter(installs))][0], bench.outputs_and_grads)
    names = ["y", "x grad", "probs grad", "W1 grad", "W2 grad"][:len(reference)]
    rows = []
    for name, (install, _) in installs.items():
        def row():
            first = bench.with_variant(install, bench.outputs_and_grads)  # noqa: B023 - row() runs at once
            second = bench.with_variant(install, bench.outputs_and_grads)  # noqa: B023 - as above
            out = {f"{n} err": ((a.double() - r).abs().max() / r.abs().max()).item()
                   for n, a, r in zip(names, first, reference)}
            out["y max |diff| vs shipped"] = (first[0] - shipped[0]).float().abs().max().item()
            out["y repro"] = torch.equal(first[0], second[0])
            differ = [n for n, a, b in zip(names[1:], first[1:], second[1:])
                      if not torch.equal(a, b)]
            out["grads repro"] = "yes" if not differ else "NO: " + ", ".join(differ)
            return out

        rows.append({"variant": name, "experts": "trainable" if bench.trainable else "frozen",
                     **guarded(name, row)})
        print(f"    check {rows[-1]}", flush=True)
    return rows


def number(value):
    """A measured figure: the median of a list of times, or a peak; None where one was OOM."""
    if isinstance(value, list):
        return statistics.median(value) if value and OOM not in value else None
    return None if value == OOM else value


def cell(row, key, unit="GiB"):
    value = row.get(key)
    if value is None or value == []:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, str):  # OOM, a note
        return value
    if key.endswith(" ms"):
        if OOM in value:
            return OOM
        median = f"{statistics.median(value):.2f}"
        return median if len(value) == 1 else f"{median} ({min(value):.2f}–{max(value):.2f})"
    if key.endswith("peak"):
        return f"{value / (MIB if unit == 'MiB' else GIB):.2f}"
    if key.endswith("/ shipped"):
        return f"{value:.2f}"
    return f"{value:.2e}"  # errors, differences


MEASURE_COLUMNS = ["fwd ms", "fwd+bwd ms", "fwd peak", "fwd+bwd peak", "fwd ms / shipped",
                   "fwd+bwd ms / shipped", "fwd peak / shipped", "fwd+bwd peak / shipped"]
CHECK_COLUMNS = ["experts", "y err", "x grad err", "probs grad err", "W1 grad err", "W2 grad err",
                 "y max |diff| vs shipped", "y repro", "grads repro"]


def table(title, rows, columns, unit):
    headers = ["variant"] + [f"{c} {unit}" if c.endswith("peak") else c for c in columns]
    cells = [[r["variant"]] + ([cell(r, c, unit) for c in columns] if "note" not in r
                               else [r["note"]] + [""] * (len(columns) - 1)) for r in rows]
    return [f"### {title}", ""] + markdown_table(headers, cells) + [""]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes; runs on the CPU")
    parser.add_argument("--out-dir", default="runs/automodel_combine_bench")
    for name in ("hidden", "ffn", "experts", "top_k", "chunk_rows", "check_tokens"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int,
                            help=f"default {SHAPE[name]} (--tiny: {TINY[name]})")
    parser.add_argument("--tokens", type=int, nargs="+",
                        help=f"token counts (default {SHAPE['tokens']}; --tiny: {TINY['tokens']})")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median, range)")
    parser.add_argument("--iters", type=int, default=5, help="calls per repeat (median)")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--reserve-gib", type=float, default=0.0,
                        help="GiB held for the whole run (the rest of a model's memory)")
    memory.add_argument("--headroom-gib", type=float,
                        help="hold all free GPU memory but this many GiB once each token count's "
                             "module and inputs are built (CUDA only)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.tiny:
        parser.error("no CUDA device: use --tiny for the CPU")
    if args.headroom_gib is not None and (args.headroom_gib <= 0 or not torch.cuda.is_available()):
        parser.error(f"--headroom-gib {args.headroom_gib:g}: needs a CUDA device and a positive "
                     "count of GiB (--reserve-gib holds a fixed amount instead)")
    for name, default in (TINY if args.tiny else SHAPE).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def header(args, device, meter, triton_note):
    held = (f"all free memory but {args.headroom_gib:g} GiB held aside while measuring (an OOM: "
            f"the call needs more than {args.headroom_gib:g} GiB)" if args.headroom_gib else
            f"{args.reserve_gib:g} GiB held aside while measuring")
    memory = (f"torch.cuda.max_memory_allocated() above memory_allocated() at the call (weights, "
              f"inputs); {held}" if meter.cuda else
              "peak RSS above RSS at the call, run with "
              + " ".join(f"{k}={v}" for k, v in CPU_ENV.items()))
    return bench_header(device, packages=("triton", "nemo-automodel")) + [
        f"module: nemo_automodel GroupedExperts, backend.experts='torch_mm', BF16, SwiGLU; hidden "
        f"{args.hidden}, expert FFN {args.ffn}, {args.experts} local experts, top-{args.top_k}",
        "experts: frozen (requires_grad=False, adapter training) or trainable; x and the routing "
        "weights require grad in both",
        f"memory: {memory}",
        f"time: {'CUDA events' if meter.cuda else 'CPU wall clock'}, median of {args.iters} calls "
        f"after a warm-up, {args.repeats} repeats (median, min–max), variants interleaved",
        f"FP64 reference and bitwise reproducibility at {args.check_tokens} tokens; errors are "
        "max |error| / max |reference|",
        f"triton kernel: {triton_note}"]


def hold_all_but(headroom_gib, device):
    """A tensor holding the GPU's free memory but headroom_gib GiB (the allocator's cache
    returned first)."""
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(device)[0]
    return torch.empty(max(0, free - int(headroom_gib * GIB)), dtype=torch.uint8, device=device)


def main():
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        rerun_with_cpu_env()
    unit = "MiB" if args.tiny else "GiB"
    automodel = package_module("integrations.automodel")
    triton_note = triton_status(device)
    installs = variants(automodel, args.chunk_rows, triton_note)
    meter = Meter(device, warmup=1, reps=args.iters)
    reserve = torch.empty(int(args.reserve_gib * GIB), dtype=torch.uint8, device=device)
    lines = header(args, device, meter, triton_note)
    print("\n".join(lines), flush=True)
    body, data = [], {"measured": [], "checked": []}
    for tokens in args.tokens:
        rows_n = tokens * args.top_k
        print(f"\n[{tokens} tokens] {rows_n} routed rows: output2 "
              f"{rows_n * args.hidden * 2 / GIB:.2f} GiB bf16, its FP32 copy "
              f"{rows_n * args.hidden * 4 / GIB:.2f} GiB", flush=True)
        module, inputs = build_experts(args, device), make_inputs(tokens, args, device)
        headroom = hold_all_but(args.headroom_gib, device) if args.headroom_gib else None
        for mode in args.modes:
            rows = measure(Bench(automodel, module, inputs, mode), installs, meter, args.repeats,
                           mode)
            body += table(f"{tokens} tokens, experts {mode} ({rows_n} routed rows)", rows,
                          MEASURE_COLUMNS, unit)
            data["measured"].append({"tokens": tokens, "experts": mode, "rows": rows})
        del module, inputs, headroom
    del reserve  # the check measures no memory; its FP64 copies need room
    print(f"\n[check] {args.check_tokens} tokens against FP64", flush=True)
    module = build_experts(args, device)
    inputs = make_inputs(args.check_tokens, args, device, seed=2)
    for mode in args.modes:
        data["checked"] += check(Bench(automodel, module, inputs, mode), installs)
    body += table(f"Against FP64 and run to run, {args.check_tokens} tokens", data["checked"],
                  CHECK_COLUMNS, unit)
    out_dir = Path(args.out_dir)
    report = write_report(out_dir, "automodel_combine_bench",
                          "NeMo Automodel GroupedExperts: the FP32 combine", lines, body, data)
    print("\n" + report)
    print(f"table: {out_dir / 'automodel_combine_bench.md'} (and automodel_combine_bench.json)")


if __name__ == "__main__":
    main()
