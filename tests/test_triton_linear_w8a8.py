"""onegraph::linear_w8a8_int8 / linear_w8a8_fp8 and their CUDA lowering (custom_ops/triton/linear_w8a8.py):
the references against independent float64 / int64 arithmetic, the Triton kernels against the references in
Triton's CPU interpreter without a GPU (small awkward shapes) and compiled on a GPU (plus the `cuda` tests at
Qwen3.5-35B-A3B shapes).

INT8: every step of the kernel is exact (integer dot products) or the reference's own fp32 operation, so
kernel == reference bit for bit, in fp32 and bf16. FP8: the sum order differs: fp32 1e-5 relative to the
output's scale, bf16 one rounding (2**-8).
"""
from __future__ import annotations

import pytest
import torch

from triton_env import CUDA, DEVICE, HAVE_TRITON, INTERPRETED, cuda_only, cuda_us, kernels, needs_triton  # noqa: F401

from onegraph.custom_ops.linear_w8a8_fp8 import reference_linear_w8a8_fp8
from onegraph.custom_ops.linear_w8a8_int8 import int_dot, reference_linear_w8a8_int8

if kernels.AVAILABLE:
    from onegraph.custom_ops.triton import linear_w8a8 as w8

TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8}
REF = {torch.int8: reference_linear_w8a8_int8, torch.float8_e4m3fn: reference_linear_w8a8_fp8}


def _weight(N, K, kind, seed):
    """-> (w [N, K] int8 (every code, -128 included) | e4m3 (every finite code), scale [N, 1] fp32), on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (N, K), generator=g, dtype=torch.int32)
    if kind == torch.int8:
        w = (codes - 128).to(torch.int8)
    else:
        w = torch.where((codes & 0x7F) == 0x7F, 0x3C, codes).to(torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.rand(N, 1, generator=g) * 2.0 ** torch.randint(-12, -4, (N, 1), generator=g)
    return w.to(DEVICE), scale.to(DEVICE)


def _x(M, K, dtype, seed):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4     # rows of different ranges
    if M > 2:
        x[1] = 0                                                                 # an all-zero row
    return x.to(dtype).to(DEVICE)


def _float64(x, w, scale, qmax):
    """Independent: per-row scales and quantization in float64 / int64, the dot in float64 (exact for int8)."""
    xd = x.double()
    s = xd.abs().amax(1, keepdim=True) / qmax
    s = torch.where(s > 0, s, torch.ones_like(s))
    v = (xd / s).clamp(-qmax, qmax)
    q = v.round() if w.dtype == torch.int8 else v.float().to(torch.float8_e4m3fn).double()
    return (q @ w.double().T) * s * scale.double().T


# e4m3 x e4m3 on Hopper's tensor cores (the M > 1 dot path, compiled): the MMA aligns the products of one
# instruction in reduced precision (custom_ops/triton/linear_w8a8.py); measured 1.1e-4 on the H200 at 17 rows
MMA_FP8_TOL = 2.0 ** -11


def _check(y, x, w, scale):
    ref = _float64(x, w, scale, 127.0 if w.dtype == torch.int8 else 448.0)
    err = ((y.double() - ref).abs() / ref.abs().amax().clamp(min=1e-30)).max().item()
    tol = TOL[x.dtype]
    if w.dtype == torch.float8_e4m3fn and x.shape[0] > 1 and not INTERPRETED:
        tol = max(tol, MMA_FP8_TOL)
    assert err <= tol, f"max relative error {err:.3g} > {tol:.3g}"


def test_int_dot_is_exact_past_the_fp32_integer_range():
    """K = 5000 of extreme codes (|sum| up to 8e7 > 2**24): the chunked fp32 sum equals the int64 sum."""
    g = torch.Generator().manual_seed(0)
    xq = torch.full((3, 5000), 127, dtype=torch.int8)
    xq[1] = torch.randint(-127, 128, (5000,), generator=g, dtype=torch.int8)
    wq = torch.full((4, 5000), -128, dtype=torch.int8)
    wq[2] = torch.randint(-128, 128, (5000,), generator=g, dtype=torch.int8)
    exact = xq.long() @ wq.long().T
    assert exact.abs().max() > 2 ** 24
    assert torch.equal(int_dot(xq, wq).long(), exact)


@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_references_match_float64(kind):
    w, scale = _weight(70, 300, kind, seed=1)
    x = _x(5, 300, torch.float32, seed=1)
    _check(REF[kind](x.cpu(), w.cpu(), scale.cpu()), x.cpu(), w.cpu(), scale.cpu())


def test_rows_are_independent():
    """Per-token scales: a row gives the same output alone as in a batch."""
    w, scale = _weight(64, 96, torch.int8, seed=2)
    x = _x(6, 96, torch.bfloat16, seed=2).cpu()
    full = reference_linear_w8a8_int8(x, w.cpu(), scale.cpu())
    assert torch.equal(full[4:5], reference_linear_w8a8_int8(x[4:5], w.cpu(), scale.cpu()))


@needs_triton
@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 16, 17])
def test_kernel_matches_reference(M, dtype, kind):
    """N = 200, K = 300 (no tile divides them); M = 17 takes the prefill (BM = 64) tiles."""
    w, scale = _weight(200, 300, kind, seed=M)
    x = _x(M, 300, dtype, seed=M)
    y = w8.matmul(x, w, scale)
    assert y.shape == (M, 200) and y.dtype == dtype
    ref = REF[kind](x, w, scale)
    if kind == torch.int8:
        assert torch.equal(y, ref), f"int8 kernel differs from the reference by {(y.float() - ref.float()).abs().max()}"
    _check(y, x, w, scale)


@needs_triton
@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [300, 2048 + 64])
def test_one_row_gemv_quantizing_its_row_is_the_two_kernel_path(K, dtype, kind):
    """At M = 1 the GEMV finds the row's scale and quantizes each K tile itself (no _quant_rows launch): the same
    8-bit values, scale and sums in the same order as _quant_rows + the GEMV, bit for bit. A zero row too (its
    scale is 1). K = 2112 takes more than one of _quant_rows' 1024-wide passes."""
    w, scale = _weight(72, K, kind, seed=K)
    for x in (_x(1, K, dtype, seed=K) * 3.0, torch.zeros(1, K, dtype=dtype, device=DEVICE)):
        fused, apart = w8.matmul(x, w, scale), w8.matmul(x, w, scale, fuse_quant=False)
        assert torch.equal(fused, apart), (fused.float() - apart.float()).abs().max()


@needs_triton
@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("M", [1, 3])
def test_concatenated_weight_is_bit_identical(M, kind):
    """Per-channel parts of any size concatenate with their scale rows: every column is the same sum as from
    its own part (the tile depends on (M, K) only)."""
    parts = [_weight(n, 192, kind, seed=10 + n) for n in (200, 64, 40)]
    x = _x(M, 192, torch.bfloat16, seed=3)
    fused = w8.matmul(x, torch.cat([w for w, _ in parts]), torch.cat([s for _, s in parts]))
    assert torch.equal(fused, torch.cat([w8.matmul(x, w, s) for w, s in parts], 1))


@needs_triton
def test_triton_ops_refuse_bad_inputs():
    w, scale = _weight(200, 300, torch.int8, seed=0)
    x = _x(1, 300, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=r"one per output channel of w.*\[200, 1\]"):
        torch.ops.onegraph.linear_w8a8_int8_triton(x, w, scale[:100])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        torch.ops.onegraph.linear_w8a8_fp8_triton(x, w, scale)


@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("M", [1, 4, 16, 64])
@pytest.mark.parametrize("N,K", [(12352, 2048), (2048, 4096), (8192 + 1024, 2048)],
                         ids=["gdn_in_proj", "out_proj", "attn_qkv"])
def test_35b_shapes(M, N, K, kind):
    """The fused GDN in_proj (8192 + 4096 + 32 + 32 rows), out_proj / o_proj and fused attention q/k/v shapes,
    bf16 activations; prints the kernel's time and weight bandwidth beside the bf16 GEMV's (informational)."""
    from onegraph.custom_ops.triton import linear as lin
    w, scale = _weight(N, K, kind, seed=M)
    x = _x(M, K, torch.bfloat16, seed=M)
    y = w8.matmul(x, w, scale)
    if kind == torch.int8:
        assert torch.equal(y, REF[kind](x, w, scale))
    _check(y, x, w, scale)
    wb = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16)

    t8, t16 = cuda_us(lambda: w8.matmul(x, w, scale)), cuda_us(lambda: lin.project(x, wb))
    print(f"\n{kind} M={M} N={N} K={K}: w8a8 {t8:.1f} us ({N * K / t8 / 1e3:.0f} GB/s), bf16 {t16:.1f} us "
          f"({2 * N * K / t16 / 1e3:.0f} GB/s)")


for _m in cuda_only:
    test_35b_shapes = _m(test_35b_shapes)
