"""bench_experts.py's report: the targets, the table of every shape and routing, fused_gemm
against grouped_mm, the local expert sweep, the one-time packing costs, and the plots.
"""

from experts_impls import (
    DENSE,
    EAGER_ACT,
    FUSED,
    GEMMS,
    GROUPED,
    LORA_FUSED,
    LORA_GROUPED,
    OURS_CPU,
    OURS_GPU,
    RAW,
    SEQUENTIAL,
    step_flops,
)
from harness import fmt, pyplot, ratio, save_figure


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


def step_of(res, name):
    return next((r.get("step_ms") for r in res["rows"] if r["name"] == name), None)


def targets(results, sweep, target_shape):
    """The issue's targets at the target shape (uniform routing) and across the sweep; judged on
    TorchGroupedMLP as MoELayer calls it (CPU splits), with GPU splits and the eager activation
    beside."""
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
        written.append(save_figure(plt, fig, out_dir / "sweep.png"))
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
        written.append(save_figure(plt, fig, out_dir / "ceiling.png"))
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


def lora_table(results):
    """fused_gemm + LoRA against grouped_mm + LoRA: the update pass (forward, input gradient and
    the adapters' gradients) and the forward alone."""
    lines = ["| shape | routing | fused_gemm + LoRA ms | grouped_mm + LoRA ms | fused / grouped_mm "
             "| fwd fused + LoRA ms | fwd grouped_mm + LoRA ms | fused_gemm (no LoRA) ms "
             "| peak MiB fused / grouped_mm | rel diff |", "|" + "---|" * 10]
    for res in results:
        rows = {r["name"]: r for r in res["rows"]}
        if LORA_GROUPED not in rows:
            continue
        fused, grouped = rows.get(LORA_FUSED, {}), rows[LORA_GROUPED]
        diff = fused.get("lora_diff")
        lines.append("| " + " | ".join([
            res["name"], res["routing"], fmt(fused.get("step_ms")), fmt(grouped.get("step_ms")),
            fmt(ratio(fused.get("step_ms"), grouped.get("step_ms")), ".3f"),
            fmt(fused.get("fwd_ms")), fmt(grouped.get("fwd_ms")), fmt(step_of(res, FUSED)),
            f"{fmt(fused.get('peak_mib'), '.0f')} / {fmt(grouped.get('peak_mib'), '.0f')}",
            fmt(diff, ".1e") if isinstance(diff, float) else (fused.get("note") or "—")]) + " |")
    return lines


def report_body(results, sweep, packing, target_shape) -> list:
    """The report's markdown lines after the header."""
    lines = ["## Targets", "", "Judged on TorchGroupedMLP as MoELayer calls it (CPU splits); GPU "
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
    lora = lora_table(results)
    if len(lora) > 2:
        lines += ["## fused_gemm + LoRA against grouped_mm + LoRA", "",
                  "The same module with our LoRA adapters on linear_fc1 and linear_fc2 (the "
                  "header's rank and layout, B drawn non-zero), kernels forced either way: the "
                  "update pass (forward, input gradient and every adapter factor's gradient) and "
                  "the forward alone. rel diff: largest relative difference of output and "
                  "gradients between the two paths.", ""]
        lines += lora + [""]
    if sweep:
        lines += ["## Local expert count sweep (uniform routing, fixed total rows)", ""]
        lines += sweep_table(sweep) + [""]
    if packing:
        lines += ["## One-time packing", ""] + packing_table(packing) + [""]
    return lines


def to_json(results):
    return [{**{k: v for k, v in res.items() if k != "shape"}, "shape": res["shape"].__dict__}
            for res in results]
