"""A shared LoRA factor's weight gradient in fixed chunks of rows (kernels/factor_grad_triton.py)
against FP64, and its sums' order fixed by the rows' positions alone: rows appended after the
others, or zero rows anywhere after them, change no bit. The kernel runs on the CPU under the
Triton interpreter (the `triton_interpreter` marker); `chunked_sums` is the CPU's torch path."""

import pytest
import torch

pytestmark = pytest.mark.once_per_venv

SHAPES = [(16, 96), (80, 16), (3, 5)]   # [p, q]: rank by width, width by rank, odd sizes


def fp64(left, right):
    return left.double().t() @ right.double()


def rows_for(chunk):
    return (0, 1, 63, 100, chunk + 37, 2 * chunk)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_kernel_matches_fp64(dtype):
    pytest.importorskip("triton", reason="triton is not installed: the kernel is untested")
    from mcore_torch_experts.kernels import factor_grad_triton as fg

    torch.manual_seed(0)
    for p, q in SHAPES:
        for rows in rows_for(fg.CHUNK_ROWS):
            left, right = torch.randn(rows, p).to(dtype), torch.randn(rows, q).to(dtype)
            got = fg.factor_grad(left, right)
            assert got.shape == (p, q) and got.dtype == torch.float32
            want = fp64(left, right)
            # FP32 sums of exact products: error of order rows x 2^-24 of the largest sum
            assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, want.abs().max()), (p, q, rows)
            assert torch.equal(fg.factor_grad(left, right), got)   # run to run


@pytest.mark.triton_interpreter
def test_rows_after_the_others_change_no_bit_of_their_sums():
    """The probe rows first, then zero rows (a batch whose other rows' gradient is zero) or the
    same rows among more chunks: bitwise; a transposed (strided) operand gives the same bits."""
    pytest.importorskip("triton", reason="triton is not installed: the kernel is untested")
    from mcore_torch_experts.kernels import factor_grad_triton as fg

    torch.manual_seed(1)
    left, right = torch.randn(300, 16).bfloat16(), torch.randn(300, 48).bfloat16()
    alone = fg.factor_grad(left, right)
    for extra in (1, 100, fg.CHUNK_ROWS, 2 * fg.CHUNK_ROWS + 5):
        zeros = torch.zeros(extra, 16).bfloat16()
        others = torch.randn(extra, 48).bfloat16()
        batched = fg.factor_grad(torch.cat([left, zeros]), torch.cat([right, others]))
        assert torch.equal(batched, alone), extra
    strided = fg.factor_grad(left.t().contiguous().t(), right)
    assert torch.equal(strided, alone)


@pytest.mark.triton_interpreter
def test_a_bounded_partial_buffer_gives_the_same_bits(monkeypatch):
    """Past PARTIAL_BYTES the chunks go in waves, each added onto the result in chunk order: the
    same sums as one wave."""
    pytest.importorskip("triton", reason="triton is not installed: the kernel is untested")
    from mcore_torch_experts.kernels import factor_grad_triton as fg

    torch.manual_seed(4)
    left = torch.randn(3 * fg.CHUNK_ROWS + 11, 16).bfloat16()
    right = torch.randn(3 * fg.CHUNK_ROWS + 11, 24).bfloat16()
    whole = fg.factor_grad(left, right)
    for waves_of in (1, 2):
        monkeypatch.setattr(fg, "PARTIAL_BYTES", waves_of * 4 * 16 * 24)
        assert torch.equal(fg.factor_grad(left, right), whole), waves_of


def test_the_cpu_path_sums_the_same_chunks_in_fp32():
    from mcore_torch_experts.kernels.factor_grad_triton import CHUNK_ROWS, chunked_sums

    torch.manual_seed(2)
    left, right = torch.randn(CHUNK_ROWS + 9, 16).bfloat16(), torch.randn(CHUNK_ROWS + 9, 40).bfloat16()
    got = chunked_sums(left, right)
    want = (left[:CHUNK_ROWS].t().float() @ right[:CHUNK_ROWS].float()
            + left[CHUNK_ROWS:].t().float() @ right[CHUNK_ROWS:].float())
    assert torch.equal(got, want)
    assert (got.double() - fp64(left, right)).abs().max() <= 1e-4
    assert torch.equal(chunked_sums(left[:0], right[:0]), torch.zeros(16, 40))


@pytest.mark.parametrize("left, right, error, words", [
    (torch.zeros(4, 3), torch.zeros(5, 2), ValueError, "same T"),
    (torch.zeros(4), torch.zeros(4, 2), ValueError, r"\[T, p\]"),
    (torch.zeros(4, 3), torch.zeros(4, 2).bfloat16(), TypeError, "torch.float32"),
    (torch.zeros(4, 3).double(), torch.zeros(4, 2).double(), TypeError, "torch.bfloat16"),
])
def test_bad_operands_are_refused_naming_what_to_give(left, right, error, words):
    pytest.importorskip("triton", reason="triton is not installed")
    from mcore_torch_experts.kernels.factor_grad_triton import factor_grad

    with pytest.raises(error, match=words):
        factor_grad(left, right)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_on_the_gpu_against_fp64_and_with_rows_appended(dtype):
    """The compiled kernel at adapter shapes (rank 16 by 2048 and 1536 by 16, 65,536 routed rows):
    FP64's value within FP32 sums' error, run to run bitwise, and the first rows' sums bitwise
    with zero rows appended (the others' gradient zero)."""
    from mcore_torch_experts.kernels.factor_grad_triton import factor_grad

    torch.manual_seed(3)
    for p, q, rows in ((16, 2048, 65536), (1536, 16, 65536), (16, 96, 5000)):
        left = torch.randn(rows, p, device="cuda").to(dtype)
        right = torch.randn(rows, q, device="cuda").to(dtype)
        got = factor_grad(left, right)
        want = left.double().t() @ right.double()
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), (p, q, rows)
        assert torch.equal(factor_grad(left, right), got)
        head = rows // 3
        zeros = torch.zeros(rows - head, p, device="cuda", dtype=dtype)
        assert torch.equal(factor_grad(torch.cat([left[:head], zeros]), right),
                           factor_grad(left[:head], right[:head]))
