"""onegraph::gated_rms_norm_linear's CUDA lowering (custom_ops/triton/gated_rms_norm_linear.py: the GDN output norm
in out_proj's GEMV prologue) against its pure-torch reference, and the in-place GDN step twin that the fold pairs
with it (custom_ops/triton/gdn_decode_step.py). In Triton's CPU interpreter without a GPU (small awkward shapes:
heads and V not powers of two, N not a multiple of the tile, the gate a strided column view as in the model), and
compiled on a GPU (the `cuda` test at the Qwen3.5-35B-A3B out_proj shape).

Bound: the kernel's normed row is gated_rms_norm's up to one rounding of its fp32 statistics (summed in another
order: 1 ulp of the model dtype at most in an element), and its sum of that row with w is a GEMV in another fp32
order: within 2**-8 (bf16) / 1e-4 (fp32) of the row scale of the double-precision product, plus 2**-8 |w| |row|
for the row's ulps (bf16).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEVICE, cuda_only, needs_triton

pytestmark = needs_triton
ops = torch.ops.onegraph


def _inputs(M, HV, V, N, dtype, w_dtype, seed):
    """x [M, HV*V]; z a strided [M, HV*V] column view of a wider output (as the fused in_proj's); norm w [V]."""
    g = torch.Generator().manual_seed(seed)
    K = HV * V
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    wide = torch.randn(M, K + 40, generator=g).to(dtype).to(DEVICE)
    z = wide[:, 24:24 + K]
    nw = (1.0 + 0.1 * torch.randn(V, generator=g)).to(w_dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype).to(DEVICE)
    return x, z, nw, w


def _check(M, HV, V, N, dtype, w_dtype, seed):
    from onegraph.custom_ops.gated_rms_norm_linear import reference_gated_rms_norm_linear
    from onegraph.custom_ops.gated_rms_norm import reference_gated_rms_norm
    x, z, nw, w = _inputs(M, HV, V, N, dtype, w_dtype, seed)
    assert z.stride(0) == z.shape[1] + 40          # a view into the wider rows
    y = ops.gated_rms_norm_linear_triton(x, z, nw, 1e-6, w)
    assert y.shape == (M, N) and y.dtype == dtype
    row = reference_gated_rms_norm(x.reshape(-1, V), z.reshape(-1, V), nw, 1e-6).reshape(M, -1)
    ref = F.linear(row.double(), w.double())
    scale = ref.abs().amax().clamp(min=1.0)
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-4
    slack = (2.0 ** -8 if dtype == torch.bfloat16 else 0.0) * (row.double().abs() @ w.double().abs().T)
    err = (y.double() - ref).abs() - slack
    assert (err <= ulp * scale).all(), f"max excess {(err / scale).max().item():.3g}"
    # and the op's own reference, which the CPU path runs, within the same bound
    assert torch.equal(reference_gated_rms_norm_linear(x, z, nw, 1e-6, w), F.linear(row, w))


@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16_fp32w"])
@pytest.mark.parametrize("M", [1, 3])
def test_matches_reference(M, dtype, w_dtype):
    _check(M, 3, 24, 37, dtype, w_dtype, seed=M)      # one row: the GEMV's prologue; 3 rows: norm kernel + GEMV


def test_35b_out_proj_shape():
    _check(1, 32, 128, 2048, torch.bfloat16, torch.bfloat16, seed=0)


for _m in cuda_only:
    test_35b_out_proj_shape = _m(test_35b_out_proj_shape)


def test_inplace_step_twin_equals_the_functional_step_and_its_writes():
    """gdn_decode_step_inplace_triton (conv kernel, then the step on its output, rows written in place) against
    gdn_decode_step_triton's outputs scattered at the slots: the same out and state, the other slots untouched."""
    from test_ops import Gen, case_gdn_decode_step, materialise
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a
            for a in materialise(case_gdn_decode_step(Gen(3)), torch.float32)]
    qkv, a, b, conv, rec, slots = args[:6]
    out, new_conv, new_rec = ops.gdn_decode_step_triton(*args)
    conv2, rec2 = conv.clone(), rec.clone()
    out2 = ops.gdn_decode_step_inplace_triton(qkv, a, b, conv2, rec2, slots, *args[6:])
    assert torch.allclose(out2, out, rtol=1e-5, atol=1e-6)
    want_conv, want_rec = conv.index_copy(0, slots, new_conv), rec.index_copy(0, slots, new_rec)
    assert torch.allclose(conv2, want_conv, rtol=1e-6, atol=1e-7) and torch.allclose(rec2, want_rec, rtol=1e-5, atol=1e-6)
    untouched = torch.ones(conv.shape[0], dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert torch.equal(conv2[untouched.to(DEVICE)], conv[untouched.to(DEVICE)])
    assert torch.equal(rec2[untouched.to(DEVICE)], rec[untouched.to(DEVICE)])
