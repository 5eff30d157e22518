"""FP32 combine of MoE top-k expert outputs: memory, time and accuracy of each way to do it.

Reproduces the reported pattern: grouped-GEMM expert outputs, bf16 [T * k, H] in expert-sorted
order (random values here; grouped_mm writes exactly this layout), summed into their tokens in FP32:

    y.scatter_add_(0, ids.unsqueeze(1).expand_as(out), out.float())   # full-size FP32 copy

and compares, per shape:
  - torch single-shot (chunk_rows=0) and the chunked autograd.Function (4096, 16384, 65536 rows),
  - the fork's workaround: the same chunk loop written inline, through ordinary autograd,
  - the fused Triton gather-reduce kernel.

Reports (combine_bench.md, .json and .png in --out-dir) max abs error against FP64 (on the first
--ref-tokens tokens), forward and forward+backward time (CUDA events, median; from an idle GPU, and
queued behind a GPU sleep so only device time counts), extra peak memory
(torch.cuda.max_memory_allocated over the inputs; also over inputs + the FP32 accumulator) and
bitwise run-to-run reproducibility.
On a CPU-only machine use --tiny: times are wall clock, memory is the process's peak RSS
(VmHWM after resetting it through /proc/self/clear_refs) and the kernel runs in the Triton
interpreter. Does not import Megatron-Core (loads mcore_torch_experts.combine on its own).

    python benchmarks/combine_bench.py --out-dir runs/combine_bench
    python benchmarks/combine_bench.py --tiny
"""

import argparse
from pathlib import Path

import torch

from harness import (
    CPU_ENV,
    GIB,
    MIB,
    Meter,
    markdown_table,
    package_module,
    pyplot,
    rerun_with_cpu_env,
    save_figure,
    write_report,
)
from harness import header as bench_header
from shapes import COMBINE_SHAPES, TINY_COMBINE_SHAPES


def make_inputs(tokens, top_k, hidden, experts, device, with_probs, seed=0):
    """Expert-sorted rows of a random top-k routing: expert_out bf16 [T*k, H], token_ids [T*k],
    probs fp32 [T*k] or None, and a gradient for y, fp32 [T, H]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen, device=device)
    chosen = scores.topk(top_k, dim=1).indices.flatten()
    token_ids = torch.arange(tokens, device=device).repeat_interleave(top_k)
    token_ids = token_ids[chosen.argsort(stable=True)]
    expert_out = torch.empty(tokens * top_k, hidden, dtype=torch.bfloat16, device=device)
    expert_out.normal_(generator=gen)
    probs = None
    if with_probs:
        probs = torch.rand(tokens * top_k, generator=gen, device=device).requires_grad_()
    grad_y = torch.empty(tokens, hidden, device=device).normal_(generator=gen)
    return expert_out.requires_grad_(), token_ids, probs, grad_y


def autograd_loop_combine(expert_out, token_ids, num_tokens, probs, chunk_rows):
    """The fork's workaround: the chunk loop inline, differentiated by ordinary autograd."""
    y = expert_out.new_zeros(num_tokens, expert_out.shape[1], dtype=torch.float32)
    for start in range(0, expert_out.shape[0], chunk_rows):
        rows = expert_out[start:start + chunk_rows].float()
        if probs is not None:
            rows = rows * probs[start:start + chunk_rows].unsqueeze(1)
        ids = token_ids[start:start + chunk_rows].unsqueeze(1).expand_as(rows)
        y.scatter_add_(0, ids, rows)
    return y


def fp64_errors(y, expert_out, token_ids, probs, grad_y, ref_tokens):
    """Max abs errors of y, grad_expert_out and grad_probs (None without probs) against FP64,
    over the rows of the first ref_tokens tokens."""
    ref_tokens = min(ref_tokens, y.shape[0])
    rows = (token_ids < ref_tokens).nonzero().flatten()
    ids = token_ids[rows]
    out64, grad_rows64 = expert_out.detach()[rows].double(), grad_y[ids].double()
    scale = probs.detach()[rows].double().unsqueeze(1) if probs is not None else 1.0
    y_ref = torch.zeros(ref_tokens, y.shape[1], dtype=torch.float64, device=y.device)
    y_ref.index_add_(0, ids, out64 * scale)
    errors = {
        "y err": (y[:ref_tokens].double() - y_ref).abs().max().item(),
        "grad err": (expert_out.grad[rows].double() - grad_rows64 * scale).abs().max().item(),
        "probs grad err": None,
    }
    if probs is not None:
        probs_grad_ref = (grad_rows64 * out64).sum(dim=1)
        errors["probs grad err"] = (probs.grad[rows].double() - probs_grad_ref).abs().max().item()
    return errors


def bench_method(name, combine_fn, measured, inputs, meter, args):
    """One row of the table: FP64 errors, reproducibility and, when `measured`, extra peak memory
    and median times."""
    expert_out, token_ids, probs, grad_y = inputs
    num_tokens, hidden = grad_y.shape
    leaves = [t for t in (expert_out, probs) if t is not None]

    def forward():
        return combine_fn(expert_out, token_ids, num_tokens, probs)

    def clear_grads():
        for leaf in leaves:
            leaf.grad = None

    def forward_backward():
        clear_grads()
        y = forward()
        y.backward(grad_y)
        return y.detach()

    def outputs_and_grads():
        return [forward_backward()] + [leaf.grad.clone() for leaf in leaves]

    first = outputs_and_grads()
    row = {"method": name}
    row.update(fp64_errors(first[0], expert_out, token_ids, probs, grad_y, args.ref_tokens))
    row["bitwise repro"] = all(torch.equal(a, b) for a, b in zip(first, outputs_and_grads()))
    del first
    clear_grads()
    accumulator = num_tokens * hidden * 4
    for key, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
        extra = meter.peak_extra_bytes(fn) if measured else None
        clear_grads()
        row[f"{key} extra"] = extra
        row[f"{key} extra over acc"] = None if extra is None else extra - accumulator
        row[f"{key} ms"] = meter.time(fn, sync_each=True)[0] if measured else None
        row[f"{key} GPU ms"] = None
        if measured and meter.cuda:
            row[f"{key} GPU ms"] = meter.time(fn, queued=True, sync_each=True)[0]
    clear_grads()
    return row


def methods(combine, chunk_rows_list, triton_note):
    """name -> (chunk rows or None, combine(expert_out, token_ids, num_tokens, probs), measured).

    The interpreted kernel is checked but neither timed nor measured (the interpreter copies
    every tensor to run it)."""
    out = {}
    for rows in chunk_rows_list:
        label = "torch single-shot" if rows == 0 else f"torch chunked {rows}"
        out[label] = (rows, lambda e, i, t, p, rows=rows: combine.fp32_combine(
            e, i, t, probs=p, chunk_rows=rows, backend="torch"), True)
    loop_rows = 4096 if 4096 in chunk_rows_list else min(r for r in chunk_rows_list if r)
    out[f"autograd loop {loop_rows} (fork)"] = (
        loop_rows, lambda e, i, t, p: autograd_loop_combine(e, i, t, p, loop_rows), True)
    if triton_note in ("compiled", INTERPRETED):
        out["triton fused"] = (None, lambda e, i, t, p: combine.fp32_combine(
            e, i, t, probs=p, backend="triton"), triton_note == "compiled")
    return out


INTERPRETED = "interpreted (TRITON_INTERPRET=1): checked, not timed or measured"


def triton_status(device):
    try:
        from mcore_torch_experts.kernels import combine_triton  # noqa: F401
    except ImportError as error:
        return f"skipped: triton not importable ({error})"
    if device.type == "cuda":
        return "compiled"
    if package_module("kernels").TRITON_INTERPRETER:
        return INTERPRETED
    return "skipped: CPU tensors need TRITON_INTERPRET=1 before triton is imported"


def header(device, meter_note, triton_note, with_probs, args):
    lines = bench_header(device, packages=("triton",))
    lines.append(f"memory: {meter_note}")
    clock = ("CUDA events; 'ms' starts on an idle GPU (includes launch latency), 'GPU ms' starts "
             "after the kernels are queued behind a sleep (device time only)"
             if device.type == "cuda" else
             "CPU wall clock (indicative only: with the malloc setting every buffer is "
             "page-faulted afresh)")
    lines.append(f"time: {clock}, median of {args.repeats} runs after {args.warmup} warmups")
    lines.append(f"triton kernel: {triton_note}")
    lines.append(f"probs: {'fp32, trainable' if with_probs else 'none (as in the report)'}")
    return lines


def format_row(row, unit):
    """Table cells: errors in scientific notation, times in ms, memory in `unit` ("GiB"/"MiB")."""
    scale = GIB if unit == "GiB" else MIB

    def cell(key):
        value = row[key]
        if value is None:
            return "n/a"
        if isinstance(value, bool):
            return "yes" if value else "NO"
        if key.endswith("err"):
            return f"{value:.2e}"
        if key.endswith("ms"):
            return f"{value:.3f}"
        if "extra" in key:
            return f"{value / scale:.3f}"
        return str(value)

    return {key: cell(key) for key in row}


COLUMNS = ["method", "y err", "grad err", "probs grad err", "fwd ms", "fwd+bwd ms", "fwd GPU ms",
           "fwd+bwd GPU ms", "fwd extra",
           "fwd extra over acc", "fwd+bwd extra", "fwd+bwd extra over acc", "bitwise repro"]


def results_table(title, rows, unit):
    headers = [f"{c} {unit}" if "extra" in c else c for c in COLUMNS]
    cells = [format_row(row, unit) for row in rows]
    return "\n".join([f"### {title}", ""] + markdown_table(
        headers, [[c[column] for column in COLUMNS] for c in cells]))


def plot(results, path, unit):
    """Extra peak memory and time against chunk rows, one row of panels per shape."""
    plt = pyplot()
    if plt is None:
        return
    scale = GIB if unit == "GiB" else MIB
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 4.5 * len(results)), squeeze=False)
    for (shape, (num_rows, rows)), (ax_mem, ax_time) in zip(results.items(), axes):
        swept = sorted((r for r in rows if r["method"].startswith("torch")),
                       key=lambda r: r["chunk_rows"] or num_rows)
        xs = [r["chunk_rows"] or num_rows for r in swept]  # single-shot = one chunk of all rows
        fused = [r for r in rows if r["chunk_rows"] is None]
        gpu_timed = rows[0]["fwd GPU ms"] is not None
        time_keys = ("fwd GPU ms", "fwd+bwd GPU ms") if gpu_timed else ("fwd ms", "fwd+bwd ms")
        panels = ((ax_mem, ("fwd extra", "fwd+bwd extra"), f"extra {unit}", scale),
                  (ax_time, time_keys, "ms", 1.0))
        for ax, keys, ylabel, div in panels:
            for key, color in zip(keys, ("tab:blue", "tab:orange")):
                if all(r[key] is not None for r in swept):
                    ax.plot(xs, [r[key] / div for r in swept], "o-", color=color,
                            label=f"torch {key}")
                for r in fused:
                    if r[key] is not None:
                        ax.axhline(r[key] / div, color=color, ls="--", label=f"triton fused {key}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"chunk rows (single-shot plotted at N = {num_rows})")
            ax.set_ylabel(ylabel)
            ax.set_title(shape)
            ax.legend(fontsize=8)
    save_figure(plt, fig, path)
    print(f"plot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes; runs on the CPU")
    parser.add_argument("--out-dir", default="runs/combine_bench",
                        help="where to write the results")
    parser.add_argument("--shapes", nargs="+", help="subset of shape names")
    parser.add_argument("--chunk-rows", type=int, nargs="+",
                        help="chunk sizes for the torch backend, 0 = single-shot "
                             "(default 0 4096 16384 65536; --tiny: 0 64 256)")
    parser.add_argument("--with-probs", action="store_true", help="multiply trainable fp32 probs")
    parser.add_argument("--ref-tokens", type=int, default=256, help="tokens checked against FP64")
    parser.add_argument("--warmup", type=int, help="untimed runs (default 3; --tiny: 1)")
    parser.add_argument("--repeats", type=int,
                        help="timed runs, median reported (default 20; --tiny: 3)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.tiny:
            parser.error("no CUDA device: use --tiny for the CPU")
        rerun_with_cpu_env()
    shapes = TINY_COMBINE_SHAPES if args.tiny else COMBINE_SHAPES
    shapes = {name: shapes[name] for name in (args.shapes or shapes)}
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.repeats = args.repeats or (3 if args.tiny else 20)
    chunk_rows_list = args.chunk_rows or ([0, 64, 256] if args.tiny else [0, 4096, 16384, 65536])
    unit = "MiB" if args.tiny else "GiB"
    combine = package_module("combine")
    triton_note = triton_status(device)
    meter = Meter(device, args.warmup, args.repeats)
    meter_note = ("torch.cuda.max_memory_allocated() minus memory_allocated() at the start "
                  "(inputs: expert_out, token_ids, probs, grad_y)" if meter.cuda else
                  "CPU peak RSS (VmHWM reset via /proc/self/clear_refs) minus RSS at the start, "
                  f"run with {' '.join(f'{k}={v}' for k, v in CPU_ENV.items())}")

    lines = header(device, meter_note, triton_note, args.with_probs, args)
    print("\n".join(lines), flush=True)
    results, tables = {}, []
    for shape, (tokens, top_k, hidden, experts) in shapes.items():
        inputs = make_inputs(tokens, top_k, hidden, experts, device, args.with_probs)
        num_rows = tokens * top_k
        print(f"\n[{shape}] T={tokens} top-{top_k} H={hidden} E={experts}: expert_out "
              f"{num_rows * hidden * 2 / 2**20:.1f} MiB bf16, accumulator "
              f"{tokens * hidden * 4 / 2**20:.1f} MiB fp32", flush=True)
        rows = []
        for name, (chunk_rows, fn, measured) in methods(
                combine, chunk_rows_list, triton_note).items():
            print(f"  {name} ...", end=" ", flush=True)
            row = bench_method(name, fn, measured, inputs, meter, args)
            row["chunk_rows"] = chunk_rows
            rows.append(row)
            cells = format_row(row, unit)
            print(f"fwd {cells['fwd ms']} ms ({cells['fwd GPU ms']} GPU), fwd+bwd "
                  f"{cells['fwd+bwd ms']} ms ({cells['fwd+bwd GPU ms']} GPU), extra "
                  f"{cells['fwd extra']} / {cells['fwd+bwd extra']} {unit}, "
                  f"y err {cells['y err']}, "
                  f"repro {cells['bitwise repro']}", flush=True)
        del inputs
        results[shape] = (num_rows, rows)
        tables.append(results_table(f"{shape}: T={tokens}, top-{top_k}, H={hidden}, N={num_rows} "
                                     f"({'CUDA' if meter.cuda else 'CPU'})", rows, unit))
    out_dir = Path(args.out_dir)
    body = [line for table in tables for line in table.split("\n") + [""]]
    report = write_report(out_dir, "combine_bench", "FP32 combine benchmark", lines, body,
                          {"results": results})
    print("\n" + report)
    print(f"table: {out_dir / 'combine_bench.md'} (and combine_bench.json)")
    plot(results, out_dir / "combine_bench.png", unit)


if __name__ == "__main__":
    main()
