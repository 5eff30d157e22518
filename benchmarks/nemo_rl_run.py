"""NeMo-RL's own Megatron policy worker on the GPU with Transformer Engine (NeMo-RL main
`7ea279ab`: megatron-core 0.20.0, Megatron-Bridge 0.7.0), as its GRPO loop drives it, with the
worker extension docs/enable.md names (`TorchExpertsMegatronPolicyWorker`) against NeMo-RL's
stock worker (TEGroupedMLP experts, and the same with TE's CUTLASS grouped GEMM).

Each arm is one process (the worker built as its Ray actor would build it, in that process):
NeMo-RL's setup in its own order (HF import with the spec, model and optimizer, reference model)
from one Qwen3-MoE-like HF checkpoint, with the Megatron GRPO recipe and the docs' YAML block
(TE attention and linears, BF16, the alltoall dispatcher, full recompute), then `--steps` GRPO
steps as `grpo.py` runs them: `get_logprobs` (the previous policy's logprobs),
`get_reference_policy_logprobs`, `train` with NeMo-RL's `ClippedPGLossFn`. The PEFT arms of
ours and of the stock worker save with the worker's `save_checkpoint`; a later process
(`torch-resumed`, `stock-resumed`) resumes from that save as NeMo-RL resumes a run
(`CheckpointManager.get_resume_paths`) and must give the trained logprobs. Where a resumed
tensor differs from the trained one, the report says whether it holds its initial value and
whether the checkpoint holds the trained one.

`torch-invariant` (not among the default arms): ours in Megatron's batch_invariant_mode, set as
docs/enable.md tells a NeMo-RL user (its `nemo-rl-batch-invariant` block, with the
FlashAttention found here), one logprob micro-batch of all sequences; sequence 0's logprobs
alone must be bitwise its logprobs among the others. It needs FlashAttention 3 or 4 and DeepGEMM importable (Megatron's
config asserts it for an MoE model in the mode; our experts never call it).

Checks: ours builds TorchGroupedMLP experts; the first logprobs (before any step) match the
stock worker's on the same checkpoint within BF16 noise; the GRPO losses follow the stock
worker's; the expert weights never change; the resumed worker holds the trained worker's
weights and buffers bit for bit, and its logprobs differ from the trained worker's no more
than that worker's own two logprob passes do (each arm's repeated pass is reported).

    python3 benchmarks/nemo_rl_run.py --out-dir OUT [--steps 6] [--arms ...]

scripts/gpu_client_routes.sh runs this in the environment it finds: megatron-core 0.20.0,
Megatron-Bridge 0.7.0 and NeMo-RL main (a checkout on PYTHONPATH, or NEMO_RL_CONFIGS naming its
examples/configs) with what its Megatron policy worker imports.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import harness

# A Qwen3-30B-A3B-like layer at a size one GPU converts in seconds: SwiGLU experts, top-8.
MODEL = dict(vocab_size=8192, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512,
             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
             num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
             tie_word_embeddings=False)
SEQUENCES, SEQ = 8, 2048
# name: (worker, PEFT, TE's CUTLASS grouped GEMM, resumed from that worker's PEFT arm's save)
ARMS = {
    "stock": ("stock", True, False, False),
    "stock-cutlass": ("stock", True, True, False),
    "torch": ("torch", True, False, False),
    "torch-resumed": ("torch", True, False, True),
    "stock-resumed": ("stock", True, False, True),
    "stock-full": ("stock", False, False, False),
    "torch-full": ("torch", False, False, False),
    "torch-invariant": ("torch", True, False, False),
}
# Ours in Megatron's batch_invariant_mode, set as a NeMo-RL user sets it (first-class settings and
# policy.megatron_cfg.model_overrides; the extension turns Megatron's kernels on), its logprob pass
# over all sequences at once. Not run by default: Megatron's config asks DeepGEMM to be importable
# for an MoE model in the mode, and the mode asks for FlashAttention 3 or 4.
INVARIANT_ARMS = ("torch-invariant",)
DEFAULT_ARMS = [arm for arm in ARMS if arm not in INVARIANT_ARMS]
SAVING_ARMS = ("torch", "stock")  # the arms a "-resumed" arm resumes from
REPO = Path(__file__).resolve().parents[1]
# What the arms import besides the package: the CPU test's worker helpers (tests/integration/nemo_rl), the
# docs' snippets (tests) and the tiny checkpoint's example (examples).
PATHS = [str(REPO), str(Path(__file__).parent), str(REPO / "tests"), str(REPO / "tests/integration/nemo_rl"),
         str(REPO / "examples")]


def make_checkpoint(path: Path) -> None:
    """The HF checkpoint (BF16, random weights from MODEL) and its tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    sys.path[:0] = PATHS
    import nemo_rl_worker_run as shared

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL)).to(torch.bfloat16).save_pretrained(path)
    shared.make_tokenizer(path, MODEL["vocab_size"])


def grpo_batch(shared, tokens: torch.Tensor):
    """The fields grpo.py hands `train`: the sequences, their masks (the second half of each
    sequence generated), fixed per-sequence advantages."""
    data = shared.batch(tokens)
    mask = data["token_mask"]
    mask[:, : tokens.shape[1] // 2] = 0
    data["advantages"] = torch.randn(tokens.shape[0], 1, generator=torch.Generator().manual_seed(
        3)).expand_as(mask).contiguous()
    return data


def timed(call):
    torch.cuda.synchronize()
    start = time.perf_counter()
    value = call()
    torch.cuda.synchronize()
    return value, (time.perf_counter() - start) * 1e3


def worker(arm: str, out: Path, steps: int) -> None:
    """One arm: the worker built as its Ray actor would be, then `steps` GRPO steps."""
    import nemo_rl_worker_run as shared
    from support import bridge_imports

    kind, peft, _, resumed = ARMS[arm]
    import ray

    # The worker runs in this process rather than in a Ray actor placed on one GPU: the GPU id
    # Ray gives such an actor (its __init__ reads it for the local rank).
    ray.get_gpu_ids = lambda: [0]
    bridge_imports.import_megatron_bridge()
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl
    from nemo_rl.utils.checkpoint import CheckpointManager
    from nemo_rl.utils.config import load_config

    hf_path = out / "hf"
    os.environ.update(NRL_MEGATRON_CHECKPOINT_DIR=str(out / f"megatron_{kind}"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(harness.free_port()))
    policy = shared.policy_config(hf_path, peft)
    policy.update(train_global_batch_size=SEQUENCES, train_micro_batch_size=1,
                  logprob_batch_size=1, max_total_sequence_length=SEQ, generation=None)
    policy["sequence_packing"]["enabled"] = False
    policy["dynamic_batching"]["enabled"] = False
    policy["megatron_cfg"]["train_iters"] = steps   # what grpo.py sets from its step count
    policy["megatron_cfg"]["optimizer"].update(lr=1e-4, min_lr=1e-4)
    policy["megatron_cfg"]["scheduler"].update(lr_warmup_iters=0, lr_warmup_init=1e-4)
    if arm in INVARIANT_ARMS:
        import yaml

        from support.batch_invariance import flash_attention_version
        from support.doc_snippets import snippet

        policy["logprob_batch_size"] = SEQUENCES
        policy["megatron_cfg"].update(
            yaml.safe_load(snippet("nemo-rl-batch-invariant"))["policy"]["megatron_cfg"])
        policy["megatron_cfg"]["model_overrides"]["flash_attention_version"] = \
            flash_attention_version()
    recipe = load_config(str(nemo_rl_configs() / shared.NEMO_RL_CONFIG))
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig(**recipe["loss_fn"]))
    if kind == "torch":
        worker_class = shared.load_extension().TorchExpertsMegatronPolicyWorker \
            .__ray_metadata__.modified_class
    else:
        worker_class = MegatronPolicyWorkerImpl
    step_dir = out / f"checkpoints_{kind}" / "step_1"
    resume = {}
    if resumed:
        weights_path, optimizer_path = CheckpointManager.get_resume_paths(step_dir)
        resume = {"weights_path": os.path.abspath(weights_path),
                  "optimizer_path": optimizer_path and os.path.abspath(optimizer_path)}
    torch.cuda.reset_peak_memory_stats()
    (built, model), build_ms = timed(lambda: shared.build_worker(worker_class, policy, hf_path,
                                                                 **resume))
    result = {**shared.describe(built, model), "arm": arm, "build_ms": build_ms}
    tokens = torch.randint(3, MODEL["vocab_size"], (SEQUENCES, SEQ),
                           generator=torch.Generator().manual_seed(7))
    data = grpo_batch(shared, tokens)
    if resumed:
        logprobs = built.get_logprobs(data=data)["logprobs"]
        trained = torch.load(out / f"{kind}_trained_logprobs.pt")
        result["resumed_vs_trained_logprobs_max_abs"] = shared.max_abs(logprobs[:, 1:],
                                                                        trained[:, 1:])
        result["resumed_repeat_logprobs_max_abs"] = shared.max_abs(
            built.get_logprobs(data=data)["logprobs"][:, 1:], logprobs[:, 1:])
        trained_state = torch.load(out / f"{kind}_trained_state.pt")
        resumed_state = model_state(model)
        result["resumed_state_differs"] = state_differences(trained_state, resumed_state)
        result["resumed_state_sources"] = state_sources(
            resumed_state, trained_state, torch.load(out / f"{kind}_initial_state.pt"),
            step_dir / "policy" / "weights")
        (out / f"{arm}.json").write_text(json.dumps(result))
        return
    if arm in INVARIANT_ARMS:
        # Sequence 0's logprobs alone against the same sequence among the others, in one call.
        batched = built.get_logprobs(data=data)["logprobs"][0]
        alone = built.get_logprobs(data=grpo_batch(shared, tokens[:1]))["logprobs"][0]
        result["alone_vs_batched_logprobs_max_abs"] = shared.max_abs(alone[1:], batched[1:])
    torch.save(model_state(model), out / f"{kind}_initial_state.pt")
    experts_before = {n: p.detach().clone() for n, p in model.named_parameters()
                      if ".mlp.experts." in n and "adapter" not in n}
    result["trainable"] = sum(p.requires_grad for p in model.parameters())
    result["steps"] = []
    for step in range(steps):
        built.prepare_for_lp_inference()
        previous, logprob_ms = timed(lambda: built.get_logprobs(data=data)["logprobs"])
        if step == 0:
            torch.save(previous.cpu(), out / f"{arm}_first_logprobs.pt")
            data["generation_logprobs"] = previous.clone()
        data["prev_logprobs"] = previous
        data["reference_policy_logprobs"] = built.get_reference_policy_logprobs(data=data)[
            "reference_logprobs"]
        built.prepare_for_training()
        metrics, train_ms = timed(lambda: built.train(data, loss_fn))
        result["steps"].append(dict(logprob_ms=logprob_ms, train_ms=train_ms,
                                    loss=float(torch.as_tensor(metrics["global_loss"]).float()
                                               .mean())))
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result["expert_weights"] = len(experts_before)
    result["expert_weights_changed"] = sum(
        not torch.equal(p, dict(model.named_parameters())[n].detach())
        for n, p in experts_before.items())
    # The trained model's logprobs: what compares the arms after training (the GRPO loss
    # cannot: its importance ratio is 1 by construction) and what the resumed arm must give.
    built.prepare_for_lp_inference()
    trained = built.get_logprobs(data=data)["logprobs"]
    torch.save(trained.cpu(), out / f"{arm}_trained_logprobs.pt")
    # The floor for the resume: the same worker's logprob pass once more, nothing changed.
    result["repeat_logprobs_max_abs"] = shared.max_abs(
        built.get_logprobs(data=data)["logprobs"][:, 1:], trained[:, 1:])
    if arm in SAVING_ARMS:
        state = model_state(model)
        torch.save(state, out / f"{kind}_trained_state.pt")
        policy_dir = step_dir / "policy"
        built.save_checkpoint(weights_path=str(policy_dir / "weights"),
                              optimizer_path=str(policy_dir / "optimizer"),
                              tokenizer_path=str(policy_dir / "tokenizer"))
        # With the recipe's async_save the write completes only when the caller waits for it,
        # as NeMo-RL's GRPO loop does (Policy.finalize_async_save) before it goes on.
        built.finalize_async_save()
        # The save must leave the model as it was.
        result["changed_by_save"] = state_differences(state, model_state(model))["values"]
    (out / f"{arm}.json").write_text(json.dumps(result))


def model_state(model) -> dict:
    """Every parameter and buffer of the model, on the CPU, by name."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: tensor.detach().cpu().clone() for name, tensor in named}


def state_sources(resumed: dict, trained: dict, initial: dict, weights: Path) -> dict:
    """For each tensor the resumed worker holds other than the trained worker's: its max abs
    against the trained and the initial values, and what the saved checkpoint holds for it (the
    layer's slice of the stacked key; a shared expert adapter's first expert slot)."""
    try:
        from megatron.core import dist_checkpointing

        folders = sorted(path.parent for path in weights.rglob("metadata.json"))
        saved = dist_checkpointing.load_plain_tensors(str(folders[-1])) if folders else {}
        saved_error = None if folders else f"no metadata.json under {weights}"
    except Exception as error:  # a report, not a crash: the other figures still come back
        saved, saved_error = {}, f"{type(error).__name__}: {error}"
    sources = {"saved_keys": sorted(saved), "saved_error": saved_error, "tensors": {}}
    for name in sorted(trained.keys() & resumed.keys()):
        if torch.equal(trained[name], resumed[name]):
            continue
        row = {"vs_trained": max_abs(resumed[name], trained[name]),
               "vs_initial": max_abs(resumed[name], initial[name])
               if name in initial else None}
        layer = re.match(r"(.*decoder\.layers\.)(\d+)\.(.*)$", name)
        key = f"{layer[1]}{layer[3]}" if layer else name
        # Grouped experts' checkpoint keys repeat `experts.` (Megatron's layout for
        # TEGroupedMLP, which ours keeps).
        keys = {key, key.replace(".mlp.experts.", ".mlp.experts.experts.")}
        # The model's own key, and the optimizer's FP32 copy of the parameter where it has one.
        for saved_key in [k for k in saved if k in keys or (
                "fp32_param" in k and any(k.endswith(f".{candidate}") for candidate in keys))]:
            row[saved_key] = {"shape": list(saved[saved_key].shape)}
            try:
                value = saved[saved_key][int(layer[2])] if layer else saved[saved_key]
                while value.dim() > trained[name].dim():
                    value = value[0]
                row[saved_key].update(vs_trained=max_abs(value, trained[name]),
                                      vs_initial=max_abs(value, initial[name])
                                      if name in initial else None)
            except (IndexError, RuntimeError) as error:  # a layout this reading does not know
                row[saved_key]["error"] = f"{type(error).__name__}: {error}"
        sources["tensors"][name] = row
    return sources


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def state_differences(trained: dict, resumed: dict) -> dict:
    """Names missing on either side, and those whose values differ (with the max abs)."""
    differs = {name: float((trained[name].double() - resumed[name].double()).abs().max())
               for name in trained.keys() & resumed.keys()
               if not torch.equal(trained[name], resumed[name])}
    return dict(missing=sorted(trained.keys() - resumed.keys()),
                extra=sorted(resumed.keys() - trained.keys()), values=differs)


def nemo_rl_configs() -> Path:
    """NeMo-RL's examples/configs: NEMO_RL_CONFIGS, else beside its package as in its checkout."""
    import nemo_rl

    return Path(os.environ.get("NEMO_RL_CONFIGS",
                               Path(nemo_rl.__file__).parents[1] / "examples" / "configs"))


def run_arm(arm: str, out: Path, args) -> dict:
    env = dict(os.environ)
    if ARMS[arm][2]:
        env["NVTE_USE_CUTLASS_GROUPED_GEMM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(PATHS + [env.get("PYTHONPATH", "")])
    command = [sys.executable, __file__, "--arm", arm, "--out-dir", str(out),
               "--steps", str(args.steps)]
    start = time.time()
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode != 0 and "EADDRINUSE" in log:   # the free port was taken before it bound
        print(f"[nemo-rl] {arm}: its master port was taken (EADDRINUSE); once more", flush=True)
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        log = run.stdout + run.stderr
    (out / f"{arm}.log").write_text(" ".join(command) + "\n\n" + log)
    print(f"[nemo-rl] {arm}: exit {run.returncode} in {time.time() - start:.0f} s", flush=True)
    if run.returncode != 0:
        print(log[-3000:], flush=True)
        return {"arm": arm, "failed": f"exit {run.returncode}"}
    return json.loads((out / f"{arm}.json").read_text())


def train_ms_of(result, skip: int):
    """The median `train` ms of an arm's timed steps (None for an arm without steps)."""
    steps = (result or {}).get("steps")
    return statistics.median(s["train_ms"] for s in steps[skip:] or steps) if steps else None


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-6)


def invariant_arm_missing() -> str | None:
    """Why the batch-invariant arm cannot run here (before any worker starts), or None."""
    from support.batch_invariance import whole_model_mode_missing

    missing = whole_model_mode_missing()
    if missing:
        return missing
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import HAVE_DEEPGEMM_BF16

    if not HAVE_DEEPGEMM_BF16:
        return ("needs DeepGEMM's BF16 grouped GEMM importable (Megatron's config asserts it for an "
                "MoE model in the mode; our experts never call it): install DeepGEMM where the "
                "worker runs")
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.arm:
        worker(args.arm, out, args.steps)
        return
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown arm(s) {unknown}; choose from {list(ARMS)}")
    if set(arms) & set(INVARIANT_ARMS):
        missing = invariant_arm_missing()
        if missing:
            parser.error(f"--arms {args.arms}: torch-invariant {missing}")
    if not (out / "hf" / "config.json").is_file():
        make_checkpoint(out / "hf")
    results = {arm: run_arm(arm, out, args) for arm in arms}
    first, trained = ({arm: torch.load(out / f"{arm}_{when}_logprobs.pt") for arm in arms
                       if (out / f"{arm}_{when}_logprobs.pt").is_file()}
                      for when in ("first", "trained"))
    logprob_diffs = {}
    rows, ok = [], all("failed" not in r for r in results.values())
    for arm, result in results.items():
        if "failed" in result:
            rows.append([arm, "-", "-", "-", "-", "-", "-", result["failed"]])
            continue
        if "steps" not in result:   # the resumed arm
            diff = result["resumed_vs_trained_logprobs_max_abs"]
            state = result["resumed_state_differs"]
            # The resume brings back every weight and buffer bit for bit; its logprobs may differ
            # from the trained worker's no more than that worker's own two passes do.
            floor = max(results.get(ARMS[arm][0], {}).get("repeat_logprobs_max_abs", 0.0),
                        result["resumed_repeat_logprobs_max_abs"])
            state_ok = not (state["missing"] or state["extra"] or state["values"])
            ours = ARMS[arm][0] == "torch"
            ok &= state_ok and diff <= floor and (result["experts"][0] == "TorchGroupedMLP"
                                                  or not ours)
            sources = result["resumed_state_sources"]["tensors"].values()
            back_to_initial = sum(row["vs_initial"] == 0.0 for row in sources)
            saved_trained = sum(any(isinstance(v, dict) and v.get("vs_trained") == 0.0
                                    for v in row.values()) for row in sources)
            rows.append([arm, ", ".join(sorted(set(result["experts"]))), "-", "-", "-", "-",
                         "-", f"logprobs vs trained worker: max abs {diff:.1e} (a repeated "
                         f"pass: {floor:.1e}); weights and buffers: "
                         + ("bitwise the trained worker's" if state_ok else
                            f"{len(state['values'])} differ ({back_to_initial} hold their "
                            f"initial values; the checkpoint holds the trained values of "
                            f"{saved_trained}), {len(state['missing'])} missing, "
                            f"{len(state['extra'])} extra")])
            continue
        stock = results.get("stock-full" if arm.endswith("full") else "stock", {})
        timed_steps = result["steps"][args.skip:] or result["steps"]
        train = statistics.median(s["train_ms"] for s in timed_steps)
        logprob = statistics.median(s["logprob_ms"] for s in timed_steps)
        notes = []
        if "steps" in stock and arm != "stock" and arm != "stock-full":
            stock_train = statistics.median(s["train_ms"] for s in (stock["steps"][args.skip:]
                                                                    or stock["steps"]))
            notes.append(f"train x stock {stock_train / train:.2f}")
            loss = max(rel(a["loss"], b["loss"]) for a, b in zip(result["steps"],
                                                                  stock["steps"]))
            notes.append(f"max rel. loss diff vs stock {loss:.1e}")
            base = "stock-full" if arm.endswith("full") else "stock"
            # Without PEFT the stock worker trains its experts and ours keeps them frozen: only
            # the first logprobs compare.
            for when, logprobs in (("first", first), ("trained", trained)):
                if arm in logprobs and base in logprobs and not (when == "trained"
                                                                 and arm.endswith("full")):
                    diff = float((logprobs[arm][:, 1:].double()
                                  - logprobs[base][:, 1:].double()).abs().max())
                    logprob_diffs[f"{arm} vs {base}, {when}"] = diff
                    notes.append(f"{when} logprobs vs stock: max abs {diff:.2e}")
                    ok &= diff < 0.1
            ok &= loss < 0.05
        ok &= result["expert_weights_changed"] == 0 or arm == "stock-full"
        if arm in INVARIANT_ARMS:
            alone = result["alone_vs_batched_logprobs_max_abs"]
            notes.append(f"batch_invariant_mode: sequence 0's logprobs alone vs among "
                         f"{SEQUENCES}: max abs {alone:.1e}")
            ok &= alone == 0.0
            ours = train_ms_of(results.get("torch"), args.skip)
            if ours:
                notes.append(f"train x ours without the mode {ours / train:.2f}")
        notes.append(f"repeated logprob pass: max abs {result['repeat_logprobs_max_abs']:.1e}")
        rows.append([arm, ", ".join(sorted(set(result["experts"]))),
                     f"{train:.1f} ({min(s['train_ms'] for s in timed_steps):.1f}–"
                     f"{max(s['train_ms'] for s in timed_steps):.1f})", f"{logprob:.1f}",
                     f"{result['steps'][0]['loss']:.4f} → {result['steps'][-1]['loss']:.4f}",
                     f"{result['peak_gib']:.1f}",
                     f"{result['expert_weights_changed']} of {result['expert_weights']}",
                     "; ".join(notes)])
    header = harness.header(torch.device("cuda"), packages=(
        "triton", "megatron-core", "megatron-bridge", "transformer-engine", "nemo-rl", "ray"))
    header.append(f"model: Qwen3-MoE {MODEL}; {SEQUENCES} x {SEQ} tokens per step; NeMo-RL's "
                  "Megatron GRPO recipe with the docs' YAML block; ClippedPGLossFn")
    body = [f"{args.steps} GRPO steps per arm, the first {args.skip} not timed; ms from the "
            "worker's `train` and `get_logprobs` calls (synchronised), median (min–max).", ""]
    body += harness.markdown_table(["arm", "experts", "train ms / step", "logprob ms",
                                    "loss, first → last", "peak GiB", "expert weights changed",
                                    "against the stock worker"], rows)
    summary = dict(ms_ours=train_ms_of(results.get("torch"), args.skip),
                   ms_stock=train_ms_of(results.get("stock"), args.skip),
                   ms_cutlass=train_ms_of(results.get("stock-cutlass"), args.skip),
                   ms_ours_invariant=train_ms_of(results.get("torch-invariant"), args.skip),
                   loss_diff=max((rel(a["loss"], b["loss"]) for a, b in zip(
                       results.get("torch", {}).get("steps", []),
                       results.get("stock", {}).get("steps", []))), default=None),
                   peak_ours=results.get("torch", {}).get("peak_gib"),
                   peak_stock=results.get("stock", {}).get("peak_gib"),
                   logprob_max_abs_diffs=logprob_diffs, ok=bool(ok))
    text = harness.write_report(out, "nemo_rl_worker", "NeMo-RL's Megatron policy worker on the "
                                "GPU", header, body, {**results, "summary": summary})
    print(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
