"""bench_cycle.py's report: per slice, the cycle table (median and range, peak memory per phase,
GPU idle, throughput against the reference arms), the RL cycle's targets, the MoE side of the update
pass against its expert-GEMM kernel time (cycle_profile.moe_side), the update-pass breakdown and
its plot; the run's header lines; results.md / results.json.
"""

import statistics

import cycle_models as cm
import cycle_profile as cp
from harness import fmt, markdown_table, ratio, write_report

REFERENCES = ("te", "te-cutlass", "sequential")  # the speed-up columns, when the arm ran
TARGETS = {"te": 1.47, "te-cutlass": 1.2}  # the RL cycle's targets: TorchGroupedMLP's throughput over these
MOE_SIDE_TARGET = 1.5  # the MoE side of the update pass over its expert-GEMM kernel time
# "No higher" peak memory, to the allocator's noise between arms of the same model (the logprob
# peaks of identical passes differ by up to a few hundred KiB).
PEAK_TOLERANCE_GIB = 16 / 1024


def _range(value: dict, spec=".0f") -> str:
    return f"{value['median']:{spec}} ({value['min']:{spec}}–{value['max']:{spec}})"


def results_table(rows) -> list:
    """Markdown lines: one row per arm; speed-ups are cycle throughput against each reference
    arm with the same expert-adapter layout."""
    ran = {(r["arm"], r["layout"], r["adapters"]): r for r in rows if "note" not in r}
    references = [a for a in REFERENCES if any(arm == a for arm, *_ in ran)]
    diffs = {r["logprob_diff_vs"] for r in ran.values() if "logprob_diff_vs" in r}
    headers = (["experts", "expert adapters", "adapters", "expert kernel", "logprob ms",
                "update ms", "cycle ms, median (min–max)", "tokens/s", "logprob peak GiB",
                "update peak GiB", "GPU idle in the update pass"]
               + [f"cycle throughput x {cm.ARMS[a]}" for a in references]
               + [f"mean abs logprob diff vs {next(iter(diffs), 'the first arm')}"])
    lines = []
    for r in rows:
        if "note" in r:
            lines.append([r["module"], r["layout"], r["adapters"], "", r["note"]]
                         + [""] * (len(headers) - 5))
            continue
        profile = r.get("profile", {})
        idle = profile["ms"][cp.IDLE] if profile.get("idle_measured") else None
        update = r["update_ms"]["median"]
        speedups = [fmt(ratio(ran.get((a, r["layout"], r["adapters"]), {}).get("cycle_ms", {})
                              .get("median"), r["cycle_ms"]["median"]), ".2f")
                    for a in references]
        lines.append([r["module"], r["layout"], r["adapters"],
                      ", ".join(r["expert_kernels"]) or "—", _range(r["logprob_ms"]),
                      _range(r["update_ms"]),
                      _range(r["cycle_ms"]), fmt(r["tokens_per_s"], ".0f"),
                      fmt(r.get("logprob_peak_gib"), ".1f"), fmt(r.get("update_peak_gib"), ".1f"),
                      "—" if idle is None else f"{idle:.0f} ms ({100 * idle / update:.0f}%)",
                      *speedups, fmt(r.get("logprob_diff"), ".2e")])
    return markdown_table(headers, lines)


def target_lines(rows) -> list:
    """Markdown bullets: the RL cycle's targets (set at the Super-like slice) for each layout where
    TorchGroupedMLP and a TE arm ran: throughput ratios and peak memory no higher."""
    ran = {(r["arm"], r["layout"], r["adapters"]): r for r in rows if "note" not in r}
    lines = []
    for (arm, layout, source), ours in ran.items():
        if arm not in cm.TORCH_ARMS:
            continue
        for reference, goal in TARGETS.items():
            other = ran.get((reference, layout, source))
            if other is None:
                continue
            speedup = other["cycle_ms"]["median"] / ours["cycle_ms"]["median"]
            peaks = [(ours.get(f"{p}_peak_gib"), other.get(f"{p}_peak_gib"))
                     for p in ("logprob", "update")]
            lower = all(a is not None and b is not None and a <= b + PEAK_TOLERANCE_GIB
                        for a, b in peaks)
            lines.append(
                f"- {layout} {source} adapters: cycle throughput {speedup:.2f}x "
                f"{cm.ARMS[reference]} "
                f"(target >= {goal}: {'met' if speedup >= goal else 'MISSED'}); peak GiB "
                f"logprob {fmt(peaks[0][0], '.1f')} vs {fmt(peaks[0][1], '.1f')}, update "
                f"{fmt(peaks[1][0], '.1f')} vs {fmt(peaks[1][1], '.1f')} (no higher, to "
                f"{PEAK_TOLERANCE_GIB * 1024:.0f} MiB: "
                f"{'met' if lower else 'MISSED'})")
    return lines


def _spread(value, spec=".1f") -> str:
    return "—" if value is None else _range(value, spec)


def moe_side_table(rows) -> list:
    """Markdown lines: per profiled arm the MoE side of the update pass (cycle_profile.moe_side),
    median (min–max) over the profiled passes, its expert-GEMM kernel ms, their ratio, the
    upper bound with `other` in it, and the arm's peak memory."""
    headers = ["experts", "expert adapters", "adapters", "MoE side ms", "of it recompute ms",
               "expert-GEMM kernel ms", "MoE side / GEMM kernels",
               f"<= {MOE_SIDE_TARGET}x", "bound with `other`: ms", "bound / GEMM kernels",
               "GEMM kernels in `other` ms", "peak GiB (logprob / update)",
               "allocated between turns GiB", "profiled passes"]
    lines = []
    for r in rows:
        if "moe_side" not in r:
            continue
        side = r["moe_side"]
        again = [x["recompute_moe_ms"] for x in side["rounds"]]
        other_gemm = [x["other_gemm_ms"] for x in side["rounds"]]
        ratio_ = side["ratio"]
        met = ("—" if ratio_ is None else
               "yes" if ratio_["max"] <= MOE_SIDE_TARGET else
               "no" if ratio_["min"] > MOE_SIDE_TARGET else "within the spread")
        lines.append([r["module"], r["layout"], r["adapters"], _spread(side["moe_ms"]),
                      f"{statistics.median(again):.1f}", _spread(side["gemm_ms"]),
                      _spread(ratio_, ".2f"), met, _spread(side["moe_bound_ms"]),
                      _spread(side["ratio_bound"], ".2f"),
                      f"{max(other_gemm):.1f}",
                      f"{fmt(r.get('logprob_peak_gib'), '.1f')} / "
                      f"{fmt(r.get('update_peak_gib'), '.1f')}",
                      fmt(r.get("between_turns_gib"), ".2f"), len(side["rounds"])])
    return markdown_table(headers, lines) if lines else []


def ceiling_lines(rows) -> list:
    """Markdown bullets: for each of our profiled arms, the cycle if the MoE side of its update
    pass cost only its expert-GEMM kernel time (the ceiling of a change to the experts alone,
    GEMM kernels as they are), and that cycle's throughput against each reference arm of the
    same layout beside the measured one. The logprob pass is not profiled: its MoE side stays
    in, so the ceiling is a floor of what such a change could reach."""
    ran = {(r["arm"], r["layout"], r["adapters"]): r for r in rows if "note" not in r}
    lines = []
    for (arm, layout, source), ours in ran.items():
        if arm not in cm.TORCH_ARMS or "moe_side" not in ours:
            continue
        side = ours["moe_side"]
        excess = side["moe_ms"]["median"] - side["gemm_ms"]["median"]
        cycle = ours["cycle_ms"]["median"]
        floor = cycle - excess
        against = [f"{ran[(ref, layout, source)]['cycle_ms']['median'] / floor:.2f}x "
                   f"{cm.ARMS[ref]} (measured "
                   f"{ran[(ref, layout, source)]['cycle_ms']['median'] / cycle:.2f}x)"
                   for ref in REFERENCES if (ref, layout, source) in ran]
        lines.append(f"- {cm.ARMS[arm]} ({layout}, {source} adapters): cycle {cycle:.0f} ms; "
                     f"the MoE side of the update pass {side['moe_ms']['median']:.0f} ms over "
                     f"its {side['gemm_ms']['median']:.0f} ms of expert-GEMM kernels: at that "
                     f"floor the cycle would be {floor:.0f} ms"
                     + (": " + ", ".join(against) if against else ""))
    return lines


MOE_SIDE_TEXT = (
    "The MoE side of the update pass (router to combine), GPU ms of one profiled update pass, "
    "median (min–max) over the profiled passes: the kernels of the router, permute/dispatch, "
    "expert GEMMs, expert activation, expert adapters, combine/unpermute and the MoE layer's "
    "other ops (`MoE layer, rest`), forward and backward, plus the same components' part of "
    "the recompute forward (split by the `bench::` range open around each re-run op; `of it "
    "recompute ms`). Not in it: the shared expert, the latent projections, attention, norms, "
    "the head, the optimizer, gradient accumulation into the adapter leaves, `other`. Expert-GEMM "
    "kernel ms: the GEMM kernels (by name) that ran for the expert GEMMs, in the forward, the "
    "recompute and the backward. The ratio is per pass, MoE side ms / expert-GEMM kernel ms; "
    f"`<= {MOE_SIDE_TARGET}x`: yes when every pass is, no when none is. `bound with `other``: "
    "the MoE side plus all of `other` (the device time no component claimed, e.g. kernels "
    "launched outside any recorded op, and the recompute's `other`), an upper bound; `GEMM "
    "kernels in `other``: the largest over the passes (a GEMM that lost its range, e.g. TE's "
    "input-gradient GEMMs inside the checkpoint's backward). Peak: as in the cycle table. "
    "Allocated between turns: the most bytes allocated on the device after an arm's turn "
    "ended (its model, optimizer state and logprobs freed; the data stays).")


def run_lines(args, world) -> list:
    tokens = args.micro_batches * args.micro_batch_size * args.seq
    return [
        f"transformer_engine.__version__: {cm.te_version()}",
        "full recompute: uniform, 1 layer per checkpoint (re-entrant), frozen-input guard",
        f"MoE: {args.dispatcher} dispatcher, EP={args.ep}, router FP32, no auxiliary loss",
        f"cycle: logprob pass (eval, no grad) over {args.micro_batches} micro-batches of "
        f"{args.micro_batch_size} x {args.seq} tokens, then the update pass over the same data "
        "(forward + backward of a clipped policy-gradient loss per micro-batch, one AdamW step "
        f"on the adapters); {tokens} tokens per rank and cycle, {world} rank(s)",
        f"timing: CUDA events around each phase; arms interleaved, {args.warmup} warm-up "
        f"round(s) then {args.cycles} measured (a slice that sets its own count says so); "
        "median (min–max) over the measured cycles; "
        "tokens/s = tokens of all ranks per cycle / median cycle time; peak = the arm's "
        "resident tensors + the phase's torch.cuda.max_memory_allocated above its start"
        + (f"; over {world} ranks: each round's phase times are the slowest rank's, peaks and "
           "logprob differences the highest rank's, the profile rank 0's" if world > 1 else ""),
    ]


def slice_report(result, out_dir) -> tuple:
    """Markdown lines of one slice and the plot written (or None)."""
    lines = [f"## {result['label']}", ""] + [f"- {h}" for h in result["header"]] + [""]
    lines += results_table(result["rows"]) + [""]
    targets = target_lines(result["rows"])
    if targets:
        lines += ["The targets for TorchGroupedMLP (set at the Super-like slice):", ""]
        lines += targets + [""]
    plot = None
    moe = moe_side_table(result["rows"])
    if moe:
        lines += ["### MoE side of the update pass against its expert-GEMM kernel time", "",
                  MOE_SIDE_TEXT, ""] + moe + [""]
        ceilings = ceiling_lines(result["rows"])
        if ceilings:
            lines += ["The ceiling of a change to the experts alone (medians; the update pass's "
                      "MoE side at its expert-GEMM kernel time, the logprob pass as measured):",
                      ""] + ceilings + [""]
    if any("profile" in r for r in result["rows"]):
        lines += ["### Update pass by component (torch profiler)", "",
                  "GPU time of the kernels each component launched in one profiled update pass "
                  "(forward, recompute, backward, optimizer step; backward kernels go to the "
                  "component whose forward op made the autograd node; `recompute (forward)` is "
                  "the forward the checkpoint re-runs); `other` is the device time no component "
                  "claimed; `GPU idle` is the measured update time minus the profiled device "
                  "time. Shares of the sum. `recompute ms`: the recompute's part by the "
                  "component it re-runs (its total on the recompute row).", ""]
        labelled = [dict(r, module=f"{r['module']} ({r['layout']}, {r['adapters']})")
                    for r in result["rows"]]
        lines += cp.breakdown_table(labelled) + [""]
        kernels = cp.kernel_lines(labelled)
        if kernels:
            lines += ["Main expert GEMM kernels (GPU ms in the profiled update pass):", ""]
            lines += kernels + [""]
        sources = cp.kernel_lines(labelled, "other_sources")
        if sources:
            lines += ["What went to `other` (GPU ms; a backward node there is one whose forward op "
                      "the profile did not record):", ""]
            lines += sources + [""]
        name = f"breakdown-{result['slice']}-{result['layers']}.png"
        if cp.plot_breakdown(labelled, out_dir / name, f"update pass: {result['label']}"):
            plot = name
    failed = [f"- {r['module']} ({r['layout']}, {r['adapters']}): no profile, "
              f"{r['profile_note']}"
              for r in result["rows"] if "profile_note" in r]
    return lines + failed + ([""] if failed else []), plot


def write_results(args, lines_header, results):
    """results.md, results.json and the breakdown plots under --out-dir: the report's text and
    the names written."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    body, written = [], ["results.md", "results.json"]
    for result in results:
        more, plot = slice_report(result, args.out_dir)
        body += more
        written += [plot] if plot else []
    text = write_report(args.out_dir, "results", "RL cycle benchmark", lines_header, body,
                        {"args": {k: str(v) for k, v in vars(args).items()}, "slices": results})
    return text, written
