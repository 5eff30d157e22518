"""Train LoRA adapters on a frozen GPT-MoE whose experts run through torch grouped GEMM, under
full activation recompute.

    python examples/finetune_lora.py [--steps 300] [--recompute-method uniform|block]
                                     [--expert-adapter per_expert|shared] [--out-dir DIR]
                                     [--transformer-engine]
    python tests/support/run_on_cpu.py examples/finetune_lora.py [...]   (a host without CUDA)

1. builds a small GPT-MoE from the reference spec with moe_expert_gemm_backend="torch"
2. checks its first MoE layer against the same layer with Megatron's SequentialMLP experts
3. freezes the base, adds LoRA to linear_qkv/linear_proj/linear_fc1/linear_fc2, recomputes fully
4. shows the step-1 adapter gradients with the frozen-input guard, and without it
5. trains on a synthetic language (sequences counting up by a step of 1, 2, 3 or 5 mod V)
6. saves the adapters, reloads them into a freshly built model, checks the loss matches
7. writes losses.csv and loss_curve.png (when matplotlib is importable) under --out-dir

CPU: FP32, a couple of minutes on two cores. GPU: BF16 base, FP32 adapter weights;
--transformer-engine builds every layer from Megatron's TE spec (TE attention and linears).
"""

import argparse
import csv
import dataclasses
import importlib.util
import math
import time
from pathlib import Path

import torch
from megatron.core.models.gpt import GPTModel

from mcore_torch_experts import TorchExpertsTransformerConfig, TorchGroupedMLP, build_moe_layer
from mcore_torch_experts.lora import (
    apply_lora,
    load_lora_state_dict,
    lora_parameters,
    lora_state_dict,
)
from mcore_torch_experts.megatron.model import build_gpt_model
from mcore_torch_experts.specs import get_gpt_decoder_block_spec
from single_process import init_megatron, shutdown_megatron

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
STEPS = (1, 2, 3, 5)  # the synthetic language: x[t+1] = (x[t] + step) mod vocab


def seed_everything(seed: int) -> None:
    """The same seed gives the same base model (the "base checkpoint" of this example)."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def make_config(args, dtype) -> TorchExpertsTransformerConfig:
    return TorchExpertsTransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_moe_experts=args.experts, moe_ffn_hidden_size=args.ffn, ffn_hidden_size=args.ffn,
        moe_router_topk=args.topk, moe_grouped_gemm=True, moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(), moe_expert_gemm_backend="torch",
        recompute_granularity="full", recompute_method=args.recompute_method,
        recompute_num_layers=1 if args.recompute_method == "uniform" else args.layers // 2)


class CountingLanguage:
    """Batches of sequences that count up from a random start by a per-sequence step."""

    def __init__(self, vocab: int, seq: int, batch: int, device, seed: int):
        self.vocab, self.seq, self.batch, self.device = vocab, seq, batch, device
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self):
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=self.generator)
        step = torch.tensor(STEPS)[torch.randint(0, len(STEPS), (self.batch, 1),
                                                 generator=self.generator)]
        tokens = (start + step * torch.arange(self.seq + 1)) % self.vocab
        return tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device)


def lm_loss(model, tokens, labels) -> torch.Tensor:
    batch, seq = tokens.shape
    positions = torch.arange(seq, device=tokens.device).expand(batch, seq)
    causal = torch.ones(1, 1, seq, seq, device=tokens.device).triu(1).bool()
    return model(tokens, positions, causal, labels=labels).float().mean()


@torch.no_grad()
def eval_loss(model, batches) -> float:
    model.eval()
    loss = sum(lm_loss(model, *b).item() for b in batches) / len(batches)
    model.train()
    return loss


def check_against_sequential_mlp(model, config, device) -> None:
    """Layer 0's MoE layer vs the same layer (router and expert weights) with SequentialMLP."""
    ours = model.decoder.layers[0].mlp
    reference_config = dataclasses.replace(config, moe_expert_gemm_backend="transformer_engine",
                                           moe_grouped_gemm=False)
    reference = build_moe_layer(reference_config).to(device)
    reference.router.load_state_dict(ours.router.state_dict())
    with torch.no_grad():
        for i, expert in enumerate(reference.experts.local_experts):
            expert.linear_fc1.weight.copy_(getattr(ours.experts.linear_fc1, f"weight{i}"))
            expert.linear_fc2.weight.copy_(getattr(ours.experts.linear_fc2, f"weight{i}"))
    reference.requires_grad_(False)
    x = torch.randn(64, 4, config.hidden_size, dtype=config.params_dtype, device=device)
    grad = torch.randn_like(x)
    results = []
    for layer in (ours, reference):
        inp = x.clone().requires_grad_(True)
        out, _ = layer(inp)
        out.backward(grad)
        results.append((out.detach().float(), inp.grad.float()))
    (out, grad_in), (ref_out, ref_grad_in) = results
    rel = lambda a, b: float((a - b).norm() / b.norm())
    print(f"[check] MoE layer 0, {type(ours.experts).__name__} ({ours.experts.grouped_mm_name}) vs "
          f"SequentialMLP, same weights: output rel. L2 error {rel(out, ref_out):.2e}, "
          f"input-gradient rel. L2 error {rel(grad_in, ref_grad_in):.2e}")


def b_gradient_norms(model, tokens, labels) -> dict:
    """{(layer, target): |dL/dB| or None} after one backward (A's gradient is zero while B = 0)."""
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model, tokens, labels)
    if loss.requires_grad:
        loss.backward()
    norms = {}
    for name, p in lora_parameters(model).items():
        if name.endswith("linear_out.weight"):
            layer = int(name.split("layers.")[1].split(".")[0])
            target = name.split(".adapter.")[0].rsplit(".", 1)[1]
            norms[layer, target] = None if p.grad is None else float(p.grad.norm())
    model.zero_grad(set_to_none=True)
    return norms


def show_step1_gradients(model, unguarded, batch, method) -> None:
    guarded, plain = b_gradient_norms(model, *batch), b_gradient_norms(unguarded, *batch)
    fmt = lambda v: "   none " if not v else f"{v:8.2e}"
    print(f"[grad] step-1 |dL/dB| per adapter, full recompute '{method}' "
          "(A's gradient is 0 while B starts at 0):")
    print("       layer " + " ".join(f"{t:>11}" for t in TARGETS) + "   | without the guard")
    for layer in sorted({layer for layer, _ in guarded}):
        row = " ".join(f"{fmt(guarded[layer, t]):>11}" for t in TARGETS)
        bare = " ".join(fmt(plain[layer, t]) for t in TARGETS)
        print(f"       {layer:5d} {row}   | {bare}")
    starved = lambda norms: sum(1 for v in norms.values() if not v)
    print(f"[grad] adapters without gradient: {starved(guarded)}/{len(guarded)} with the guard, "
          f"{starved(plain)}/{len(plain)} without it")


def progress(step, total, loss, tokens_per_s, elapsed) -> str:
    filled = round(24 * step / total)
    return (f"[{'#' * filled}{'.' * (24 - filled)}] {step:4d}/{total} loss {loss:6.3f} "
            f"{tokens_per_s:8,.0f} tok/s {elapsed:6.1f}s")


def save_loss_curve(losses, out_dir: Path) -> str:
    with open(out_dir / "losses.csv", "w", newline="") as f:
        csv.writer(f).writerows([("step", "loss"), *enumerate(losses, start=1)])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib not importable: loss_curve.png skipped ({out_dir / 'losses.csv'})"
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=1)
    ax.set(xlabel="step", ylabel="training loss", title="LoRA on a frozen GPT-MoE, full recompute")
    fig.tight_layout()
    fig.savefig(out_dir / "loss_curve.png", dpi=120)
    return str(out_dir / "loss_curve.png")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--vocab", type=int, default=128, help="vocabulary size (default 128)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--ffn", type=int, default=256,
                        help="each expert's FFN hidden size (default 256)")
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer (default 8)")
    parser.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--alpha", type=float, default=32.0,
                        help="LoRA alpha: the update is scaled by alpha / rank (default 32)")
    parser.add_argument("--lr", type=float, default=2e-3,
                        help="Adam learning rate of the adapters (default 2e-3)")
    parser.add_argument("--expert-adapter", choices=["per_expert", "shared"], default="per_expert",
                        help="one adapter per expert, or one shared by a layer's experts "
                             "(default per_expert)")
    parser.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform",
                        help="Megatron's full-recompute method (default uniform)")
    parser.add_argument("--seed", type=int, default=1234, help="random seed (default 1234)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/finetune_lora"),
                        help="where losses.csv, loss_curve.png and the adapters go "
                             "(default runs/finetune_lora)")
    parser.add_argument("--transformer-engine", action="store_true",
                        help="every layer from Megatron's TE spec (TE attention and linears); "
                             "needs Transformer Engine and a CUDA device")
    args = parser.parse_args()
    if args.transformer_engine and not (torch.cuda.is_available()
                                        and importlib.util.find_spec("transformer_engine")):
        parser.error("--transformer-engine needs Transformer Engine and a CUDA device")

    init_megatron()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = make_config(args, dtype)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def fresh_model(guard=True):
        """The frozen base (same seed, same weights) with fresh LoRA adapters."""
        seed_everything(args.seed)
        if guard:
            model = build_gpt_model(config, vocab_size=args.vocab, max_sequence_length=args.seq,
                                    use_transformer_engine=args.transformer_engine)
        else:  # Megatron's own path, for the comparison
            spec = get_gpt_decoder_block_spec(config,
                                              use_transformer_engine=args.transformer_engine)
            model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                             max_sequence_length=args.seq)
        return model.to(device=device, dtype=dtype)  # as Megatron's Float16Module casts it

    model = fresh_model()
    experts = sum(isinstance(m, TorchGroupedMLP) for m in model.modules())
    modules = "Megatron's TE spec" if args.transformer_engine else "local modules"
    print(f"[model] GPT-MoE on {device} ({dtype}, {modules}): {args.layers} layers, "
          f"hidden {args.hidden}, {args.experts} experts top-{args.topk} (SwiGLU, ffn {args.ffn}), "
          f"vocab {args.vocab}; {experts} TorchGroupedMLP modules")
    model.requires_grad_(False)  # the frozen base (apply_lora freezes it too)
    check_against_sequential_mlp(model, config, device)

    adapter_kwargs = dict(rank=args.rank, alpha=args.alpha, expert_adapter=args.expert_adapter,
                          dtype=torch.float32)
    wrapped = apply_lora(model, TARGETS, **adapter_kwargs)
    trainable = list(lora_parameters(model).values())
    total = sum(p.numel() for p in model.parameters())
    print(f"[lora] {len(wrapped)} linears wrapped (experts: {args.expert_adapter}), rank "
          f"{args.rank}, alpha {args.alpha}: {sum(p.numel() for p in trainable):,} trainable of "
          f"{total:,} parameters; full recompute '{args.recompute_method}' "
          f"({config.recompute_num_layers} layer(s) per checkpoint)")

    corpus = CountingLanguage(args.vocab, args.seq, args.batch, device, seed=args.seed)
    held_out = [CountingLanguage(args.vocab, args.seq, args.batch, device, seed=0).sample()
                for _ in range(4)]
    unguarded = fresh_model(guard=False)
    apply_lora(unguarded, TARGETS, **adapter_kwargs)
    load_lora_state_dict(unguarded, lora_state_dict(model))
    show_step1_gradients(model, unguarded, corpus.sample(), args.recompute_method)
    del unguarded

    base_loss = eval_loss(model, held_out)
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (  # warmup, then cosine
        min(1.0, (s + 1) / 20) * (1 + math.cos(math.pi * s / args.steps)) / 2))
    tokens_per_step = args.batch * args.seq
    log_every = max(1, args.steps // 15)
    losses = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = lm_loss(model, *corpus.sample())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - start
            recent = sum(losses[-log_every:]) / len(losses[-log_every:])
            print(progress(step, args.steps, recent, step * tokens_per_step / elapsed, elapsed),
                  flush=True)
    train_time = time.perf_counter() - start
    tuned_loss = eval_loss(model, held_out)

    checkpoint = args.out_dir / "adapters.pt"
    torch.save(lora_state_dict(model), checkpoint)
    reloaded = fresh_model()
    apply_lora(reloaded, TARGETS, **adapter_kwargs)
    reloaded_base_loss = eval_loss(reloaded, held_out)
    load_lora_state_dict(reloaded, torch.load(checkpoint, map_location=device))
    reloaded_loss = eval_loss(reloaded, held_out)
    curve = save_loss_curve(losses, args.out_dir)

    print(f"[save] {len(lora_state_dict(model))} adapter tensors -> {checkpoint} "
          f"({checkpoint.stat().st_size / 2**20:.1f} MiB)")
    print(f"[reload] fresh base: held-out loss {reloaded_base_loss:.4f} (trained model's base: "
          f"{base_loss:.4f}); with the saved adapters: {reloaded_loss:.4f} (trained model: "
          f"{tuned_loss:.4f}) -> {'match' if reloaded_loss == tuned_loss else 'MISMATCH'}")
    print("[summary]")
    print(f"  steps {args.steps}, {args.steps * tokens_per_step:,} tokens in {train_time:.1f}s "
          f"({args.steps * tokens_per_step / train_time:,.0f} tok/s) on {device}")
    print(f"  training loss {losses[0]:.3f} -> {sum(losses[-10:]) / len(losses[-10:]):.3f} "
          f"(uniform guess: ln {args.vocab} = {math.log(args.vocab):.3f}; knowing the step: 0)")
    print(f"  held-out loss {base_loss:.3f} (frozen base) -> {tuned_loss:.3f} (with adapters)")
    print(f"  adapters reloaded into a fresh model: "
          f"{'same loss' if reloaded_loss == tuned_loss else 'DIFFERENT loss'}")
    print(f"  loss curve: {curve}")
    if reloaded_loss != tuned_loss or not tuned_loss < base_loss:
        raise SystemExit("finetune_lora: the adapters did not train or did not reload")


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown_megatron()
