"""gdn_decode_steps (T positions of a speculative verify's GDN layer in one kernel) against T gdn_decode_step calls:
the reference chain (tolerances as tests/test_triton_gdn_decode_norm.py: fp32 1e-4, bf16 outputs 2e-2, the fp32
state 1e-3, conv rows exact) and the Triton decode step launched T times, whose values it must give: bit for bit
in the interpreter, within one output rounding compiled (the same per-position arithmetic, the state kept in fp32
between positions as the chain stores it). T runs below, at and past the conv window (W - 1 = 3 state columns),
so windows mix the conv state and the inputs.
Interpreter on CPU (small shapes), compiled on a GPU, plus the `cuda`-marked 35B shape.
"""
from __future__ import annotations

import pytest
import torch
from triton_env import CUDA, DEVICE, HAVE_TRITON, needs_triton

from onegraph.custom_ops.gdn_decode_steps import reference_gdn_decode_steps

ops = torch.ops.onegraph
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
REC_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-3}


def make(B, T, S, HK, HV, K, V, W, dtype, seed, slots):
    """The op's arguments; qkv, b, a are column views of one [B, T, C + 2*HV] buffer (the fused in_proj output)."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * HK * K + HV * V

    def rn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(DEVICE)

    fused = rn(B, T, C + 2 * HV)
    return [fused[..., :C], fused[..., C + HV:], fused[..., C:C + HV], rn(S, C, W - 1),
            rn(S, HV, K, V, scale=0.5, dt=torch.float32), torch.as_tensor(slots, dtype=torch.int64).to(DEVICE),
            rn(C, W, scale=0.5), rn(HV, scale=0.5), rn(HV), HK]


def chain(args, step):
    """T calls of `step` (a gdn_decode_step implementation), each from the state the one before returned."""
    qkv, a, b, conv, rec, slots, *rest = args
    B, T = qkv.shape[:2]
    conv_j, rec_j = conv.index_select(0, slots), rec.index_select(0, slots)
    rows = torch.arange(B, device=qkv.device)
    outs, convs, recs = [], [], []
    for j in range(T):
        out, conv_j, rec_j = step(qkv[:, j], a[:, j], b[:, j], conv_j, rec_j, rows, *rest)
        outs.append(out)
        convs.append(conv_j)
        recs.append(rec_j)
    return torch.stack(outs, 1), torch.stack(convs), torch.stack(recs)


def close(got, ref, atol, what):
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape, f"{what}: shape {list(got.shape)} != {list(ref.shape)}"
    err = (got - ref).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol:.3g}"


def _same_as_chain(got, ref, dtype):
    """The T-launch chain's values: bit for bit in the interpreter (the same operations in the same order); compiled,
    within one output rounding (the compiler may contract another multiply-add in a kernel of another shape)."""
    for x, y, what in zip(got, ref, ("out", "conv_after", "rec_after")):
        if CUDA:
            close(x, y, 0.0 if what == "conv_after" else (2 ** -7 if x.dtype == torch.bfloat16 else 1e-5), what)
        else:
            assert torch.equal(x, y), f"{what}: not the T-launch chain's bits"


def test_reference_is_the_decode_step_chain():
    """The CPU lowering is T gdn_decode_step calls from the slot's rows, and leaves the state untouched."""
    args = make(2, 4, 5, 2, 4, 16, 8, 4, torch.float32, 0, [4, 1])
    before = [t.clone() for t in args[3:5]]
    got = ops.gdn_decode_steps(*args)
    for x, y in zip(got, chain(args, ops.gdn_decode_step)):
        assert torch.equal(x, y)
    assert torch.equal(args[3], before[0]) and torch.equal(args[4], before[1])


SHAPES = [
    (1, 1, 3, 2, 4, 16, 16, 4, [2]),                 # one position: the decode step itself
    (1, 4, 3, 2, 4, 16, 16, 4, [2]),                 # K = 3: the 35B verify's positions, past the window
    (2, 2, 5, 1, 3, 32, 24, 4, [4, 0]),              # T < W - 1, REP 3, V not a power of 2
    (3, 5, 6, 2, 2, 16, 40, 3, [5, 2, 0]),           # REP 1, W = 3, V over 3 tiles
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,S,HK,HV,K,V,W,slots", SHAPES)
def test_kernel_is_the_triton_chain_and_matches_the_reference(B, T, S, HK, HV, K, V, W, slots, dtype):
    args = make(B, T, S, HK, HV, K, V, W, dtype, B * 10 + T, slots)
    before = [t.clone() for t in args[3:5]]
    got = ops.gdn_decode_steps_triton(*args)
    ref = reference_gdn_decode_steps(*args)
    close(got[0], ref[0], TOL[dtype], "out")
    close(got[1], ref[1], 0.0, "conv_after")
    close(got[2], ref[2], REC_TOL[dtype], "rec_after")
    _same_as_chain(got, chain(args, ops.gdn_decode_step_triton), dtype)
    assert torch.equal(args[3], before[0]) and torch.equal(args[4], before[1])


@needs_triton
def test_refuses_a_call_without_positions():
    args = make(1, 1, 3, 2, 4, 16, 16, 4, torch.float32, 0, [2])
    args[0], args[1], args[2] = args[0][:, :0], args[1][:, :0], args[2][:, :0]
    with pytest.raises(ValueError, match="no position"):
        ops.gdn_decode_steps_triton(*args)


@pytest.mark.cuda
@pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a CUDA device and triton")
@pytest.mark.parametrize("B", [1, 4])
def test_35b_shape(B):
    """Qwen3.5-35B-A3B's GDN layer (16 key heads, 32 value heads, 128 x 128), a K = 3 verify: the T-launch chain's
    bits; prints both times (informational: the chain reads and writes the 2 MiB slot state 4 times)."""
    from triton_env import cuda_us
    args = make(B, 4, B + 1, 16, 32, 128, 128, 4, torch.bfloat16, B, list(range(B, 0, -1)))
    got = ops.gdn_decode_steps_triton(*args)
    _same_as_chain(got, chain(args, ops.gdn_decode_step_triton), torch.bfloat16)
    one = cuda_us(lambda: ops.gdn_decode_steps_triton(*args))
    four = cuda_us(lambda: chain(args, ops.gdn_decode_step_triton))
    print(f"\nB={B} T=4: one launch {one:.1f} us, the chain {four:.1f} us")
