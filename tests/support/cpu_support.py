"""Run Megatron-Core on one process, on a CPU-only host too: the one table of patches the CPU
launcher of the examples (run_on_cpu.py), the test fixtures (tests/conftest.py), the test workers
and the torchrun workers (tests/distributed/) apply, each with the reason it exists.

On the CPU (a machine without CUDA, or `init_single_process_megatron(on_cpu=True)`), the router's
`torch.cuda.current_device()` answers "cpu", its gating GEMM is torch's (TE's takes CUDA tensors
only), and attention dropout's CUDA RNG-tracker fork and the checkpoint's CUDA RNG save/restore
are no-ops, so the examples build and run a real MoE layer or GPTModel (pass an explicit
attention mask: Megatron's default causal mask is made on CUDA). The package is never patched.
"""

import contextlib
import os
import socket
import sys
import types
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Patch:
    """`setattr(owner, name, value)`, and why it is needed."""

    owner: object
    name: str
    value: object
    reason: str


def megatron_patches(on_cpu: bool, *, host_streams: bool = False,
                     recompute_without_te: bool = False) -> list:
    """[Patch]: what keeps Megatron-Core running in this process. `on_cpu`: a model on the CPU,
    on a CPU-only host and on a CUDA host alike. `host_streams` (a CPU-only host): the alltoall
    dispatcher's CUDA streams and split sizes. `recompute_without_te`: selective "layernorm"
    recompute without Transformer Engine. Applied for good by `apply` (examples, workers) or,
    undone after each test, by the fixtures of tests/conftest.py."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, random
    from megatron.core.transformer.moe import moe_utils

    patches = []
    if not hasattr(moe_utils, "te_general_gemm"):
        patches.append(Patch(moe_utils, "te_general_gemm", None,
                             "megatron-core 0.16.1's router gating calls `te_general_gemm` even "
                             "where TE (and so the name) is absent, on the GPU too"))
    if on_cpu:
        device_of = torch.cuda.current_device

        def current_device():
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("megatron.") or not torch.cuda.is_available():
                return "cpu"
            return device_of()

        no_op = lambda *args, **kwargs: None  # noqa: E731
        patches += [
            Patch(torch.cuda, "current_device", current_device,
                  "Megatron's router, rope and buffers place tensors on "
                  "`torch.cuda.current_device()` (on a CUDA host a CPU model would be half moved "
                  "to the GPU): Megatron's own modules are answered 'cpu'; torch, TE and everyone "
                  "else get the real device where there is one"),
            Patch(moe_utils, "te_general_gemm", None,
                  "with TE importable the router's gating GEMM is TE's, which takes CUDA tensors "
                  "only (a CPU tensor read as device memory: an illegal memory access on a CUDA "
                  "host): None is the router's torch.mm path"),
            Patch(random, "_get_cuda_rng_state", no_op,
                  "the re-entrant checkpoint saves the CUDA RNG state (a CPU-only torch has "
                  "none); the CPU generator is still saved and restored"),
            Patch(random, "_set_cuda_rng_state", no_op, "as `_get_cuda_rng_state`"),
            Patch(get_cuda_rng_tracker(), "fork",
                  lambda *args, **kwargs: contextlib.nullcontext(),
                  "attention dropout forks the model-parallel CUDA RNG"),
        ]
        if not torch.cuda.is_available():
            patches.append(Patch(torch.cuda, "synchronize", no_op,
                                 "dist_checkpointing's filesystem writer synchronises CUDA; a "
                                 "CPU-only torch has nothing to wait for"))
    if host_streams and not torch.cuda.is_available():
        from megatron.core.transformer.moe import token_dispatcher
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        stream = HostStream()
        reason = ("Megatron's alltoall token dispatcher creates a `torch.cuda.Stream` when it is "
                  "built and moves its split sizes to the host on it: one process's host stream")
        patches += [Patch(torch.cuda, "Stream", lambda *args, **kwargs: stream, reason),
                    Patch(torch.cuda, "current_stream", lambda *args, **kwargs: stream, reason),
                    Patch(torch.cuda, "stream", lambda s: contextlib.nullcontext(), reason),
                    Patch(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", None, reason)]
        if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
            to_host = token_dispatcher.maybe_move_tensor_to_cpu

            def split_sizes_to_host(tensor, as_numpy=False, record_stream=False):
                if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
                    return tensor.numpy()
                return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

            patches.append(Patch(
                token_dispatcher, "maybe_move_tensor_to_cpu", split_sizes_to_host,
                "the alltoall dispatcher hands its split sizes to all_to_all_single as numpy "
                "arrays, converting only CUDA tensors: on a CPU-only host (expert parallel "
                "under gloo) they stay tensors, which all_to_all_single refuses"))
        patches.append(Patch(
            torch.distributed, "all_gather", uneven_all_gather(torch.distributed.all_gather),
            "with expert-tensor parallelism the alltoall dispatcher gathers each rank's rows in "
            "uneven sizes (torch.distributed.all_gather of tensors of different lengths), which "
            "gloo refuses and NCCL takes: gloo gathers them padded to the longest, and each "
            "output gets its rows"))
    if recompute_without_te and not hasattr(random, "FP8GlobalStateManager"):
        reason = ("CheckpointWithoutOutput (selective 'layernorm' recompute) asks TE whether FP8 "
                  "is on even when TE is absent: it answers what TE says without FP8")
        null_context = lambda *args, **kwargs: contextlib.nullcontext()  # noqa: E731
        patches += [Patch(random, "FP8GlobalStateManager", types.SimpleNamespace(
                        is_fp8_enabled=lambda: False, get_fp8_recipe=lambda: None), reason),
                    Patch(random, "activation_recompute_forward", null_context, reason),
                    Patch(random, "fp8_autocast", null_context, reason)]
    return patches


def uneven_all_gather(all_gather):
    """`all_gather` taking outputs of different lengths on gloo, as NCCL does: every input is
    padded along dim 0 to the longest, gathered, and each output gets its own rows."""

    def gather(tensor_list, tensor, group=None, async_op=False):
        lengths = [t.shape[0] for t in tensor_list]
        if len(set(lengths)) <= 1 or tensor.dim() == 0:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(lengths)
        padded = tensor.new_zeros(longest, *tensor.shape[1:])
        padded[:tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        all_gather(gathered, padded, group=group)
        for out, got, length in zip(tensor_list, gathered, lengths):
            out.copy_(got[:length])
        return None

    return gather


class HostStream:
    """What Megatron asks of a CUDA stream or event on one host process: nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return self  # an event whose synchronize() returns at once


def apply(patches: list) -> None:
    """Apply `megatron_patches(...)` for the rest of the process."""
    for patch in patches:
        setattr(patch.owner, patch.name, patch.value)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def init_single_process_megatron(on_cpu: bool = None) -> None:
    """One process with Megatron's parallel state (every size 1): NCCL with a GPU, gloo and the
    CPU patches above on the CPU. `on_cpu` (default: when there is no CUDA device) keeps
    Megatron on the CPU on a CUDA host too (an FP32 model on the CPU)."""
    from megatron.core import parallel_state

    on_cpu = not torch.cuda.is_available() if on_cpu is None else on_cpu
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        torch.distributed.init_process_group("gloo" if on_cpu else "nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    apply(megatron_patches(on_cpu))
    if not on_cpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)


def shutdown_megatron() -> None:
    """Undo init_single_process_megatron: Megatron's parallel state, then the process group (NCCL
    warns at exit about a group never destroyed)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class CudaTensorsOnTheCpu(torch.overrides.TorchFunctionMode):
    """Inside this mode, tensors asked for on CUDA (`device="cuda"`, `.cuda()`, `.to("cuda")`)
    are made on the CPU: Megatron-LM's training loop (`megatron.training`) puts its counters,
    loss reductions and timers on CUDA by name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if name == "to":
            args = tuple(_cpu_device(a) if isinstance(a, (str, torch.device)) else a
                         for a in args)
        return func(*args, **kwargs)


def _cpu_device(device):
    """'cpu' for a CUDA device given by name, torch.device or index; anything else as given."""
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


def _called_from_megatron() -> bool:
    """Whether the caller of the patched function is Megatron's code."""
    return sys._getframe(2).f_globals.get("__name__", "").startswith("megatron.")


def megatron_lm_patches() -> list:
    """[Patch]: what Megatron-LM's `pretrain()` (megatron.training, driven by its own
    `pretrain_gpt.py`) needs, beyond `megatron_patches(on_cpu=True)`, to run on a CPU-only host
    with `--distributed-backend gloo`; tensors it asks for on CUDA come from
    `CudaTensorsOnTheCpu`. Nothing here touches this package or changes what a model computes."""
    import megatron.core.datasets.utils as dataset_utils
    import megatron.training.initialize as initialize
    from megatron.core import tensor_parallel

    is_available, device_count = torch.cuda.is_available, torch.cuda.device_count
    tensor_type = torch.Tensor.type

    def cuda_type_name(tensor, *args, **kwargs):
        name = tensor_type(tensor, *args, **kwargs)
        if args or kwargs or not _called_from_megatron() or name.startswith("torch.cuda."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    no_op = lambda *args, **kwargs: None  # noqa: E731
    host = "a CPU-only host has no CUDA device"
    return [
        Patch(torch.cuda, "is_available",
              lambda: True if _called_from_megatron() else is_available(),
              "initialize_megatron asserts CUDA; Megatron is answered yes, everyone else (torch "
              "itself) the truth"),
        Patch(torch.cuda, "device_count", lambda: 1 if _called_from_megatron() else device_count(),
              "Megatron-LM sets up its parallel groups only when it counts a device"),
        Patch(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0),
              "argument validation asserts compute capability 8+ for --moe-grouped-gemm"),
        # One function per torch name: torch.compile's map of torch's functions refuses one
        # object under two names.
        Patch(torch.cuda, "set_device", lambda *args, **kwargs: None, host),
        Patch(torch.cuda, "synchronize", lambda *args, **kwargs: None, host),
        Patch(torch.cuda, "get_rng_state", lambda *args, **kwargs: torch.get_rng_state(),
              "the rerun state machine saves the CUDA generator; the CPU one stands for it"),
        Patch(torch.cuda, "set_rng_state", no_op, "as `get_rng_state`"),
        Patch(torch.cuda, "Stream", HostStream, "DDP and the optimizer make CUDA streams"),
        Patch(torch.cuda, "Event", HostStream, "timers and DDP record CUDA events"),
        Patch(torch.cuda, "current_stream", lambda *args, **kwargs: HostStream(), "as `Stream`"),
        Patch(torch.cuda, "stream", lambda stream: contextlib.nullcontext(), "as `Stream`"),
        Patch(torch.nn.Module, "cuda", lambda module, *args, **kwargs: module,
              "get_model moves each model chunk to the GPU; it stays on the CPU"),
        Patch(torch.Tensor, "type", cuda_type_name,
              "Megatron's mixed-precision optimizers accept only parameters whose type() is "
              "torch.cuda.*Tensor; Megatron is told the CUDA name of the same dtype"),
        Patch(tensor_parallel, "model_parallel_cuda_manual_seed", no_op,
              "it seeds the CUDA generators; torch.manual_seed (called before it) seeds the CPU"),
        Patch(initialize, "_warmup_jit_function", no_op,
              "it warms the JIT fusions up on CUDA tensors (the fusions are off on the CPU)"),
        Patch(dataset_utils, "compile_helpers", no_op,
              "it runs `make` in megatron/core/datasets, whose Makefile is in a Megatron-LM "
              "checkout but not in the megatron-core wheel; the wheel ships the compiled helpers"),
    ]



def _bridge_setup_patches(*get_model_also_in) -> list:
    """[Patch]: the CPU-host patches Megatron-Bridge's model setup and `initialize_megatron` need,
    under its `pretrain()` and `finetune()` (`megatron_bridge_patches`) and under NeMo-RL's
    Megatron worker (`nemo_rl_patches`) alike: Bridge's `get_model` (and the same name in the
    modules of `get_model_also_in`, which import it themselves) building on the CPU, and Bridge's
    copies of Megatron-LM's setup steps that need CUDA or a Megatron-LM checkout as no-ops."""
    import megatron.bridge.training.initialize as bridge_initialize
    from megatron.bridge.models import model_provider

    get_model = model_provider.get_model

    def get_model_on_the_cpu(*args, **kwargs):
        return get_model(*args, **{**kwargs, "use_cpu_initialization": True})

    no_op = lambda *args, **kwargs: None  # noqa: E731
    return [
        *(Patch(module, "get_model", get_model_on_the_cpu,
                "Bridge's `get_model` sets the provider's `use_cpu_initialization` from its "
                "argument (False when not given), which neither Bridge's training setup, nor its "
                "provide_distributed_model (NeMo-RL's HF import), nor NeMo-RL's model setup "
                "passes, so the model would be built on the current CUDA device; on a CPU host "
                "it is built on the CPU, as `get_model(use_cpu_initialization=True)` builds it "
                "(Megatron's flag for it, which also admits FP32 weights)")
          for module in (model_provider, *get_model_also_in)),
        Patch(bridge_initialize, "compile_helpers", no_op,
              "as megatron_lm_patches' `compile_helpers`, for Bridge's initialize_megatron, "
              "which imports the name itself"),
        Patch(bridge_initialize, "_warmup_jit_function", no_op,
              "as megatron_lm_patches' `_warmup_jit_function`, for Bridge's copy of Megatron-LM's "
              "JIT warm-up on CUDA tensors (the fusions are off on the CPU)"),
    ]


def megatron_bridge_patches() -> list:
    """[Patch]: what Megatron-Bridge's `pretrain()` and `finetune()` (megatron.bridge.training)
    need, beyond `megatron_lm_patches()` (applied after them) and `megatron_patches(on_cpu=True)`,
    to run on a CPU-only host with the gloo backend, after `import_megatron_bridge_training()`;
    tensors they ask for on CUDA come from `CudaTensorsOnTheCpu`. Nothing here touches this
    package or changes what a model computes."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random

    return [
        *_bridge_setup_patches(),
        Patch(tensor_parallel, "model_parallel_cuda_manual_seed",
              random.model_parallel_cuda_manual_seed,
              "megatron_lm_patches' no-op seeding undone: Bridge's checkpoints save the RNG "
              "tracker's states and its resume stops on an empty tracker (load_checkpoint's "
              "`raise KeyError`, then sys.exit); Megatron's own seeding runs, its CUDA generator "
              "read as the CPU one (megatron_lm_patches' `get_rng_state`), `torch.cuda."
              "manual_seed` queued by torch (lazy without a device)"),
    ]


def nemo_rl_patches() -> list:
    """[Patch]: what NeMo-RL's Megatron policy worker (`MegatronPolicyWorkerImpl.__init__`, its
    `get_logprobs` and `train`) needs, beyond `megatron_patches(on_cpu=True)` and
    `megatron_lm_patches()` (apply it after them: its `current_device` answers through theirs),
    to run in this process on a CPU-only host, outside a Ray actor; tensors it asks for on CUDA
    come from `CudaTensorsOnTheCpu`. Nothing here touches this package or changes what a model
    computes."""
    import nemo_rl.models.megatron.setup as nemo_rl_setup
    import ray
    from megatron.bridge import AutoBridge
    from megatron.core.tensor_parallel import random

    init_process_group = torch.distributed.init_process_group
    to_megatron_provider = AutoBridge.to_megatron_provider

    def provider_in_cpu_form(bridge, *args, **kwargs):
        provider = to_megatron_provider(bridge, *args, **kwargs)
        provider.transformer_impl = "local"
        provider.moe_permute_fusion = False
        return provider

    current_device = torch.cuda.current_device

    def gloo_process_group(backend=None, *args, **kwargs):
        return init_process_group("gloo" if backend in (None, "nccl") else backend, *args,
                                  **kwargs)

    def nemo_rl_current_device():
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return 0 if caller.startswith("nemo_rl.") else current_device()

    return [
        Patch(ray, "get_gpu_ids", lambda: [0],
              "the worker runs in this process, not in a Ray actor given a GPU: the id Ray "
              "would give it"),
        Patch(AutoBridge, "to_megatron_provider", provider_in_cpu_form,
              "Bridge's providers build Transformer Engine modules and (Qwen3-MoE's among "
              "them) turn on TE's fused permutation, which a CPU host has not; NeMo-RL's HF "
              "import takes only the parallelism from megatron_cfg, so its `transformer_impl: "
              "local` and `moe_permute_fusion: false` reach the rebuilt provider but not this "
              "one: it gets them here"),
        *_bridge_setup_patches(nemo_rl_setup),  # NeMo-RL's model setup imports get_model
        Patch(random.CudaRNGStatesTracker, "fork",
              lambda *args, **kwargs: contextlib.nullcontext(),
              "as megatron_patches' `fork`, on every tracker: NeMo-RL's HF import drops "
              "Megatron's RNG tracker and Bridge's initialize_megatron makes a new one, with no "
              "CUDA states (their seeding is a no-op here)"),
        Patch(torch.cuda, "get_device_name", lambda *args, **kwargs: "cpu",
              "train's metrics record the GPU's name"),
        Patch(torch.distributed, "init_process_group", gloo_process_group,
              "setup_distributed asks for NCCL; a CPU host has gloo"),
        Patch(torch.cuda, "current_device", nemo_rl_current_device,
              "the worker asserts that the device it set is current: NeMo-RL is answered the "
              "device it set (0), everyone else as before"),
    ]
