"""Which kernels TorchGroupedMLP runs, decided in one place: the values of `moe_expert_kernel`,
what each Triton kernel covers, the choice resolved once at construction (`KernelChoice`), and
the per-call obstacles of the fused GEMM path.

`ExpertKernel.GROUPED_MM`: four torch grouped GEMMs with the activation between them, as one
fused Triton activation kernel on CUDA where it covers the config (`ActivationImpl.FUSED`) or as
torch ops (`ActivationImpl.EAGER`); `ExpertKernel.FUSED_GEMM`: Triton grouped GEMMs with the
activation in their epilogues (fused_experts_triton.py); `ExpertKernel.AUTO`: fused_gemm where it
measured faster.
"""

import functools
import types
from dataclasses import dataclass
from typing import Callable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu

from ..enums import ActivationImpl, ExpertKernel
from ..errors import TorchExpertsConfigError
from ..settings import ExpertSettings
from . import TRITON_INTERPRETER

KERNEL_ACTIVATIONS = {squared_relu: 0, F.silu: 1}
"""The activations both Triton kernels compute, and each one's code in the kernels (`ACT`)."""


FUSED_GEMM_AUTO_CAPABILITIES = ((9, 0),)
"""GPUs where "auto" picks the fused GEMM kernels, for non-gated activations only: there they
measured faster than grouped_mm + the fused activation kernel on the H200; gated ones (SwiGLU)
measured slower at every tiling tried (BENCHMARKS.md)."""


def _triton_missing() -> Optional[str]:
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"triton is not importable ({error})"
    return None


def _activation_not_covered(config) -> Optional[str]:
    """Why neither Triton kernel computes this config's activation, or None."""
    if config.activation_func not in KERNEL_ACTIVATIONS or config.moe_apply_probs_on_input:
        return (f"they compute squared ReLU or SiLU (gated or not) with the probs applied after "
                f"the activation; this config has activation_func={config.activation_func!r}, "
                f"moe_apply_probs_on_input={config.moe_apply_probs_on_input}")
    return None


def fused_gemm_not_covered(config) -> Optional[str]:
    """None when the fused GEMM kernels compute this config's experts (squared ReLU or SiLU,
    gated or not, glu_linear_offset, the GLU clamp; probs applied after the activation), else
    why not."""
    return _triton_missing() or _activation_not_covered(config)


def activation_kernel_not_covered(config) -> Optional[str]:
    """None when the fused activation kernel computes this config's activation x probs (as the
    fused GEMMs, without the GLU clamp), else why not."""
    if (reason := _triton_missing() or _activation_not_covered(config)) is not None:
        return reason
    if config.activation_func_clamp_value is not None:
        return (f"it does not clamp; this config has activation_func_clamp_value="
                f"{config.activation_func_clamp_value}")
    return None


def check_expert_kernel(config, setting: Optional[ExpertKernel] = None) -> ExpertKernel:
    """`moe_expert_kernel` (`setting`, where already read: `ExpertSettings.expert_kernel`) as an
    ExpertKernel; one that is not a choice, or a forced "fused_gemm" the fused kernels cannot
    compute, is a TorchExpertsConfigError."""
    if setting is None:
        setting = ExpertSettings.read(config).expert_kernel
    if setting == ExpertKernel.FUSED_GEMM and (reason := fused_gemm_not_covered(config)):
        raise TorchExpertsConfigError(f"moe_expert_kernel='fused_gemm' cannot run: {reason}. "
                                      "Set moe_expert_kernel='grouped_mm' or 'auto'.")
    return ExpertKernel(setting)


@dataclass(frozen=True)
class KernelChoice:
    """What one TorchGroupedMLP runs, resolved once at construction (`resolve_kernels`)."""

    setting: ExpertKernel
    """`moe_expert_kernel` as the config says it: a forced FUSED_GEMM raises where a call cannot
    take it, AUTO falls back to grouped_mm for that call."""
    expert_kernel: ExpertKernel
    """FUSED_GEMM or GROUPED_MM: what the calls take when nothing stands in the way."""
    activation: ActivationImpl
    """The grouped_mm path's activation x probs."""


def resolve_kernels(config, setting: Optional[ExpertKernel] = None) -> KernelChoice:
    """The kernels for this config on this machine (`setting`: its `moe_expert_kernel`, where
    already read); a bad setting is a TorchExpertsConfigError."""
    setting = check_expert_kernel(config, setting)
    expert_kernel = setting
    if setting == ExpertKernel.AUTO:
        on_measured_gpu = (torch.cuda.is_available() and torch.cuda.get_device_capability()
                           in FUSED_GEMM_AUTO_CAPABILITIES)
        measured_faster = on_measured_gpu and not config.gated_linear_unit
        expert_kernel = (ExpertKernel.FUSED_GEMM
                         if measured_faster and fused_gemm_not_covered(config) is None
                         else ExpertKernel.GROUPED_MM)
    activation = (ActivationImpl.FUSED if activation_kernel_not_covered(config) is None
                  else ActivationImpl.EAGER)
    return KernelChoice(setting, expert_kernel, activation)


@functools.lru_cache(maxsize=None)
def _param_gather_hook_code() -> frozenset:
    """The code of the forward pre-hook that Megatron's DistributedDataParallel puts on every
    module under the distributed optimizer with overlap_param_gather (Megatron-LM's
    --overlap-param-gather, Bridge's and NeMo-RL's recipes): it only waits for the all-gather of
    the module's own trainable parameters (and starts the next bucket's), ignoring its input."""
    try:
        from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    except ImportError:
        return frozenset()
    make = DistributedDataParallel._make_forward_pre_hook
    return frozenset(c for c in make.__code__.co_consts if isinstance(c, types.CodeType))


def is_param_gather_hook(hook) -> bool:
    """Whether `hook` is Megatron DDP's parameter all-gather pre-hook (_param_gather_hook_code):
    the fused path runs it (run_param_gather_hooks) instead of counting it as a hook it skips."""
    return getattr(hook, "__code__", None) in _param_gather_hook_code()


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether calling `module` runs hooks the fused path would skip: its own forward or backward
    hooks, or global module hooks (`torch.nn.modules.module.register_module_*_hook`). Megatron
    DDP's parameter all-gather pre-hooks do not count: the fused path runs them."""
    hooks = torch.nn.modules.module
    pre_hooks = [h for h in module._forward_pre_hooks.values() if not is_param_gather_hook(h)]
    return any((module._forward_hooks, pre_hooks, module._backward_hooks,
                module._backward_pre_hooks, hooks._global_forward_hooks,
                hooks._global_forward_pre_hooks, hooks._global_backward_hooks,
                hooks._global_backward_pre_hooks))


def run_param_gather_hooks(module: torch.nn.Module, args: tuple) -> None:
    """Run Megatron DDP's parameter all-gather pre-hooks of `module` and its submodules, in the
    order their calls would (a module before its children), as calling them would: the fused
    path reads their parameters without calling them, and the all-gathers must have finished
    (a parameter of the distributed optimizer is stale until then). Waiting twice is a no-op."""
    for sub in module.modules():
        for hook in list(sub._forward_pre_hooks.values()):
            if is_param_gather_hook(hook):
                hook(sub, args)


class FusedAdapter(NamedTuple):
    """An expert linear as the fused kernels see it."""

    base: Optional[torch.nn.Module]
    """The grouped linear whose packed weights the kernels read (None: a module they cannot
    compute)."""
    factors: Optional[Callable[[], Tuple[torch.Tensor, torch.Tensor, float]]] = None
    """Reads the adapter's (A [r, in] or [E, r, in], B [out, r] or [E, out, r], scale) for one
    call, as autograd must see them; None: no adapter term."""
    obstacle: Optional[str] = None
    """Why the kernels cannot compute this adapter (a clause naming the setting), or None."""


AdapterReader = Callable[[torch.nn.Module, type, torch.Tensor], Optional[FusedAdapter]]
ADAPTER_READERS: List[AdapterReader] = []
"""Adapter systems whose wrappers the fused kernels compute add a reader here: called with an
expert linear, the grouped-linear type and the experts' input, it returns the linear's
FusedAdapter when the wrapper is one of theirs, else None. lora.py adds this package's and
integrations/bridge.py Megatron-Bridge's, so the kernels import neither."""


def read_fused_adapter(linear: torch.nn.Module, linear_type: type,
                       x: torch.Tensor) -> FusedAdapter:
    """`linear` (an expert linear, possibly wrapped) as the fused kernels see it."""
    if type(linear) is linear_type:
        return FusedAdapter(linear)
    for reader in ADAPTER_READERS:
        if (found := reader(linear, linear_type, x)) is not None:
            return found
    return FusedAdapter(None)


def hooked(modules: Mapping[str, torch.nn.Module]) -> Optional[str]:
    """Which of the named modules ({what: module}) carry hooks that the fused kernels would
    skip, as a clause, or None."""
    names = [name for name, module in modules.items() if has_hooks(module)]
    return f"{' and '.join(names)} carry hooks that it would skip" if names else None


class FusedGemmPlan(NamedTuple):
    """One call's verdict on the fused GEMM path (`plan_fused_gemm`): the expert linears as the
    kernels see them, read once (where the path cannot run, those read up to the obstacle), and
    why it cannot run (None: it can)."""

    views: Tuple[FusedAdapter, ...]
    obstacle: Optional[str]
    """The error a forced "fused_gemm" raises: the reason and the fix."""
    reason: Optional[str] = None
    """The obstacle's cause alone, as a clause (what "auto" logs when it runs grouped_mm)."""


def plan_fused_gemm(linears: Sequence[torch.nn.Module], linear_type: type,
                    hidden: torch.Tensor) -> FusedGemmPlan:
    """Read each of `linears` (fc1, fc2) once as the fused kernels see it, and decide whether this
    call can take the fused GEMM path, which calls the packed weights directly (skipping
    `linears`' own calls): each linear must be a plain `linear_type` without hooks, or an adapter
    wrapper around one that a reader of ADAPTER_READERS says the kernels compute, and the input
    on CUDA (or under triton's interpreter). The forward uses the views it returns."""
    views = []
    for name, linear in zip(("linear_fc1", "linear_fc2"), linears):
        view = read_fused_adapter(linear, linear_type, hidden)
        views.append(view)
        reason = None
        if view.base is None:
            reason = (f"{name} is a {type(linear).__name__}, an adapter wrapper or module it "
                      "cannot compute")
        elif has_hooks(view.base):
            reason = f"{name} carries hooks that it would skip"
        elif view.obstacle is not None:
            reason = f"{name}'s {view.obstacle}"
        if reason is not None:
            return FusedGemmPlan(tuple(views), (
                "moe_expert_kernel='fused_gemm' runs the packed expert weights directly, but "
                f"linear_fc1/linear_fc2 carry adapters or hooks that it would skip ({reason});"
                " set moe_expert_kernel='grouped_mm' or 'auto' for such adapters or hooks on "
                "the experts."), reason)
    if not hidden.is_cuda and not TRITON_INTERPRETER:
        return FusedGemmPlan(tuple(views), (
            f"moe_expert_kernel='fused_gemm' runs Triton kernels on CUDA tensors; the "
            f"input is on {hidden.device}. Move the module to CUDA or set "
            "moe_expert_kernel='grouped_mm' or 'auto'."), f"the input is on {hidden.device}")
    return FusedGemmPlan(tuple(views), None)


def fused_gemm_obstacle(linears: Sequence[torch.nn.Module], linear_type: type,
                        hidden: torch.Tensor) -> Optional[str]:
    """Why this call cannot take the fused GEMM path, or None when it can (`plan_fused_gemm`)."""
    return plan_fused_gemm(linears, linear_type, hidden).obstacle
