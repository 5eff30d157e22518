"""Where the update pass's peak memory goes, per experts arm: one update pass of a cycle slice
(bench_cycle.py's models and passes) under torch's allocator history, then the tensors alive at
the peak, grouped by the code that allocated them, side by side for the arms; and the tensors
autograd saved for backward in the same pass, grouped by the code that saved them.

An allocation's site is its innermost frame in this package, Megatron, Transformer Engine or the
benchmark; autograd's own backward kernels (no Python frame) are "autograd engine" with their
size. One warm-up cycle per arm first, then the recorded update pass (CUDA only).

    python benchmarks/cycle_memory.py --out-dir runs/memory --slice nemotron-3-super:1
"""

import argparse
import collections
import gc
import sys
from pathlib import Path

import torch

import cycle_models as cm
import cycle_passes
from harness import GIB, MIB, REPO_ROOT, header, markdown_table, reset_peak, write_report
from shapes import SLICES

OWN_CODE = ("mcore_torch_experts/", "megatron/", "transformer_engine/", "benchmarks/")
TOP_SITES = 14


def site_of(frames) -> str:
    """'path:line (function)' of the innermost frame in OWN_CODE, else the engine's label."""
    for frame in frames:
        name = frame["filename"]
        for root in OWN_CODE:
            if root in name:
                return f"{root}{name.split(root, 1)[1]}:{frame['line']} ({frame['name']})"
    return "autograd engine / C++ (no Python frame)"


def live_at_peak(trace) -> tuple:
    """(peak bytes above the recording's start, {site: [bytes, count]} of the allocations made
    since the start and alive at the peak) from the allocator's event trace."""
    total = peak = peak_index = 0
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            total += event["size"]
        elif event["action"] == "free_completed":
            total -= event["size"]
        if total > peak:
            peak, peak_index = total, index
    live = {}
    for event in trace[:peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    sites = collections.defaultdict(lambda: [0, 0])
    for event in live.values():
        site = site_of(event.get("frames", []))
        if site.startswith("autograd engine"):
            site = f"{site}, {event['size'] / MIB:,.0f} MiB blocks"
        sites[site][0] += event["size"]
        sites[site][1] += 1
    return peak, dict(sites)


class SavedTensors:
    """Bytes autograd saves for backward, by the site that saved them (unique storages)."""

    def __init__(self):
        self.storages = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage() if tensor.is_cuda else None
        if storage is not None and storage.data_ptr() not in self.storages:
            frames = [{"filename": f.f_code.co_filename, "line": f.f_lineno,
                       "name": f.f_code.co_name} for f in _stack()]
            self.storages[storage.data_ptr()] = (storage.nbytes(), site_of(frames),
                                                 tuple(tensor.shape))
        return tensor

    def by_site(self) -> dict:
        sites = collections.defaultdict(lambda: [0, 0, set()])
        for nbytes, site, shape in self.storages.values():
            sites[site][0] += nbytes
            sites[site][1] += 1
            sites[site][2].add(shape)
        return dict(sites)


def _stack():
    """The caller's frames, innermost first, past this file's own."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename != __file__:
            yield frame
        frame = frame.f_back


def record_update(cycle, device) -> dict:
    """One recorded update pass: peak (max_memory_allocated and the trace's), live sites, saved
    sites."""
    cycle.logprob_pass()
    gc.collect()
    start = reset_peak(device)
    saved = SavedTensors()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=4_000_000)
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
            cycle.update_pass()
        torch.cuda.synchronize(device)
        trace = torch.cuda.memory._snapshot()["device_traces"][device.index or 0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, live = live_at_peak(trace)
    return {"peak_above_start_gib": (torch.cuda.max_memory_allocated(device) - start) / GIB,
            "trace_peak_gib": peak / GIB, "events": len(trace), "live": live,
            "saved": saved.by_site()}


def site_table(results: dict, key: str, with_shapes: bool = False) -> list:
    """Markdown rows of the largest sites over all arms, GiB per arm, largest first."""
    arms = list(results)
    totals = collections.Counter()
    for arm in arms:
        for site, entry in results[arm][key].items():
            totals[site] += entry[0]
    headers = ["site"] + [f"{cm.ARMS[a]} GiB (count)" for a in arms]
    rows = []
    for site, _ in totals.most_common(TOP_SITES):
        row = [f"`{site}`"]
        for arm in arms:
            entry = results[arm][key].get(site)
            cell = f"{entry[0] / GIB:.2f} ({entry[1]})" if entry else "—"
            if entry and with_shapes:
                cell += " " + ", ".join(str(list(s)) for s in sorted(entry[2])[:3])
            row.append(cell)
        rows.append(row)
    return markdown_table(headers, rows)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "runs" / "memory")
    parser.add_argument("--slice", default="nemotron-3-super:1", help="MODEL:MoE-LAYERS")
    parser.add_argument("--arms", default="te,torch")
    parser.add_argument("--expert-adapters", default="shared", choices=cm.EXPERT_ADAPTERS)
    parser.add_argument("--adapters", choices=["auto", "bridge", "ours"], default="auto")
    cycle_passes.add_batch_and_adapter_options(parser, micro_batches=1)
    args = parser.parse_args()
    key, _, layers = args.slice.partition(":")
    if key not in SLICES or not layers.isdigit() or int(layers) < 1:
        parser.error(f"--slice {args.slice!r}: give MODEL:LAYERS, MODEL from {list(SLICES)}")
    arms = args.arms.split(",")
    if set(arms) - set(cm.ARMS):
        parser.error(f"--arms {args.arms!r}: choose from {list(cm.ARMS)}")
    args.dispatcher, args.permute_fusion, args.ep = "alltoall", True, 1
    return args, key, int(layers), arms


def main():
    args, key, layers, arms = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cycle_memory.py records the CUDA allocator: it needs a GPU")
    device = torch.device("cuda", 0)
    stack = cm.pick_stack("auto", device)
    args.adapters = cm.adapter_source(args.adapters)
    cycle_passes.init_parallel(1, device)
    model = SLICES[key]
    config = cm.make_config(model, layers, stack, args, device)
    batches = cycle_passes.make_batches(model, args, device)
    results = {}
    for arm in arms:
        print(f"[memory] {key}:{layers} {arm}: building", flush=True)
        with cm.arm_environment(arm):
            built = cm.build_arm(arm, model, layers, config, stack, args, device,
                                 args.expert_adapters)
            cycle = cycle_passes.Cycle(arm, built, batches, stack, args, device)
            cycle.logprob_pass()
            cycle.update_pass()  # warm-up
            results[arm] = record_update(cycle, device)
        print(f"[memory] {arm}: update-pass peak {results[arm]['peak_above_start_gib']:.2f} GiB "
              f"above its start (trace: {results[arm]['trace_peak_gib']:.2f} GiB, "
              f"{results[arm]['events']:,} events)", flush=True)
        del cycle, built
        gc.collect()
        torch.cuda.empty_cache()
    lines = ["| arm | update-pass peak above start, GiB | from the trace, GiB |", "|---|---|---|"]
    lines += [f"| {cm.ARMS[a]} | {r['peak_above_start_gib']:.2f} | {r['trace_peak_gib']:.2f} |"
              for a, r in results.items()]
    lines += ["", "Alive at the peak, by allocating site:", ""] + site_table(results, "live")
    lines += ["", "Saved for backward during the pass (unique storages), by saving site:", ""]
    lines += site_table(results, "saved", with_shapes=True)
    head = header(device, packages=("triton", "megatron-core", "transformer-engine",
                                    "megatron-bridge")) + cm.describe(model, layers, stack, args)
    data = {arm: {k: v for k, v in r.items() if k in ("peak_above_start_gib", "trace_peak_gib")}
            for arm, r in results.items()}
    text = write_report(args.out_dir, "memory", f"Update-pass memory at the peak: {key}:{layers}",
                        head, lines, data)
    print(text, flush=True)


if __name__ == "__main__":
    main()
