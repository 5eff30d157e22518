"""What the examples share: one process with Megatron's parallel state (every size 1), and the
training step and layer summary the model examples print.

On a GPU an example runs as it is (`python examples/NAME.py`): NCCL, Megatron's CUDA RNG seeded.
A host without CUDA runs an example through the test side's launcher, which first applies the
patches Megatron needs on the CPU (`python tests/support/run_on_cpu.py examples/NAME.py`); started
any other way without CUDA, an example stops and names that command.
"""

import os
import socket
import sys

import torch

CPU_LAUNCHER_ENV = "MCORE_TORCH_EXPERTS_EXAMPLE_ON_CPU"
"""Set to 1 by tests/support/run_on_cpu.py once it has applied the CPU patches."""


def on_cpu() -> bool:
    """Whether this example runs on the CPU: under the CPU launcher. Without CUDA and without the
    launcher, SystemExit naming the launcher's command."""
    if os.environ.get(CPU_LAUNCHER_ENV) == "1":
        return True
    if torch.cuda.is_available():
        return False
    name = os.path.basename(sys.argv[0]) or "the example"
    raise SystemExit(
        f"{name}: no CUDA device here. On a CPU host run it through the launcher that applies "
        f"the patches Megatron needs there: python tests/support/run_on_cpu.py examples/{name}")


def init_megatron() -> bool:
    """One process with Megatron's parallel state: NCCL and Megatron's CUDA RNG seeded on a GPU,
    gloo under the CPU launcher. Returns whether it runs on the CPU."""
    from megatron.core import parallel_state

    cpu = on_cpu()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
        torch.distributed.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if not cpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    return cpu


def shutdown_megatron() -> None:
    """Undo init_megatron: Megatron's parallel state, then the process group (NCCL warns at exit
    about a group never destroyed)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def training_step_loss(model, vocab_size: int, seq_length: int, batch: int = 2) -> float:
    """One forward/backward of random tokens through a GPTModel with an explicit causal mask,
    every parameter as built (TorchGroupedMLP's expert weights frozen); returns the loss."""
    device = next(model.parameters()).device
    tokens = torch.randint(0, vocab_size, (batch, seq_length + 1), device=device)
    positions = torch.arange(seq_length, device=device).expand(batch, -1)
    causal_mask = torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool,
                             device=device).triu(1)
    loss = model(tokens[:, :-1], positions, causal_mask, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    return loss.item()


def describe_layers(model) -> str:
    """'0: dense MLP, 1: TorchGroupedMLP, ...' for a GPTModel's decoder layers."""
    return ", ".join(f"{i}: {type(layer.mlp.experts).__name__}" if hasattr(layer.mlp, "experts")
                     else f"{i}: dense {type(layer.mlp).__name__}"
                     for i, layer in enumerate(model.decoder.layers))
