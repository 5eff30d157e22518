"""The benchmarks' CPU smoke runs complete and report; no timing assertions."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcore_torch_experts import _compat
from support.torchrun import torchrun

# The benchmarks' smoke runs on 0.19.2, the release their GPU runs use (BENCHMARKS.md); those
# marked once_per_venv (bench_experts, whose Megatron arms differ by release, and the kernels')
# on 0.16.1 too (scripts/legs.sh: leg_skips).
BENCH_SMOKE = pytest.mark.bench_smoke

REPO = Path(__file__).resolve().parents[1]


# A smoke run's limit: `bench_experts.py --tiny` takes about 40 s on a CPU host, 94 s alone on an
# H100 host (its GPU arms compile there), and went past 300 s in the TE leg, eight test files at
# once on 16 cores (scripts/gpu_te.sh).
BENCHMARK_TIMEOUT_S = 900


def run_benchmark(script, *args):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=REPO, capture_output=True, text=True, timeout=BENCHMARK_TIMEOUT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.once_per_venv
def test_bench_experts_tiny(tmp_path):
    stdout = run_benchmark("bench_experts.py", "--tiny", "--out-dir", str(tmp_path))
    assert "| shape | routing | implementation | fwd ms | fwd+dgrad ms |" in stdout
    assert "## Local expert count sweep" in stdout
    assert (tmp_path / "results.md").read_text().startswith("# TorchGroupedMLP benchmark")

    report = json.loads((tmp_path / "results.json").read_text())
    rows = [row for res in report["results"] for row in res["rows"]]
    assert not [row for row in rows if row.get("note", "").startswith("error")]
    # A module the installed releases lack is "not installed" / "not available", never an error.
    legacy = [row for row in rows if row["name"] == "GroupedMLP (legacy)"]
    assert legacy and all(row["note"].startswith(("not installed", "not available"))
                          for row in legacy if "note" in row)
    # Every implementation that computes the experts agrees with SequentialMLP (bf16 rounding).
    checked = [row for row in rows if "err" in row]
    assert len(checked) >= 4 * len(report["results"])
    assert all(row["err"] < 3e-2 for row in checked), checked


@BENCH_SMOKE
def test_bench_cycle_smoke(tmp_path):
    stdout = run_benchmark("bench_cycle.py", "--smoke", "--out-dir", str(tmp_path))
    assert ("| experts | expert adapters | adapters | expert kernel | logprob ms | update ms | "
            "cycle ms, median (min–max) |") in stdout
    assert "| experts | expert adapters | adapters | MoE side ms | of it recompute ms |" in stdout
    assert "### Update pass by component (torch profiler)" in stdout
    assert "bench_cycle.py --smoke" in stdout and "megatron-core" in stdout  # the header

    report = json.loads((tmp_path / "results.json").read_text())
    gpt = report["slices"][0]
    assert (gpt["slice"], gpt["layers"]) == ("tiny", 2)
    rows = {row["arm"]: row for row in gpt["rows"]}
    te_stack = any(line.startswith("stack: Megatron's Transformer Engine")
                   for line in gpt["header"])
    # The TE arms run where Transformer Engine can (the GPU); elsewhere they say why, never error.
    assert set(rows) == ({"te", "te-cutlass", "torch"} if te_stack
                         else {"sequential", "torch", "te", "te-cutlass"})
    assert all(row["note"].startswith("not available") for row in rows.values() if "note" in row)
    ran = [arm for arm, row in rows.items() if "note" not in row]
    assert set(ran) == (set(rows) if te_stack else {"sequential", "torch"})
    reference = "te" if te_stack else "sequential"
    for arm in ran:
        row = rows[arm]
        values = [row[k]["median"] for k in ("logprob_ms", "update_ms", "cycle_ms")]
        values += [row["tokens_per_s"], row["cycle_ms"]["max"] - row["cycle_ms"]["min"] + 1]
        values.append(rows[reference]["cycle_ms"]["median"] / row["cycle_ms"]["median"])
        assert all(math.isfinite(v) and v > 0 for v in values), row
        assert len(row["cycles_ms"]) == 2  # the measured rounds
        shares = row["profile"]["ms"]
        assert sum(shares.values()) > 0 and shares["expert GEMMs"] > 0 and shares["adapters"] > 0
        # What `other` holds, by source: its largest parts, never more than it.
        assert sum(ms for _, ms in row["profile"]["other_sources"]) <= shares["other"] + 1e-9
        # Same weights, adapters and data: the arms' log-probabilities agree (BF16 rounding).
        assert row["logprob_diff"] < 1e-2, row
    assert (tmp_path / "breakdown-tiny-2.png").stat().st_size > 0
    check_moe_side(gpt["rows"], (tmp_path / "results.md").read_text(), passes=2)
    if te_stack:  # the hybrid slice (latent MoE, shared expert) runs on the TE stack only
        hybrid = {row["arm"]: row for row in report["slices"][1]["rows"]}
        assert all("note" not in row and row["logprob_diff"] < 1e-2 for row in hybrid.values())


# The MoE side as the report defines it, from the breakdown's named components.
MOE_SIDE = ("router", "permute/dispatch", "expert GEMMs", "expert activation", "expert adapters",
            "combine/unpermute", "MoE layer, rest")


def check_moe_side(rows, report_md, passes):
    """Every arm that ran has its MoE side over `passes` profiled passes: each pass's MoE ms is
    the sum of the MoE components and their recompute part, its ratio that over the recorded
    expert-GEMM kernel ms; the summary is the median and range of those; and the report's MoE
    table has a row per arm, with the median ratio."""
    import statistics

    table = report_md.split("### MoE side of the update pass")[1].split("###")[0]
    ran = [row for row in rows if "note" not in row]
    assert ran
    for row in ran:
        side = row["moe_side"]
        assert len(side["rounds"]) == passes, side
        first = side["rounds"][0]
        profile = row["profile"]  # the first pass's breakdown
        moe = sum(profile["ms"][c] + profile["recompute_ms"][c] for c in MOE_SIDE)
        assert math.isclose(first["moe_ms"], moe, rel_tol=1e-9), (first, moe)
        assert first["gemm_ms"] == profile["gemm_kernel_ms"] > 0
        assert first["moe_ms"] > first["gemm_ms"]  # the GEMMs are a part of the MoE side
        for one in side["rounds"]:
            assert math.isclose(one["ratio"], one["moe_ms"] / one["gemm_ms"], rel_tol=1e-9)
            assert one["moe_bound_ms"] >= one["moe_ms"]
        ratios = [one["ratio"] for one in side["rounds"]]
        assert side["ratio"] == {"median": statistics.median(ratios), "min": min(ratios),
                                 "max": max(ratios)}
        cells = [line for line in table.splitlines()
                 if line.startswith(f"| {row['module']} | {row['layout']} | {row['adapters']} |")]
        assert len(cells) == 1, (row["module"], table)
        assert f"| {side['ratio']['median']:.2f} (" in cells[0]
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == len(ran) + 1
    # the ceiling of an experts-only change: the cycle with the MoE side at its GEMM kernel time
    ceilings = report_md.split("The ceiling of a change to the experts alone")[1].split("###")[0]
    for row in ran:
        if row["arm"] not in ("torch", "torch-fp32-combine"):
            continue
        side, cycle = row["moe_side"], row["cycle_ms"]["median"]
        floor = cycle - (side["moe_ms"]["median"] - side["gemm_ms"]["median"])
        line = next(line for line in ceilings.splitlines()
                    if f"({row['layout']}, {row['adapters']} adapters): cycle {cycle:.0f} ms"
                    in line)
        assert f"the cycle would be {floor:.0f} ms" in line, line


@BENCH_SMOKE
def test_bench_cycle_smoke_keeps_the_options_given_beside_it(tmp_path):
    """--smoke sets sizes only where no option says otherwise: both adapter layouts run, as
    asked, at the rank and round count given."""
    run_benchmark("bench_cycle.py", "--smoke", "--adapters", "ours", "--expert-adapters",
                  "shared,per_expert", "--rank", "16", "--cycles", "3", "--arms", "torch",
                  "--no-profile", "--out-dir", str(tmp_path))
    report = json.loads((tmp_path / "results.json").read_text())
    rows = report["slices"][0]["rows"]
    assert sorted(row["layout"] for row in rows) == ["per_expert", "shared"]
    assert all(len(row["cycles_ms"]) == 3 for row in rows), rows
    assert (report["args"]["rank"], report["args"]["seq"]) == ("16", "32")  # stored as text


@BENCH_SMOKE
def test_bench_cycle_runs_every_adapter_source_and_layout_as_an_arm(tmp_path):
    """--adapters ours,bridge with both layouts: a row per (arm, layout, source), each measured
    and profiled in its own turns; a source named twice is refused."""
    if sys.version_info < (3, 12) or importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("Megatron-Bridge's PEFT needs Python 3.12 and megatron-bridge")
    run_benchmark("bench_cycle.py", "--smoke", "--adapters", "ours,bridge", "--expert-adapters",
                  "shared,per_expert", "--arms", "torch", "--profile-rounds", "1",
                  "--out-dir", str(tmp_path))
    report = json.loads((tmp_path / "results.json").read_text())
    rows = report["slices"][0]["rows"]
    assert sorted((row["layout"], row["adapters"]) for row in rows) == [
        ("per_expert", "bridge"), ("per_expert", "ours"), ("shared", "bridge"), ("shared", "ours")]
    check_moe_side(rows, (tmp_path / "results.md").read_text(), passes=1)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_cycle.py"), "--smoke",
                           "--adapters", "ours,ours"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--adapters 'ours,ours'" in proc.stderr, proc.stderr[-2000:]


@BENCH_SMOKE
def test_bench_cycle_profiles_the_fused_path_it_timed(tmp_path):
    """The profiler's ranges leave the fused kernels' linears and adapters unhooked, so a forced
    "fused_gemm" with Megatron-Bridge's adapters (shared and per expert) is profiled on the path
    it was timed on (Triton's interpreter on the CPU): every row says fused_gemm, and its
    backward's kernel and adapter work lands in the expert GEMMs and expert adapters rows."""
    if sys.version_info < (3, 12) or importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("Megatron-Bridge's PEFT needs Python 3.12 and megatron-bridge")
    pytest.importorskip("triton", reason="the fused kernels run under Triton's interpreter here")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_cycle.py"), "--smoke",
         "--expert-kernel", "fused_gemm", "--adapters", "bridge", "--expert-adapters",
         "shared,per_expert", "--arms", "torch", "--profile-rounds", "1", "--cycles", "1",
         "--out-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=BENCHMARK_TIMEOUT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads((tmp_path / "results.json").read_text())["slices"][0]["rows"]
    assert [(row["layout"], row.get("note")) for row in rows] == [("shared", None),
                                                                   ("per_expert", None)]
    for row in rows:
        assert row["expert_kernels"] == ["fused_gemm"] == row["profile"]["expert_kernels"], row
        ms, again = row["profile"]["ms"], row["profile"]["recompute_ms"]
        for component in ("expert GEMMs", "expert adapters"):
            assert ms[component] > 0 and again[component] > 0, (component, ms, again)
    assert "| TorchGroupedMLP | shared | bridge | fused_gemm |" in proc.stdout


@BENCH_SMOKE
def test_bench_cycle_smoke_at_ep2_under_torchrun(tmp_path):
    """--ep 2 on two CPU processes (gloo, allgather dispatcher): both arms run on every rank, with
    4 of the tiny slice's 8 experts per rank, and their logprobs agree on every rank. Our adapters
    and no profile: the run is the launch's imports (about 30 s on two cores)."""
    run = torchrun(REPO / "benchmarks" / "bench_cycle.py", 2,
                   ["--smoke", "--ep", "2", "--adapters", "ours", "--no-profile",
                    "--out-dir", str(tmp_path)], tmp_path / "torchrun.log", timeout_s=180)
    assert run.returncode == 0, run.output[-8000:]

    report = json.loads((tmp_path / "results.json").read_text())
    assert any("EP=2" in line for line in report["header"])
    assert any("128 tokens per rank and cycle, 2 rank(s)" in line for line in report["header"])
    tiny = report["slices"][0]
    assert tiny["label"] == "tiny, 2 MoE layers, EP=2"
    assert "8 SwiGLU experts of 32, top-2 (softmax router), 4 per rank at EP=2" in tiny["header"][0]
    rows = {row["arm"]: row for row in tiny["rows"] if "note" not in row}
    assert set(rows) == {"sequential", "torch"}, tiny["rows"]
    for row in rows.values():
        assert len(row["cycles_ms"]) == 2 and all(math.isfinite(v) and v > 0
                                                  for v in row["cycles_ms"]), row
        assert row["tokens_per_s"] > 0 and "profile" not in row
        assert row["logprob_diff"] < 1e-2, row  # the largest of the two ranks'


@BENCH_SMOKE
def test_cycle_memory_replay_finds_what_is_alive_at_the_peak():
    import cycle_memory

    ours = [{"filename": "/env/site-packages/torch/nn/modules/module.py", "line": 1, "name": "x"},
            {"filename": "/env/site-packages/mcore_torch_experts/experts.py", "line": 260,
             "name": "forward"}]
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": ours},
             {"action": "alloc", "addr": 2, "size": 50, "frames": []},
             {"action": "free_requested", "addr": 1, "size": 100},
             {"action": "free_completed", "addr": 1, "size": 100},
             {"action": "alloc", "addr": 3, "size": 30, "frames": ours},
             {"action": "alloc", "addr": 1, "size": 200, "frames": ours},  # the address reused
             {"action": "free_completed", "addr": 1, "size": 200},
             {"action": "free_completed", "addr": 9, "size": 70}]  # allocated before the start
    peak, live = cycle_memory.live_at_peak(trace)
    assert peak == 280
    assert live == {"mcore_torch_experts/experts.py:260 (forward)": [230, 2],
                    "autograd engine / C++ (no Python frame), 0 MiB blocks": [50, 1]}


@BENCH_SMOKE
@pytest.mark.te
def test_cycle_memory_runs_on_a_tiny_slice(tmp_path):
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("cycle_memory.py records the CUDA allocator; its default arms include "
                    "TEGroupedMLP (Transformer Engine)")
    stdout = run_benchmark("cycle_memory.py", "--slice", "tiny:1", "--seq", "32",
                           "--micro-batch-size", "2", "--out-dir", str(tmp_path))
    report = json.loads((tmp_path / "memory.json").read_text())
    assert set(report) == {"header", "te", "torch"}, report
    assert "Alive at the peak, by allocating site:" in stdout
    assert all(arm["trace_peak_gib"] > 0 for name, arm in report.items() if name != "header")


@BENCH_SMOKE
def test_automodel_combine_bench_measures_each_peak_without_earlier_gradients():
    """Each step's peak is taken from a state that holds no gradients: a gradient left by the
    warm-up call is freed inside the measured call and would take its bytes off the peak."""
    import automodel_combine_bench as bench_module

    class Bench:  # the methods measure() calls, with one gradient as the state
        grad = None

        def forward(self):
            return torch.zeros(2)

        def forward_backward(self):
            self.grad = torch.ones(2)

        def clear_grads(self):
            self.grad = None

        def with_variant(self, install, fn):
            try:
                return fn()
            finally:
                self.clear_grads()

    bench, grads_at_start = Bench(), []

    class Meter:
        def peak_extra_bytes(self, fn):
            grads_at_start.append(bench.grad)
            fn()
            return 0

        def time(self, fn):
            fn()
            return 1.0, 1.0

    rows = bench_module.measure(bench, {"shipped": (None, True)}, Meter(), repeats=1,
                                mode="frozen")
    assert [row["variant"] for row in rows] == ["shipped"] and "note" not in rows[0]
    assert grads_at_start == [None, None]  # forward, then forward + backward


@BENCH_SMOKE
@pytest.mark.parametrize("options, message", [
    (["--headroom-gib", "0"], "--headroom-gib 0: needs a CUDA device and a positive count of GiB"),
    (["--headroom-gib", "1", "--reserve-gib", "1"], "not allowed with argument --headroom-gib")])
def test_automodel_combine_bench_refuses_a_headroom_it_cannot_hold(options, message):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "automodel_combine_bench.py"),
                           "--tiny", *options], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


@BENCH_SMOKE
def test_automodel_combine_bench_tiny(tmp_path):
    pytest.importorskip("nemo_automodel.components.moe.experts",
                        reason="nemo-automodel is not installed here (the megatron-core 0.19.2 "
                               "leg installs it)")
    stdout = run_benchmark("automodel_combine_bench.py", "--tiny", "--out-dir", str(tmp_path))
    assert "| variant | fwd ms | fwd+bwd ms | fwd peak MiB | fwd+bwd peak MiB |" in stdout
    assert "automodel_combine_bench.py --tiny" in stdout and "nemo-automodel 0.7.0" in stdout

    report = json.loads((tmp_path / "automodel_combine_bench.json").read_text())
    measured = [row for table in report["measured"] for row in table["rows"]]
    variants = {row["variant"] for row in measured}
    assert {"shipped (scatter_add_)", "fork loop 64", "fp32_combine torch 64"} <= variants
    assert len(report["measured"]) == 2 * 2  # two token counts, experts frozen and trainable
    for row in measured:
        assert "note" not in row, row
        if row["variant"] != "fp32_combine triton":  # interpreted: checked, not measured
            assert len(row["fwd ms"]) == len(row["fwd+bwd ms"]) == 3, row  # the repeats
            assert all(math.isfinite(t) and t > 0 for t in row["fwd ms"] + row["fwd+bwd ms"])
            assert row["fwd+bwd ms / shipped"] > 0
    checked = report["checked"]
    assert len(checked) == 2 * len(variants)
    on_cpu = any(line.startswith("device: CPU") for line in report["header"])
    for row in checked:
        assert all(row[k] < 2e-2 for k in row if k.endswith(" err") and row[k] is not None), row
        if on_cpu:  # every variant adds each token's rows in row order, as scatter_add_ there
            assert row["y max |diff| vs shipped"] == 0 and row["y repro"], row
            assert row["grads repro"] == "yes", row


@BENCH_SMOKE
def test_bench_bridge_per_expert_tiny():
    if sys.version_info < (3, 12) or importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("Megatron-Bridge's PEFT needs Python 3.12 and megatron-bridge")
    stdout = run_benchmark("bench_bridge_per_expert.py", "--tiny")
    header = ("| shape | routing | no adapters | grouped | Bridge's | adapters grouped | "
              "adapters Bridge's | speed-up | host syncs (grouped / Bridge's) | "
              "max rel L2 vs Bridge's |")
    assert header in stdout
    rows = [line.split("|")[1:-1] for line in stdout.splitlines()
            if line.startswith("| tiny ")]
    assert len(rows) == 2 * 2 and all(float(row[-1]) < 2e-2 for row in rows), rows


@BENCH_SMOKE
def test_a_parked_arm_trains_on_as_if_it_had_stayed_built():
    """bench_cycle's ParkedArm (cycle_passes.py): two update steps with the model dropped and
    rebuilt between them give bitwise the adapters, optimizer state and logprobs of two steps on
    one model; the dropped model is freed."""
    import types
    import weakref

    import cycle_passes

    x = torch.randn(8, 6)

    def build():
        torch.manual_seed(0)  # the same frozen base every build, as build_base seeds it
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
        model[0].requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        return types.SimpleNamespace(model=model, params=params, device=torch.device("cpu"),
                                     optimizer=torch.optim.AdamW(params, lr=0.1),
                                     old_logprobs=None)

    def step(cycle):
        cycle.old_logprobs = [cycle.model(x).detach()]
        cycle.model(x).square().mean().backward()
        cycle.optimizer.step()
        cycle.optimizer.zero_grad(set_to_none=True)

    held = build()
    step(held), step(held)
    arm = cycle_passes.ParkedArm(build)
    step(arm.open())
    first = weakref.ref(arm.cycle.model)
    arm.close()
    assert arm.cycle is None and first() is None
    parked = arm.open()
    step(parked)
    assert all(torch.equal(a, b) for a, b in zip(parked.params, held.params, strict=True))
    assert torch.equal(parked.old_logprobs[0], held.old_logprobs[0])
    state, held_state = parked.optimizer.state_dict(), held.optimizer.state_dict()
    assert state["state"].keys() == held_state["state"].keys() and all(
        torch.equal(torch.as_tensor(v), torch.as_tensor(held_state["state"][i][k]))
        for i, s in state["state"].items() for k, v in s.items())


@BENCH_SMOKE
def test_a_parked_arm_refuses_to_end_a_turn_while_its_model_is_still_referenced():
    """ParkedArm.close: a model kept alive past its turn (so its memory would stay with the next
    arm) is an error naming it; the state was kept, and the next close of a clean turn passes."""
    import types

    import cycle_passes

    def build():
        model = torch.nn.Linear(4, 2)
        params = list(model.parameters())
        return types.SimpleNamespace(model=model, params=params, device=torch.device("cpu"),
                                     optimizer=torch.optim.AdamW(params, lr=0.1),
                                     old_logprobs=[torch.zeros(2)])

    arm = cycle_passes.ParkedArm(build)
    leaked = arm.open().model
    with pytest.raises(RuntimeError, match="the arm's model outlived its turn"):
        arm.close()
    assert arm.cycle is None and arm.kept is not None
    del leaked
    arm.open()
    arm.close()  # nothing else holds it
    assert arm.cycle is None


@pytest.mark.once_per_venv
def test_bench_field_kernels_tiny(tmp_path):
    """The kernels-from-the-field benchmark's CPU smoke: the arms that run here agree with the
    FP32 evaluation; those that cannot say why instead of failing the run."""
    stdout = run_benchmark("bench_field_kernels.py", "--tiny", "--out-dir", str(tmp_path))
    assert "| shape, routing | arm | forward ms | update ms |" in stdout
    report = json.loads((tmp_path / "field_kernels.json").read_text())
    rows = [row for result in report["results"] for row in result["rows"]]
    ran = {row["name"] for row in rows if "err" in row}
    assert ran == {"grouped_mm", "fused_gemm"}, rows
    assert all(row["err"] < 3e-2 for row in rows if "err" in row), rows
    assert all(row["note"].startswith("not available") for row in rows if "note" in row), rows


@BENCH_SMOKE
def test_megatron_lm_report_from_logs_keeps_each_batch_apart_and_leaves_out_cut_runs(tmp_path):
    """megatron_lm_run.py --from-logs: per batch size, each arm's median of its runs' medians,
    the ratios within each run, and a run cut short (no timed iteration) left out."""
    per_arm = {"torch": 100.0, "te": 200.0, "te-cutlass": 150.0}
    for repeat in range(2):
        for batch in (4, 8):
            for arm, ms in per_arm.items():
                if (arm, batch, repeat) == ("te-cutlass", 8, 1):   # cut short at iteration 2
                    iterations = range(1, 3)
                else:
                    iterations = range(1, 7)
                lines = [f" [2026-12-05] iteration {i:8d}/       6 | consumed samples: {i} | "
                         f"elapsed time per iteration (ms): {ms * batch / 4 * (1 + repeat):.1f} "
                         f"| learning rate: 1.0E-05 | lm loss: {10 - i / 10 + (arm == 'torch') * 1e-5:.6E} |"
                         for i in iterations]
                if arm == "torch":
                    lines.append("mcore_torch_experts: rank 0 runs TorchGroupedMLP experts")
                (tmp_path / f"{arm}_gb{batch}_{repeat}.log").write_text("\n".join(lines))
    stdout = run_benchmark("megatron_lm_run.py", "--megatron-lm", str(tmp_path), "--out-dir",
                           str(tmp_path), "--global-batch", "4,8", "--repeats", "2", "--iters",
                           "6", "--skip", "3", "--from-logs")
    summary = json.loads((tmp_path / "megatron_lm.json").read_text())["summary"]
    by_tokens = {s["tokens"]: s for s in summary["by_batch"]}
    assert by_tokens[16384]["ms_ours"] == pytest.approx(150.0)       # runs of 100 and 200 ms
    assert by_tokens[32768]["ms_stock"] == pytest.approx(600.0)
    assert by_tokens[32768]["runs"] == {"torch": 2, "te": 2, "te-cutlass": 1}
    assert by_tokens[32768]["ms_cutlass"] == pytest.approx(300.0)
    assert summary["tokens"] == 32768 and summary["ok"]
    assert "| 16,384 | TorchGroupedMLP (the documented command) | 2 | 150.0 (100.0–200.0) |" \
        in stdout
    assert "2.00 (2.00–2.00)" in stdout and "1.50 (1.50–1.50)" in stdout


def test_megatron_lm_run_refuses_a_batch_list_it_cannot_read(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "megatron_lm_run.py"),
                           "--megatron-lm", str(tmp_path), "--out-dir", str(tmp_path),
                           "--global-batch", "4;8", "--from-logs"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--global-batch: '4;8' is not a comma-separated list of integers" in proc.stderr


@BENCH_SMOKE
@pytest.mark.parametrize("options, message", [
    (["--slice", "qwen3-30b-a3b"], "--slice 'qwen3-30b-a3b': give MODEL:LAYERS"),
    (["--rounds", "0"], "--rounds and --micro-batches must be at least 1"),
    pytest.param([], "needs a CUDA GPU and Transformer Engine", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="on a CUDA host the benchmark would run"))])
def test_batch_invariant_cycle_cost_refuses_what_it_cannot_run(tmp_path, options, message):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "batch_invariant_cycle_cost.py"),
                           "--out-dir", str(tmp_path), *options], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


@BENCH_SMOKE
def test_nemo_rl_run_refuses_the_invariant_arm_before_any_worker_starts(tmp_path):
    """Here (no FlashAttention 3 or 4, no DeepGEMM; or a release before the mode) the arm is
    refused with what it needs, before the checkpoint is written or a worker starts."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "nemo_rl_run.py"),
                           "--out-dir", str(tmp_path), "--arms", "torch,torch-invariant"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--arms torch,torch-invariant: torch-invariant needs" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "hf").exists()


@pytest.mark.skipif(_compat.megatron_core_release() < (0, 20),
                    reason="the benchmark runs megatron-core 0.20's batch_invariant_mode")
def test_batch_invariant_cycle_cost_builds_each_arms_config_and_names_its_run(monkeypatch, tmp_path):
    """Each arm's config as the benchmark builds it on the slice it times (the experts each arm
    names; the mode's settings on the mode's arms), and the report's line naming the run."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "batch_invariant_cycle_cost", REPO / "benchmarks" / "batch_invariant_cycle_cost.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import HAVE_DEEPGEMM_BF16

    import cycle_models
    from shapes import SLICES

    args = bench.make_parser().parse_args(["--out-dir", str(tmp_path)])
    args.adapters, args.ep, args.dispatcher = "ours", 1, "alltoall"
    args.expert_kernel = "auto"
    args.permute_fusion = importlib.util.find_spec("transformer_engine") is not None  # TE's fusion
    model_slice = SLICES["qwen3-30b-a3b"]
    base = cycle_models.make_config(model_slice, 2, "te", args, torch.device("cpu"))
    for arm, (backend, mode, fp32_combine) in bench.ARMS.items():
        if arm == "TEGroupedMLP, mode on" and not HAVE_DEEPGEMM_BF16:
            continue  # the benchmark's row says why (Megatron asserts DeepGEMM)
        config = bench.arm_config(base, arm, 4)
        assert (config.moe_expert_gemm_backend, config.batch_invariant_mode,
                config.moe_combine_in_fp32) == (backend, mode, fp32_combine), arm
        if mode:
            assert (config.flash_attention_version, config.moe_permute_fusion) == (4, False)
    assert bench.run_line(model_slice, 4, args, 4).startswith(
        f"{model_slice.label}, 4 MoE layers; 2 micro-batches of 2 x 4096 tokens; ")


@BENCH_SMOKE
def test_batch_invariance_probe_tiny_finds_the_control_and_reports_every_piece(tmp_path):
    """The probe's CPU smoke run (Triton pieces in the interpreter): every piece of ours reported
    for every batch, and the control (a batch-dependent op) found batch-dependent. Every piece
    batch-invariant, but the fused kernels' probs gradient: under the interpreter their tiles'
    reductions run as numpy's, which on some CPUs (this repository's AMD EPYC machine) move it in
    the last bits with the other rows of a tile; compiled on the GPU it measured bitwise
    (benchmarks/results/h100/2026-12-05/batch_invariance.md). Their output and input gradient
    stay bitwise here too."""
    run_benchmark("batch_invariance_probe.py", "--tiny", "--out-dir", str(tmp_path))
    report = json.loads((tmp_path / "batch_invariance.json").read_text())
    verdicts = report["verdicts"]
    assert verdicts.pop("control (subtracts the batch mean)") is False
    fused = {piece for piece in verdicts if piece.startswith("fused kernels")}
    assert len(verdicts) == 9 and len(fused) == 3
    assert all(verdicts[piece] for piece in set(verdicts) - fused), verdicts
    for piece, _, _, verdict in report["rows"]:
        if piece in fused:
            assert verdict.startswith("out bitwise, d x bitwise, "), (piece, verdict)
    assert len(report["rows"]) == 2 * 10 * 3   # 2 shapes (SwiGLU, squared ReLU); run to run, 2 batches
    assert not any("error" in row[-1] for row in report["rows"]), report["rows"]


@pytest.mark.once_per_venv
def test_nemo_rl_resume_check_names_each_weight_or_buffer_that_did_not_come_back(monkeypatch):
    """nemo_rl_run.py's resume check: the resumed worker's weights and buffers against the
    trained worker's, bit for bit, with the names that are missing, extra or different."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("nemo_rl_run", REPO / "benchmarks" / "nemo_rl_run.py")
    nemo_rl_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nemo_rl_run)
    trained = {"a": torch.ones(2), "b": torch.zeros(3), "gone": torch.ones(1)}
    resumed = {"a": torch.ones(2), "b": torch.tensor([0.0, -0.5, 0.0]), "new": torch.ones(1)}
    assert nemo_rl_run.state_differences(trained, resumed) == dict(
        missing=["gone"], extra=["new"], values={"b": 0.5})
    assert nemo_rl_run.state_differences(trained, {k: v.clone() for k, v in trained.items()}) \
        == dict(missing=[], extra=[], values={})
    model = torch.nn.BatchNorm1d(2)
    assert sorted(nemo_rl_run.model_state(model)) == [
        "bias", "num_batches_tracked", "running_mean", "running_var", "weight"]


@pytest.mark.once_per_venv
def test_batch_invariance_probe_refuses_megatrons_mode_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the mode runs")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "batch_invariance_probe.py"),
                           "--tiny", "--megatron-mode", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--megatron-mode: Megatron's batch-invariant kernels need a CUDA GPU" in proc.stderr


@pytest.mark.once_per_venv
def test_batch_invariance_cost_refuses_without_a_gpu(tmp_path):
    """The mode's cost is a GPU measurement (Megatron's kernels run on CUDA only): on the CPU the
    benchmark says so and exits 2, writing nothing."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the benchmark runs")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "batch_invariance_cost.py"),
                           "--shape", "tiny", "--out-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU: Megatron's batch-invariant kernels run on CUDA only" in proc.stderr
    assert not (tmp_path / "out").exists()


@BENCH_SMOKE
def test_bench_host_time_smoke(tmp_path):
    stdout = run_benchmark("bench_host_time.py", "--out-dir", str(tmp_path), "--experts", "8",
                           "--rows", "16", "--rounds", "2", "--calls", "2")
    assert "| call | us per call, median (min–max) of the rounds |" in stdout
    for call in ("`linear_fc1.packed()`", "forward (no grad)", "forward + input gradient"):
        assert f"| {call} | " in stdout
    report = json.loads((tmp_path / "host_time.json").read_text())
    rounds = {call: values for call, values in report.items() if call != "header"}
    assert len(rounds) == 3 and all(len(v) == 2 and min(v) > 0 for v in rounds.values()), rounds


def test_bench_host_time_refuses_bad_arguments(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_host_time.py"),
                           "--out-dir", str(tmp_path), "--rounds", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--rounds" in proc.stderr


def test_bridge_finetune_report_from_results_names_each_arm_and_checks_the_resume(tmp_path):
    """bridge_finetune_run.py --from-results: each arm named (ours, stock, stock with TE's
    CUTLASS grouped GEMM), its median against TEGroupedMLP's, the loss and resume differences,
    and our experts' log line; a resumed loss off by more than 1e-3 fails the run."""
    def record(phase, ms, losses, experts):
        steps = [dict(step=i + 1, ms=m, loss=loss) for i, (m, loss) in enumerate(zip(ms, losses))]
        (tmp_path / f"{phase}.json").write_text(json.dumps(dict(
            model=dict(experts=[experts], trained=32, expert_weights_trained=0), steps=steps,
            peak_gib=9.0 if experts == "TorchGroupedMLP" else 9.7)))
        line = ("INFO:mcore_torch_experts: rank 0 runs TorchGroupedMLP experts in 4 MoE layer(s)"
                if experts == "TorchGroupedMLP" else "")
        (tmp_path / f"{phase}.log").write_text(f"torchrun ...\n\n{line}\n")

    losses = [10.70, 10.60, 10.50, 10.40]
    record("te", [900, 700, 710, 720], losses, "TEGroupedMLP")
    record("te-cutlass", [800, 600, 610, 620], losses, "TEGroupedMLP")
    record("torch", [500, 270, 280, 290], losses, "TorchGroupedMLP")
    record("torch-first-half", [500, 270], losses[:2], "TorchGroupedMLP")
    record("torch-resumed", [500, 270], losses[2:], "TorchGroupedMLP")
    stdout = run_benchmark("bridge_finetune_run.py", "--out-dir", str(tmp_path), "--iters", "4",
                           "--skip", "1", "--from-results")
    assert "| stock | TEGroupedMLP | 710.0 (700.0–720.0) |" in stdout, stdout
    assert "| stock, NVTE_USE_CUTLASS_GROUPED_GEMM=1 | TEGroupedMLP | 610.0 (600.0–620.0) |" \
        in stdout
    assert "| ours | TorchGroupedMLP | 280.0 (270.0–290.0) |" in stdout
    summary = json.loads((tmp_path / "bridge_finetune.json").read_text())["summary"]
    assert summary["ms_ours"] == 280.0 and summary["ms_cutlass"] == 610.0
    assert summary["resume_diff"] == 0.0 and summary["loss_diff"] == 0.0 and summary["ok"]

    record("torch-resumed", [500, 270], [10.50, 10.45], "TorchGroupedMLP")   # adapters lost
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bridge_finetune_run.py"),
                           "--out-dir", str(tmp_path), "--iters", "4", "--skip", "1",
                           "--from-results"], cwd=REPO, capture_output=True, text=True,
                          timeout=BENCHMARK_TIMEOUT_S)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not json.loads((tmp_path / "bridge_finetune.json").read_text())["summary"]["ok"]
