"""onegraph::linear_fp8's CUDA lowering (custom_ops/triton/linear_fp8.py) against an independent float64
dequantization, in Triton's CPU interpreter without a GPU (small awkward shapes) and compiled on a GPU
(plus the `cuda` tests at Qwen3.5-35B-A3B shapes).

The float tail (linear_fp8's `tail`, the GDN [b; a] rows of an FP8 model) against the same reference, its FP8
columns bit-identical to the tail-free launch's.

Weights are random e4m3 bytes (every finite code) with a different random power-of-two-spread scale per
128x128 block, so a block read with another block's scale is caught, not averaged away. Tolerances as
tests/test_triton_linear.py: fp32 1e-5 relative to the output's scale (another summation order); bf16 one
rounding of an almost exact sum, 2**-8 relative.
"""
from __future__ import annotations

import pytest
import torch

from triton_env import CUDA, DEVICE, HAVE_TRITON, cuda_only, cuda_us, kernels, needs_triton, same_sums  # noqa: F401

if kernels.AVAILABLE:
    from onegraph.custom_ops.triton import linear_fp8 as lin8

TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8}


def _fp8_weight(N, K, seed):
    """-> (w [N, K] e4m3, scale [ceil(N/128), ceil(K/128)] fp32), on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (N, K), generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, 0x3C, codes).to(torch.uint8)      # no NaN codes (0x7F, 0xFF)
    nb, kb = -(-N // 128), -(-K // 128)
    scale = torch.rand(nb, kb, generator=g) * 2.0 ** torch.randint(-12, -4, (nb, kb), generator=g)
    return codes.view(torch.float8_e4m3fn).to(DEVICE), scale.to(DEVICE)


def _x(M, K, dtype, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(M, K, generator=g).to(dtype).to(DEVICE)


def _dequant(w, scale):
    """float64 [N, K]: each block's scale repeated over its elements (repeat_interleave, not the op's expand)."""
    N, K = w.shape
    return w.double() * scale.double().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]


def _ref(x, w, scale):
    return x.double() @ _dequant(w, scale).T


def _check(y, x, w, scale):
    ref = _ref(x, w, scale)
    err = ((y.double() - ref).abs() / ref.abs().amax().clamp(min=1e-30)).max().item()
    assert err <= TOL[x.dtype], f"max relative error {err:.3g} > {TOL[x.dtype]:.3g}"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 16, 17])
def test_matches_float64_dequantization(M, dtype):
    """N = 200 and K = 300: partial blocks on both edges; M = 17 takes the prefill (BM = 64) tiles."""
    w, scale = _fp8_weight(200, 300, seed=M)
    x = _x(M, 300, dtype, seed=M)
    y = lin8.matmul(x, w, scale)
    assert y.shape == (M, 200) and y.dtype == dtype
    _check(y, x, w, scale)


@needs_triton
@pytest.mark.parametrize("M", [1, 3])
def test_concatenated_weight_is_bit_identical(M):
    """Parts of whole 128-row blocks (and a last partial one) concatenate with their scale rows: every
    column is the same sum as from its own part (the tile depends on (M, K) only)."""
    parts = [_fp8_weight(n, 192, seed=10 + n) for n in (256, 128, 40)]
    x = _x(M, 192, torch.bfloat16, seed=3)
    fused = lin8.matmul(x, torch.cat([w for w, _ in parts]), torch.cat([s for _, s in parts]))
    assert torch.equal(fused, torch.cat([lin8.matmul(x, w, s) for w, s in parts], 1))


@needs_triton
def test_triton_op_refuses_a_scale_of_the_wrong_shape():
    w, scale = _fp8_weight(200, 300, seed=0)
    x = _x(1, 300, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=r"one per 128x128 block of w.*\[2, 3\]"):
        torch.ops.onegraph.linear_fp8_triton(x, w, scale[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        torch.ops.onegraph.linear_fp8_triton(x, w.float(), scale)


def test_reference_is_the_float64_dequantization():
    """The op's pure-torch reference (the CPU lowering) against the same independent dequantization."""
    from onegraph.custom_ops.linear_fp8 import reference_linear_fp8
    w, scale = _fp8_weight(200, 300, seed=5)
    x = _x(4, 300, torch.float32, seed=5)
    _check(reference_linear_fp8(x.cpu(), w.cpu(), scale.cpu()), x.cpu(), w.cpu(), scale.cpu())


@pytest.mark.parametrize("M", [1, 4, 16, 64])
@pytest.mark.parametrize("N,K", [(12352, 2048), (2048, 4096), (248320, 2048)], ids=["gdn_in_proj", "out_proj", "lm_head"])
def test_35b_shapes(M, N, K):
    """The fused GDN in_proj (8192 + 4096 + 32 + 32 rows), out_proj / o_proj and (`--fp8-lm-head`) lm_head shapes,
    bf16 activations; prints the kernel's time and its weight bandwidth beside the bf16 GEMV's (informational)."""
    from onegraph.custom_ops.triton import linear as lin
    w, scale = _fp8_weight(N, K, seed=M)
    x = _x(M, K, torch.bfloat16, seed=M)
    _check(lin8.matmul(x, w, scale), x, w, scale)
    wb = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16)

    t8, t16 = cuda_us(lambda: lin8.matmul(x, w, scale)), cuda_us(lambda: lin.project(x, wb))
    print(f"\nM={M} N={N} K={K}: fp8 {t8:.1f} us ({N * K / t8 / 1e3:.0f} GB/s), bf16 {t16:.1f} us "
          f"({2 * N * K / t16 / 1e3:.0f} GB/s)")


for _m in cuda_only:
    test_35b_shapes = _m(test_35b_shapes)


def _subnormal_heavy_weight(N, K, seed):
    """Every code, half of the columns e4m3 subnormals (exponent field 0) of either sign."""
    w, scale = _fp8_weight(N, K, seed)
    g = torch.Generator().manual_seed(seed + 7)
    sub = torch.randint(0, 8, (N, K // 2), generator=g, dtype=torch.uint8) | (
        torch.randint(0, 2, (N, K // 2), generator=g, dtype=torch.uint8) << 7)
    codes = w.cpu().view(torch.uint8).clone()
    codes[:, : K // 2] = sub
    return codes.view(torch.float8_e4m3fn).to(DEVICE), scale




@needs_triton
@pytest.mark.parametrize("M", [1, 4])
def test_subnormal_codes_convert_exactly(M):
    """e4m3 subnormals go through the kernels' conversion as their values (the GEMV's fp32 upcast and the dot
    path's bf16 one), to the reference's bound: x is zero outside the subnormal columns, so a conversion that
    flushed them would give zeros."""
    w, scale = _subnormal_heavy_weight(256, 512, seed=4 + M)
    x = _x(M, 512, torch.bfloat16, seed=4)
    x[:, 256:] = 0                                     # only the subnormal half (columns < K / 2) counts
    y = lin8.matmul(x, w, scale)
    assert y.float().abs().max() > 0
    _check(y, x, w, scale)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M, cfg", [(1, None), (1, (1, 4, 512, 4, 1)), (3, None)])
def test_add_rms_norm_linear_fp8_matches_reference(M, cfg, dtype):
    """add_rms_norm_linear_fp8's lowering (one row: custom_ops/triton/linear_fp8.py REGS, the normed row made per
    K tile (its default tile, K = 300 > BK) or whole in registers (cfg: one K tile of 512); more rows: the norm
    kernel, then the projection): h is add_rms_norm's sum exactly, normed within one rounding of the fp32
    statistics, and y is the plain FP8 GEMV of those normed rows at the same tile (the same products:
    triton_env.same_sums), within the op's bound above."""
    from onegraph.custom_ops.add_rms_norm_linear_fp8 import reference_add_rms_norm_linear_fp8
    N, K = 200, 300
    w, scale = _fp8_weight(N, K, seed=M)
    x, res = _x(M, K, dtype, seed=M), _x(M, K, dtype, seed=M + 50)
    nw = (_x(1, K, dtype, seed=M + 9)[0] * 0.1)
    if cfg is None:
        y, normed, h = torch.ops.onegraph.add_rms_norm_linear_fp8_triton(x, res, nw, 1e-6, w, scale)
    else:
        y, normed, h = lin8.matmul(x, w, scale, cfg, norm=(res, nw, 1e-6))
    y_ref, normed_ref, h_ref = reference_add_rms_norm_linear_fp8(x, res, nw, 1e-6, w, scale)
    assert y.shape == (M, N) and torch.equal(h, h_ref)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6
    assert ((normed.float() - normed_ref.float()).abs() <= ulp * normed_ref.float().abs() + 1e-30).all()
    plain = lin8.matmul(normed, w, scale, cfg=(cfg or lin8.norm_tile(K)) if M == 1 else None)
    same_sums(y, plain, normed, _dequant(w, scale))
    _check(y, normed, w, scale)


# ---------------------------------------------------------------- the float tail (linear_fp8's `tail`)

def _check_tail(y, x, w, scale, tail):
    """y [M, N + Nt] against the float64 [dequant(w); tail] product, at the op's bound."""
    ref = x.double() @ torch.cat([_dequant(w, scale), tail.double()]).T
    err = ((y.double() - ref).abs() / ref.abs().amax().clamp(min=1e-30)).max().item()
    assert err <= TOL[x.dtype], f"max relative error {err:.3g} > {TOL[x.dtype]:.3g}"


@needs_triton
@pytest.mark.parametrize("group_m", [2, 3, 8])
def test_launch_order_groups_change_no_bit(group_m):
    """The dot path's 1-D launch order (_fp8_kernel GM: group_m M tiles of one weight tile side by side) only
    reorders programs: 5 M tiles of 16 rows (the last partial, so a group may be cut short) x 3 weight tiles + a
    tail tile give GM = 1's bits, and the reference's values."""
    K, N, M = 256, 96, 65
    w, scale = _fp8_weight(N, K, seed=60)
    x = _x(M, K, torch.float32, seed=61)
    tail = _x(8, K, torch.float32, seed=62) * 0.05
    cfg = (16, 32, 64, 4, 2)
    y = lin8.matmul(x, w, scale, cfg, tail=tail, group_m=group_m)
    assert torch.equal(y, lin8.matmul(x, w, scale, cfg, tail=tail, group_m=1))
    _check_tail(y, x, w, scale, tail)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 17])
def test_tail_rides_in_the_fp8_launch(M, dtype):
    """tail [8, K] of x's dtype: y [M, N + 8] is the float64 reference's within the op's bound at the GEMV (M = 1),
    the dot tile (M = 3) and the batch / prefill tiles (M = 17); the FP8 columns are the tail-free launch's bits
    (the tile depends on (M class, K) only), and so are the tail columns whatever N they follow."""
    K, N = 256, 256
    w, scale = _fp8_weight(N, K, seed=20 + M)
    x = _x(M, K, dtype, seed=M)
    tail = _x(8, K, dtype, seed=40 + M) * 0.05
    y = lin8.matmul(x, w, scale, tail=tail)
    assert y.shape == (M, N + 8) and y.dtype == dtype
    _check_tail(y, x, w, scale, tail)
    assert torch.equal(y[:, :N], lin8.matmul(x, w, scale))
    assert torch.equal(y[:, N:], lin8.matmul(x, w[:128], scale[:1], tail=tail)[:, 128:])
    assert torch.equal(y, torch.ops.onegraph.linear_fp8_triton(x, w, scale, tail))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [None, (1, 16, 64, 4, 2)], ids=["whole_row", "k_looped"])
def test_add_rms_norm_linear_fp8_with_tail(cfg, dtype):
    """The norm-folded form (REGS) at one row with a tail: normed and h, and the FP8 columns, are the tail-free
    launch's bits; the tail columns multiply the same normed row (the float64 reference of normed's rows), with
    the whole row in registers (K = 256, the default tile) or made per K tile (cfg: BK = 64)."""
    K, N = 256, 256
    w, scale = _fp8_weight(N, K, seed=31)
    x, res = _x(1, K, dtype, seed=31), _x(1, K, dtype, seed=32)
    nw = _x(1, K, dtype, seed=33)[0] * 0.1
    tail = _x(8, K, dtype, seed=34) * 0.05
    y, normed, h = lin8.matmul(x, w, scale, cfg, norm=(res, nw, 1e-6), tail=tail)
    y0, normed0, h0 = lin8.matmul(x, w, scale, cfg, norm=(res, nw, 1e-6))
    assert y.shape == (1, N + 8)
    assert torch.equal(normed, normed0) and torch.equal(h, h0) and torch.equal(y[:, :N], y0)
    _check_tail(y, normed, w, scale, tail)
    if cfg is None:                                   # the op's own lowering: the same launch
        got = torch.ops.onegraph.add_rms_norm_linear_fp8_triton(x, res, nw, 1e-6, w, scale, tail)
        assert all(torch.equal(a, b) for a, b in zip(got, (y, normed, h)))


@needs_triton
def test_add_rms_norm_linear_fp8_with_tail_more_rows():
    """Above one row the lowering is the norm kernel, then the FP8 launch with its tail."""
    from onegraph.custom_ops.add_rms_norm_linear_fp8 import reference_add_rms_norm_linear_fp8
    K, N = 256, 256
    w, scale = _fp8_weight(N, K, seed=35)
    x, res = _x(3, K, torch.float32, seed=35), _x(3, K, torch.float32, seed=36)
    nw = _x(1, K, torch.float32, seed=37)[0] * 0.1
    tail = _x(8, K, torch.float32, seed=38) * 0.05
    y, normed, h = torch.ops.onegraph.add_rms_norm_linear_fp8_triton(x, res, nw, 1e-6, w, scale, tail)
    assert torch.equal(y, lin8.matmul(normed, w, scale, tail=tail))
    y_ref = reference_add_rms_norm_linear_fp8(x, res, nw, 1e-6, w, scale, tail)[0]
    assert torch.allclose(y, y_ref, rtol=0, atol=1e-5 * y_ref.abs().max().item())


@needs_triton
def test_triton_op_refuses_a_tail_of_another_dtype_or_width():
    w, scale = _fp8_weight(200, 300, seed=0)
    x = _x(1, 300, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=r"linear_fp8 tail .*expected dtype torch.bfloat16"):
        torch.ops.onegraph.linear_fp8_triton(x, w, scale, torch.zeros(8, 300))
    with pytest.raises(ValueError, match=r"linear_fp8 tail .*expected shape \[\*, 300\]"):
        torch.ops.onegraph.linear_fp8_triton(x, w, scale, torch.zeros(8, 256, dtype=torch.bfloat16))


def test_reference_with_tail_is_the_concatenation():
    """The CPU lowering: [linear_fp8(x, w, s) | F.linear(x.float(), tail.float()).to(x.dtype)]."""
    from onegraph.custom_ops.linear_fp8 import reference_linear_fp8
    w, scale = _fp8_weight(200, 300, seed=6)
    x = _x(4, 300, torch.float32, seed=6).cpu()
    tail = _x(8, 300, torch.float32, seed=7).cpu()
    y = reference_linear_fp8(x, w.cpu(), scale.cpu(), tail)
    assert y.shape == (4, 208)
    _check_tail(y, x, w.cpu(), scale.cpu(), tail)


@pytest.mark.parametrize("M", [1, 4, 64])
def test_35b_gdn_in_proj_with_its_tail(M):
    """The 35B GDN in_proj as an FP8 checkpoint fuses it: e4m3 [qkv; z] 12288 x 2048 with the bf16 [b; a] 64 x 2048
    as its tail; prints the one launch's time beside the two it replaces (informational)."""
    from onegraph.custom_ops.triton import linear as lin
    w, scale = _fp8_weight(12288, 2048, seed=M)
    x = _x(M, 2048, torch.bfloat16, seed=M)
    tail = _x(64, 2048, torch.bfloat16, seed=M + 3) * 0.02
    y = lin8.matmul(x, w, scale, tail=tail)
    _check_tail(y, x, w, scale, tail)
    assert torch.equal(y[:, :12288], lin8.matmul(x, w, scale))
    one = cuda_us(lambda: lin8.matmul(x, w, scale, tail=tail))
    two = cuda_us(lambda: (lin8.matmul(x, w, scale), lin.project(x, tail)))
    print(f"\nM={M}: FP8 run with its tail {one:.1f} us, FP8 run + bf16 [b; a] launches {two:.1f} us")


for _m in cuda_only:
    test_35b_gdn_in_proj_with_its_tail = _m(test_35b_gdn_in_proj_with_its_tail)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [2, 3, 4])
def test_rows_path_reads_the_weight_once_for_every_row(M, dtype):
    """The FMA path over all rows at once (BM = 4 < 16: no tl.dot; tile() takes it at 2..ROWS_MAX_M rows where
    TILES holds an FMA tile for K, out/o_proj's): the float64 reference's values within the op's bound, partial
    blocks on both edges
    (N = 200, K = 300, so BK = 256 loops over a partial K tile), with and without a float tail; and each row the
    same bits whatever rows share its launch."""
    cfg = (4, 16, 256, 8, 1)
    w, scale = _fp8_weight(200, 300, seed=70 + M)
    x = _x(M, 300, dtype, seed=70 + M)
    tail = _x(8, 300, dtype, seed=80 + M) * 0.05
    y = lin8.matmul(x, w, scale, cfg, tail=tail)
    _check_tail(y, x, w, scale, tail)
    assert torch.equal(y[:, :200], lin8.matmul(x, w, scale, cfg))
    # a row's sum does not depend on the rows beside it in the class: the same rows among 4 give the same bits
    four = torch.cat([x, _x(4, 300, dtype, seed=90)])[:4]
    assert torch.equal(lin8.matmul(four, w, scale, cfg, tail=tail)[:M], y)
    assert lin8.tile(M, 4096)[0] == (2 if M == 2 else 4)         # out/o_proj's K: the FMA tile of M's class


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,cfg", [(3, (16, 32, 64, 4, 2, True)), (70, (64, 64, 128, 4, 2, True))],
                         ids=["few", "prefill"])
def test_swapped_dot_matches_the_plain_dot(M, cfg, dtype):
    """The dot path's transposed product (SWAP: the upcast weight tile as the MMA's A operand, x's rows on its N):
    the float64 reference's values within the op's bound, with a float tail, partial blocks and M tiles on every
    edge (N = 200, K = 300, M = 70 over 64-row tiles); and the same values as the plain dot at the same tile — the
    same products and per-tile fp32 sums (bit-equal in the interpreter; the GPU's MMA may order a k16 step's
    products differently, so there one rounding of the output apart)."""
    w, scale = _fp8_weight(200, 300, seed=100 + M)
    x = _x(M, 300, dtype, seed=100 + M)
    tail = _x(8, 300, dtype, seed=110 + M) * 0.05
    y = lin8.matmul(x, w, scale, cfg, tail=tail)
    _check_tail(y, x, w, scale, tail)
    plain = lin8.matmul(x, w, scale, cfg[:5], tail=tail)
    if CUDA:
        assert ((y.float() - plain.float()).abs() <= plain.float().abs() * TOL[dtype] + 1e-30).all()
    else:
        assert torch.equal(y, plain)
    assert torch.equal(y[:, :200], lin8.matmul(x, w, scale, cfg))
