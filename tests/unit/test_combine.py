"""fp32_combine: exactness against an FP64 reference, chunked == single-shot, the fused Triton
kernel (compiled on a CUDA host, else run by the Triton interpreter on the CPU), input checks,
the chunk-size env var, and the forward / backward memory bound."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcore_torch_experts import combine
from mcore_torch_experts.combine import (
    CHUNK_ROWS_ENV,
    DEFAULT_CHUNK_ROWS,
    chunk_rows_from_env,
    fp32_combine,
)
from mcore_torch_experts.kernels import TRITON_INTERPRETER
from support.triton_interpreter import ROOT, interpreter_is_on, run_interpreted

# torch and Triton only, the same on every release: one leg per venv (scripts/legs.sh).
pytestmark = pytest.mark.once_per_venv

FP32_UNIT_ROUNDOFF = 2.0 ** -24
BF16_RTNE_REL_ERR = 2.0 ** -8  # round to nearest: half a bf16 ulp (8 significant bits)
BF16_TRUNC_REL_ERR = 2.0 ** -7  # the Triton interpreter truncates fp32 -> bf16: one ulp

NUM_TOKENS, TOP_K, HIDDEN = 12, 3, 1030  # HIDDEN > the kernel's 1024-column block: two blocks
EMPTY_TOKEN, SHORT_TOKEN = 2, 5  # token 2 keeps no rows (all dropped), token 5 keeps TOP_K - 1


def routed_rows(with_probs=True, seed=0):
    """A top-k routing with dropped rows, rows in expert-sorted order, on the default device.

    Returns expert_out bf16 [N, HIDDEN], token_ids int64 [N], probs fp32 [N] or None, grad_y
    fp32 [NUM_TOKENS, HIDDEN]. Values span several binades so rounding shows.
    """
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    num_experts = 8
    experts = torch.rand(NUM_TOKENS, num_experts, generator=gen).argsort(dim=1)[:, :TOP_K]
    token_ids = torch.arange(NUM_TOKENS).repeat_interleave(TOP_K)
    experts = experts.flatten()
    keep = token_ids != EMPTY_TOKEN
    keep &= ~((token_ids == SHORT_TOKEN) & (experts == experts[token_ids == SHORT_TOKEN][0]))
    token_ids, experts = token_ids[keep], experts[keep]
    token_ids = token_ids[experts.argsort(stable=True)]
    num_rows = token_ids.numel()
    scale = 2.0 ** torch.randint(-3, 4, (num_rows, 1), generator=gen)
    expert_out = (torch.randn(num_rows, HIDDEN, generator=gen) * scale).bfloat16()
    probs = torch.rand(num_rows, generator=gen) if with_probs else None
    grad_y = torch.randn(NUM_TOKENS, HIDDEN, generator=gen)
    return expert_out, token_ids, probs, grad_y


def fp64_reference(expert_out, token_ids, probs, grad_y):
    """y, grad_expert_out, grad_probs computed in float64 with index_add and autograd."""
    out64 = expert_out.double().requires_grad_()
    probs64 = probs.double().requires_grad_() if probs is not None else None
    rows = out64 * probs64.unsqueeze(1) if probs is not None else out64
    y = torch.zeros(NUM_TOKENS, HIDDEN, dtype=torch.float64).index_add(0, token_ids, rows)
    y.backward(grad_y.double())
    return y.detach(), out64.grad, probs64.grad if probs is not None else None


def run_combine(expert_out, token_ids, probs, grad_y, **options):
    """fp32_combine forward and backward: (y, grad_expert_out, grad_probs)."""
    expert_out = expert_out.clone().requires_grad_()
    probs = probs.clone().requires_grad_() if probs is not None else None
    y = fp32_combine(expert_out, token_ids, NUM_TOKENS, probs=probs, **options)
    y.backward(grad_y)
    return y.detach(), expert_out.grad, probs.grad if probs is not None else None


def bf16_cast_rel_err(options):
    """The Triton interpreter truncates fp32 -> bf16; torch and the compiled kernel round."""
    if options["backend"] == "triton" and TRITON_INTERPRETER:
        return BF16_TRUNC_REL_ERR
    return BF16_RTNE_REL_ERR


def assert_within(actual, reference, bound):
    error = (actual.double() - reference).abs()
    assert torch.all(error <= bound), f"max error {error.max():.3e}, max allowed {bound.max():.3e}"


@pytest.fixture
def interpreted_triton():
    """On the CPU the kernels run only if TRITON_INTERPRET=1 was set before triton was first
    imported (Megatron-Core imports it, so setting it here would be too late). Tests using this
    skip in an ordinary session; test_triton_tests_pass_under_the_interpreter reruns them in a
    child process started with TRITON_INTERPRET=1."""
    pytest.importorskip("triton", reason="triton is not installed: the fused kernel is untested")
    if not TRITON_INTERPRETER:
        pytest.skip("the Triton interpreter is off in this process; "
                    "test_triton_tests_pass_under_the_interpreter runs this test with it on")


COMBINE_OPTIONS = {
    "torch-single-shot": dict(backend="torch", chunk_rows=0),
    "torch-chunked": dict(backend="torch", chunk_rows=5),
    "triton": dict(backend="triton"),
}


@pytest.fixture(params=list(COMBINE_OPTIONS))
def options(request):
    """fp32_combine keyword arguments for each backend. The triton one runs compiled on a CUDA
    host (CUDA is the default device for the test's tensors), else interpreted on the CPU."""
    compiled = (request.param == "triton" and torch.cuda.is_available()
                and not interpreter_is_on())
    if compiled:
        pytest.importorskip("triton", reason="triton is not installed: the fused kernel is untested")
    elif request.param == "triton":
        request.getfixturevalue("interpreted_triton")
    with torch.device("cuda") if compiled else contextlib.nullcontext():
        yield COMBINE_OPTIONS[request.param]


# --- exactness ------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
def test_matches_fp64_reference_to_fp32_rounding(options, with_probs):
    """y: each product rounds once and each of <= TOP_K additions rounds once in FP32.
    grad_expert_out: one FP32 product then one cast to bf16. grad_probs: an FP32 dot over HIDDEN."""
    expert_out, token_ids, probs, grad_y = routed_rows(with_probs)
    y, grad_out, grad_probs = run_combine(expert_out, token_ids, probs, grad_y, **options)
    y_ref, grad_out_ref, grad_probs_ref = fp64_reference(expert_out, token_ids, probs, grad_y)

    abs_rows = expert_out.double().abs() * (probs.double().unsqueeze(1) if with_probs else 1)
    abs_sum = torch.zeros_like(y_ref).index_add(0, token_ids, abs_rows)
    assert y.dtype == torch.float32
    assert_within(y, y_ref, (TOP_K + 1) * FP32_UNIT_ROUNDOFF * abs_sum)

    assert grad_out.dtype == torch.bfloat16
    assert_within(grad_out, grad_out_ref,
                  (bf16_cast_rel_err(options) + 2 * FP32_UNIT_ROUNDOFF) * grad_out_ref.abs())
    if with_probs:
        abs_dots = (grad_y.double()[token_ids] * expert_out.double()).abs().sum(dim=1)
        assert grad_probs.dtype == torch.float32
        assert_within(grad_probs, grad_probs_ref, (HIDDEN + 1) * FP32_UNIT_ROUNDOFF * abs_dots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_are_never_modified(options, dtype):
    """expert_out (FP32: `.float()` is the same tensor) and probs keep their values and version,
    an upstream op that saved expert_out for its backward still runs, and the gradients are the
    FP64 reference's."""
    expert_out, token_ids, probs, grad_y = routed_rows()
    source = expert_out.to(dtype).requires_grad_()
    expert_out = source.tanh()  # tanh's backward reads its output
    probs = probs.clone().requires_grad_()
    values = expert_out.detach().clone(), probs.detach().clone()
    versions = expert_out._version, probs._version

    y = fp32_combine(expert_out, token_ids, NUM_TOKENS, probs=probs, **options)
    assert (expert_out._version, probs._version) == versions
    assert torch.equal(expert_out, values[0]) and torch.equal(probs, values[1])
    y.backward(grad_y)

    y_ref, grad_out_ref, grad_probs_ref = fp64_reference(values[0], token_ids, values[1], grad_y)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs.grad.double(), grad_probs_ref, rtol=1e-5, atol=1e-4)
    grad_source_ref = grad_out_ref * (1 - values[0].double() ** 2)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(source.grad.double(), grad_source_ref, **tol)


def test_token_without_rows_gets_zeros(options):
    expert_out, token_ids, probs, grad_y = routed_rows()
    y, _, _ = run_combine(expert_out, token_ids, probs, grad_y, **options)
    assert torch.equal(y[EMPTY_TOKEN], torch.zeros(HIDDEN))
    assert (y[SHORT_TOKEN] != 0).any()


@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
@pytest.mark.parametrize("chunk_rows", [1, 7, "all", "more-than-all"])
def test_chunked_is_bit_identical_to_single_shot_on_cpu(chunk_rows, with_probs):
    """Bit-for-bit on the CPU: scatter_add_ there adds rows into each token in row order, and
    chunks keep that order; backward does the same elementwise ops per row. (On CUDA scatter-add
    uses atomics, so the two agree only to FP32 rounding.)"""
    expert_out, token_ids, probs, grad_y = routed_rows(with_probs)
    num_rows = token_ids.numel()
    assert num_rows % 7
    chunk_rows = {"all": num_rows, "more-than-all": num_rows + 100}.get(chunk_rows, chunk_rows)
    single = run_combine(expert_out, token_ids, probs, grad_y, backend="torch", chunk_rows=0)
    chunked = run_combine(expert_out, token_ids, probs, grad_y, backend="torch",
                          chunk_rows=chunk_rows)
    for name, expected, actual in zip(["y", "grad_expert_out", "grad_probs"], single, chunked):
        assert (expected is None) == (actual is None)
        if expected is not None:
            assert torch.equal(expected, actual), name


@pytest.mark.parametrize("probs_grad", [True, False], ids=["probs-grad", "probs-frozen"])
def test_only_inputs_that_need_grad_get_one(options, probs_grad):
    expert_out, token_ids, probs, grad_y = routed_rows()
    expert_out.requires_grad_(not probs_grad)
    probs.requires_grad_(probs_grad)
    y = fp32_combine(expert_out, token_ids, NUM_TOKENS, probs=probs, **options)
    y.backward(grad_y)
    assert (expert_out.grad is not None) == (not probs_grad)
    assert (probs.grad is not None) == probs_grad


# --- edge cases -----------------------------------------------------------------------------------

def test_no_rows_gives_zeros_and_keeps_the_graph(options):
    expert_out = torch.zeros(0, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.zeros(0, requires_grad=True)
    y = fp32_combine(expert_out, torch.zeros(0, dtype=torch.int64), NUM_TOKENS, probs=probs,
                     **options)
    assert torch.equal(y, torch.zeros(NUM_TOKENS, HIDDEN)) and y.requires_grad
    y.sum().backward()
    assert expert_out.grad.shape == (0, HIDDEN) and probs.grad.shape == (0,)


def test_stride_zero_grad_output(options):
    """`y.sum().backward()` hands backward an expanded (stride-0) gradient of ones."""
    expert_out, token_ids, probs, _ = routed_rows()
    expert_out.requires_grad_()
    probs.requires_grad_()
    fp32_combine(expert_out, token_ids, NUM_TOKENS, probs=probs, **options).sum().backward()
    grad_out_ref = probs.double().unsqueeze(1).expand(-1, HIDDEN)
    assert_within(expert_out.grad, grad_out_ref, bf16_cast_rel_err(options) * grad_out_ref)
    sum_ref = expert_out.double().sum(dim=1)
    assert_within(probs.grad, sum_ref, (HIDDEN + 1) * FP32_UNIT_ROUNDOFF
                  * expert_out.double().abs().sum(dim=1))


def test_nan_row_only_poisons_its_own_token(options):
    expert_out, token_ids, probs, grad_y = routed_rows()
    poisoned_row = 4
    expert_out[poisoned_row, 7] = float("nan")
    y, grad_out, grad_probs = run_combine(expert_out, token_ids, probs, grad_y, **options)
    nan_at = torch.zeros_like(y, dtype=torch.bool)
    nan_at[token_ids[poisoned_row], 7] = True
    assert torch.equal(y.isnan(), nan_at)
    assert not grad_out.isnan().any()
    assert torch.equal(grad_probs.isnan().nonzero().flatten(), torch.tensor([poisoned_row]))


@pytest.fixture
def nan_filled_allocations(monkeypatch):
    """Deterministic mode with fill_uninitialized_memory: every torch.empty, new_empty and
    empty_like is filled with NaN, so an element left unwritten shows. Restored afterwards."""
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    previous = (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def test_outputs_never_expose_uninitialised_memory(options, nan_filled_allocations):
    """Every element of y, grad_expert_out and grad_probs is written."""
    assert torch.empty(1).isnan().all()  # else this test could pass vacuously
    expert_out, token_ids, probs, grad_y = routed_rows()
    outputs = run_combine(expert_out, token_ids, probs, grad_y, **options)
    for name, tensor in zip(["y", "grad_expert_out", "grad_probs"], outputs):
        assert not tensor.isnan().any(), name


# --- input checks, backend choice, env var --------------------------------------------------------

def _bad_inputs():
    out, ids, probs = torch.zeros(4, 8), torch.tensor([0, 1, 1, 2]), torch.ones(4)
    return {
        "expert_out-1d": ((torch.zeros(8), ids, 3), {}, "expert_out must be 2-D"),
        "expert_out-int": ((out.long(), ids, 3), {}, "expert_out must be floating point"),
        "ids-length": ((out, ids[:3], 3), {}, r"token_ids must have shape \[4\]"),
        "ids-2d": ((out, ids.view(2, 2), 3), {}, r"token_ids must have shape \[4\]"),
        "ids-float": ((out, ids.float(), 3), {}, "token_ids must be an integer tensor"),
        "ids-bool": ((out, ids.bool(), 3), {}, "token_ids must be an integer tensor"),
        "probs-shape": ((out, ids, 3), dict(probs=torch.ones(4, 1)),
                        r"probs must have shape \[4\]"),
        "probs-int": ((out, ids, 3), dict(probs=probs.long()), "probs must be floating point"),
        "num_tokens-negative": ((out, ids, -1), {}, "num_tokens must be an int >= 0"),
        "num_tokens-float": ((out, ids, 3.0), {}, "num_tokens must be an int >= 0"),
        "id-too-large": ((out, ids, 2), {},
                         r"token_ids must lie in \[0, 2\), got values from 0 to 2"),
        "id-negative": ((out, -ids, 3), {}, r"token_ids must lie in \[0, 3\)"),
        "chunk_rows-negative": ((out, ids, 3), dict(chunk_rows=-1), "chunk_rows must be an int"),
        "chunk_rows-float": ((out, ids, 3), dict(chunk_rows=2.0), "chunk_rows must be an int"),
        "backend-unknown": ((out, ids, 3), dict(backend="cuda"), "backend must be one of"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_input_raises_value_error(case):
    args, kwargs, message = _bad_inputs()[case]
    with pytest.raises(ValueError, match=message):
        fp32_combine(*args, **kwargs)


def test_triton_backend_on_cpu_without_interpreter_raises():
    pytest.importorskip("triton", reason="triton is not installed")
    if TRITON_INTERPRETER:
        pytest.skip("the Triton interpreter is on in this process")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fp32_combine(torch.zeros(2, 4), torch.tensor([0, 1]), 2, backend="triton")


def test_triton_tests_pass_under_the_interpreter():
    """Reruns every triton test of this file in a child process with TRITON_INTERPRET=1 set from
    the start, so the kernels run (interpreted) on the CPU whatever this process imported."""
    pytest.importorskip("triton", reason="triton is not installed: the fused kernel is untested")
    if TRITON_INTERPRETER:
        pytest.skip("this process already runs the triton tests under the interpreter")
    if torch.cuda.is_available():
        pytest.skip("on a CUDA host this process runs the triton cases of the `options` tests "
                    "compiled, on the GPU")
    child = run_interpreted(str(Path(__file__).resolve().relative_to(ROOT)), "-k", "triton", timeout=300)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and " failed" not in child.stdout, child.stdout[-4000:]


def _backward_name(**options):
    expert_out = torch.zeros(2, 4, requires_grad=True)
    return type(fp32_combine(expert_out, torch.tensor([0, 1]), 2, **options).grad_fn).__name__


def test_auto_backend_on_cpu_is_torch(monkeypatch):
    monkeypatch.delenv(CHUNK_ROWS_ENV, raising=False)
    assert _backward_name() == "_ChunkedFP32CombineBackward"
    assert _backward_name(chunk_rows=0) == "ScatterAddBackward0"


@pytest.mark.parametrize("value, expected", [("0", 0), ("1", 1), ("4096", 4096), (" 512 ", 512)])
def test_env_var_sets_chunk_rows(monkeypatch, value, expected):
    monkeypatch.setenv(CHUNK_ROWS_ENV, value)
    assert chunk_rows_from_env() == expected


def test_env_var_unset_means_default(monkeypatch):
    monkeypatch.delenv(CHUNK_ROWS_ENV, raising=False)
    assert chunk_rows_from_env() == DEFAULT_CHUNK_ROWS == 4096


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", "", "4k"])
def test_env_var_rejects_bad_values(monkeypatch, value):
    monkeypatch.setenv(CHUNK_ROWS_ENV, value)
    with pytest.raises(ValueError, match=f"{CHUNK_ROWS_ENV}={value!r}"):
        chunk_rows_from_env()
    with pytest.raises(ValueError, match=CHUNK_ROWS_ENV):
        fp32_combine(torch.zeros(1, 2), torch.tensor([0]), 1, backend="torch")


def test_env_var_drives_fp32_combine(monkeypatch):
    monkeypatch.setenv(CHUNK_ROWS_ENV, "0")
    assert _backward_name(backend="torch") == "ScatterAddBackward0"
    monkeypatch.setenv(CHUNK_ROWS_ENV, "3")
    assert _backward_name(backend="torch") == "_ChunkedFP32CombineBackward"


# --- memory bound ---------------------------------------------------------------------------------

# Peak resident memory of a fresh process, measured by Linux itself: writing "5" to
# /proc/self/clear_refs resets the VmHWM high-water mark to the current VmRSS once the inputs exist,
# so VmHWM - VmRSS afterwards is the peak extra memory of the combine alone. The inputs are created
# in place (no FP32 temporaries). MALLOC_MMAP_THRESHOLD_ makes glibc map every buffer of 64 KiB or
# more on its own and unmap it when freed, so each temporary shows in RSS exactly once.
# combine.py is imported without the package's __init__ (the package registered by its path): it
# and the leaves it imports (enums, settings, errors) need only torch, and the package's __init__
# would import Megatron-Core, which is slow and irrelevant here.
MEMORY_PROBE = r"""
import importlib, json, re, sys, types
import torch

package = types.ModuleType("mcore_torch_experts")
package.__path__ = [sys.argv[1]]
sys.modules["mcore_torch_experts"] = package
combine = importlib.import_module("mcore_torch_experts.combine")
num_rows, hidden, num_tokens, chunk_rows = map(int, sys.argv[2:])

def vm_kib(field):
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1))

gen = torch.Generator().manual_seed(0)
expert_out = torch.empty(num_rows, hidden, dtype=torch.bfloat16).uniform_(-1, 1, generator=gen)
token_ids = torch.randperm(num_rows, generator=gen) % num_tokens
expert_out.requires_grad_()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = vm_kib("VmRSS")
y = combine.fp32_combine(expert_out, token_ids, num_tokens, chunk_rows=chunk_rows, backend="torch")
forward = vm_kib("VmHWM") - base
y.sum().backward()
forward_backward = vm_kib("VmHWM") - base
print(json.dumps({"forward_mib": forward / 1024, "forward_backward_mib": forward_backward / 1024}))
"""


def _peak_extra_mib(num_rows, hidden, num_tokens, chunk_rows):
    package_path = Path(combine.__file__).parent
    args = [sys.executable, "-c", MEMORY_PROBE, str(package_path),
            str(num_rows), str(hidden), str(num_tokens), str(chunk_rows)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_chunked_forward_and_backward_memory_is_bounded():
    """32768 rows x 1024 bf16 (64 MiB), 4096 tokens: the single-shot FP32 copy is 128 MiB, the
    accumulator 16 MiB, a 2048-row FP32 chunk 8 MiB. Chunked forward must need at most the
    accumulator + two chunks (+16 MiB slack) and under 40% of the single-shot extra peak; chunked
    forward+backward at most that plus the bf16 gradient (64 MiB), while single-shot backward also
    needs a full FP32 gradient."""
    num_rows, hidden, num_tokens, chunk_rows = 32768, 1024, 4096, 2048
    mib = 2 ** 20
    fp32_copy = num_rows * hidden * 4 / mib
    accumulator = num_tokens * hidden * 4 / mib
    bf16_grad = num_rows * hidden * 2 / mib
    chunk = chunk_rows * hidden * 4 / mib
    probes = {rows: _peak_extra_mib(num_rows, hidden, num_tokens, rows) for rows in (0, chunk_rows)}
    peaks = {}
    for rows, probe in probes.items():
        stdout, stderr = probe.communicate(timeout=120)
        if probe.returncode and "clear_refs" in stderr:
            pytest.skip(f"cannot reset the peak-RSS counter here: {stderr.strip()[-200:]}")
        assert probe.returncode == 0, stderr
        peaks[rows] = json.loads(stdout)
    single, chunked = peaks[0], peaks[chunk_rows]
    # The method sees the single-shot FP32 copy (else the test below could pass vacuously).
    assert single["forward_mib"] > 0.9 * (fp32_copy + accumulator), peaks
    assert chunked["forward_mib"] < accumulator + 2 * chunk + 16, peaks
    assert chunked["forward_mib"] < 0.4 * single["forward_mib"], peaks
    assert chunked["forward_backward_mib"] < accumulator + bf16_grad + 2 * chunk + 32, peaks
    assert single["forward_backward_mib"] > accumulator + bf16_grad + fp32_copy * 0.9, peaks


# --- CUDA -----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_on_cuda_matches_chunked_torch_and_reproduces():
    """Compiled: the chunked torch backend's values, and y and both gradients bit-identical run
    to run (the interpreter runs the programs one after another: only here can an order
    dependence show)."""
    expert_out, token_ids, probs, grad_y = (t.cuda() for t in routed_rows())
    fused = run_combine(expert_out, token_ids, probs, grad_y, backend="triton")
    again = run_combine(expert_out, token_ids, probs, grad_y, backend="triton")
    chunked = run_combine(expert_out, token_ids, probs, grad_y, backend="torch", chunk_rows=5)
    for expected, actual in zip(fused, again):
        assert torch.equal(expected, actual)
    torch.testing.assert_close(fused[0], chunked[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(fused[1], chunked[1])  # one FP32 product, one round-to-nearest cast
    torch.testing.assert_close(fused[2], chunked[2], rtol=1e-5, atol=1e-5)
