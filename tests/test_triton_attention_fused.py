"""The gated attention layer's fused decode pieces (custom_ops/triton/{qk_norm_rope,attention_decode}.py)
against their pure-torch references, and the model-level guarantees around them.

- qk_norm_rope: q and k read in place from a fused q ‖ gate | k | v projection output (strided
  views); vs the reference (rms_norm's then rope's): fp32 1e-5, bf16 one ulp of |y| (torch's and
  Triton's fp32 cos/sin may round to different bf16 neighbours, as for rope); vs today's two Triton
  kernels in sequence (rms_norm_triton then rope_triton): bit for bit, since it reduces in the same
  order and repeats the same elementwise arithmetic.
- attention_decode's gate epilogue: the kernel's output equals its own ungated output (gate = +inf:
  sigmoid = 1) times sigmoid(gate) rounded as the reference rounds them (bit for bit but where torch's
  and Triton's fp32 sigmoid differ in the last bit: then one ulp).
- Qwen35Model.decode clamps positions once per step: a position past the KV cache writes (and reads)
  its last row, exactly as the per-layer clamp did, in eager and for every layer.
Kernels run in Triton's CPU interpreter without a GPU (tests/triton_env.py); `cuda` tests at
Qwen3.5-35B-A3B shapes (16 q heads, 2 kv heads, head_dim 256, rotary 64) on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from onegraph.custom_ops.attention_decode import reference_attention_decode
from onegraph.custom_ops.qk_norm_rope import reference_qk_norm_rope

from triton_env import DEVICE, HAVE_TRITON, needs_triton

if HAVE_TRITON:
    from onegraph.custom_ops.triton import attention_decode as attn_mod

ops = torch.ops.onegraph
DTYPES = [torch.float32, torch.bfloat16]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def close_ulp(got, ref, dtype, what):
    """|got - ref| <= one ulp of |ref| (bf16: 2^-7 relative bounds it) or fp32's 1e-5."""
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape, f"{what}: shape {list(got.shape)} != {list(ref.shape)}"
    atol, rtol = (1e-5, 0.0) if dtype == torch.float32 else (1e-6, 2.0 ** -7)
    err = ((got - ref).abs() - rtol * ref.abs()).max().item()
    assert err <= atol, f"{what}: error beyond one ulp: {err:.3g}"


def inv_freq(rot, theta=1e7):
    return (1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))).to(DEVICE)


def fused_qk(N, HQ, KVH, D, dtype, g):
    """q [N, HQ, D], k [N, KVH, D]: strided views of one [N, HQ*2D + 2*KVH*D] projection output, as
    GatedAttention._qkv takes them (q the first half of each head's query ‖ gate)."""
    qkv = (torch.randn(N, HQ * 2 * D + 2 * KVH * D, generator=g) * 2.0).to(dtype).to(DEVICE)
    qg, k, _ = qkv.split([HQ * 2 * D, KVH * D, KVH * D], dim=-1)
    return qg.view(N, HQ, 2 * D)[..., :D], k.view(N, KVH, D)


def check_qk_norm_rope(N, HQ, KVH, D, rot, dtype, seed, max_pos=5000):
    g = gen(seed)
    q, k = fused_qk(N, HQ, KVH, D, dtype, g)
    wq = (torch.randn(D, generator=g) * 0.2).to(dtype).to(DEVICE)
    wk = (torch.randn(D, generator=g) * 0.2).to(dtype).to(DEVICE)
    positions = torch.randint(0, max_pos, (N,), generator=g).to(DEVICE)
    positions[0] = 0
    inv = inv_freq(rot)
    args = (q, k, wq, wk, positions, inv, 1e-6)
    gq, gk = ops.qk_norm_rope_triton(*args)
    rq, rk = reference_qk_norm_rope(*args)
    assert gq.is_contiguous() and gk.is_contiguous()
    close_ulp(gq, rq, dtype, "q vs reference")
    close_ulp(gk, rk, dtype, "k vs reference")
    # today's kernels in sequence: the same values, bit for bit
    nq, nk = ops.rms_norm_triton(q, wq, 1e-6), ops.rms_norm_triton(k, wk, 1e-6)
    assert torch.equal(gq, ops.rope_triton(nq, positions, inv)), "q differs from rms_norm_triton + rope_triton"
    assert torch.equal(gk, ops.rope_triton(nk, positions, inv)), "k differs from rms_norm_triton + rope_triton"
    assert torch.equal(gq[..., rot:], nq[..., rot:]), "pass-through dims are not the normalised input"
    assert (gq[1:, :, :rot].float() - nq[1:, :, :rot].float()).abs().max() > 0.1, "nothing rotated"
    return gq, gk


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,HQ,KVH,D,rot", [
    (3, 4, 2, 32, 8),          # tiny's attention: 4 q heads, 2 kv heads, head_dim 32, rotary 8
    (5, 3, 1, 24, 12),         # head_dim not a power of 2 (masked tile), G = 3
    (2, 2, 2, 16, 16),         # full rotary (no pass-through dims)
])
def test_qk_norm_rope(N, HQ, KVH, D, rot, dtype):
    check_qk_norm_rope(N, HQ, KVH, D, rot, dtype, seed=N * 10 + D)


@needs_triton
def test_qk_norm_rope_contiguous_inputs_and_expanded_positions():
    """Unfused projections (contiguous q, k) and a stride-0 position tensor give the same values."""
    g = gen(1)
    q, k = fused_qk(4, 4, 2, 32, torch.bfloat16, g)
    w = (torch.randn(32, generator=g) * 0.2).bfloat16().to(DEVICE)
    pos = torch.tensor([17], device=DEVICE)
    strided = ops.qk_norm_rope_triton(q, k, w, w, pos.expand(4), inv_freq(8), 1e-6)
    dense = ops.qk_norm_rope_triton(q.contiguous(), k.contiguous(), w, w, pos.repeat(4), inv_freq(8), 1e-6)
    for a, b in zip(strided, dense):
        assert torch.equal(a, b)


def check_gate_epilogue(got, o, gate, dtype):
    """got == o * sigmoid(gate) in the model dtype up to the fp32 sigmoid (torch's and Triton's differ in
    the last fp32 bit for ~15 % of inputs): within one ulp everywhere; bf16, whose rounding absorbs
    that bit, bit-identical for >= 95 % of the elements."""
    want = o * torch.sigmoid(gate)
    close_ulp(got, want, dtype, "gate epilogue vs o * sigmoid(gate)")
    if dtype == torch.float32:
        return
    same = (got == want).float().mean().item()
    assert same >= 0.95, f"gate epilogue: only {same:.1%} of the elements equal o * sigmoid(gate)"


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_gate_epilogue(dtype):
    """The combine kernel's gate: out = round(o) * round(sigmoid(gate)), o the kernel's own attention
    output (gate = +inf gives sigmoid = 1: o itself); and within tolerance of the reference."""
    g = gen(5)
    B, H, KVH, D, S, T = 3, 4, 2, 32, 4, 40
    r = lambda *s: (torch.randn(*s, generator=g)).to(dtype).to(DEVICE)     # noqa: E731
    q, kc, vc = r(B, H, D), r(S, KVH, T, D), r(S, KVH, T, D)
    slots = torch.tensor([3, 0, 2], device=DEVICE)
    positions = torch.tensor([39, 0, 17], device=DEVICE)
    gate = (r(B, H, 2 * D) * 3.0)[..., D:]                                # strided, as q_proj's gate half
    args = (q, kc, vc, slots, positions, D ** -0.5)
    got = ops.attention_decode_triton(*args, gate)
    o = ops.attention_decode_triton(*args, torch.full((B, H, D), float("inf"), dtype=dtype, device=DEVICE))
    check_gate_epilogue(got, o, gate, dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    err = (got.float() - reference_attention_decode(*args, gate).float()).abs().max().item()
    assert err <= tol, f"vs reference: {err:.3g} > {tol}"
    # forced small tiles and splits (empty splits for the short rows) through the same epilogue
    got_split = attn_mod.run(q, kc, vc, slots, positions, D ** -0.5, gate, block_n=16, nsplit=4)
    err = (got_split.float() - reference_attention_decode(*args, gate).float()).abs().max().item()
    assert err <= tol, f"split plan vs reference: {err:.3g} > {tol}"


# ---------------------------------------------------------------- model: one clamp per step

@pytest.fixture(scope="module")
def tiny32():
    from onegraph.graphs.load import load_model
    return load_model("tiny", "float32")[1]


def test_decode_past_the_cache_writes_the_last_row(tiny32):
    """positions >= Tmax: the KV write and the attention use row Tmax - 1 (never index past the
    cache), and the step computes what a step at Tmax - 1 computes; sampling still sees the real
    position. Eager, on the reference ops."""
    from onegraph.graphs.qwen3_5 import new_state
    model, Tmax = tiny32, 8
    cfg = model.cfg
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)                        # noqa: E731
    samp = (torch.zeros(1), i64([0]), torch.ones(1), i64([0]))
    outs = {}
    for pos in (Tmax - 1, Tmax + 5):
        state = new_state(cfg, 2, Tmax, torch.float32)
        g = gen(0)
        for t, st in enumerate(state):                                         # a filled cache, same for both
            st.copy_(torch.randn(st.shape, generator=g) * 0.1)
        with torch.no_grad():
            ids, logits = model.decode(i64([7]), i64([1]), i64([pos]), *samp, *state)
        outs[pos] = (logits, state)
    (l0, s0), (l1, s1) = outs[Tmax - 1], outs[Tmax + 5]
    assert torch.equal(l0, l1), "a position past the cache does not act as the last row"
    for i in [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]:
        assert torch.equal(s0[2 * i], s1[2 * i]) and torch.equal(s0[2 * i + 1], s1[2 * i + 1])


# ---------------------------------------------------------------- CUDA: 35B-A3B shapes

@pytest.mark.parametrize("N", [1, 64, 2048])
@pytest.mark.cuda
@pytest.mark.skipif(not (DEVICE == "cuda" and HAVE_TRITON), reason="needs a CUDA device and triton")
def test_qk_norm_rope_35b(N):
    check_qk_norm_rope(N, 16, 2, 256, 64, torch.bfloat16, seed=N, max_pos=262144)


@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.cuda
@pytest.mark.skipif(not (DEVICE == "cuda" and HAVE_TRITON), reason="needs a CUDA device and triton")
def test_attention_decode_gate_35b(B):
    g = gen(B)
    bf = torch.bfloat16
    r = lambda *s: torch.randn(*s, generator=g).to(bf).to(DEVICE)              # noqa: E731
    q, kc, vc = r(B, 16, 256), r(B + 1, 2, 4096, 256), r(B + 1, 2, 4096, 256)
    slots = torch.arange(B, 0, -1, device=DEVICE)
    positions = torch.randint(0, 4096, (B,), generator=g).to(DEVICE)
    positions[0] = 4095
    gate = (r(B, 16, 512) * 3.0)[..., 256:]
    args = (q, kc, vc, slots, positions, 256 ** -0.5)
    got = ops.attention_decode_triton(*args, gate)
    o = ops.attention_decode_triton(*args, torch.full((B, 16, 256), float("inf"), dtype=bf, device=DEVICE))
    check_gate_epilogue(got, o, gate, bf)
    assert (got.float() - reference_attention_decode(*args, gate).float()).abs().max().item() <= 1e-2
