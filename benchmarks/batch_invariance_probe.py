"""Is each piece of our expert path batch-invariant? A probe batch of tokens is computed alone and
inside larger batches (the same tokens among 7x others, among thousands, with the others skewed
onto two experts); the probe tokens' results are compared bit for bit. Also run twice in the same
batch (run to run).

Pieces (frozen BF16 expert weights, rows sorted by expert as Megatron's permute leaves them, the
probe tokens in the middle of the token order so that other rows come before and after theirs):
- `grouped_mm fc1`: torch grouped GEMM forward, x [N, H] @ W1[e].T, and its input gradient;
- `grouped path`: fc1 -> SwiGLU (or squared ReLU) * probs -> fc2 with torch grouped GEMM, the
  output and the input and probs gradients;
- `fused kernels`: the same through our Triton kernels (`fused_experts`), without an adapter and
  with a shared or per-expert LoRA adapter on both linears (output, input and probs gradients);
- `shared LoRA down`: scale * x @ A.T over all rows (a shared factor), as a plain matmul and as
  one group of the frozen grouped GEMM;
- `fp32 combine`: each token's rows summed in FP32 (torch chunked and triton backends);
- a control that is not ours (each row minus the batch's mean row): it must come out
  batch-dependent, or the probe is broken (exit 1).

`--megatron-mode`: every piece inside megatron-core 0.20's `set_batch_invariant_mode(True,
backend="triton")`, which routes `aten::mm`/`addmm` (the shared factors' matmuls) through its
batch-invariant Triton matmul, as Megatron's `batch_invariant_mode` does for the whole run.

    python3 benchmarks/batch_invariance_probe.py --out-dir OUT [--tiny] [--megatron-mode]
        [--pieces ...]

Prints and writes a table: piece, shape, context, output / gradients bitwise equal to the probe
alone, max abs difference where not.
"""

import argparse
import contextlib
import math
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu

import harness

SHAPES = {  # name: experts, hidden, expert ffn, top-k, gated (SwiGLU) or squared ReLU
    "qwen3-30b-a3b": (128, 2048, 768, 8, True),
    "super-like": (128, 4096, 2688, 22, False),
    "deepseek-v3-ep8": (32, 7168, 2048, 8, True),
}
TINY = {"tiny": (8, 64, 32, 2, True), "tiny-squared-relu": (8, 64, 32, 2, False)}
CONTEXTS = {  # name: other tokens per probe token, skewed onto two experts
    "among 7x others": (7, False),
    "among thousands": (256, False),
    "skewed, thousands": (256, True),
}
PROBE_TOKENS, RANK = 16, 16
CONTROL = "control (subtracts the batch mean)"




def routing(num_probe, num_other, experts, topk, skewed, generator):
    """Rows (token, expert) sorted by expert then token, the probe tokens in the middle of the
    token order; their first expert is never used by the probe (an expert with no probe row)."""
    before = num_other // 2
    probe_generator = torch.Generator().manual_seed(7)   # the probe's routing in every batch
    tokens = []
    for token in range(num_other + num_probe):
        probe = before <= token < before + num_probe
        if skewed and not probe:
            choice = torch.tensor([0, 1] + torch.randperm(experts - 2, generator=generator)[
                :topk - 2].add(2).tolist())
        else:
            choice = torch.randperm(experts - 1, generator=probe_generator if probe
                                    else generator)[:topk] + (1 if probe else 0)
        tokens += [(token, int(e)) for e in choice]
    rows = sorted(tokens, key=lambda te: (te[1], te[0]))
    token_of_row = torch.tensor([t for t, _ in rows])
    expert_of_row = torch.tensor([e for _, e in rows])
    is_probe = (token_of_row >= before) & (token_of_row < before + num_probe)
    counts = torch.bincount(expert_of_row, minlength=experts)
    return token_of_row, expert_of_row, is_probe, counts, before


def batch(shape, num_other, skewed, device, seed=0):
    """One batch's tensors, the probe tokens' values the same in every batch (drawn from their
    own generator, by token and expert)."""
    experts, hidden, ffn, topk, _ = shape
    gen = torch.Generator().manual_seed(seed + 1000 * num_other + skewed)
    token_of_row, expert_of_row, is_probe, counts, before = routing(
        PROBE_TOKENS, num_other, experts, topk, skewed, gen)
    num_tokens = num_other + PROBE_TOKENS
    probe_gen = torch.Generator().manual_seed(seed)
    probe_x = torch.randn(PROBE_TOKENS, hidden, generator=probe_gen)
    probe_values = torch.randn(PROBE_TOKENS, experts, hidden + 1, generator=probe_gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    x[before:before + PROBE_TOKENS] = probe_x
    values = torch.randn(token_of_row.numel(), hidden + 1, generator=gen)   # grad rows, probs
    probe_rows = is_probe.nonzero().squeeze(1)
    values[probe_rows] = probe_values[token_of_row[probe_rows] - before,
                                      expert_of_row[probe_rows]]
    to = dict(device=device)
    return SimpleNamespace(
        x_tokens=x.to(**to, dtype=torch.bfloat16),
        rows=x[token_of_row].to(**to, dtype=torch.bfloat16),
        grad_rows=values[:, :hidden].to(**to, dtype=torch.bfloat16),
        probs=values[:, hidden].sigmoid().to(**to, dtype=torch.float32),
        offs=counts.cumsum(0).to(**to, dtype=torch.int32),
        token_of_row=token_of_row.to(**to), probe_rows=probe_rows.to(**to),
        probe_tokens=slice(before, before + PROBE_TOKENS), num_tokens=num_tokens,
        rows_total=token_of_row.numel())


def weights(shape, device):
    experts, hidden, ffn, _, gated = shape
    gen = torch.Generator().manual_seed(1)
    w1 = torch.randn(experts, ffn * (2 if gated else 1), hidden, generator=gen) / math.sqrt(hidden)
    w2 = torch.randn(experts, hidden, ffn, generator=gen) / math.sqrt(ffn)
    lora = {}
    for name, lead in (("shared", ()), ("per_expert", (experts,))):
        lora[name] = [
            (torch.randn(*lead, RANK, hidden, generator=gen) / math.sqrt(hidden),
             torch.randn(*lead, w1.shape[1], RANK, generator=gen) * 0.1),
            (torch.randn(*lead, RANK, ffn, generator=gen) / math.sqrt(ffn),
             torch.randn(*lead, hidden, RANK, generator=gen) * 0.1)]
    to = dict(device=device, dtype=torch.bfloat16)
    return (w1.to(**to), w2.to(**to),
            {k: [(a.to(**to), b.to(**to)) for a, b in v] for k, v in lora.items()})


def activation(shape):
    """SwiGLU's SiLU or Megatron's squared ReLU: the function objects the fused kernels are
    keyed by."""
    return F.silu if shape[4] else squared_relu


def grouped_fc1(b, w1, w2, shape, lora):
    from mcore_torch_experts.kernels.grouped_gemm import frozen_grouped_linear

    x = b.rows.clone().requires_grad_(True)
    y = frozen_grouped_linear(x, w1, b.offs)
    y.backward(torch.ones_like(y) * b.grad_rows[:, :1])
    return {"out": y[b.probe_rows], "d x": x.grad[b.probe_rows]}


def grouped_path(b, w1, w2, shape, lora):
    from mcore_torch_experts.kernels.grouped_gemm import frozen_grouped_linear

    x = b.rows.clone().requires_grad_(True)
    probs = b.probs.clone().requires_grad_(True)
    h = frozen_grouped_linear(x, w1, b.offs)
    if shape[4]:
        gate, up = h.chunk(2, dim=-1)
        inter = F.silu(gate) * up
    else:
        inter = squared_relu(h)
    y = frozen_grouped_linear((inter * probs[:, None]).to(x.dtype), w2, b.offs)
    y.backward(b.grad_rows)
    return {"out": y[b.probe_rows], "d x": x.grad[b.probe_rows],
            "d probs": probs.grad[b.probe_rows]}


def fused(adapter):
    def run(b, w1, w2, shape, lora):
        from mcore_torch_experts.kernels.fused_experts import LoRATerm, fused_experts

        config = SimpleNamespace(activation_func=activation(shape), gated_linear_unit=shape[4],
                                 glu_linear_offset=0.0, activation_func_clamp_value=None)
        terms = [None, None]
        if adapter:
            terms = [LoRATerm(a.clone().requires_grad_(True), bb.clone().requires_grad_(True),
                              2.0) for a, bb in lora[adapter]]
        x = b.rows.clone().requires_grad_(True)
        probs = b.probs.clone().requires_grad_(True)
        y = fused_experts(config, x, probs, w1, w2, b.offs, *terms)
        y.backward(b.grad_rows)
        return {"out": y[b.probe_rows], "d x": x.grad[b.probe_rows],
                "d probs": probs.grad[b.probe_rows]}
    return run


def shared_lora_down(b, w1, w2, shape, lora):
    a = lora["shared"][0][0]
    return {"out": (F.linear(b.rows, a) * 2.0)[b.probe_rows]}


def shared_lora_down_grouped(b, w1, w2, shape, lora):
    """The same product as one group of the frozen grouped GEMM (the factor as a 1-expert
    weight): a candidate for the batch-invariant mode, where a plain matmul is not."""
    from mcore_torch_experts.kernels.grouped_gemm import frozen_grouped_linear

    x = b.rows.clone().requires_grad_(True)
    offs = torch.tensor([x.shape[0]], dtype=torch.int32, device=x.device)
    y = frozen_grouped_linear(x, lora["shared"][0][0][None], offs) * 2.0
    y.backward(b.grad_rows[:, :y.shape[1]])
    return {"out": y[b.probe_rows], "d x": x.grad[b.probe_rows]}


def combine(backend):
    def run(b, w1, w2, shape, lora):
        from mcore_torch_experts.combine import fp32_combine

        y = fp32_combine(b.grad_rows, b.token_of_row, b.num_tokens, probs=b.probs,
                         backend=backend)
        return {"out": y[b.probe_tokens]}
    return run


def control(b, w1, w2, shape, lora):
    """Not ours: each row minus the batch's mean row, which no batch-invariant piece could be.
    It shows the probe finds a batch dependence."""
    return {"out": (b.rows.float() - b.rows.float().mean(0))[b.probe_rows]}


PIECES = {
    CONTROL: control,
    "grouped_mm fc1": grouped_fc1,
    "grouped path": grouped_path,
    "fused kernels": fused(None),
    "fused kernels + shared LoRA": fused("shared"),
    "fused kernels + per-expert LoRA": fused("per_expert"),
    "shared LoRA down (matmul)": shared_lora_down,
    "shared LoRA down (grouped_mm)": shared_lora_down_grouped,
    "fp32 combine (torch)": combine("torch"),
    "fp32 combine (triton)": combine("triton"),
}


def compare(alone: dict, other: dict) -> str:
    """'bitwise' or the largest difference, per output."""
    notes = []
    for name, value in alone.items():
        if torch.equal(value, other[name]):
            notes.append(f"{name} bitwise")
        else:
            diff = (value.double() - other[name].double()).abs().max().item()
            notes.append(f"**{name} differs** ({diff:.1e})")
    return ", ".join(notes)


def measure(args, pieces, device) -> tuple:
    """The probe's rows (piece, shape, batch, comparison) and each piece's verdict."""
    shapes = TINY if args.tiny else SHAPES
    contexts = {"among 7x others": (7, False), "skewed": (7, True)} if args.tiny else CONTEXTS
    rows, verdicts = [], {}
    for shape_name, shape in shapes.items():
        w1, w2, lora = weights(shape, device)
        alone = batch(shape, 0, False, device)
        batches = {name: batch(shape, PROBE_TOKENS * n, skewed, device)
                   for name, (n, skewed) in contexts.items()}
        for piece in pieces:
            fn = PIECES[piece]
            try:
                reference = fn(alone, w1, w2, shape, lora)
            except Exception as exc:   # a piece that cannot run here is reported, not hidden
                rows.append([piece, shape_name, "alone", harness.error_note(exc)])
                verdicts[piece] = False
                continue
            rows.append([piece, shape_name, "run to run (alone)",
                         compare(reference, fn(alone, w1, w2, shape, lora))])
            for context, other in batches.items():
                note = compare(reference, fn(other, w1, w2, shape, lora))
                rows.append([piece, shape_name, f"{context} ({other.rows_total:,} rows)", note])
                verdicts[piece] = verdicts.get(piece, True) and "differs" not in note
            del reference
    return rows, verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--tiny", action="store_true", help="one tiny shape (a smoke run)")
    parser.add_argument("--pieces", default=",".join(PIECES),
                        help=f"comma-separated, of: {', '.join(PIECES)}")
    parser.add_argument("--megatron-mode", action="store_true",
                        help="every piece under Megatron's batch-invariant kernels (0.20+)")
    args = parser.parse_args()
    pieces = args.pieces.split(",")
    unknown = sorted(set(pieces) - set(PIECES))
    if unknown:
        parser.error(f"--pieces: unknown piece(s) {unknown}; choose from {list(PIECES)}")
    if not torch.cuda.is_available():
        if args.megatron_mode:
            parser.error("--megatron-mode: Megatron's batch-invariant kernels need a CUDA GPU")
        harness.rerun_with_cpu_env()   # the Triton pieces in the interpreter
    mode = contextlib.nullcontext()
    if args.megatron_mode:
        try:
            from megatron.core.transformer.custom_layers.batch_invariant_kernels import (
                set_batch_invariant_mode,
            )
        except ImportError as exc:
            parser.error(f"--megatron-mode: this megatron-core has no batch-invariant kernels "
                         f"(0.20 or newer has them): {exc}")
        mode = set_batch_invariant_mode(True, backend="triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with mode:
        rows, verdicts = measure(args, pieces, device)
    header = harness.header(device, packages=("triton", "megatron-core"))
    if args.megatron_mode:
        header.append("every piece inside megatron-core's set_batch_invariant_mode(True, "
                      "backend='triton')")
    body = [f"{PROBE_TOKENS} probe tokens (their values, routing and gradients the same in every "
            f"batch), LoRA rank {RANK}; each piece run on the probe tokens alone, then inside "
            "each larger batch; the probe tokens' results compared bit for bit.", ""]
    body += harness.markdown_table(["piece", "shape", "batch", "probe tokens vs alone"], rows)
    body += ["", "Batch-invariant in every shape and batch: " + ", ".join(
        f"{piece} {'yes' if ok else 'NO'}" for piece, ok in verdicts.items())]
    control_seen = verdicts.get(CONTROL) is False or CONTROL not in verdicts
    if not control_seen:
        body += ["", f"PROBE BROKEN: the control ({CONTROL}) came out batch-invariant"]
    text = harness.write_report(harness.Path(args.out_dir), "batch_invariance",
                                "Batch invariance of the expert path", header, body,
                                {"rows": rows, "verdicts": verdicts})
    print(text)
    sys.exit(0 if control_seen else 1)


if __name__ == "__main__":
    main()
