"""TorchGroupedMLP under Megatron-Core 0.19's flex dispatcher (DeepEP, HybridEP, NCCL-EP).

The all-to-all kernels cannot run here, so each backend's manager gets the state its dispatch()
leaves (shapes, dtypes and devices from the 0.19 code: fused_a2a.py, token_dispatcher.py), and
MoELayer.routed_experts_compute runs unchanged: the manager's permute, the zero-copy buffer
lookup, the experts call, the manager's restore. The restored rows are checked against an FP64
per-expert loop and against SequentialMLP given the same input; settings that hand the experts a
fixed-size buffer or NCCL-EP's zero-copy buffers are refused at build.
"""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from mcore_torch_experts import (
    TorchExpertsConfigError,
    TorchExpertsTransformerConfig,
    TorchGroupedMLP,
    _compat,
)
from support.reference import (
    copy_weights_to_sequential,
    fp64_experts,
    make_config,
    rel_err,
    sequential_mlp,
)

NUM_EXPERTS, HIDDEN, TOPK = 4, 32, 2
TOL = 3e-2  # bf16 inputs and weights against FP64: a few bf16 ulps of relative L2 error
INSTALLED = ".".join(map(str, _compat.megatron_core_release()))
needs_0_19 = pytest.mark.skipif(
    _compat.megatron_core_release() < (0, 19),
    reason=f"the flex dispatcher's NCCL-EP backend and the 0.19 manager state arrived in "
           f"megatron-core 0.19 (installed {INSTALLED})")
# NCCL-EP's modes. 0.19: the flag moe_ncclep_static_shape selects the static shape and the
# dispatcher needs a rank capacity factor either way (it sizes the receive buffer, which the
# dynamic shape narrows to the received rows). 0.20: the flag is gone; a set capacity factor selects
# the static shape, and without it (eager) the receive buffer holds the received rows only.
NCCLEP_STATIC_FLAG = "moe_ncclep_static_shape" in TorchExpertsTransformerConfig.__dataclass_fields__
NCCLEP_DYNAMIC = dict(moe_expert_rank_capacity_factor=2.0) if NCCLEP_STATIC_FLAG else {}
NCCLEP_DYNAMIC_FIX = ("moe_ncclep_static_shape=False" if NCCLEP_STATIC_FLAG
                      else "moe_expert_rank_capacity_factor=None")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (first run on the H200 in a later session)")


def _needs_fields(*fields):
    fields_here = TorchExpertsTransformerConfig.__dataclass_fields__
    missing = [field for field in fields if field not in fields_here]
    return pytest.mark.skipif(bool(missing), reason=f"megatron-core {INSTALLED} has no {missing}")


def build_pair(pg, device="cpu", **config_kw):
    """TorchGroupedMLP and SequentialMLP with the same frozen bf16 weights, on `device`."""
    torch.manual_seed(0)
    config = make_config(hidden=HIDDEN, num_experts=NUM_EXPERTS, moe_router_topk=TOPK,
                         moe_token_dispatcher_type="flex", **config_kw)
    experts = TorchGroupedMLP(NUM_EXPERTS, config, pg_collection=pg)
    seq = sequential_mlp(config, pg)
    copy_weights_to_sequential(experts, seq)
    experts, seq = experts.to(device), seq.to(device)
    for p in [*experts.parameters(), *seq.parameters()]:
        p.requires_grad_(False)
    return config, experts, seq


def received_tokens(num_tokens, device, seed=1):
    """What the all-to-all delivers to this rank: tokens [N, H] bf16, each routed to TOPK
    distinct local experts (some to fewer: a -1 index, as DeepEP marks other ranks' experts),
    with FP32 probs [N, TOPK] (the flex backends take FP32 probs only)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(num_tokens, HIDDEN, generator=gen).bfloat16()
    indices = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOPK]
                           for _ in range(num_tokens)])
    indices[torch.rand(num_tokens, generator=gen) < 0.25, 1] = -1
    probs = torch.rand(num_tokens, TOPK, generator=gen) * (indices >= 0)
    return tokens.to(device), indices.to(device), probs.to(device)


def expert_major(indices, probs):
    """The (token, prob) pairs of each local expert in token order, and the counts [E] (CPU)."""
    token_ids, pair_probs, counts = [], [], []
    for e in range(NUM_EXPERTS):
        rows, slots = (indices == e).nonzero(as_tuple=True)
        token_ids.append(rows)
        pair_probs.append(probs[rows, slots])
        counts.append(len(rows))
    return torch.cat(token_ids), torch.cat(pair_probs), counts


def fp64_restored(config, experts, tokens, indices, probs):
    """FP64 reference of the restored rows [N, H]: sum_k probs[n, k] * expert_{indices[n, k]}(x_n)."""
    token_ids, pair_probs, counts = expert_major(indices.cpu(), probs.cpu())
    x = tokens.detach().cpu().double().requires_grad_(True)
    out = fp64_experts(config, experts.linear_fc1.packed_weight.cpu(),
                       experts.linear_fc2.packed_weight.cpu(), x[token_ids], counts, pair_probs)
    return torch.zeros(x.shape, dtype=torch.float64).index_add(0, token_ids, out), x


class Recorder:
    """A forward pre-hook that keeps what the experts were called with."""

    def __init__(self, module):
        self.calls = []
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        hidden, splits, probs = args
        self.calls.append(SimpleNamespace(hidden=hidden, splits=splits, probs=probs, kwargs=kwargs))


def routed_experts_compute(config, manager, experts, hidden, dispatched_probs):
    """Megatron's MoELayer.routed_experts_compute on a flex dispatcher around `manager`."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    dispatcher = MoEFlexTokenDispatcher.__new__(MoEFlexTokenDispatcher)
    dispatcher.config, dispatcher._comm_manager = config, manager
    layer = SimpleNamespace(config=config, token_dispatcher=dispatcher, experts=experts)
    output, bias = MoELayer.routed_experts_compute(layer, hidden, dispatched_probs)
    assert bias is None
    return output


def deepep_manager(config, indices, probs, splits_device="cpu"):
    """_DeepepManager after dispatch(): fused_dispatch's recv indices [N, TOPK] int64 (local ids,
    -1 elsewhere), recv probs [N, TOPK] FP32 and `torch.tensor(num_recv_tokens_per_expert_list)`
    (CPU int64)."""
    from megatron.core.transformer.moe.token_dispatcher import _DeepepManager

    manager = _DeepepManager.__new__(_DeepepManager)
    manager.config, manager.num_local_experts = config, NUM_EXPERTS
    manager.permute_fusion, manager.router_dtype = False, config.moe_router_dtype
    manager.dispatched_indices, manager.dispatched_probs = indices, probs
    manager.tokens_per_expert = torch.tensor(expert_major(indices.cpu(), probs.cpu())[2],
                                             device=splits_device)
    return manager


def expert_major_buffer(tokens, indices, probs, rows=None, fill=0.0):
    """The receive buffer HybridEP / NCCL-EP hand over: rows grouped by local expert, [rows, H]
    bf16 (rows past the received ones hold `fill`), their FP32 probs [rows] and counts [E]."""
    token_ids, pair_probs, counts = expert_major(indices.cpu(), probs.cpu())
    rows = rows or len(token_ids)
    buffer = torch.full((rows, HIDDEN), fill, dtype=tokens.dtype, device=tokens.device)
    buffer_probs = torch.full((rows,), fill, dtype=torch.float32, device=tokens.device)
    buffer[:len(token_ids)] = tokens[token_ids.to(tokens.device)]
    buffer_probs[:len(token_ids)] = pair_probs.to(tokens.device)
    return buffer, buffer_probs, counts, token_ids


def scatter_to_tokens(rows_out, token_ids, num_tokens):
    """Sum expert-major rows back to their tokens (what HybridEP's / NCCL-EP's combine does)."""
    return rows_out.new_zeros(num_tokens, HIDDEN, dtype=torch.float64).index_add(
        0, token_ids.to(rows_out.device), rows_out[:len(token_ids)].double())


def check_against_references(config, experts, other, run, tokens, indices, probs):
    """run(experts module, tokens requiring grad) -> restored [N, H]: TorchGroupedMLP against
    the FP64 loop (output and input gradient) and against `other` (SequentialMLP or
    TEGroupedMLP with the same weights) on the same path."""
    expected, x64 = fp64_restored(config, experts, tokens, indices, probs)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    expected.backward(grad)
    outputs = {}
    for name, module in (("torch", experts), ("other", other)):
        x = tokens.detach().clone().requires_grad_(True)
        out = run(module, x)
        out.backward(grad.to(out.dtype).to(out.device))
        outputs[name] = (out.detach().cpu(), x.grad.cpu())
    out, dx = outputs["torch"]
    assert rel_err(out, expected.detach()) < TOL
    assert rel_err(dx, x64.grad) < TOL
    assert rel_err(out, outputs["other"][0]) < TOL
    assert rel_err(dx, outputs["other"][1]) < TOL


@needs_0_19
@pytest.mark.parametrize("router_dtype", [None, "fp64"], ids=["fp32_probs", "fp64_probs"])
def test_deepep_contract(megatron_cpu, router_dtype):
    """DeepEP: CPU int64 splits, exactly sum(splits) rows (permute with num_out_tokens=sum),
    FP32 probs (FP64 with moe_router_dtype='fp64'), no keyword arguments."""
    config, experts, seq = build_pair(megatron_cpu, moe_flex_dispatcher_backend="deepep",
                                      moe_router_dtype=router_dtype)
    tokens, indices, probs = received_tokens(24, "cpu")
    recorder = Recorder(experts)

    def run(module, x):
        manager = deepep_manager(config, indices, probs)
        return routed_experts_compute(config, manager, module, x, probs)

    check_against_references(config, experts, seq, run, tokens, indices, probs)
    call = recorder.calls[0]
    assert call.kwargs == {}
    assert call.splits.device.type == "cpu" and call.splits.dtype == torch.int64
    assert call.hidden.shape == (int(call.splits.sum()), HIDDEN)
    assert call.probs.shape == (call.hidden.shape[0],)
    assert call.probs.dtype == (torch.float64 if router_dtype == "fp64" else torch.float32)


@needs_0_19
def test_hybridep_contract(megatron_cpu):
    """HybridEP without a budget: the dispatch's expert-major buffer as is, sum(splits) rows,
    FP32 probs [rows]; its restore hands the rows straight to its combine."""
    from megatron.core.transformer.moe.token_dispatcher import _HybridEPManager

    config, experts, seq = build_pair(megatron_cpu, moe_flex_dispatcher_backend="hybridep")
    tokens, indices, probs = received_tokens(24, "cpu")
    _, _, counts, token_ids = expert_major_buffer(tokens, indices, probs)

    def run(module, x):
        buffer, buffer_probs, counts, _ = expert_major_buffer(x, indices, probs)
        manager = _HybridEPManager.__new__(_HybridEPManager)
        manager.dispatched_probs, manager.tokens_per_expert = buffer_probs, torch.tensor(counts)
        rows_out = routed_experts_compute(config, manager, module, buffer, buffer_probs)
        assert rows_out.shape == buffer.shape
        return scatter_to_tokens(rows_out, token_ids, x.shape[0])

    check_against_references(config, experts, seq, run, tokens, indices, probs)


@needs_0_19
def test_hybridep_drop_and_pad_segments_are_not_padded_again(megatron_cpu):
    """HybridEP with moe_pad_expert_input_to_capacity: every local expert's segment arrives
    padded to the capacity (tokens_per_expert = full(capacity), CPU int64), the pad rows zero
    with zero probs; skip_routed_expert_padding holds, and the output keeps every row."""
    from megatron.core.transformer.moe.moe_utils import skip_routed_expert_padding

    config, experts, seq = build_pair(megatron_cpu, moe_flex_dispatcher_backend="hybridep",
                                      moe_expert_capacity_factor=2.0,
                                      moe_pad_expert_input_to_capacity=True)
    assert skip_routed_expert_padding(config)
    tokens, indices, probs = received_tokens(12, "cpu")
    token_ids, pair_probs, counts = expert_major(indices, probs)
    capacity = max(counts) + 3
    padded = torch.zeros(NUM_EXPERTS * capacity, HIDDEN, dtype=tokens.dtype)
    padded_probs = torch.zeros(NUM_EXPERTS * capacity)
    slots = torch.cat([e * capacity + torch.arange(c) for e, c in enumerate(counts)])
    padded[slots], padded_probs[slots] = tokens[token_ids], pair_probs
    splits = torch.full((NUM_EXPERTS,), capacity, dtype=torch.long)

    out, _ = experts(padded, splits, padded_probs)
    assert out.shape == padded.shape
    pad_rows = torch.ones(len(padded), dtype=torch.bool)
    pad_rows[slots] = False
    assert torch.count_nonzero(out[pad_rows]) == 0
    expected, _ = fp64_restored(config, experts, tokens, indices, probs)
    restored = torch.zeros_like(expected).index_add(0, token_ids, out[slots].double())
    assert rel_err(restored, expected) < TOL
    seq_out, _ = seq(padded, splits, padded_probs)
    assert rel_err(out, seq_out) < TOL


def ncclep_manager(config, buffer_probs, counts, recv_capacity, static_shape=False):
    """_NCCLEPManager after dispatch(): ep_dispatch's recv buffer [recv_capacity, H], per-slot
    FP32 probs [recv_capacity] and counts (`tokens_per_expert.to(torch.int64)`, on the device)."""
    from megatron.core.transformer.moe.token_dispatcher import _NCCLEPManager

    manager = _NCCLEPManager.__new__(_NCCLEPManager)
    manager.static_shape, manager._recv_capacity = static_shape, recv_capacity  # 0.19
    manager.eager = not static_shape  # 0.20
    manager.dispatched_probs = buffer_probs
    manager.tokens_per_expert = torch.tensor(counts, dtype=torch.int32,
                                             device=buffer_probs.device).to(torch.int64)
    return manager


@needs_0_19
def test_ncclep_contract(megatron_cpu):
    """NCCL-EP (0.19's dynamic shape, 0.20's eager mode): the experts get the sum(splits) received
    rows (0.19: the receive buffer narrowed by the dispatcher's own host sync, and the restore
    re-expands to the receive capacity; 0.20: TE sizes the buffer to them), int64 splits on the
    buffer's device, FP32 probs. What lies past the received rows is never read."""
    config, experts, seq = build_pair(megatron_cpu, moe_flex_dispatcher_backend="ncclep",
                                      **NCCLEP_DYNAMIC)
    tokens, indices, probs = received_tokens(24, "cpu")
    _, _, counts, token_ids = expert_major_buffer(tokens, indices, probs)
    recv_capacity = sum(counts) + (16 if NCCLEP_STATIC_FLAG else 0)
    recorder = Recorder(experts)

    def run(module, x):
        buffer, buffer_probs, _, _ = expert_major_buffer(x, indices, probs, rows=recv_capacity,
                                                         fill=float("nan"))
        manager = ncclep_manager(config, buffer_probs, counts, recv_capacity)
        rows_out = routed_experts_compute(config, manager, module, buffer, buffer_probs)
        assert rows_out.shape == (recv_capacity, HIDDEN)
        assert torch.count_nonzero(rows_out[sum(counts):]) == 0
        return scatter_to_tokens(rows_out, token_ids, x.shape[0])

    check_against_references(config, experts, seq, run, tokens, indices, probs)
    call = recorder.calls[0]
    assert call.kwargs == {} and call.splits.dtype == torch.int64
    assert call.hidden.shape == (sum(counts), HIDDEN) and call.probs.dtype == torch.float32


@needs_0_19
def test_ncclep_zero_copy_buffers_are_refused(megatron_cpu, monkeypatch):
    """With zero copy's buffers set, MoELayer passes output_buffer / grad_input_buffer: refused
    by name (TEGroupedMLP takes them only on the TE op fuser path)."""
    from megatron.core.transformer.moe.token_dispatcher import _NCCLEPManager

    config, experts, _ = build_pair(megatron_cpu, moe_flex_dispatcher_backend="ncclep",
                                    **NCCLEP_DYNAMIC)
    tokens, indices, probs = received_tokens(8, "cpu")
    buffer, buffer_probs, counts, _ = expert_major_buffer(tokens, indices, probs)
    monkeypatch.setattr(_NCCLEPManager, "_zc_fwd_token_buf", torch.empty_like(buffer))
    monkeypatch.setattr(_NCCLEPManager, "_zc_bwd_token_buf", torch.empty_like(buffer))
    manager = ncclep_manager(config, buffer_probs, counts, len(buffer))
    with pytest.raises(TorchExpertsConfigError,
                       match="got output_buffer and grad_input_buffer .NCCL-EP zero copy.*set "
                             f"moe_ncclep_zero_copy=False and {NCCLEP_DYNAMIC_FIX}"):
        routed_experts_compute(config, manager, experts, buffer, buffer_probs)


@needs_0_19
def test_rows_past_the_split_sum_are_refused(megatron_cpu):
    """NCCL-EP's static shape hands over the whole receive buffer; the forward refuses a split
    sum short of the rows (the config refusal below keeps the dispatcher from doing it)."""
    config, experts, _ = build_pair(megatron_cpu, moe_flex_dispatcher_backend="ncclep",
                                    **NCCLEP_DYNAMIC)
    tokens, indices, probs = received_tokens(8, "cpu")
    _, _, counts, _ = expert_major_buffer(tokens, indices, probs)
    buffer, buffer_probs, _, _ = expert_major_buffer(tokens, indices, probs, rows=sum(counts) + 8)
    manager = ncclep_manager(config, buffer_probs, counts, len(buffer), static_shape=True)
    with pytest.raises(ValueError, match=f"sums to {sum(counts)} but the input has "
                                         f"{len(buffer)} rows .rows past the split sum"):
        routed_experts_compute(config, manager, experts, buffer, buffer_probs)


def test_backward_dw_through_moe_layer_is_a_no_op(megatron_cpu):
    """MoELayer.backward_dw (ExpertsInterface) calls experts.backward_dw(): nothing changes."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config, experts, _ = build_pair(megatron_cpu)
    before = [p.detach().clone() for p in experts.parameters()]
    layer = SimpleNamespace(config=config, experts=experts)
    MoELayer.backward_dw(layer, routed_experts=True, shared_experts=False)
    assert all(torch.equal(b, p) and p.grad is None for b, p in zip(before, experts.parameters()))


VALID = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=NUM_EXPERTS,
             moe_ffn_hidden_size=48, moe_grouped_gemm=True, add_bias_linear=False, bf16=True,
             params_dtype=torch.bfloat16, use_cpu_initialization=True,
             moe_token_dispatcher_type="flex", moe_expert_gemm_backend="torch")
NCCLEP_REFUSALS = [
    ("ncclep_static_shape", dict(moe_flex_dispatcher_backend="ncclep",
                                 moe_expert_rank_capacity_factor=1.5,
                                 moe_ncclep_static_shape=True),
     "moe_ncclep_static_shape=True", "set moe_ncclep_static_shape=False"),
    ("ncclep_zero_copy", dict(moe_flex_dispatcher_backend="ncclep",
                              moe_expert_rank_capacity_factor=1.5, moe_ncclep_static_shape=True,
                              moe_ncclep_zero_copy=True),
     "moe_ncclep_zero_copy=True", "set moe_ncclep_zero_copy=False and moe_ncclep_static_shape=False"),
] if NCCLEP_STATIC_FLAG else [
    ("ncclep_static_shape", dict(moe_flex_dispatcher_backend="ncclep",
                                 moe_expert_rank_capacity_factor=1.5),
     "moe_expert_rank_capacity_factor=1.5", "set moe_expert_rank_capacity_factor=None"),
    ("ncclep_zero_copy", dict(moe_flex_dispatcher_backend="ncclep",
                              moe_expert_rank_capacity_factor=1.5, moe_ncclep_zero_copy=True),
     "moe_ncclep_zero_copy=True",
     "set moe_ncclep_zero_copy=False and moe_expert_rank_capacity_factor=None"),
]
FLEX_REFUSALS = [
    ("hybridep_budget", dict(moe_flex_dispatcher_backend="hybridep",
                             moe_expert_rank_capacity_factor=1.5),
     "moe_expert_rank_capacity_factor=1.5", "set moe_expert_rank_capacity_factor=None"),
    *NCCLEP_REFUSALS,
    ("paged_stash", dict(moe_flex_dispatcher_backend="hybridep", moe_paged_stash=True),
     "moe_paged_stash=True", "set moe_paged_stash=False"),
    ("offload_fused_group_mlp", dict(fine_grained_activation_offloading=True,
                                     offload_modules=["fused_group_mlp"]),
     "offload_modules=['fused_group_mlp']", "remove 'fused_group_mlp' from offload_modules"),
]


@pytest.mark.parametrize("settings, named, fix", [case[1:] for case in FLEX_REFUSALS],
                         ids=[case[0] for case in FLEX_REFUSALS])
def test_refused_at_build(megatron_cpu, settings, named, fix):
    """Refused when the config is built (before Megatron's own checks, which ask for the TE op
    fuser) and when TorchGroupedMLP is built from a plain TransformerConfig."""
    missing = sorted(set(settings) - set(TorchExpertsTransformerConfig.__dataclass_fields__))
    if missing:
        pytest.skip(f"megatron-core {INSTALLED} has no {missing}")
    with pytest.raises(TorchExpertsConfigError) as refusal:
        TorchExpertsTransformerConfig(**VALID, **settings)
    assert named in str(refusal.value) and fix in str(refusal.value)
    config = make_config(hidden=HIDDEN, num_experts=NUM_EXPERTS, moe_token_dispatcher_type="flex")
    for field, value in settings.items():
        setattr(config, field, value)
    with pytest.raises(TorchExpertsConfigError, match=named.replace("[", r"\[")):
        TorchGroupedMLP(NUM_EXPERTS, config, pg_collection=megatron_cpu)


@_needs_fields("moe_flex_dispatcher_backend")
@pytest.mark.parametrize("backend", ["deepep", "hybridep", "ncclep"])
def test_supported_flex_configs_build(megatron_cpu, backend):
    """DeepEP, HybridEP (no budget) and NCCL-EP (0.19: dynamic shape, its rank capacity factor
    sizing the receive buffer; 0.20: eager, no capacity factor) build TorchGroupedMLP."""
    settings = dict(moe_flex_dispatcher_backend=backend)
    if backend == "ncclep":
        if "moe_ncclep_zero_copy" not in TorchExpertsTransformerConfig.__dataclass_fields__:
            pytest.skip(f"megatron-core {INSTALLED} has no NCCL-EP backend")
        settings.update(NCCLEP_DYNAMIC)
    config = TorchExpertsTransformerConfig(**VALID, **settings)
    assert isinstance(TorchGroupedMLP(NUM_EXPERTS, config, pg_collection=megatron_cpu),
                      TorchGroupedMLP)


def te_grouped_mlp_with_weights_of(experts, pg):
    """Megatron's TEGroupedMLP (TE grouped linears, no op fuser) holding `experts`' weights."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelGroupedLinear,
        TERowParallelGroupedLinear,
    )
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    config = make_config(hidden=HIDDEN, num_experts=NUM_EXPERTS, moe_router_topk=TOPK,
                         use_cpu_initialization=False)
    submodules = GroupedMLPSubmodules(linear_fc1=TEColumnParallelGroupedLinear,
                                      linear_fc2=TERowParallelGroupedLinear)
    te = TEGroupedMLP(NUM_EXPERTS, config, submodules, pg_collection=pg).cuda()
    with torch.no_grad():
        for name in ("linear_fc1", "linear_fc2"):
            for i, weight in enumerate(getattr(experts, name).expert_weights()):
                getattr(getattr(te, name), f"weight{i}").copy_(weight)
    return te.requires_grad_(False)


@needs_0_19
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["deepep", "deepep_fp64_probs", "hybridep", "ncclep"])
def test_flex_contract_on_cuda(te_world, backend):
    """The same contracts on CUDA, with each backend's split device: DeepEP CPU int64, HybridEP
    pinned host int64, NCCL-EP device int64 (the kernels TorchGroupedMLP picks on this GPU); with
    Transformer Engine importable (the TE leg), TEGroupedMLP on the same path agrees too."""
    router_dtype = "fp64" if backend == "deepep_fp64_probs" else None
    name = backend.split("_")[0]
    extra = NCCLEP_DYNAMIC if name == "ncclep" else {}
    config, experts, seq = build_pair(te_world, "cuda", moe_flex_dispatcher_backend=name,
                                      moe_router_dtype=router_dtype, **extra)
    tokens, indices, probs = received_tokens(64, "cuda")
    _, _, counts, token_ids = expert_major_buffer(tokens, indices, probs)

    def run(module, x):
        if name == "deepep":
            manager = deepep_manager(config, indices, probs)
            return routed_experts_compute(config, manager, module, x, probs)
        if name == "hybridep":
            from megatron.core.transformer.moe.token_dispatcher import _HybridEPManager

            buffer, buffer_probs, _, _ = expert_major_buffer(x, indices, probs)
            manager = _HybridEPManager.__new__(_HybridEPManager)
            manager.dispatched_probs = buffer_probs
            manager.tokens_per_expert = torch.tensor(counts).pin_memory()
        else:
            rows = sum(counts) + (64 if NCCLEP_STATIC_FLAG else 0)
            buffer, buffer_probs, _, _ = expert_major_buffer(x, indices, probs, rows=rows,
                                                             fill=float("nan"))
            manager = ncclep_manager(config, buffer_probs, counts, len(buffer))
        rows_out = routed_experts_compute(config, manager, module, buffer, buffer_probs)
        return scatter_to_tokens(rows_out, token_ids, x.shape[0])

    check_against_references(config, experts, seq, run, tokens, indices, probs)
    if importlib.util.find_spec("transformer_engine") is not None:
        te = te_grouped_mlp_with_weights_of(experts, te_world)
        check_against_references(config, experts, te, run, tokens, indices, probs)
