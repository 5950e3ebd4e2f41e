"""onegraph::linear's CUDA lowering (custom_ops/triton/linear.py) against F.linear, and the projection
concatenation it makes exact (models/qwen3_5/fuse.py). Runs in Triton's CPU interpreter without a GPU (small
awkward shapes) and compiled on a GPU (plus the `cuda` tests at Qwen3.5-35B-A3B shapes).

Tolerances: fp32 1e-4 relative to the row's scale (another summation order); bf16: the kernel rounds
its fp32 sum once, as cuBLAS does, so it is within 1 bf16 ulp of the fp32 reference (2**-8 relative).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_env import CUDA, DEVICE, HAVE_TRITON, cuda_only, kernels, needs_triton, same_sums  # noqa: F401

if kernels.AVAILABLE:
    from onegraph.custom_ops.triton import linear as lin

ULP = {torch.float32: 1e-4, torch.bfloat16: 2.0 ** -8}


def _inputs(M, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype).to(DEVICE)
    return x, w


def _check(y, x, w):
    ref = F.linear(x.double(), w.double())
    scale = ref.abs().amax().clamp(min=1.0)
    err = ((y.double() - ref).abs() / scale).max().item()
    # bf16: one rounding of an (almost) exact sum: half an ulp of |y| <= scale, plus fp32 slack
    assert err <= ULP[x.dtype], f"max relative error {err:.3g} > {ULP[x.dtype]:.3g}"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 16])
def test_gemv_matches_linear(M, dtype):
    x, w = _inputs(M, 37, 300, dtype)            # N not a multiple of the tile, K not a multiple of BK
    y = lin.gemv(x, w)
    assert y.shape == (M, 37) and y.dtype == dtype
    _check(y, x, w)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_concatenated_weight_is_bit_identical(dtype):
    """The tile depends on (M, K) only, so a column's sum does not depend on which rows sit beside it.
    (M = 1: the interpreter's FMA path is exact too; the tl.dot path is checked on the GPU below.)"""
    x, w = _inputs(1, 70, 300, dtype, seed=1)
    parts = [w[:37], w[37:69], w[69:]]
    y = lin.gemv(x, torch.cat(parts))
    assert torch.equal(y, torch.cat([lin.gemv(x, p) for p in parts], 1))


@needs_triton
def test_linear_triton_above_the_gemv_rows_is_the_aten_gemm():
    x, w = _inputs(lin.GEMV_MAX_M + 1, 24, 40, torch.float32)
    assert torch.equal(torch.ops.onegraph.linear_triton(x, w), F.linear(x, w))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_triton_gemm_with_unaligned_rows_pads_the_weight(dtype):
    """N = 17 (as the router's E + 1), PAD_MIN_M rows: the GEMM runs on the weight padded to 16-byte rows (cuBLAS
    would pick an align-1 kernel otherwise); the result has N contiguous columns, each F.linear's within an ulp.
    Fewer rows (decode buckets above the GEMV) take the plain GEMM."""
    x, w = _inputs(lin.PAD_MIN_M, 17, 40, dtype, seed=2)
    y = torch.ops.onegraph.linear_triton(x, w)
    assert y.shape == (lin.PAD_MIN_M, 17) and y.is_contiguous() and y.dtype == dtype
    _check(y, x, w)
    rows = 16 // w.element_size()                                     # 4 fp32 / 8 bf16 rows: 20 / 24
    big = F.linear(x, torch.cat([w, torch.zeros_like(w[:-17 % rows])]))  # the padded product, computed apart
    assert torch.equal(y, big[:, :17])
    x = x[: lin.PAD_MIN_M - 1]
    assert torch.equal(torch.ops.onegraph.linear_triton(x, w), F.linear(x, w))


@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [(8192, 4096, 32, 32), (8192, 512, 512)], ids=["gdn_in_proj", "attn_qkv"])
@pytest.mark.parametrize("K", [2048])
def test_gemv_35b_shapes_concatenated(M, dtype, parts, K):
    x, w = _inputs(M, sum(parts), K, dtype, seed=2)
    y = lin.gemv(x, w)
    _check(y, x, w)
    split = torch.split(w, list(parts))
    assert torch.equal(y, torch.cat([lin.gemv(x, p) for p in split], 1)), "concatenation changed a column"


for _m in cuda_only:
    test_gemv_35b_shapes_concatenated = _m(test_gemv_35b_shapes_concatenated)


@pytest.mark.parametrize("M,N,K", [(1, 2048, 4096), (8, 2048, 4096), (1, 256, 2048), (1, 248320, 2048)])
def test_gemv_35b_shapes(M, N, K):
    x, w = _inputs(M, N, K, torch.bfloat16, seed=3)
    _check(lin.gemv(x, w), x, w)


for _m in cuda_only:
    test_gemv_35b_shapes = _m(test_gemv_35b_shapes)


# ---------------------------------------------------------------- add_rms_norm_linear (the norm in the GEMV's prologue)

def _norm_inputs(M, N, K, dtype, seed):
    x, w = _inputs(M, N, K, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    res = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    nw = (torch.randn(K, generator=g) * 0.1).to(dtype).to(DEVICE)
    return x, res, nw, w


def _check_norm_linear(M, N, K, dtype, seed):
    """h is add_rms_norm's sum exactly; normed is its norm within one rounding of the fp32 statistics (summed
    in another order: 1 ulp of the model dtype at most); y is the plain GEMV of the kernel's own normed rows,
    the same sums (same tile: at M = 1 the norm-row tile, the whole row one K tile, where the normed row is
    multiplied from registers; from 8 rows the norm kernel's rows by the 16-row tiles; triton_env.same_sums:
    bit for bit interpreted, within summation order compiled), and so within the GEMV's bound of F.linear."""
    from onegraph.custom_ops.add_rms_norm_linear import reference_add_rms_norm_linear
    x, res, nw, w = _norm_inputs(M, N, K, dtype, seed)
    y, normed, h = torch.ops.onegraph.add_rms_norm_linear_triton(x, res, nw, 1e-6, w)
    y_ref, normed_ref, h_ref = reference_add_rms_norm_linear(x, res, nw, 1e-6, w)
    assert y.shape == (M, N) and normed.shape == h.shape == (M, K)
    assert torch.equal(h, h_ref)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6
    assert ((normed.float() - normed_ref.float()).abs() <= ulp * normed_ref.float().abs() + 1e-30).all()
    plain = lin.gemv(normed, w, cfg=lin.norm_row_tile(K) if M == 1 else None, row_tiles=M > lin.GEMV_MAX_M)
    same_sums(y, plain, normed, w)
    _check(y, normed, w)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 3, 16, 20])     # 16, 20: the norm kernel, then the 16-row tiles
def test_add_rms_norm_linear_matches_reference(M, dtype):
    _check_norm_linear(M, 37, 300, dtype, seed=M)     # N not a multiple of the tile, K not of BK


@needs_triton
def test_add_rms_norm_linear_above_the_decode_rows_is_two_launches():
    """Above SPLIT_TO_M rows (prefill chunks): the add_rms_norm kernel then the aten GEMM, the reference's values."""
    from onegraph.custom_ops.add_rms_norm_linear import reference_add_rms_norm_linear
    from onegraph.custom_ops.triton.add_rms_norm_linear import SPLIT_TO_M
    x, res, nw, w = _norm_inputs(SPLIT_TO_M + 1, 24, 40, torch.float32, seed=5)
    got = torch.ops.onegraph.add_rms_norm_linear_triton(x, res, nw, 1e-6, w)
    ref = reference_add_rms_norm_linear(x, res, nw, 1e-6, w)
    assert torch.equal(got[2], ref[2]) and torch.allclose(got[1], ref[1], rtol=1e-6)
    assert torch.equal(got[0], F.linear(got[1], w))


@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("N", [257, 12352], ids=["router+shared_gate", "gdn_in_proj"])
def test_add_rms_norm_linear_35b_shapes(M, N):
    _check_norm_linear(M, N, 2048, torch.bfloat16, seed=M)


for _m in cuda_only:
    test_add_rms_norm_linear_35b_shapes = _m(test_add_rms_norm_linear_35b_shapes)
