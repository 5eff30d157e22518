"""The benchmarks' one harness: the header (command, machine, versions), timing with CUDA events
(the wall clock on the CPU), every rank's figures under torchrun, peak memory (allocator, or RSS
on the CPU), host-sync counting and host-blocking probes (`Meter`), rows that record a failure or
an OOM instead of stopping the run, and the report (markdown, JSON, matplotlib).

Imports neither Megatron-Core nor the package; `package_module` loads one package module without
the package's __init__ (combine_bench.py and automodel_combine_bench.py run without Megatron-Core).
"""

import gc
import importlib
import json
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
import traceback
import types
import warnings
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

MIB = 2.0 ** 20
GIB = 2.0 ** 30
REPO_ROOT = Path(__file__).resolve().parents[1]
# The test side's `support` package (tests/support: the CPU patch table, Bridge's imports without
# Transformer Engine, the Bridge finetune config) serves the benchmarks' CPU modes and the client
# routes; appended, so that nothing in tests/ shadows an installed module.
if str(REPO_ROOT / "tests") not in sys.path:
    sys.path.append(str(REPO_ROOT / "tests"))

# On the CPU a benchmark re-executes itself with these set (`rerun_with_cpu_env`): glibc then maps
# every buffer of 64 KiB or more separately and unmaps it when freed, so peak RSS sees each
# temporary; and Triton kernels are defined for the interpreter (the variable must be set before
# triton is imported).
CPU_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "TRITON_INTERPRET": "1"}


def free_port() -> int:
    """A free TCP port on the loopback interface (a torchrun master's)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rerun_with_cpu_env() -> None:
    """Re-execute this script with CPU_ENV set, unless it already is (then return)."""
    if CPU_ENV.items() - os.environ.items():
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **CPU_ENV})


def package_module(name: str):
    """mcore_torch_experts.<name> from this checkout without running the package __init__
    (which imports Megatron-Core)."""
    if "mcore_torch_experts" not in sys.modules:
        package = types.ModuleType("mcore_torch_experts")
        package.__path__ = [str(REPO_ROOT / "mcore_torch_experts")]
        sys.modules["mcore_torch_experts"] = package
    return importlib.import_module(f"mcore_torch_experts.{name}")


def version(dist: str) -> str:
    """The installed version of a distribution, or "not installed"."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def nvidia_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"
    return out.split("\n")[0].strip() or "unknown"


def header(device: torch.device, packages=("triton", "megatron-core", "transformer-engine",
                                            "grouped_gemm")) -> list:
    """Lines: the command, the date, the GPU (or CPU) and the versions of python, torch and
    `packages`."""
    lines = [f"command: `{shlex.join(['python3', *sys.argv])}`",
             f"date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        lines.append(f"GPU: {props.name}, {props.multi_processor_count} SMs, "
                     f"{props.total_memory / GIB:.0f} GiB; driver {nvidia_driver()}; "
                     f"CUDA {torch.version.cuda}")
    else:
        lines.append(f"device: CPU ({platform.processor() or platform.machine()}, "
                     f"{torch.get_num_threads()} threads); times are wall clock and say nothing "
                     "about GPU speed")
    lines.append(", ".join([f"python {platform.python_version()}", f"torch {torch.__version__}"]
                           + [f"{p} {version(p)}" for p in packages]))
    return lines


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather_ranks(value) -> list:
    """Every rank's `value` (a picklable object), by rank; [value] without a process group."""
    if not torch.distributed.is_initialized():
        return [value]
    values = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


class Stopwatch:
    """Device time of the work queued between construction and `ms()` (CUDA events), or the
    wall clock on the CPU; `host_ms` is the host time until `stop()`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        self.t0 = time.perf_counter()
        self.host_ms = None

    def stop(self) -> "Stopwatch":
        self.host_ms = (time.perf_counter() - self.t0) * 1e3
        if self.cuda:
            self.end.record()
        return self

    def ms(self) -> float:
        """Elapsed milliseconds (waits for the end event)."""
        if self.host_ms is None:
            self.stop()
        if not self.cuda:
            return self.host_ms
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


def median_ms(fn, device, warmup: int, reps: int, before=None, sync_each=False):
    """(median device ms, median host ms) of fn() over `reps` calls after `warmup` calls.

    `before()` runs ahead of each timed call and is not timed (an L2 flush; a GPU sleep, which
    lets fn's launches queue up so that only device time counts); `sync_each` waits for the
    device before each call.
    """
    for _ in range(warmup):
        fn()
    sync(device)
    watches = []
    for _ in range(reps):
        if sync_each:
            sync(device)
        if before is not None:
            before()
        watch = Stopwatch(device)
        fn()
        watches.append(watch.stop())
    return (statistics.median(w.ms() for w in watches),
            statistics.median(w.host_ms for w in watches))


def reset_peak(device: torch.device) -> int:
    """Start a peak-memory window: returns the bytes allocated now (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_bytes(device: torch.device):
    """The peak allocated since reset_peak (None on the CPU)."""
    if device.type != "cuda":
        return None
    sync(device)
    return torch.cuda.max_memory_allocated(device)


SLEEP_CYCLES = 500_000_000  # GPU sleep of ~0.25 s ahead of the host-blocking probe
QUEUE_CYCLES = 50_000_000  # ~25 ms: long enough for a call's launches to queue up behind it


class Meter:
    """Medians of repeated calls (CUDA events, or the wall clock on the CPU), extra peak memory,
    host syncs and host blocking, on one device."""

    def __init__(self, device: torch.device, warmup: int = 1, reps: int = 1,
                 flush_l2: bool = False):
        self.device, self.cuda = device, device.type == "cuda"
        self.warmup, self.reps = warmup, reps
        self.l2 = torch.empty(256 * 2 ** 20, dtype=torch.int8, device=device) if flush_l2 else None

    def sync(self):
        sync(self.device)

    def time(self, fn, queued=False, sync_each=False):
        """(median device ms, median host ms) of fn; on the CPU both are the wall clock.

        With an L2 flush, 256 MiB are zeroed ahead of each call. queued=True puts the GPU to
        sleep ahead of each call so that all of fn's kernels are enqueued before the start event
        fires: device time only, as inside a busy training step (launches that outlast the sleep
        still show). sync_each waits for the device before each call.
        """
        before = []
        if self.l2 is not None:
            before.append(self.l2.zero_)
        if queued and self.cuda:
            before.append(lambda: torch.cuda._sleep(QUEUE_CYCLES))
        return median_ms(fn, self.device, self.warmup, self.reps, sync_each=sync_each,
                         before=(lambda: [b() for b in before]) if before else None)

    def peak_extra_bytes(self, fn):
        """Peak memory above what is allocated when fn starts: the CUDA allocator's, or on the
        CPU the process's peak RSS (VmHWM after resetting it; None where /proc cannot)."""
        if self.cuda:
            torch.cuda.empty_cache()
            base = reset_peak(self.device)
            fn()
            return peak_bytes(self.device) - base
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return None
        base = _vm_kib("VmRSS")
        fn()
        return (_vm_kib("VmHWM") - base) * 1024

    def step_memory(self, forward, backward):
        """(extra peak MiB of forward then backward(ctx), MiB held from one to the other), above
        what was allocated before (CUDA). forward() -> (out, ctx)."""
        base = reset_peak(self.device)
        out, ctx = forward()
        self.sync()
        held = torch.cuda.memory_allocated() - base
        backward(ctx)
        del out, ctx
        return (peak_bytes(self.device) - base) / MIB, held / MIB

    def count_syncs(self, fn):
        """Host syncs torch's sync debug mode reports while fn runs (CUDA)."""
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
        """True if fn returns only after earlier GPU work (a ~0.25 s sleep) has finished (CUDA)."""
        self.sync()
        torch.cuda._sleep(SLEEP_CYCLES)
        slept = torch.cuda.Event()
        slept.record()
        fn()
        blocked = slept.query()
        self.sync()
        return blocked

    def one_time(self, fn):
        """(result, {ms, extra peak MiB, MiB held after}) of a one-time step such as packing."""
        self.sync()
        base = torch.cuda.memory_allocated() if self.cuda else 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        result = fn()
        self.sync()
        cost = {"ms": (time.perf_counter() - t0) * 1e3}
        if self.cuda:
            cost["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
            cost["held_mib"] = (torch.cuda.memory_allocated() - base) / MIB
        return result, cost


def _vm_kib(field):
    return int(re.search(field + r":\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


# --- rows ----------------------------------------------------------------------------------------

def error_note(exc) -> str:
    """The table note of a failure (the traceback goes to stderr)."""
    traceback.print_exc()
    return f"error: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"


OOM = "OOM"


def catch_oom(fn):
    """fn(), or OOM when the GPU runs out of memory (what fn held is freed, the cache emptied)."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        pass
    gc.collect()
    torch.cuda.empty_cache()
    return OOM


def guarded(name, fn):
    """fn() -> row, or a row that says why it did not run; a failure never stops the run."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the table, traceback on stderr
        return {"name": name, "note": error_note(exc)}


# --- report --------------------------------------------------------------------------------------

def write_report(out_dir: Path, name: str, title: str, header_lines, body_lines, data) -> str:
    """<name>.md (the title, the header as bullets, the body) and <name>.json (`data`, with the
    header) under out_dir; returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = "\n".join([f"# {title}", ""] + [f"- {h}" for h in header_lines] + [""]
                     + list(body_lines)) + "\n"
    (out_dir / f"{name}.md").write_text(text)
    (out_dir / f"{name}.json").write_text(json.dumps({"header": list(header_lines), **data},
                                                     indent=1, default=str))
    return text


def fmt(value, spec=".3f", missing="—") -> str:
    return missing if value is None else format(value, spec)


def ratio(num, den):
    return None if num is None or den is None or den == 0 else num / den


def markdown_table(headers, rows) -> list:
    """Lines of a markdown table; cells are str()-ed."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note) when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not importable: no plots", flush=True)
        return None
    return plt


def save_figure(plt, fig, path) -> str:
    """Lay out, write (PNG, 120 dpi) and close a matplotlib figure; its file name."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path).name
