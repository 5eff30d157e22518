"""What the benchmarks share: the header (command, machine, versions), timing with CUDA events
(the wall clock on the CPU), peak memory, markdown tables and matplotlib.

Imports neither Megatron-Core nor the package (combine_bench.py runs without Megatron-Core).
"""

import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata

import torch

MIB = 2.0 ** 20
GIB = 2.0 ** 30


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
