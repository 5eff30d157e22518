"""Kernels from the field against torch's grouped GEMM, on the frozen experts' own work.

One experts MLP with frozen BF16 weights, as the MoE layer runs it: gather the routed rows of
the tokens (the permutation), fc1, the activation times the probs (FP32 probs), fc2; the update
pass adds the input gradients (of the tokens and of the probs; frozen weights need none). Every
arm computes that same function at each shape of shapes.py:

- grouped_mm: torch's grouped GEMM (`torch._grouped_mm`) in eager ops, the gather a copy;
- compiled: the same function under `torch.compile(mode=--compile-mode)`;
- fused_gemm: this package's Triton kernels (`kernels.fused_experts`), the gather a copy;
- quack: quack-kernels' varlen-M GEMMs (`gemm_act`, `gemm`, `gemm_dact` with the probs as a
  column scale and their gradient as a column reduction), the gather a copy;
- quack_gather: the same with fc1 reading the tokens through the row index (`A_idx`).

Each arm is checked against an FP32 evaluation of the same function (rel-L2 of the output and of
both input gradients). CUDA events, median of --reps after warm-ups, the arms interleaved over
--rounds; the table gives the median over rounds and each arm's ratio to grouped_mm. An arm that
cannot run here (not installed, no GPU) says why in its row.

    python benchmarks/bench_field_kernels.py --out-dir runs/field
    python benchmarks/bench_field_kernels.py --tiny --out-dir runs/field   # CPU smoke
"""

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from harness import (
    REPO_ROOT,
    error_note,
    fmt,
    markdown_table,
    median_ms,
    rerun_with_cpu_env,
    version,
    write_report,
)
from harness import header as bench_header
from shapes import SHAPES, TINY_SHAPES, make_splits

GROUPED, COMPILED, FUSED, QUACK, QUACK_GATHER = ARMS = (
    "grouped_mm", "compiled", "fused_gemm", "quack", "quack_gather")
ARM_TITLES = {GROUPED: "grouped_mm (torch, eager)", COMPILED: "grouped_mm under torch.compile",
              FUSED: "fused_gemm (this package)", QUACK: "quack",
              QUACK_GATHER: "quack, fc1 gathers the rows"}
QUACK_ACT = {("squared_relu", False): "relu_sq", ("silu", True): "swiglu"}


class Problem:
    """One shape's inputs: tokens [T, H], the row index [R] (rows grouped by expert), FP32 probs
    [R], frozen w1 [E, N1, H] and w2 [E, H, F], the group offsets [E] (int32, cumulative)."""

    def __init__(self, shape, routing, device, seed, zipf=1.0):
        gen = torch.Generator().manual_seed(seed)
        self.shape, self.glu = shape, shape.glu
        rows, experts, hidden, ffn = shape.rows, shape.experts, shape.hidden, shape.ffn
        self.tokens = max(1, rows // 8)
        counts = make_splits(rows, experts, routing, zipf, seed)
        bf16 = dict(dtype=torch.bfloat16)
        self.x = torch.randn(self.tokens, hidden, generator=gen, **bf16).to(device)
        self.index = torch.randint(self.tokens, (rows,), generator=gen).to(device)
        self.probs = torch.rand(rows, generator=gen).to(device)
        width = ffn * (2 if shape.glu else 1)
        self.w1 = (torch.randn(experts, width, hidden, generator=gen) * hidden ** -0.5).to(
            device, torch.bfloat16)
        self.w2 = (torch.randn(experts, hidden, ffn, generator=gen) * ffn ** -0.5).to(
            device, torch.bfloat16)
        self.offs = counts.cumsum(0).to(device, torch.int32)
        self.grad = torch.randn(rows, hidden, generator=gen, **bf16).to(device)

    def activation(self, h):
        if self.glu:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.relu(h).square()


def chain(problem, grouped_mm):
    """x [T, H], probs [R] -> [R, H] in torch ops over `grouped_mm`, the gather a copy."""
    def run(x, probs):
        h = grouped_mm(x[problem.index], problem.w1.mT, offs=problem.offs)
        inter = (problem.activation(h.float()) * probs[:, None]).to(x.dtype)
        return grouped_mm(inter, problem.w2.mT, offs=problem.offs)
    return run


def reference(problem):
    """The FP32 output and input gradients, one expert at a time."""
    x = problem.x.float().requires_grad_()
    probs = problem.probs.clone().requires_grad_()
    starts = [0] + problem.offs.tolist()[:-1]
    out = []
    for e, (lo, hi) in enumerate(zip(starts, problem.offs.tolist())):
        rows = x[problem.index[lo:hi]]
        h = problem.activation(rows @ problem.w1[e].float().t()) * probs[lo:hi, None]
        out.append(h @ problem.w2[e].float().t())
    y = torch.cat(out)
    y.backward(problem.grad.float())
    return y.detach(), x.grad, probs.grad


def autograd_arm(problem, fn):
    """(forward, update) of a differentiable fn(x, probs)."""
    def forward():
        with torch.no_grad():
            return fn(problem.x, problem.probs)

    def update():
        x = problem.x.detach().requires_grad_()
        probs = problem.probs.detach().requires_grad_()
        y = fn(x, probs)
        dx, dprobs = torch.autograd.grad(y, (x, probs), problem.grad)
        return y, dx, dprobs
    return forward, update


def fused_arm(problem):
    from megatron.core.activations import squared_relu

    from mcore_torch_experts.kernels.fused_experts import fused_experts

    class Config:
        activation_func = F.silu if problem.glu else squared_relu
        gated_linear_unit, glu_linear_offset = problem.glu, 0.0
        activation_func_clamp_value = None

    def run(x, probs):
        return fused_experts(Config, x[problem.index], probs, problem.w1, problem.w2,
                             problem.offs)
    return autograd_arm(problem, run)


def quack_arm(problem, gather: bool):
    """quack-kernels' varlen-M GEMMs; gated weights interleaved once ([g0, u0, g1, ...]), as
    quack's gated epilogue reads them (a one-time repack of frozen weights, not timed)."""
    from quack.gemm_interface import gemm, gemm_act, gemm_dact

    act = QUACK_ACT[(problem.shape.activation, problem.glu)]
    w1 = problem.w1
    if problem.glu:
        ffn = problem.shape.ffn
        w1 = torch.stack((w1[:, :ffn], w1[:, ffn:]), dim=2).flatten(1, 2).contiguous()
    cu = torch.cat((problem.offs.new_zeros(1), problem.offs))
    index = problem.index.to(torch.int32)

    def fc1(x):
        rows = dict(A_idx=index) if gather else {}
        preact, postact = gemm_act(x if gather else x[problem.index], w1.mT, activation=act,
                                   cu_seqlens_m=cu, **rows)
        return preact, postact

    def forward():
        _, postact = fc1(problem.x)
        inter = (postact.float() * problem.probs[:, None]).to(postact.dtype)
        return gemm(inter, problem.w2.mT, cu_seqlens_m=cu)

    def update():
        preact, postact = fc1(problem.x)
        inter = (postact.float() * problem.probs[:, None]).to(postact.dtype)
        y = gemm(inter, problem.w2.mT, cu_seqlens_m=cu)
        dpre, _, dprobs = gemm_dact(problem.grad, problem.w2, preact, activation=act,
                                    colvec_scale=problem.probs, colvec_reduce=True,
                                    cu_seqlens_m=cu)
        drows = gemm(dpre, w1, cu_seqlens_m=cu)
        dx = torch.zeros_like(problem.x).index_add_(0, problem.index, drows)
        return y, dx, dprobs
    return forward, update


def build_arm(name, problem, compile_mode):
    """(forward, update), or raise with the reason the arm cannot run here."""
    cuda = problem.x.is_cuda
    if name == GROUPED:
        return autograd_arm(problem, chain(problem, torch._grouped_mm))
    if name == COMPILED:
        if not cuda:
            raise RuntimeError("not available: torch.compile of grouped_mm is timed on CUDA only")
        return autograd_arm(problem, torch.compile(chain(problem, torch._grouped_mm),
                                                   mode=compile_mode, fullgraph=True))
    if name == FUSED:
        return fused_arm(problem)
    if not cuda:
        raise RuntimeError("not available: quack-kernels needs a CUDA GPU (sm90 or newer)")
    if version("quack-kernels") == "not installed":
        raise RuntimeError("not installed: quack-kernels (pip install quack-kernels)")
    try:
        import quack.gemm_interface  # noqa: F401 - its CuTe DSL frontend comes with nvidia-cutlass-dsl
    except ImportError as exc:
        raise RuntimeError(f"not available: quack-kernels {version('quack-kernels')} does not "
                           f"import with nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}: "
                           f"{exc}") from exc
    if (problem.shape.activation, problem.glu) not in QUACK_ACT:
        raise RuntimeError(f"not available: no quack activation for {problem.shape.activation}")
    return quack_arm(problem, gather=name == QUACK_GATHER)


def rel_l2(a, b):
    return float((a.float() - b).norm() / b.norm().clamp_min(1e-30))


def measure(problem, arms, ref, args, device):
    """Per arm: {name, fwd, update (lists of per-round ms), err} or {name, note}."""
    built, rows = {}, {}
    for name in arms:
        try:
            built[name] = build_arm(name, problem, args.compile_mode)
            y, dx, dprobs = built[name][1]()
            errs = [rel_l2(got, want) for got, want in zip((y, dx, dprobs), ref)]
            rows[name] = {"name": name, "fwd": [], "update": [], "err": max(errs)}
        except Exception as exc:  # noqa: BLE001 - the row says why; the traceback goes to stderr
            note = str(exc) if str(exc).startswith("not ") else error_note(exc)
            rows[name] = {"name": name, "note": note}
            built.pop(name, None)
    for _ in range(args.rounds):
        for name, (forward, update) in built.items():
            for kind, fn in (("fwd", forward), ("update", update)):
                ms, _ = median_ms(fn, device, args.warmup, args.reps)
                rows[name][kind].append(ms)
    return list(rows.values())


def report_rows(label, rows):
    base = next((r for r in rows if r["name"] == GROUPED and r.get("fwd")), None)
    lines = []
    for row in rows:
        if "note" in row:
            lines.append([label, ARM_TITLES[row["name"]], "—", "—", "—", "—", "—", row["note"]])
            continue
        cells = [label, ARM_TITLES[row["name"]]]
        for kind in ("fwd", "update"):
            mid = statistics.median(row[kind])
            spread = f" ({min(row[kind]):.3f}–{max(row[kind]):.3f})"
            cells.append(f"{mid:.3f}{spread}")
        for kind in ("fwd", "update"):
            ratio = statistics.median(base[kind]) / statistics.median(row[kind]) if base else None
            cells.append(fmt(ratio, ".2f"))
        cells += [f"{row['err']:.1e}", ""]
        lines.append(cells)
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "runs" / "field")
    parser.add_argument("--shapes", default="super-ep4,qwen3-30b,nano")
    parser.add_argument("--routings", default="uniform,skewed")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, one rep")
    args = parser.parse_args()
    if args.tiny or not torch.cuda.is_available():
        rerun_with_cpu_env()
        args.tiny, args.rounds, args.warmup, args.reps = True, 1, 0, 1
    device = torch.device("cpu" if args.tiny else "cuda")
    catalogue = TINY_SHAPES if args.tiny else SHAPES
    shapes = list(TINY_SHAPES) if args.tiny else args.shapes.split(",")
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS] + [s for s in shapes if s not in catalogue]
    if unknown:
        parser.error(f"unknown arm or shape {unknown}; arms: {list(ARMS)}, "
                     f"shapes: {list(catalogue)}")
    lines, data = [], []
    for name in shapes:
        for routing in args.routings.split(","):
            problem = Problem(catalogue[name], routing, device, args.seed)
            ref = reference(problem)
            print(f"[field] {name} {routing}: {len(arms)} arms x {args.rounds} rounds", flush=True)
            rows = measure(problem, arms, ref, args, device)
            shape_lines = report_rows(f"{name} {routing}", rows)
            print("\n".join("| " + " | ".join(map(str, r)) + " |" for r in shape_lines), flush=True)
            lines += shape_lines
            data.append({"shape": name, "routing": routing, "rows": rows})
    headers = ["shape, routing", "arm", "forward ms", "update ms", "x grouped_mm fwd",
               "x grouped_mm update", "rel err vs FP32", "note"]
    body = ["Median (min–max) over rounds of each round's median; update = forward + the input "
            "gradients of tokens and probs.", ""] + markdown_table(headers, lines)
    head = bench_header(device, packages=("triton", "megatron-core", "quack-kernels",
                                          "nvidia-cutlass-dsl"))
    text = write_report(args.out_dir, "field_kernels", "Kernels from the field: the experts MLP",
                        head, body, {"results": data})
    print(text, flush=True)


if __name__ == "__main__":
    main()
