"""TorchGroupedMLP: Megatron-Core experts whose frozen BF16 weights run through torch grouped GEMM.

Each projection keeps its E expert weights in one contiguous, non-persistent buffer
`[E, out, in]`; the Parameters `weight0 .. weight{E-1}` are views into it, so parameter objects
and state-dict keys are those of TEGroupedMLP and nothing new is checkpointed.
"""

import contextlib
import logging
import weakref
from typing import Callable, List, Optional, Tuple

import torch
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from megatron.core.utils import get_pg_rank, get_pg_size

from . import _compat
from .config import validate_torch_experts_config
from .errors import TorchExpertsConfigError
from .kernels.choice import (
    ActivationImpl,
    ExpertKernel,
    FusedAdapter,
    plan_fused_gemm,
    resolve_kernels,
    run_param_gather_hooks,
)
from .kernels.grouped_gemm import Splits, find_grouped_mm, frozen_grouped_linear, group_offsets
from .packing import PackedExpertWeights
from .routed_tokens import RoutedTokens
from .settings import ExpertSettings

ON_BUILD: List[Callable[[], None]] = []
"""Called, without arguments, whenever a TorchGroupedMLP is built: integrations that must know
the experts before they are used add themselves here."""

logger = logging.getLogger("mcore_torch_experts")
_BUILT: "weakref.WeakSet[TorchGroupedMLP]" = weakref.WeakSet()
_summary_logged = False
_LOGGED_AUTO_FALLBACKS = set()


def experts_summary(first_call: Optional[str] = None) -> str:
    """One line on the TorchGroupedMLP modules alive in this process: how many, their expert
    weights (how many frozen, packed size) and the kernels they run: `first_call`, the path the
    first forward took, where given; else each module's kernels on its weights' device."""
    modules = sorted(_BUILT, key=id)
    linears = [linear for m in modules for linear in m.modules()
               if isinstance(linear, TorchGroupedLinear)]  # adapter wrappers hold them
    weights = [w for linear in linears for w in linear.expert_weights()]
    frozen = sum(not w.requires_grad for w in weights)
    gib = sum(linear.packed_weight.numel() * linear.packed_weight.element_size()
              for linear in linears) / 2**30
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    kernels = ([first_call] if first_call is not None else
               sorted({m.path_taken(m.kernels.expert_kernel == ExpertKernel.FUSED_GEMM,
                                    m.linear_fc1.packed_weight.is_cuda) for m in modules}))
    return (f"mcore_torch_experts: rank {rank} runs TorchGroupedMLP experts in {len(modules)} "
            f"MoE layer(s): {len(weights)} expert weights ({gib:.2f} GiB packed), {frozen} of them "
            f"frozen; {'; '.join(kernels)}")


def _log_summary_once(first_call: str) -> None:
    """Log experts_summary() at the first forward of any TorchGroupedMLP in this process (every
    module is built by then), with the path that forward takes."""
    global _summary_logged
    _summary_logged = True
    logger.info(experts_summary(first_call))


def _expert_rng_fork():
    """Context in which expert weights are initialised on the GPU (Megatron's expert RNG)."""
    tracker = get_cuda_rng_tracker()
    if torch.cuda.is_available() and tracker.is_initialized():
        return tracker.fork(get_expert_parallel_rng_tracker_name())
    return contextlib.nullcontext()


class TorchGroupedLinear(PackedExpertWeights):
    """E frozen, bias-free expert linears packed in one buffer (packing.py).

    forward(x [T, in], tokens_per_expert [E]) -> (y [T, out], None): the call contract of
    Megatron's grouped linears, so adapter wrappers (`base(x, *args)`) work unchanged.
    Megatron-Bridge's PEFT reads `config`, `parallel_mode`, `in_features`/`out_features` (local
    shard) and `num_gemms` (= num_experts), as on a TE grouped linear.
    """

    def __init__(self, num_experts: int, input_size: int, output_size: int, *,
                 config: TransformerConfig, init_method, parallel_mode: str, stride: int,
                 pg_collection, name: str):
        tp_size = get_pg_size(pg_collection.expt_tp)
        local_out, local_in, partition_dim = local_shard(input_size, output_size, parallel_mode,
                                                         tp_size)
        device = torch.device("cpu") if config.use_cpu_initialization else torch.device(
            "cuda", torch.cuda.current_device())
        super().__init__(num_experts, local_out, local_in, dtype=config.params_dtype,
                         device=device, name=name)
        self.config = config
        self.num_gemms = num_experts
        self.parallel_mode = parallel_mode
        self._pg_collection = pg_collection
        self.in_features, self.out_features = local_in, local_out
        # The weights' tensor-parallel attributes, on the module too: weight converters that
        # classify a module by them (Megatron-Bridge's AutoMapping) see fc1 as column-parallel
        # and fc2 as row-parallel, as they do TE's grouped linears by class name.
        self.tensor_model_parallel = True
        self.partition_dim = partition_dim
        # Refused here, naming the fix, where torch has no grouped GEMM; calls go through the
        # kernels' one seam (kernels.grouped_gemm.grouped_mm).
        self.grouped_mm_name = find_grouped_mm().name
        self._register_load_state_dict_pre_hook(self._drop_per_expert_extra_states)
        expert_parallel = config.expert_model_parallel_size > 1
        for weight in self.expert_weights():
            set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
            weight.allreduce = not expert_parallel
            if config.perform_initialization:
                self._initialize(weight, init_method, output_size, input_size, partition_dim,
                                 stride, tp_size)

    def _initialize(self, weight, init_method, output_size, input_size, partition_dim, stride,
                    tp_size):
        if self.config.use_cpu_initialization:
            _initialize_affine_weight_cpu(
                weight, output_size, input_size,
                self.out_features if partition_dim == 0 else self.in_features,
                partition_dim, init_method, stride=stride, params_dtype=self.config.params_dtype,
                rank=get_pg_rank(self._pg_collection.expt_tp), world_size=tp_size,
                skip_set_tensor_parallel_attributes=True)
        else:
            with _expert_rng_fork():
                init_method(weight.data)

    def get_extra_state(self):
        """Key parity with TE grouped linears (`<module>._extra_state`); nothing to store."""
        return None

    def set_extra_state(self, state):
        """Accept the extra state of a TE or Megatron checkpoint; BF16 weights need none."""

    def _drop_per_expert_extra_states(self, state_dict, prefix, *args):
        """A distributed checkpoint hands back `_extra_state1 ..` (one per expert, as TE splits
        them); like TE, fold them into the single `_extra_state`."""
        for i in range(1, self.num_experts):
            state_dict.pop(f"{prefix}_extra_state{i}", None)

    def forward(self, x: torch.Tensor, tokens_per_expert: Splits):
        weight, offs = self.weight_and_offsets(x, tokens_per_expert)
        return frozen_grouped_linear(x, weight, offs), None

    def weight_and_offsets(self, x: torch.Tensor, tokens_per_expert: Splits,
                           num_rows: Optional[int] = None):
        """Check x [T, in] against the weights; (packed weight [E, out, in], offsets int32 [E])
        of num_rows rows (default T)."""
        weight = self.packed(refuse_trainable=torch.is_grad_enabled())
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"{self.name} expects input [T, {self.in_features}], got {list(x.shape)}")
        if x.dtype != weight.dtype:
            raise TypeError(f"{self.name}: input dtype {x.dtype} differs from weight dtype {weight.dtype}")
        if x.is_cuda and x.dtype != torch.bfloat16:
            raise TypeError(
                f"{self.name}: grouped GEMM's fast path on CUDA needs bfloat16, got {x.dtype}; "
                "set bf16=True and params_dtype=torch.bfloat16."
            )
        if x.device != weight.device:
            raise ValueError(f"{self.name}: input on {x.device}, weights on {weight.device}")
        rows = x.shape[0] if num_rows is None else num_rows
        return weight, group_offsets(tokens_per_expert, self.num_experts, rows, x.device)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """One ShardedTensor per expert under the keys TE grouped linears use."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton_local_shards = metadata.get("singleton_local_shards", False)
        tp_axis = 0 if self.parallel_mode == "column" else 1
        ep_group = self._pg_collection.ep
        num_global = get_pg_size(ep_group) * self.num_experts
        first_global = get_pg_rank(ep_group) * self.num_experts
        ep_axis = len(sharded_offsets)
        expert_dp_rank = get_pg_rank(self._pg_collection.expt_dp)
        result = {}
        for i, weight in enumerate(self.expert_weights()):
            global_idx = first_global + i
            if singleton_local_shards:
                expert_prefix, offsets = f"{global_idx}.{prefix}", sharded_offsets
            else:
                expert_prefix = prefix
                offsets = (*sharded_offsets, (ep_axis, global_idx, num_global))
            local = {f"{i}.weight": weight, f"{i}._extra_state": None}
            sub = make_sharded_tensors_for_checkpoint(
                local, "", {f"{i}.weight": tp_axis}, offsets,
                tp_group=self._pg_collection.expt_tp, dp_cp_group=metadata.get("dp_cp_group"))
            replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
            result[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            result[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
        for sharded in result.values():
            sharded.replica_id = (*sharded.replica_id[:2], expert_dp_rank)
        return result

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, "
                f"grouped_mm={self.grouped_mm_name}")


def local_shard(input_size: int, output_size: int, parallel_mode: str, tp_size: int) -> tuple:
    """(local_out, local_in, partition_dim) of one expert linear on one expert-TP rank: a column-
    parallel linear splits its output, a row-parallel one its input."""
    if parallel_mode == "column":
        return output_size // tp_size, input_size, 0
    return output_size, input_size // tp_size, 1


def expert_linear_sizes(config: TransformerConfig) -> tuple:
    """((input, output) of linear_fc1, of linear_fc2), unsharded: the experts read and write
    moe_latent_size when set, else hidden_size; fc1 holds gate and up under GLU."""
    io_size = config.hidden_size if config.moe_latent_size is None else config.moe_latent_size
    ffn = config.moe_ffn_hidden_size
    return (io_size, ffn * (2 if config.gated_linear_unit else 1)), (ffn, io_size)


def local_weight_shapes(config: TransformerConfig, etp_size: int) -> tuple:
    """Each expert's [out, in] weight shapes of linear_fc1 and linear_fc2 on one expert-TP rank,
    as TorchGroupedMLP packs them."""
    return tuple(list(local_shard(*sizes, mode, etp_size)[:2])
                 for sizes, mode in zip(expert_linear_sizes(config), ("column", "row")))


class TorchGroupedMLP(MegatronModule):
    """Drop-in experts module: fc1 grouped GEMM, activation x probs (FP32), fc2 grouped GEMM.

    forward(permuted_hidden [T, H], tokens_per_expert [E], permuted_probs [T]) -> (out [T, H], None)
    with rows contiguous by local expert and sum(tokens_per_expert) == T. H is the hidden size, or
    moe_latent_size when set. tokens_per_expert may be a list, a CPU (or pinned) tensor, checked on
    the host, or a device tensor, checked without a host sync. Segments are taken as they arrive,
    pre-padded ones too: TEGroupedMLP pads them only for FP8/FP4 (refused here), so
    skip_routed_expert_padding needs no check. The flex dispatcher: docs/scale_out.md.
    permuted_hidden may instead be RoutedTokens (tokens [tokens, H] and the token of each of the
    T rows, from FP32CombineMoELayer on the allgather dispatcher): the fused kernels read the
    rows in place, the other paths gather them.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules=None,
                 pg_collection=None, name: Optional[str] = None):
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        ep_size = get_pg_size(self.ep_group)
        etp_size = get_pg_size(self.tp_group)
        settings = ExpertSettings.read(config)  # this module's one read of them
        validate_torch_experts_config(config, ep_size, etp_size, settings)
        if num_local_experts * ep_size != config.num_moe_experts:
            raise ValueError(
                f"num_local_experts={num_local_experts} x expert parallel size {ep_size} != "
                f"num_moe_experts={config.num_moe_experts}"
            )
        fc1_sizes, fc2_sizes = expert_linear_sizes(config)
        prefix = f"{name}." if name else ""
        self.linear_fc1 = TorchGroupedLinear(
            num_local_experts, *fc1_sizes,
            config=config, init_method=config.init_method, parallel_mode="column",
            stride=2 if config.gated_linear_unit else 1, pg_collection=pg_collection,
            name=f"{prefix}linear_fc1")
        self.linear_fc2 = TorchGroupedLinear(
            num_local_experts, *fc2_sizes,
            config=config, init_method=config.output_layer_init_method, parallel_mode="row",
            stride=1, pg_collection=pg_collection, name=f"{prefix}linear_fc2")
        self.grouped_mm_name = self.linear_fc1.grouped_mm_name
        self.batch_invariant = settings.batch_invariant
        """batch_invariant_mode=True: every forward first checks that Megatron's batch-invariant
        kernels are on (they make the shared adapters' matmuls invariant; the rest of this path
        is by itself)."""
        for hook in ON_BUILD:
            hook()
        self.kernels = resolve_kernels(config, settings.expert_kernel)
        """The kernels this module runs (kernels/choice.py), resolved from `moe_expert_kernel`
        and the config's activation at construction: "fused_gemm", fc1 with activation x probs
        in its epilogue and fc2's input gradient with the activation's backward in its epilogue,
        a LoRA adapter of ours on either linear in the same kernels (`fused_gemm_obstacle` names
        what is not); "grouped_mm", four grouped_mm GEMMs with the activation between them
        (one Triton kernel on CUDA where `kernels.activation` is "fused", torch ops otherwise),
        adapters called as modules."""
        self.last_expert_kernel: Optional[ExpertKernel] = None
        """The expert kernel the latest forward ran (FUSED_GEMM or GROUPED_MM; None before the
        first): what a profile or a test reads to know the path a call took."""
        _BUILT.add(self)

    def activation(self, fc1_out: torch.Tensor) -> torch.Tensor:
        """Megatron's expert activation: act(x), or act(gate) * (up + offset) for GLU."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(fc1_out)
        gate, up = torch.chunk(fc1_out, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate = gate.clamp(min=None, max=clamp)
            up = up.clamp(min=-clamp, max=clamp)
        if config.glu_linear_offset:
            up = up + config.glu_linear_offset
        return config.activation_func(gate) * up

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: Splits,
                permuted_probs: torch.Tensor, output_buffer: Optional[torch.Tensor] = None,
                grad_input_buffer: Optional[torch.Tensor] = None):
        """output_buffer / grad_input_buffer: NCCL-EP zero copy's buffers for the fc2 output and
        the fc1 input gradient, which MoELayer (0.19) passes only when set. As on TEGroupedMLP's
        path without the TE op fuser, a buffer is refused: the config refusal
        (moe_ncclep_zero_copy) keeps the dispatcher from making them."""
        if output_buffer is not None or grad_input_buffer is not None:
            given = [name for name, buffer in (("output_buffer", output_buffer),
                                               ("grad_input_buffer", grad_input_buffer))
                     if buffer is not None]
            raise TorchExpertsConfigError(
                f"TorchGroupedMLP got {' and '.join(given)} (NCCL-EP zero copy): it allocates its "
                "own outputs, and only TE's op fuser writes into the dispatcher's buffers; set "
                f"moe_ncclep_zero_copy=False and {_compat.ncclep_dynamic_shape_setting()}.")
        if self.batch_invariant:
            _check_batch_invariant_kernels_on()
        hidden, routed = permuted_local_hidden_states, None
        if isinstance(hidden, RoutedTokens):  # FP32CombineMoELayer: the tokens and a row index
            hidden, routed = hidden.tokens, hidden
        probs = permuted_probs.unsqueeze(-1)
        if self.config.moe_apply_probs_on_input:
            hidden, routed = (hidden if routed is None else routed.rows()), None
            hidden = (probs * hidden).to(hidden.dtype)
            probs = None
        fused_views = self._fused_gemm_views(hidden)
        self.last_expert_kernel = (ExpertKernel.GROUPED_MM if fused_views is None
                                   else ExpertKernel.FUSED_GEMM)
        if not _summary_logged:
            _log_summary_once(self.path_taken(fused_views is not None, hidden.is_cuda))
        if fused_views is not None:
            return self._fused_forward(fused_views, hidden, tokens_per_expert, permuted_probs,
                                       routed), None
        if routed is not None:
            hidden = routed.rows()
        fc1_out, _ = self.linear_fc1(hidden, tokens_per_expert)
        if self._fused_activation(fc1_out.is_cuda):
            from .kernels.activation_triton import fused_activation_probs

            act = fused_activation_probs(self.config, fc1_out, permuted_probs)
        else:
            act = self.activation(fc1_out)
            if probs is not None:
                act = (act * probs).to(fc1_out.dtype)
        out, _ = self.linear_fc2(act, tokens_per_expert)
        return out, None

    def _fused_activation(self, on_cuda: bool) -> bool:
        """Whether the grouped_mm path applies activation x probs with the Triton kernel: where
        it covers the config, on CUDA tensors; torch ops otherwise."""
        return self.kernels.activation == ActivationImpl.FUSED and on_cuda

    def path_taken(self, fused_gemm: bool, on_cuda: bool) -> str:
        """The path of a call, as the log line names it: the grouped GEMM entry point, the expert
        kernel and where activation x probs runs."""
        if fused_gemm:
            return (f"{self.grouped_mm_name}, expert kernel {ExpertKernel.FUSED_GEMM}, activation "
                    "in its fc1 epilogue")
        activation = ActivationImpl.FUSED if self._fused_activation(on_cuda) else ActivationImpl.EAGER
        return f"{self.grouped_mm_name}, expert kernel {ExpertKernel.GROUPED_MM}, activation {activation}"

    def _fused_forward(self, views: Tuple[FusedAdapter, FusedAdapter], hidden, tokens_per_expert,
                       permuted_probs, routed=None):
        """The fused GEMM path: the packed weights, and the LoRA term of each linear's adapter
        (`views`: fc1 and fc2 as this call's plan read them); with `routed`, hidden is its tokens
        and fc1 reads the rows through its index."""
        from .kernels.fused_experts import LoRATerm, check_lora, fused_experts

        bases, terms = [], []
        for linear, view in zip((self.linear_fc1, self.linear_fc2), views):
            run_param_gather_hooks(linear, (hidden,))  # the calls this path replaces would
            base = view.base
            bases.append(base)
            if view.factors is None:
                terms.append(None)
                continue
            a, b, scale = view.factors()
            term = LoRATerm(a.to(hidden.dtype), b.to(hidden.dtype), float(scale))
            check_lora(term, f"{base.name}.adapter", base.num_experts, base.in_features,
                       base.out_features, hidden.dtype)
            terms.append(term)
        fc1, fc2 = bases
        w1, offs = fc1.weight_and_offsets(hidden, tokens_per_expert,
                                          None if routed is None else routed.num_rows)
        w2 = fc2.packed(refuse_trainable=torch.is_grad_enabled())
        return fused_experts(self.config, hidden, permuted_probs, w1, w2, offs, *terms,
                             routed=routed, chunked_grad=_compat.batch_invariant_kernels_on())

    def _fused_gemm_views(self, hidden: torch.Tensor) -> Optional[Tuple[FusedAdapter, ...]]:
        """fc1 and fc2 as the fused kernels see them when this call takes the fused GEMM path
        (kernels.choice.plan_fused_gemm: each linear is read once per call), else None; a
        forced "fused_gemm" that cannot run raises."""
        if self.kernels.expert_kernel != ExpertKernel.FUSED_GEMM:
            return None
        plan = plan_fused_gemm((self.linear_fc1, self.linear_fc2), TorchGroupedLinear, hidden)
        if plan.obstacle is None:
            return plan.views
        if self.kernels.setting == ExpertKernel.FUSED_GEMM:
            raise RuntimeError(plan.obstacle)
        if plan.reason not in _LOGGED_AUTO_FALLBACKS:  # "auto": said once per reason
            _LOGGED_AUTO_FALLBACKS.add(plan.reason)
            logger.warning(
                "mcore_torch_experts: moe_expert_kernel='auto' runs grouped_mm, not the fused "
                "GEMM kernels it picked for this config, in calls where %s", plan.reason)
        return None

    def backward_dw(self):
        """A no-op: the expert weights are frozen, so there is no weight gradient to compute late.
        MoELayer.backward_dw (Megatron's ExpertsInterface; the 1F1B EP overlap schedule) calls it."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The same keys, global shapes and offsets as TEGroupedMLP (and SequentialMLP)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton_local_shards = metadata.get("singleton_local_shards", False)
        num_global = get_pg_size(self.ep_group) * self.num_local_experts
        first_global = get_pg_rank(self.ep_group) * self.num_local_experts
        result = {}
        for name, module in self._modules.items():
            sub = sharded_state_dict_default(module, f"{name}.", sharded_offsets, metadata,
                                             tp_group=self.tp_group)
            if name == "linear_fc1" and self.config.gated_linear_unit:
                ep_axis = len(sharded_offsets)
                for i in range(self.num_local_experts):
                    offsets = sharded_offsets if singleton_local_shards else (
                        *sharded_offsets, (ep_axis, first_global + i, num_global))
                    key = f"{name}.weight{i}"
                    sub[key] = apply_swiglu_sharded_factory(sub[key], offsets,
                                                            singleton_local_shards)
            if singleton_local_shards:
                replace_prefix_for_sharding(sub, "", f"{prefix}experts.")
            else:
                replace_prefix_for_sharding(sub, f"{name}.", f"{prefix}experts.{name}.")
            result.update({f"{prefix}{k}": v for k, v in sub.items()})
        return result


def _check_batch_invariant_kernels_on() -> None:
    """Refuse a batch_invariant_mode=True forward while Megatron's global batch-invariant mode is
    off: the expert GEMMs and kernels are batch-invariant by themselves, a shared adapter's plain
    matmul (ours, Megatron-Bridge's) only through the mode's `aten::mm`."""
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import (
        is_batch_invariant_mode_enabled,
    )

    if not is_batch_invariant_mode_enabled():
        raise TorchExpertsConfigError(
            "TorchGroupedMLP runs with batch_invariant_mode=True but Megatron's batch-invariant "
            "kernels are off (is_batch_invariant_mode_enabled() is False), so adapter matmuls and "
            "the rest of the model are not batch-invariant: turn them on before the forward with "
            "megatron.core.transformer.custom_layers.batch_invariant_kernels."
            "set_batch_invariant_mode(True, backend='triton') (Megatron-LM's "
            "--batch-invariant-mode does it with DeepGEMM's backend), or set "
            "batch_invariant_mode=False.")
