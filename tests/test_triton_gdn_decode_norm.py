"""Parity rung 1 for gdn_decode_step_norm's Triton kernel (custom_ops/triton/gdn_decode_step_norm.py), functional
and in place, against the pure-torch reference = gdn_decode_step then gated_rms_norm.

Inputs are laid out as the model hands them over: qkv and z strided column views of one fused projection
output, the state rows picked by `slots`. Tolerances (max abs error) as in tests/test_triton_ops.py: fp32
1e-4; bf16 outputs 2e-2 (the kernel reproduces the reference's roundings: on the interpreter within a few
bf16 ulps), the fp32 state 1e-3; the new conv rows are a copy: exact. Interpreter on CPU (small shapes),
compiled on a GPU, plus the `cuda`-marked tests at Qwen3.5-35B-A3B shapes.
"""
from __future__ import annotations

import pytest
import torch
from triton_env import CUDA, DEVICE, HAVE_TRITON, needs_triton

from onegraph.custom_ops.gated_rms_norm import reference_gated_rms_norm
from onegraph.custom_ops.gdn_decode_step import reference_gdn_decode_step
from onegraph.custom_ops.gdn_decode_step_norm import reference_gdn_decode_step_norm

ops = torch.ops.onegraph
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
REC_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-3}


def close(got, ref, atol, what):
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape, f"{what}: shape {list(got.shape)} != {list(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = (got - ref).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol:.3g}"


def make(B, S, HK, HV, K, V, W, dtype, seed, slots, w_dtype=None):
    """The op's arguments; qkv, z, b, a are column views of one [B, C + 2*HV*V + 2*HV] buffer (fused in_proj
    with an extra HV*V of padding so z is not the last part)."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * HK * K + HV * V

    def rn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(DEVICE)

    fused = rn(B, C + 2 * HV * V + 2 * HV)
    qkv, z = fused[:, :C], fused[:, C + HV * V:C + 2 * HV * V]
    b, a = fused[:, C + 2 * HV * V:C + 2 * HV * V + HV], fused[:, C + 2 * HV * V + HV:]
    return [qkv, a, b, z, rn(S, C, W - 1), rn(S, HV, K, V, scale=0.5, dt=torch.float32),
            torch.as_tensor(slots, dtype=torch.int64).to(DEVICE), rn(C, W, scale=0.5), rn(HV, scale=0.5), rn(HV),
            rn(V, dt=w_dtype or dtype), HK, 1e-6]


def test_reference_is_the_unfused_composition():
    """The op computes exactly what gdn_decode_step + gated_rms_norm did (so CPU artifacts do not move)."""
    args = make(3, 5, 2, 4, 16, 8, 4, torch.float32, 0, [4, 0, 2])
    y, conv, rec = ops.gdn_decode_step_norm(*args)
    step = args[:3] + args[4:10] + [args[11]]
    out, rconv, rrec = reference_gdn_decode_step(*step)
    ry = reference_gated_rms_norm(out.reshape(-1, 8), args[3].reshape(-1, 8), args[10], args[12]).reshape(3, 4, 8)
    assert torch.equal(y, ry) and torch.equal(conv, rconv) and torch.equal(rec, rrec)


SHAPES = [
    (1, 3, 2, 4, 16, 16, 4, [2]),                 # the tiny model's shape ratio (REP 2)
    (5, 9, 1, 3, 32, 24, 4, [7, 0, 8, 1, 3]),     # REP 3 (padded to 4 in the kernel), V not a power of 2
    (4, 6, 2, 2, 16, 40, 3, [5, 2, 0, 3]),        # REP 1, W = 3
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,HK,HV,K,V,W,slots", SHAPES)
def test_kernel_matches_reference(B, S, HK, HV, K, V, W, slots, dtype):
    args = make(B, S, HK, HV, K, V, W, dtype, B, slots)
    got = ops.gdn_decode_step_norm_triton(*args)
    ref = reference_gdn_decode_step_norm(*args)
    close(got[0], ref[0], TOL[dtype], "y")
    close(got[1], ref[1], 0.0, "new_conv_rows")
    close(got[2], ref[2], REC_TOL[dtype], "new_rec_rows")


@needs_triton
def test_fp32_norm_weight_on_bf16():
    """promote(fp32 w, bf16) is fp32: w * norm(x) is not rounded to bf16 (the ROUND_MID=False path)."""
    args = make(2, 3, 2, 4, 16, 16, 4, torch.bfloat16, 11, [1, 0], w_dtype=torch.float32)
    close(ops.gdn_decode_step_norm_triton(*args)[0], reference_gdn_decode_step_norm(*args)[0], 2e-2, "y")


def inplace_vs_reference(args, dtype, steps, what):
    """`steps` decode steps of the in-place op against the reference + index_copy (the model's write-back)."""
    conv, rec = args[4].clone(), args[5].clone()
    rconv, rrec = args[4].clone(), args[5].clone()
    slots = args[6]
    g = torch.Generator().manual_seed(123)
    for step in range(steps):
        if step:          # a new token's projections (same strided layout)
            args[0].copy_(torch.randn(args[0].shape, generator=g).to(dtype))
            args[3].copy_(torch.randn(args[3].shape, generator=g).to(dtype))
        y = ops.gdn_decode_step_norm_inplace_triton(*args[:4], conv, rec, *args[6:])
        ry, nc, nr = reference_gdn_decode_step_norm(*args[:4], rconv, rrec, *args[6:])
        rconv.index_copy_(0, slots, nc)
        rrec.index_copy_(0, slots, nr)
        close(y, ry, TOL[dtype], f"{what} step {step} y")
        close(conv, rconv, 0.0, f"{what} step {step} conv state")       # copies of inputs: exact
        close(rec, rrec, REC_TOL[dtype] * (step + 1), f"{what} step {step} recurrent state")
    untouched = torch.ones(args[4].shape[0], dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert torch.equal(conv[untouched.to(conv.device)], args[4][untouched.to(conv.device)]), "a row not in slots moved"
    assert torch.equal(rec[untouched.to(rec.device)], args[5][untouched.to(rec.device)]), "a row not in slots moved"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,HK,HV,K,V,W,slots", SHAPES[:2])
def test_inplace_matches_reference_and_index_copy(B, S, HK, HV, K, V, W, slots, dtype):
    """The in-place twin writes exactly the rows the functional op returns, at `slots`, and nothing else;
    its y equals the functional kernel's bit for bit (the same arithmetic)."""
    args = make(B, S, HK, HV, K, V, W, dtype, B + 20, slots)
    y_fun = ops.gdn_decode_step_norm_triton(*args)[0]
    conv, rec = args[4].clone(), args[5].clone()
    y_inp = ops.gdn_decode_step_norm_inplace_triton(*args[:4], conv, rec, *args[6:])
    assert torch.equal(y_fun, y_inp)
    inplace_vs_reference(args, dtype, 1, f"B={B}")


@needs_triton
def test_inplace_carries_state():
    args = make(3, 4, 2, 4, 16, 16, 4, torch.float32, 7, [3, 1, 0])
    inplace_vs_reference(args, torch.float32, 3, "3 steps")


# ---------------------------------------------------------------- CUDA only: 35B-A3B shapes

@pytest.mark.cuda
@pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a CUDA device and triton")
@pytest.mark.parametrize("B", [1, 8, 64])
def test_35b_shapes(B):
    args = make(B, B + 1, 16, 32, 128, 128, 4, torch.bfloat16, B, list(range(B, 0, -1)))
    got = ops.gdn_decode_step_norm_triton(*args)
    ref = reference_gdn_decode_step_norm(*args)
    close(got[0], ref[0], 3.2e-2, "y")
    close(got[1], ref[1], 0.0, "new_conv_rows")
    close(got[2], ref[2], 1e-3, "new_rec_rows")
    inplace_vs_reference(args, torch.bfloat16, 2, f"35B B={B}")
