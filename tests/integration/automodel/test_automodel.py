"""install_fp32_combine on NeMo Automodel's GroupedExperts and its expert LoRA GroupedExpertsLoRA
(nemo-automodel 0.7.0, or 0.4.0 put first on PYTHONPATH; torch_mm experts): fp32_combine runs
inside with the options given, the shipped module's outputs and gradients bit for bit on the CPU
(FP32 and BF16, frozen and trainable experts), the FP64 reference's to FP32 rounding, no full-size
FP32 temporary in forward or backward (peak RSS), in use whether Automodel's PEFT comes before or
after, through Automodel's Qwen3-MoE builder and two optimizer steps, scoped to the modules given
and undoable, and the refusals."""

import copy
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

NOT_INSTALLED = ("nemo-automodel is not installed here (the megatron-core 0.19.2 leg installs "
                 "0.7.0 without its dependencies, scripts/legs.sh)")
automodel_experts = pytest.importorskip("nemo_automodel.components.moe.experts",
                                        reason=NOT_INSTALLED)
BackendConfig = pytest.importorskip(
    "nemo_automodel.components.models.common",
    reason="nemo_automodel's BackendConfig does not import (it needs transformers)").BackendConfig

import nemo_automodel  # noqa: E402
from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules  # noqa: E402
from nemo_automodel.components._peft.lora_experts import GroupedExpertsLoRA  # noqa: E402
from nemo_automodel.components.moe.config import MoEConfig  # noqa: E402
from nemo_automodel.components.moe.experts import GroupedExperts, GroupedExpertsDeepEP  # noqa: E402
from nemo_automodel.components.moe.layers import MoE  # noqa: E402

from mcore_torch_experts import combine  # noqa: E402
from mcore_torch_experts.combine import fp32_combine  # noqa: E402
from mcore_torch_experts.integrations import automodel  # noqa: E402
from mcore_torch_experts.integrations.automodel import (  # noqa: E402
    AutomodelCombineError,
    install_fp32_combine,
    remove_combine,
)
from support.doc_snippets import DOCS, run_snippet  # noqa: E402

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 40, 64, 24, 8, 3
PADDING_TOKEN = 3  # token_mask False: routed nowhere
FP32_TOL = 1e-5  # FP32 GEMMs over HIDDEN / FFN terms, relative to the largest reference value
BF16_TOL = 2e-2  # BF16 GEMMs, relative to the largest reference value


def moe_config(dtype=torch.float32, **overrides) -> MoEConfig:
    fields = dict(n_routed_experts=EXPERTS, n_shared_experts=0, n_activated_experts=TOP_K,
                  n_expert_groups=1, n_limited_groups=1, train_gate=True,
                  gate_bias_update_factor=0.0, aux_loss_coeff=0.0, score_func="softmax",
                  route_scale=1.0, dim=HIDDEN, inter_dim=4 * FFN, moe_inter_dim=FFN,
                  norm_topk_prob=False, dtype=dtype)
    return MoEConfig(**{**fields, **overrides})


def backend(experts="torch_mm"):
    return BackendConfig(experts=experts, dispatcher="torch")


def fill(module: torch.nn.Module, seed=0) -> torch.nn.Module:
    """Weights with unit-scale outputs: normal, std 1/sqrt(fan-in); biases std 0.1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            std = 0.1 if param.dim() < 3 else param.shape[1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    return module


def grouped_experts(dtype=torch.float32, experts="torch_mm", **overrides) -> GroupedExperts:
    return fill(GroupedExperts(moe_config(dtype, **overrides), backend=backend(experts)))


def routed_batch(dtype=torch.float32, tokens=TOKENS, hidden=HIDDEN, experts=EXPERTS, top_k=TOP_K,
                 seed=1):
    """x [T, H], token_mask [T] (one padding token), weights fp32 [T, k] and indices [T, k] (the
    last expert gets no token), grad_y [T, H]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    token_mask = torch.ones(tokens, dtype=torch.bool)
    token_mask[PADDING_TOKEN] = False
    scores, indices = torch.rand(tokens, experts - 1, generator=gen).topk(top_k, dim=1)
    weights = scores.softmax(dim=1)
    grad_y = torch.randn(tokens, hidden, generator=gen).to(dtype)
    return x, token_mask, weights, indices, grad_y


def forward_backward(module, batch, trainable=True):
    """y and the gradients of x, weights and (trainable) every parameter, in that order."""
    x, token_mask, weights, indices, grad_y = batch
    module.requires_grad_(trainable)
    module.zero_grad(set_to_none=True)
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y = module(x, token_mask, weights, indices)
    y.backward(grad_y)
    return [y.detach(), x.grad, weights.grad] + [p.grad for p in module.parameters()]


def assert_bitwise(expected, actual):
    assert len(expected) == len(actual)
    for i, (a, b) in enumerate(zip(expected, actual)):
        assert (a is None) == (b is None), i
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), i


def fp64_reference(module, batch):
    """y [T, H] and the gradients of x, weights and every parameter, in float64: each token's
    sum over its top-k experts of (swiglu(x W1_e + b1_e) * p) W2_e + b2_e * p."""
    x, token_mask, weights, indices, grad_y = batch
    leaves = [t.detach().double().requires_grad_() for t in (x, weights, *module.parameters())]
    x64, w64, w1, w2, *biases = leaves
    tokens, slots = torch.where(token_mask.unsqueeze(1).expand_as(indices))
    expert, probs = indices[tokens, slots], w64[tokens, slots].unsqueeze(1)
    h = torch.einsum("nh,nhf->nf", x64[tokens], w1[expert])
    if biases:
        h = h + biases[0][expert]
    gate, up = h.chunk(2, dim=1)
    rows = torch.einsum("nf,nfh->nh", F.silu(gate) * up * probs, w2[expert])
    if biases:
        rows = rows + biases[1][expert] * probs
    y = torch.zeros(x.shape, dtype=torch.float64).index_add(0, tokens, rows)
    y.backward(grad_y.double())
    return [y.detach()] + [leaf.grad for leaf in leaves]


@pytest.fixture
def combine_calls(monkeypatch):
    """The options of every fp32_combine call an installed module makes: install_fp32_combine
    binds the module's global fp32_combine when it is called, so this spy is what it installs."""
    calls = []
    monkeypatch.setattr(automodel, "fp32_combine",
                        lambda *a, **k: calls.append(k) or fp32_combine(*a, **k))
    return calls


# --- same outputs and gradients as shipped -------------------------------------------------------

@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("expert_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("chunk_rows", [0, 5], ids=["single-shot", "chunks-of-5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_same_outputs_and_gradients_as_shipped_bitwise(combine_calls, dtype, chunk_rows,
                                                      expert_bias, trainable):
    """On the CPU scatter-add sums each token's rows in row order, and so does the torch combine,
    in chunks or not; its backward gathers the same FP32 gradient rows and casts them once."""
    module = grouped_experts(dtype, expert_bias=expert_bias)
    batch = routed_batch(dtype)
    shipped = forward_backward(module, batch, trainable)
    assert install_fp32_combine(module, chunk_rows=chunk_rows, backend="torch") == [""]
    inputs = [t.clone() for t in batch]
    combined = forward_backward(module, batch, trainable)
    assert combine_calls == [dict(chunk_rows=chunk_rows, backend="torch")]
    assert_bitwise(shipped, combined)
    assert all(torch.equal(a, b) for a, b in zip(inputs, batch))  # inputs never modified


@pytest.mark.parametrize("expert_bias", [False, True], ids=["no-bias", "bias"])
def test_matches_fp64_reference_to_fp32_rounding(combine_calls, expert_bias):
    module = grouped_experts(expert_bias=expert_bias)
    batch = routed_batch()
    install_fp32_combine(module, chunk_rows=5, backend="torch")
    combined = forward_backward(module, batch)
    assert combine_calls == [dict(chunk_rows=5, backend="torch")]
    reference = fp64_reference(module, batch)
    assert len(combined) == len(reference) == 5 + 2 * expert_bias
    for actual, expected in zip(combined, reference):
        bound = FP32_TOL * expected.abs().max()
        assert (actual.double() - expected).abs().max() <= bound
    assert torch.equal(combined[0][PADDING_TOKEN], torch.zeros(HIDDEN))


def test_no_routed_rows_runs_the_shipped_dummy_graph(combine_calls):
    """No token routed to a local expert: the shipped method's zeros and graph, no combine."""
    module = grouped_experts()
    x, token_mask, weights, indices, grad_y = routed_batch()
    batch = (x, torch.zeros_like(token_mask), weights, indices, grad_y)
    shipped = forward_backward(module, batch)
    install_fp32_combine(module, backend="torch")
    assert_bitwise(shipped, forward_backward(module, batch))
    assert combine_calls == []


@pytest.mark.skipif(torch.cuda.is_available(), reason=(
    "on a CUDA host the kernel runs compiled: test_triton_backend_on_cuda_matches_fp64_and_"
    "reproduces (the Triton 3.6 interpreter cannot take a loaded scalar as a loop bound under "
    "numpy 2.5, and CUDA images ship those)"))
@pytest.mark.triton_interpreter
def test_triton_backend_matches_shipped_bitwise_in_fp32(combine_calls):
    """The fused kernel also adds each token's rows in row order from zero; in FP32 its backward
    writes the gradient rows uncast."""
    pytest.importorskip("triton", reason="triton is not installed: the fused kernel is untested")
    module = grouped_experts()
    batch = routed_batch()
    shipped = forward_backward(module, batch)
    install_fp32_combine(module, backend="triton")
    assert_bitwise(shipped, forward_backward(module, batch))
    assert combine_calls == [dict(chunk_rows=None, backend="triton")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_backend_on_cuda_matches_fp64_and_reproduces(combine_calls):
    """Compiled, in BF16 as trained: output and every gradient within BF16 rounding of the FP64
    reference and of the shipped module (whose scatter-add uses CUDA atomics), bit-identical run
    to run."""
    cpu_module = grouped_experts(torch.bfloat16)
    cpu_batch = routed_batch(torch.bfloat16)
    reference = fp64_reference(cpu_module, cpu_batch)
    module = cpu_module.cuda()
    batch = [t.cuda() for t in cpu_batch]
    shipped = forward_backward(module, batch)
    install_fp32_combine(module, backend="triton")
    first, second = forward_backward(module, batch), forward_backward(module, batch)
    assert combine_calls == [dict(chunk_rows=None, backend="triton")] * 2
    assert_bitwise(first, second)
    assert len(first) == len(reference) == 5
    for actual, from_shipped, expected in zip(first, shipped, reference):
        bound = BF16_TOL * expected.abs().max()
        assert (actual.double().cpu() - expected).abs().max() <= bound
        assert (actual.double() - from_shipped.double()).abs().max() <= bound
    assert torch.equal(first[0][PADDING_TOKEN].cpu(), torch.zeros(HIDDEN))


# --- peak memory ---------------------------------------------------------------------------------

# Peak RSS above the start of each call in a fresh process (harness.Meter: VmHWM reset through
# /proc/self/clear_refs; MALLOC_MMAP_THRESHOLD_ maps and unmaps every buffer of 64 KiB or more on
# its own, so each temporary shows). One warm-up call first (torch.compile of the activation).
MEMORY_PROBE = r"""
import json, sys
import torch
from harness import Meter
from test_automodel import grouped_experts, routed_batch
from mcore_torch_experts.integrations.automodel import install_fp32_combine

tokens, hidden, experts, top_k, chunk_rows = map(int, sys.argv[1:])
module = grouped_experts(torch.bfloat16, dim=hidden, n_routed_experts=experts,
                         n_activated_experts=top_k).requires_grad_(False)
x, token_mask, weights, indices, grad_y = routed_batch(torch.bfloat16, tokens, hidden,
                                                       experts + 1, top_k)
x.requires_grad_()
meter = Meter(torch.device("cpu"))

def forward():
    return module(x, token_mask, weights, indices)

peaks = {}
for name in ("shipped", "fp32_combine"):
    if name == "fp32_combine":
        install_fp32_combine(module, chunk_rows=chunk_rows, backend="torch")
    forward().backward(grad_y)  # warm-up
    x.grad = None
    y = forward()
    peaks[name] = {"forward": meter.peak_extra_bytes(forward),
                   "backward": meter.peak_extra_bytes(lambda: y.backward(grad_y))}
    del y
    x.grad = None
print(json.dumps(peaks))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_no_full_size_fp32_temporary_in_forward_or_backward():
    """2048 tokens x top-4 of 4 frozen experts, hidden 1024: output2 is 16 MiB bf16, its FP32
    copy 32 MiB, y 8 MiB, a 512-row chunk 2 MiB. Shipped, the forward holds the copy, and the
    backward the FP32 gradient rows next to their bf16 cast. The combine's forward must need the
    copy less (a chunk at a time instead); its backward the FP32 rows less, though y's FP32
    gradient is still alive next to the bf16 rows and a chunk."""
    tokens, hidden, experts, top_k, chunk_rows = 2048, 1024, 4, 4, 512
    fp32_copy, accumulator = tokens * top_k * hidden * 4, tokens * hidden * 4
    chunk, slack = chunk_rows * hidden * 4, 4 * 2 ** 20
    saving = {"forward": fp32_copy - 2 * chunk, "backward": fp32_copy - accumulator - 2 * chunk}
    args = [tokens, hidden, experts, top_k, chunk_rows]
    # The probe imports this module by name: its folder first on the child's path.
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    probe = subprocess.run([sys.executable, "-c", MEMORY_PROBE, *map(str, args)],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
                                "PYTHONPATH": path})
    assert probe.returncode == 0, probe.stderr[-4000:]
    peaks = json.loads(probe.stdout.splitlines()[-1])
    if peaks["shipped"]["forward"] is None:
        pytest.skip("cannot reset the peak-RSS counter here (/proc/self/clear_refs)")
    for phase in ("forward", "backward"):
        shipped, combined = peaks["shipped"][phase], peaks["fp32_combine"][phase]
        assert shipped > fp32_copy, peaks  # the measurement sees the full-size FP32 tensor
        assert combined < shipped - saving[phase] + slack, (phase, peaks)


# --- scope, undo, refusals -----------------------------------------------------------------------

def test_scoped_to_the_modules_given_idempotent_and_undone(combine_calls):
    """An MoE layer (router and experts): only its experts get the combine, the class and
    nemo_automodel's module globals stay as they are, a second call changes only the options,
    and remove_combine gives the shipped method back."""
    layer = fill(MoE(moe_config(), backend()))
    other = grouped_experts()
    x = routed_batch()[0].requires_grad_()
    module_globals, class_dict = dict(vars(automodel_experts)), dict(vars(GroupedExperts))

    def layer_step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).square().sum().backward()
        return [x.grad.clone()] + [p.grad for p in layer.parameters()]

    shipped = layer_step()
    assert install_fp32_combine(layer, backend="torch") == ["experts"]
    assert install_fp32_combine(layer, chunk_rows=7, backend="torch") == ["experts"]
    assert "_forward_grouped_mm" in vars(layer.experts)
    assert "_forward_grouped_mm" not in vars(other)
    assert vars(automodel_experts) == module_globals and dict(vars(GroupedExperts)) == class_dict
    assert_bitwise(shipped, layer_step())
    assert combine_calls == [dict(chunk_rows=7, backend="torch")]
    assert remove_combine(layer) == ["experts"]
    assert remove_combine(layer) == []
    assert "_forward_grouped_mm" not in vars(layer.experts)
    assert_bitwise(shipped, layer_step())
    assert len(combine_calls) == 1


def doubled_combine(expert_out, token_ids, num_tokens):
    """A combine the shipped module cannot be mistaken for (module level: pickled by name)."""
    return 2 * fp32_combine(expert_out, token_ids, num_tokens, backend="torch")


def pickled(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("round_trip", [pickled, copy.deepcopy], ids=["pickle", "deepcopy"])
def test_the_combine_survives_pickling_and_deep_copies(round_trip):
    """torch.save / torch.load (checkpoints, multiprocessing) and deepcopy give back a module that
    runs the installed combine, that remove_combine undoes and that install_combine takes again;
    the original is unchanged."""
    layer = fill(MoE(moe_config(), backend()))
    x = routed_batch()[0]
    shipped = layer(x)
    shipped_state = sorted(vars(layer.experts))
    assert automodel.install_combine(layer, doubled_combine) == ["experts"]
    copied = round_trip(layer)
    assert torch.equal(copied(x), 2 * shipped)
    assert torch.equal(layer(x), 2 * shipped)
    assert remove_combine(copied) == ["experts"]
    assert sorted(vars(copied.experts)) == shipped_state  # nothing of the combine left
    assert torch.equal(copied(x), shipped)
    assert automodel.install_combine(copied, doubled_combine) == ["experts"]
    assert torch.equal(copied(x), 2 * shipped)
    assert torch.equal(layer(x), 2 * shipped)


def test_fp32_combine_options_survive_pickling(monkeypatch):
    """The reloaded module calls fp32_combine (the package's, looked up by name on load: here a
    spy) with the options given at install."""
    layer = fill(MoE(moe_config(), backend()))
    install_fp32_combine(layer, chunk_rows=7, backend="torch")
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    calls = []
    monkeypatch.setattr(combine, "fp32_combine",
                        lambda *a, **k: calls.append(k) or fp32_combine(*a, **k))
    buffer.seek(0)
    copied = torch.load(buffer, weights_only=False)
    copied(routed_batch()[0])
    assert calls == [dict(chunk_rows=7, backend="torch")]
    assert remove_combine(copied) == ["experts"]


def test_docs_snippet_installs_and_removes():
    layer = fill(MoE(moe_config(), backend()))
    namespace = run_snippet("install", doc=DOCS / "automodel.md", model=layer)
    assert namespace["names"] == ["experts"]
    assert "_forward_grouped_mm" not in vars(layer.experts)


class _OwnForward(GroupedExperts):
    def forward(self, x, token_mask, weights, indices):
        return super().forward(x, token_mask, weights, indices)


def _replaced_on_the_instance(attr):
    module = grouped_experts()
    setattr(module, attr, lambda *args: None)
    return module


REFUSED = {
    "per-expert-loop": (lambda: grouped_experts(experts="torch"),
                        r"use_torch_mm=False \(backend.experts is not 'torch_mm'\)"),
    "weight-after-down": (lambda: grouped_experts(apply_router_weight_after_down=True),
                          r"config.apply_router_weight_after_down=True"),
    "subclass-forward": (lambda: _OwnForward(moe_config(), backend=backend()),
                         r"_OwnForward overrides GroupedExperts.forward"),
    "instance-forward": (lambda: _replaced_on_the_instance("forward"),
                         r"its forward was replaced on the instance"),
    "instance-grouped-mm": (lambda: _replaced_on_the_instance("_forward_grouped_mm"),
                            r"its _forward_grouped_mm was replaced on the instance"),
    "deepep": (lambda: GroupedExpertsDeepEP(moe_config(), backend=backend()),
               r"dispatchers combine the expert outputs themselves"),
    "no-experts": (lambda: torch.nn.Linear(2, 2), r"ModuleList holds no GroupedExperts"),
}


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=pytest.mark.skipif(
        case == "weight-after-down" and not automodel._HAS_MXFP8,
        reason="nemo-automodel 0.4.0 has no apply_router_weight_after_down"))
    for case in REFUSED])
def test_refusal_names_the_field_and_leaves_every_module_unchanged(case):
    build, message = REFUSED[case]
    supported = grouped_experts()
    model = torch.nn.ModuleList([supported, build()] if case != "no-experts" else [build()])
    before = [dict(vars(m)) for m in model]
    with pytest.raises(AutomodelCombineError, match=message):
        install_fp32_combine(model)
    assert [dict(vars(m)) for m in model] == before


def test_refuses_an_unverified_release(monkeypatch):
    module = grouped_experts()
    monkeypatch.setattr(nemo_automodel, "__version__", "0.8.0")
    with pytest.raises(AutomodelCombineError,
                       match=r"nemo_automodel.__version__='0.8.0'.*nemo-automodel==0.7.0"):
        install_fp32_combine(module)
    assert "_forward_grouped_mm" not in vars(module)


@pytest.mark.parametrize("options, message", [
    (dict(chunk_rows=-1), "chunk_rows must be an int >= 0"),
    (dict(backend="cuda"), "backend must be one of"),
])
def test_bad_options_are_refused_before_any_change(options, message):
    module = grouped_experts()
    with pytest.raises(ValueError, match=message):
        install_fp32_combine(module, **options)
    assert "_forward_grouped_mm" not in vars(module)


# --- Automodel's expert LoRA (GroupedExpertsLoRA), PEFT before or after --------------------------

LORA_RANK, LORA_ALPHA = 8, 16  # rank 8: 16-byte grouped-GEMM strides in BF16 (0.4.0 does not pad)
PEFT = PeftConfig(target_modules=["*experts"], dim=LORA_RANK, alpha=LORA_ALPHA)


def lora_experts(dtype=torch.float32, **overrides) -> GroupedExpertsLoRA:
    """Automodel's GroupedExpertsLoRA over a GroupedExperts, every weight (LoRA B too) random."""
    base = grouped_experts(dtype, **overrides)
    return fill(GroupedExpertsLoRA(base, lora_dim=LORA_RANK, alpha=LORA_ALPHA), seed=2)


def fp64_lora_reference(module, batch):
    """y [T, H] and the gradients of x, weights and every parameter, in float64: each token's
    sum over its top-k experts of swiglu(x (W1_e + s A1_e B1_e)) * p (W2_e + s A2_e B2_e)."""
    x, token_mask, weights, indices, grad_y = batch
    params = {name: p.detach().double().requires_grad_() for name, p in module.named_parameters()}
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, weights))
    tokens, slots = torch.where(token_mask.unsqueeze(1).expand_as(indices))
    expert, probs = indices[tokens, slots], w64[tokens, slots].unsqueeze(1)

    def project(rows, base, lora_a, lora_b):
        low = torch.einsum("nh,nhr->nr", rows, params[lora_a][expert])
        return (torch.einsum("nh,nhf->nf", rows, params[base][expert])
                + module.scale * torch.einsum("nr,nrf->nf", low, params[lora_b][expert]))

    gate, up = project(x64[tokens], "gate_and_up_projs", "lora_gate_and_up_A",
                       "lora_gate_and_up_B").chunk(2, dim=1)
    rows = project(F.silu(gate) * up * probs, "down_projs", "lora_down_A", "lora_down_B")
    y = torch.zeros(x.shape, dtype=torch.float64).index_add(0, tokens, rows)
    y.backward(grad_y.double())
    return [y.detach(), x64.grad, w64.grad] + [p.grad for p in params.values()]


@pytest.mark.parametrize("expert_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_experts_same_outputs_and_gradients_as_shipped_bitwise(combine_calls, dtype,
                                                                   expert_bias):
    module = lora_experts(dtype, expert_bias=expert_bias)
    batch = routed_batch(dtype)
    shipped = forward_backward(module, batch)
    assert install_fp32_combine(module, chunk_rows=5, backend="torch") == [""]
    combined = forward_backward(module, batch)
    assert combine_calls == [dict(chunk_rows=5, backend="torch")]
    assert_bitwise(shipped, combined)


def test_lora_experts_match_fp64_reference_to_fp32_rounding(combine_calls):
    module = lora_experts()
    batch = routed_batch()
    install_fp32_combine(module, chunk_rows=5, backend="torch")
    combined = forward_backward(module, batch)
    assert combine_calls == [dict(chunk_rows=5, backend="torch")]
    reference = fp64_lora_reference(module, batch)
    assert len(combined) == len(reference) == 3 + 6  # y, x, weights; W1, W2 and four LoRA
    for actual, expected in zip(combined, reference):
        assert expected.abs().max() > 0  # LoRA B random: every gradient is exercised
        assert (actual.double() - expected).abs().max() <= FP32_TOL * expected.abs().max()
    assert torch.equal(combined[0][PADDING_TOKEN], torch.zeros(HIDDEN))


def test_lora_experts_no_routed_rows_run_the_shipped_dummy_graph(combine_calls):
    module = lora_experts()
    x, token_mask, weights, indices, grad_y = routed_batch()
    batch = (x, torch.zeros_like(token_mask), weights, indices, grad_y)
    shipped = forward_backward(module, batch)
    install_fp32_combine(module, backend="torch")
    assert_bitwise(shipped, forward_backward(module, batch))
    assert combine_calls == []


def moe_model(seed=0) -> torch.nn.Module:
    """An MoE layer where a model holds it (Automodel's PEFT replaces children by name)."""
    return torch.nn.ModuleDict({"moe": fill(MoE(moe_config(), backend()), seed)})


def apply_peft(model: torch.nn.Module) -> None:
    """Automodel's PEFT (experts only), then its LoRA B random (as after some training)."""
    assert apply_lora_to_linear_modules(model, PEFT) == 1
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[1] ** -0.5)


def layer_step(model):
    """The layer's output and the gradients of its input and of every trainable parameter."""
    x = routed_batch()[0].requires_grad_()
    model.zero_grad(set_to_none=True)
    y = model["moe"](x)
    y.square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("order", ["install-then-peft", "peft-then-install"])
def test_either_order_with_automodel_peft_ends_with_the_combine(combine_calls, order):
    """Installed before PEFT, the GroupedExpertsLoRA that PEFT puts in its place gets the same
    combine on the layer's next forward (before: the shipped scatter-add ran unannounced);
    installed after, it takes GroupedExpertsLoRA (before: refused). Both give the shipped
    LoRA module's outputs and gradients bit for bit."""
    shipped = moe_model()
    apply_peft(shipped)
    model = moe_model()
    if order == "install-then-peft":
        assert install_fp32_combine(model, chunk_rows=5, backend="torch") == ["moe.experts"]
    apply_peft(model)
    if order == "peft-then-install":
        assert install_fp32_combine(model, chunk_rows=5, backend="torch") == ["moe.experts"]
    assert type(model["moe"].experts) is GroupedExpertsLoRA
    expected = layer_step(shipped)
    assert len(expected) == 2 + 4  # y, x and the four LoRA matrices
    assert_bitwise(expected, layer_step(model))
    assert combine_calls == [dict(chunk_rows=5, backend="torch")]
    assert automodel._installed(model["moe"].experts)
    assert remove_combine(model) == ["moe.experts"]
    assert_bitwise(expected, layer_step(model))
    assert len(combine_calls) == 1  # removed: neither the module nor its replacement hook left


class _OwnLoRAForward(GroupedExpertsLoRA):
    def forward(self, x, token_mask, weights, indices):
        return super().forward(x, token_mask, weights, indices)


@pytest.mark.parametrize("replacement, message", [
    (lambda old: torch.nn.Identity(), r"experts \(Identity\): replaced the GroupedExperts that "
                                      r"install_fp32_combine was given.*remove_combine"),
    (lambda old: _OwnLoRAForward(old), r"_OwnLoRAForward overrides GroupedExpertsLoRA.forward"),
], ids=["not-experts", "lora-subclass"])
def test_a_replacement_the_combine_cannot_take_is_refused_at_the_next_forward(replacement,
                                                                             message):
    model = moe_model()
    install_fp32_combine(model, backend="torch")
    model["moe"].experts = replacement(model["moe"].experts)
    with pytest.raises(AutomodelCombineError, match=message):
        model["moe"](routed_batch()[0])


# --- Automodel's own model builder and optimizer steps ---------------------------------------------

VOCAB, SEQ = 96, 12


@pytest.fixture
def qwen3_moe(monkeypatch):
    """Build Automodel's Qwen3-MoE (2 layers of 4 experts, top-2, torch_mm experts) with its own
    builder and its own PEFT (experts and q_proj), BF16 as trained. Its builder asks
    torch.cuda.current_device() for the rotary embedding's device, which initialize_weights(cpu)
    then sets; on a CPU-only host that call needs this stand-in."""
    qwen3 = pytest.importorskip("nemo_automodel.components.models.qwen3_moe.model",
                                reason="Automodel's Qwen3-MoE does not import here")
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                            moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=64, dtype="bfloat16")
    backend_config = BackendConfig(linear="torch", attn="sdpa", rms_norm="torch",
                                   experts="torch_mm", dispatcher="torch",
                                   enable_hf_state_dict_adapter=False)

    def build(seed=0):
        torch.manual_seed(seed)
        model = qwen3.Qwen3MoeForCausalLM.from_config(config, backend=backend_config)
        model.initialize_weights(torch.device("cpu"), dtype=torch.bfloat16)
        apply_lora_to_linear_modules(model, PeftConfig(target_modules=["*experts", "*q_proj"],
                                                       dim=LORA_RANK, alpha=LORA_ALPHA))
        return model
    return build


def train_steps(model, steps=2):
    """Losses, trainable gradients per step and the parameters after `steps` AdamW steps of
    next-token cross-entropy on one fixed random batch."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2)
    losses, grads = [], []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        output = model(ids)
        logits = getattr(output, "logits", output)  # 0.4.0's Qwen3-MoE returns the logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in trainable.items()})
        optimizer.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_automodel_qwen3_moe_trains_the_same_with_the_combine(combine_calls, qwen3_moe):
    """Two optimizer steps of Automodel's Qwen3-MoE with its LoRA, the combine installed with the
    documented snippet against the same model without it: losses, every LoRA gradient and the
    updated parameters bit for bit (on the CPU both sum each token's rows in row order)."""
    shipped, model = qwen3_moe(), qwen3_moe()
    namespace = run_snippet("after-build", doc=DOCS / "automodel.md", model_parts=[model])
    assert namespace["names"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(type(m) is GroupedExpertsLoRA for m in (model.get_submodule(n)
                                                      for n in namespace["names"]))
    expected, actual = train_steps(shipped), train_steps(model)
    assert len(combine_calls) == 2 * 2  # both layers, both steps
    assert combine_calls[0] == dict(chunk_rows=None, backend=None)
    assert all(torch.equal(a, b) for a, b in zip(expected[0], actual[0])), (expected[0], actual[0])
    for step_expected, step_actual in zip(expected[1], actual[1]):
        assert step_expected.keys() == step_actual.keys()
        assert any("lora_gate_and_up_A" in n for n in step_expected)
        for name, grad in step_expected.items():
            assert torch.equal(step_actual[name], grad), name
    # Step 2: LoRA B is no longer zero, so the experts' LoRA A gradients are exercised too.
    assert expected[1][1]["model.layers.0.mlp.experts.lora_down_A"].abs().max() > 0
    assert expected[0][1] < expected[0][0]  # it trains
    for name, param in expected[2].items():
        assert torch.equal(actual[2][name], param), name
