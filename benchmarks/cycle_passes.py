"""The RL cycle's data and passes, shared by bench_cycle.py and cycle_memory.py: Megatron's
parallel state, the micro-batches, one arm's logprob and update passes on them (`Cycle`), an arm
whose model exists only during its turns (`ParkedArm`), and the data, LoRA and optimizer options.
"""

import gc
import os
import time
import weakref

import torch

import cycle_models as cm
import cycle_profile as cp
from shapes import ModelSlice

CLIP = 0.2


# --- setup ---------------------------------------------------------------------------------------

def init_parallel(ep: int, device: torch.device) -> None:
    """The process group (torchrun's environment, else one process) and Megatron's parallel
    state with expert parallelism `ep`; then the single-process example's Megatron fixes."""
    from megatron.core import parallel_state

    from support.cpu_support import init_single_process_megatron

    if "WORLD_SIZE" in os.environ and not torch.distributed.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    elif ep > 1:
        raise SystemExit("--ep > 1 needs torchrun (one process per expert-parallel rank)")
    if torch.distributed.is_initialized() and not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    init_single_process_megatron()


def make_batches(model: ModelSlice, args, device):
    """N micro-batches of (tokens, labels, advantages [mbs, 1]), seeded per data-parallel rank."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    generator = torch.Generator().manual_seed(args.seed + 1000 * rank)
    batches = []
    for _ in range(args.micro_batches):
        tokens = torch.randint(0, model.vocab, (args.micro_batch_size, args.seq + 1),
                               generator=generator)
        advantages = torch.randn(args.micro_batch_size, 1, generator=generator)
        batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device), advantages.to(device)))
    return batches



def add_batch_and_adapter_options(parser, micro_batches: int) -> None:
    """The data, LoRA and optimizer options of a cycle (bench_cycle.py, cycle_memory.py)."""
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=micro_batches)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (a multiple of 8)")
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--expert-kernel", choices=["auto", "fused_gemm", "grouped_mm"],
                        default="auto", help="TorchGroupedMLP's moe_expert_kernel")


# --- the cycle -----------------------------------------------------------------------------------

class Cycle:
    """The logprob and update passes of one arm, on fixed data."""

    def __init__(self, arm, model, batches, stack, args, device):
        self.arm, self.model, self.batches, self.device = arm, model, batches, device
        mbs, seq = batches[0][0].shape
        self.positions = torch.arange(seq, device=device).expand(mbs, seq)
        # TE attention is causal by its mask type; the local one needs the mask.
        self.mask = (None if stack == "te" else
                     torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).triu(1))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr, weight_decay=0.0)
        self.old_logprobs = None

    def environment(self):
        return cm.arm_environment(self.arm)

    def logprobs(self, tokens, labels):
        """Per-token log-probabilities of the labels [mbs, seq] (the model returns -log p)."""
        return -self.model(tokens, self.positions, self.mask, labels=labels)

    @torch.no_grad()
    def logprob_pass(self):
        self.model.eval()
        self.old_logprobs = [self.logprobs(t, l) for t, l, _ in self.batches]
        return self.old_logprobs

    def update_pass(self):
        """Clipped policy-gradient loss per micro-batch, backward, then one optimizer step."""
        from torch.profiler import record_function

        self.model.train()
        for (tokens, labels, advantages), old in zip(self.batches, self.old_logprobs):
            logprobs = self.logprobs(tokens, labels)
            with record_function(cp.RANGE + cp.HEAD):
                ratio_ = torch.exp(logprobs - old)
                loss = -torch.min(ratio_ * advantages,
                                  ratio_.clamp(1 - CLIP, 1 + CLIP) * advantages).mean()
                loss = loss / len(self.batches)
            loss.backward()
        with record_function(cp.RANGE + cp.OPTIMIZER):
            reduce_adapter_grads(self.params)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def resident_bytes(self) -> int:
        """Bytes of the arm's own tensors: weights, buffers, optimizer state (unique storages)."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        tensors += [t for state in self.optimizer.state.values() for t in state.values()
                    if torch.is_tensor(t)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors if t.device.type == self.device.type}
        return sum(storages.values())


def _to_host(value):
    """A copy of `value` (nested dicts, lists, tuples) with every tensor copied to the host."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


class ParkedArm:
    """One arm whose model exists only during its turns: `open()` builds it (`build() -> Cycle`)
    and restores what the last `close()` kept on the host (trainable tensors, optimizer state,
    last logprobs); `close()` keeps those and drops the model."""

    def __init__(self, build, device=None):
        self.build, self.cycle, self.kept, self.resident = build, None, None, None
        self.device, self.open_s = device, None  # open_s: how long the last open() took
        self.between_turns = None  # the most bytes allocated on the device after a close()

    def open(self) -> Cycle:
        started = time.perf_counter()
        self.cycle = self.build()
        if self.kept is not None:
            params, optimizer, old_logprobs = self.kept
            with torch.no_grad():
                for p, kept in zip(self.cycle.params, params, strict=True):
                    p.copy_(kept)
            self.cycle.optimizer.load_state_dict(optimizer)
            self.cycle.old_logprobs = (None if old_logprobs is None else
                                       [lp.to(self.cycle.device) for lp in old_logprobs])
        self.open_s = time.perf_counter() - started
        return self.cycle

    def close(self) -> None:
        """Keep the arm's state on the host and free its model, optimizer state and logprobs
        (the caching allocator keeps the memory for the next arm); an error naming what is
        left when the model outlives its turn. Records the bytes still allocated on the
        device afterwards (`between_turns`: the data and whatever else is not an arm's)."""
        cycle, self.cycle = self.cycle, None
        if cycle is None:
            return
        self.kept = (_to_host(cycle.params), _to_host(cycle.optimizer.state_dict()),
                     _to_host(cycle.old_logprobs))
        model, optimizer = weakref.ref(cycle.model), weakref.ref(cycle.optimizer)
        cycle.old_logprobs = None
        del cycle
        gc.collect()
        alive = [name for name, ref in (("model", model), ("optimizer", optimizer)) if ref()]
        if alive:
            holders = sorted({type(r).__name__ for r in gc.get_referrers(model() or optimizer())})
            raise RuntimeError(f"ParkedArm.close: the arm's {' and '.join(alive)} outlived its "
                               f"turn (still referenced from {holders}); drop every reference "
                               "to the Cycle before close()")
        if self.device is not None and self.device.type == "cuda":
            held = torch.cuda.memory_allocated(self.device)
            self.between_turns = max(self.between_turns or 0, held)


def reduce_adapter_grads(params) -> None:
    """Average adapter gradients over data-parallel ranks (expert adapters over the expert
    data-parallel group), as DDP would; nothing on one process."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return
    groups = {True: parallel_state.get_data_parallel_group(),
              False: parallel_state.get_expert_data_parallel_group()}
    for dense, group in groups.items():
        grads = [p.grad for p in params
                 if p.grad is not None and getattr(p, "allreduce", True) == dense]
        if grads and torch.distributed.get_world_size(group) > 1:
            flat = torch.cat([g.flatten() for g in grads])
            torch.distributed.all_reduce(flat, group=group)
            flat /= torch.distributed.get_world_size(group)
            parts = flat.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(parts, grads)])
