"""Rung 1 of the parity ladder, the op-level checks every registered op must pass:

- `torch.library.opcheck` on small random fp32 inputs (schema: no hidden mutation / aliasing;
  fake tensor: the fake impl's shapes, dtypes and strides match the real output). The ops have no
  autograd, so the autograd utils are not run.
- `_validate`: a malformed input raises ValueError naming the expected shape.
- bf16 inputs run and stay close to fp32 on the same (bf16-rounded) values:
  |bf16 - fp32| <= 3e-2 * max(1, max|fp32|) (bf16 keeps 8 mantissa bits: 4e-3 relative per
  rounding, a few roundings deep); `sample` must pick identical ids (it computes in fp32).
- a few independent recomputations (torch.linalg.inv, SDPA, complex rotation, a per-token MoE
  loop) for the pieces whose reference is not plain arithmetic.
"""
import re

import pytest
import torch
import torch.nn.functional as F

from onegraph.custom_ops import REGISTRY
from onegraph.custom_ops.gdn_prefill import unit_lower_inverse

ops = torch.ops.onegraph
BF16_TOL = 3e-2

# small shapes shared by the cases
B, S, HQ, KVH, D, TMAX = 3, 4, 4, 2, 16, 24        # attention
HK, HV, K, V, W = 2, 4, 8, 8, 4                    # GDN
C = 2 * HK * K + HV * V
T = 10                                             # prefill chunk
E, I, IS, H = 8, 16, 12, 32                        # MoE


pytestmark = pytest.mark.usefixtures("one_thread")


def i64(v):
    return torch.tensor(v, dtype=torch.int64)


class Gen:
    """Seeded tensors; `m(...)` are model-dtype tensors (cast to bf16 in the bf16 runs), `f(...)`
    stay fp32 by contract (recurrent state, gates, inv_freq, sampling scalars)."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def f(self, *shape, scale=1.0):
        return torch.randn(shape, generator=self.g) * scale

    def m(self, *shape, scale=1.0):
        return ("model", self.f(*shape, scale=scale))


def case_rms_norm(g):
    return [g.m(B, 5, H), g.m(H, scale=0.1), 1e-6]


def case_add_rms_norm(g):
    return [g.m(B, H), g.m(B, H), g.m(H, scale=0.1), 1e-6]


def case_gated_rms_norm(g):
    return [g.m(6, V), g.m(6, V), g.m(V, scale=0.5), 1e-6]


def case_rope(g):
    return [g.m(5, HQ, D), i64([0, 3, 7, 100, 4095]), 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))]


def case_attention_decode(g):
    return [g.m(B, HQ, D), g.m(S, KVH, TMAX, D), g.m(S, KVH, TMAX, D), i64([2, 0, 3]), i64([5, 0, 23]), D ** -0.5,
            g.m(B, HQ, D)]


def case_qk_norm_rope(g):
    return [g.m(5, HQ, D), g.m(5, KVH, D), g.m(D, scale=0.1), g.m(D, scale=0.1), i64([0, 3, 7, 100, 4095]),
            1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), 1e-6]


def case_attention_prefill(g):
    return [g.m(T, HQ, D), g.m(S, KVH, TMAX, D), g.m(S, KVH, TMAX, D), i64([2]), i64([7]), D ** -0.5]


def case_causal_conv_prefill(g):
    return [g.m(T, C), g.m(S, C, W - 1), i64([2]), i64([7]), g.m(C, W, scale=0.5)]


def case_causal_conv_update(g):
    return [g.m(B, C), g.m(S, C, W - 1), i64([2, 0, 3]), g.m(C, W, scale=0.5)]


def case_fused_moe(g):
    """x [5, H], logits [5, E + 1] (router ‖ shared gate), the experts' and the shared expert's weights, top_k."""
    return [g.m(5, H), g.m(5, E + 1), g.m(E, 2 * I, H, scale=H ** -0.5), g.m(E, H, I, scale=I ** -0.5),
            g.m(IS, H, scale=H ** -0.5), g.m(IS, H, scale=H ** -0.5), g.m(H, IS, scale=IS ** -0.5), 2]


def case_fused_moe_fp8(g):
    """fused_moe's case with block-FP8 experts and shared expert, H = 160 (two 128-column blocks, one partial):
    e4m3 weights, fp32 block scales (gate_up's: the gate rows' block rows, then the up rows')."""
    q = lambda *s: (g.f(*s) * 8).to(torch.float8_e4m3fn)                      # noqa: E731
    sc = lambda *s: g.f(*s).abs() * 0.01 / 8 + 1e-4                           # noqa: E731
    return [g.m(5, 160), g.m(5, E + 1), q(E, 2 * I, 160), sc(E, 2, 2), q(E, 160, I), sc(E, 2, 1), q(IS, 160), sc(1, 2),
            q(IS, 160), sc(1, 2), q(160, IS), sc(2, 1), 2]


def case_add_rms_norm_linear(g):
    return [g.m(B, H), g.m(B, H), g.m(H, scale=0.1), 1e-6, g.m(IS, H, scale=H ** -0.5)]


def case_linear(g):
    return [g.m(5, H), g.m(IS, H, scale=H ** -0.5)]


def case_linear_f32(g):
    return [g.m(5, H), g.m(IS, H, scale=H ** -0.5)]


def case_linear_fp8(g):
    """w [130, 160] e4m3: partial 128x128 blocks on both edges; x and the float tail [8, 160] in the model dtype."""
    return [g.m(5, 160), (g.f(130, 160) * 8).to(torch.float8_e4m3fn), g.f(2, 2).abs() * 0.01,
            g.m(8, 160, scale=160 ** -0.5)]


def case_add_rms_norm_linear_fp8(g):
    """linear_fp8's weight, scales ([130, 160]: partial blocks) and tail behind add_rms_norm of [5, 160] rows."""
    return [g.m(5, 160), g.m(5, 160), g.m(160, scale=0.1), 1e-6, (g.f(130, 160) * 8).to(torch.float8_e4m3fn),
            g.f(2, 2).abs() * 0.01, g.m(8, 160, scale=160 ** -0.5)]


def case_linear_w8a8_int8(g):
    """w [130, 160] int8 per-channel; x in the model dtype (quantized per row inside the op)."""
    return [g.m(5, 160), (g.f(130, 160) * 60).round().clamp(-127, 127).to(torch.int8), g.f(130, 1).abs() * 0.01]


def case_linear_w8a8_fp8(g):
    return [g.m(5, 160), (g.f(130, 160) * 8).to(torch.float8_e4m3fn), g.f(130, 1).abs() * 0.01]


def gdn_params(g):
    A_log = ("model", torch.empty(HV).uniform_(1.0, 16.0, generator=g.g).log())
    dt_bias = ("model", torch.empty(HV).uniform_(-1.0, 1.0, generator=g.g))
    return A_log, dt_bias


def case_gdn_decode_step(g):
    A_log, dt_bias = gdn_params(g)
    return [g.m(B, C), g.m(B, HV), g.m(B, HV), g.m(S, C, W - 1), g.f(S, HV, K, V, scale=0.5), i64([2, 0, 3]),
            g.m(C, W, scale=0.5), A_log, dt_bias, HK]


def case_gdn_decode_steps(g):
    A_log, dt_bias = gdn_params(g)
    return [g.m(2, 3, C), g.m(2, 3, HV), g.m(2, 3, HV), g.m(S, C, W - 1), g.f(S, HV, K, V, scale=0.5), i64([3, 1]),
            g.m(C, W, scale=0.5), A_log, dt_bias, HK]


def case_gdn_decode_step_norm(g):
    A_log, dt_bias = gdn_params(g)
    return [g.m(B, C), g.m(B, HV), g.m(B, HV), g.m(B, HV * V), g.m(S, C, W - 1), g.f(S, HV, K, V, scale=0.5),
            i64([2, 0, 3]), g.m(C, W, scale=0.5), A_log, dt_bias, g.m(V), HK, 1e-6]


def case_gdn_prefill(g):
    x = F.silu(g.f(T, C))
    gate = -F.softplus(g.f(T, HV))
    beta = torch.sigmoid(g.f(T, HV))
    return [("model", x), gate, beta, g.f(S, HV, K, V, scale=0.5), i64([1]), HK, 8]


def case_sample(g):
    Bs = 4
    return [g.m(Bs, 40, scale=2.0), torch.tensor([0.0, 0.7, 1.0, 1.5]), i64([0, 5, 0, 1]),
            torch.tensor([1.0, 1.0, 0.9, 1.0]), i64([1, 2, 3, 2 ** 40]), i64([0, 7, 7, 100])]


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def materialise(args, dtype):
    return [a[1].to(dtype) if isinstance(a, tuple) and a and a[0] == "model" else a for a in args]


def op_args(name, dtype=torch.float32, seed=0):
    return materialise(CASES[name](Gen(seed)), dtype)


def test_every_registered_op_has_a_case():
    assert set(REGISTRY) <= set(CASES), f"ops without test inputs: {sorted(set(REGISTRY) - set(CASES))}"


# (fake and real outputs must agree on strides too: the references return contiguous tensors)


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    spec = REGISTRY[name]
    # torch 2.13's schema check compares each input before/after with allclose, which has no float8 CPU kernel
    float8 = ("linear_fp8", "linear_w8a8_fp8", "fused_moe_fp8", "add_rms_norm_linear_fp8")
    utils = (("test_faketensor",) if name in float8
             else ("test_schema", "test_faketensor"))
    torch.library.opcheck(spec.op, tuple(op_args(name)), test_utils=utils)


def outputs(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


@pytest.mark.parametrize("name", sorted(CASES))
def test_bf16_close_to_fp32(name):
    args_bf16 = op_args(name, torch.bfloat16)
    # the fp32 run sees the same values the bf16 run sees (rounded to bf16, then widened)
    args_fp32 = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in args_bf16]
    got = outputs(getattr(ops, name)(*args_bf16))
    ref = outputs(getattr(ops, name)(*args_fp32))
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.shape == b.shape
        if not b.is_floating_point():
            assert torch.equal(a, b), f"{name} output {i}: ids differ between bf16 and fp32"
            continue
        assert torch.isfinite(a.float()).all(), f"{name} output {i}: non-finite values in bf16"
        scale = max(1.0, b.abs().max().item())
        diff = (a.float() - b).abs().max().item()
        assert diff <= BF16_TOL * scale, f"{name} output {i}: bf16 differs by {diff:.3g} (scale {scale:.3g})"


# ---------------------------------------------------------------- validation

def bad(name, index, value):
    """op args with args[index] replaced by value (computed from the good args if callable)."""
    args = op_args(name)
    args[index] = value(args) if callable(value) else value
    return args


VALIDATION = [
    ("rms_norm", 1, torch.zeros(H + 1), f"rms_norm weight: expected shape [{H}], got [{H + 1}]"),
    ("add_rms_norm", 1, torch.zeros(B, H - 1), f"add_rms_norm residual: expected shape [{B}, {H}]"),
    ("add_rms_norm", 2, torch.zeros(2, H), f"add_rms_norm weight: expected shape [{H}]"),
    ("gated_rms_norm", 1, torch.zeros(6, V + 1), f"gated_rms_norm z: expected shape [6, {V}]"),
    ("rope", 1, i64([0, 1]), "rope positions: expected shape [5]"),
    ("rope", 0, torch.zeros(5, HQ * D), "rope x: expected shape [N, H, D]"),
    ("attention_decode", 3, i64([0, 1]), f"attention_decode slots: expected shape [{B}]"),
    ("attention_decode", 2, torch.zeros(S, KVH, TMAX + 1, D), f"attention_decode v_cache: expected shape "
                                                              f"[{S}, {KVH}, {TMAX}, {D}]"),
    ("attention_decode", 0, torch.zeros(B, HQ * D), "expected q [B, H, D]"),
    ("attention_decode", 6, torch.zeros(B, HQ * D), f"attention_decode gate: expected shape [{B}, {HQ}, {D}]"),
    ("qk_norm_rope", 1, torch.zeros(5, KVH, D + 1), f"qk_norm_rope k: expected shape [5, *, {D}]"),
    ("qk_norm_rope", 4, i64([0, 1]), "qk_norm_rope positions: expected shape [5]"),
    ("qk_norm_rope", 5, torch.zeros(D), f"qk_norm_rope inv_freq: expected [rot/2] with rot <= head_dim {D}"),
    ("attention_prefill", 4, i64([1, 2]), "attention_prefill start_pos: expected shape [1]"),
    ("attention_prefill", 0, torch.zeros(T, HQ, D + 2), f"attention_prefill q: expected shape [*, *, {D}]"),
    ("causal_conv_prefill", 1, torch.zeros(S, C, W), f"causal_conv_prefill conv_state: expected shape "
                                                     f"[*, {C}, {W - 1}]"),
    ("causal_conv_prefill", 3, i64([[7]]), "causal_conv_prefill n_valid: expected shape [1]"),
    ("causal_conv_update", 2, i64([0, 1]), f"causal_conv_update slots: expected shape [{B}]"),
    ("causal_conv_update", 3, torch.zeros(C + 1, W), f"causal_conv_update weight: expected shape [{C}, *]"),
    ("fused_moe", 3, torch.zeros(E, H, I + 1), f"fused_moe down: expected shape [{E}, {H}, {I}]"),
    ("fused_moe", 1, torch.zeros(5, E), f"fused_moe logits (router logits + the shared expert's gate logit): "
                                        f"expected shape [5, {E + 1}]"),
    ("fused_moe", 6, torch.zeros(H, IS + 1), f"fused_moe shared_down: expected shape [{H}, {IS}]"),
    ("add_rms_norm_linear", 1, torch.zeros(B, H + 1), f"add_rms_norm_linear residual: expected shape [{B}, {H}]"),
    ("add_rms_norm_linear", 4, torch.zeros(IS, H - 1), f"add_rms_norm_linear w: expected shape [*, {H}]"),
    ("linear", 1, torch.zeros(IS, H + 1), f"linear w: expected shape [*, {H}]"),
    ("linear", 0, torch.zeros(H), "linear x: expected shape [*, *]"),
    ("linear_f32", 1, torch.zeros(IS, H + 1), f"linear_f32 w: expected shape [*, {H}]"),
    ("linear_f32", 0, torch.zeros(H), "linear_f32 x: expected shape [*, *]"),
    ("fused_moe_fp8", 3, torch.zeros(E, 1, 2), "fused_moe_fp8 gate_up_scale (the gate rows' 128x128 block scales, "
                                               f"then the up rows'): expected shape [{E}, 2, 2]"),
    ("fused_moe_fp8", 10, torch.zeros(160, IS), "fused_moe_fp8 shared_down: expected dtype torch.float8_e4m3fn"),
    ("linear_fp8", 2, torch.zeros(1, 2), "linear_fp8 scale (one per 128x128 block of w): expected shape [2, 2]"),
    ("linear_fp8", 1, torch.zeros(130, 160), "linear_fp8 w: expected dtype torch.float8_e4m3fn"),
    ("linear_fp8", 3, torch.zeros(8, 161), "linear_fp8 tail (float rows after w's, x's dtype): expected shape "
                                          "[*, 160]"),
    ("linear_fp8", 3, torch.zeros(8, 160, dtype=torch.float64), "linear_fp8 tail (float rows after w's, x's dtype): "
                                                                "expected dtype torch.float32"),
    ("add_rms_norm_linear_fp8", 1, torch.zeros(5, 161), "add_rms_norm_linear_fp8 residual: expected shape [5, 160]"),
    ("add_rms_norm_linear_fp8", 5, torch.zeros(1, 2), "linear_fp8 scale (one per 128x128 block of w): expected shape "
                                                      "[2, 2]"),
    ("add_rms_norm_linear_fp8", 6, torch.zeros(8, 128), "linear_fp8 tail (float rows after w's, x's dtype): expected "
                                                        "shape [*, 160]"),
    ("linear_w8a8_int8", 2, torch.zeros(130), "linear_w8a8_int8 scale (one per output channel of w): expected shape "
                                              "[130, 1]"),
    ("linear_w8a8_int8", 1, torch.zeros(130, 160), "linear_w8a8_int8 w: expected dtype torch.int8"),
    ("linear_w8a8_fp8", 2, torch.zeros(2, 2), "linear_w8a8_fp8 scale (one per output channel of w): expected shape "
                                              "[130, 1]"),
    ("linear_w8a8_fp8", 0, torch.zeros(5, 161), "linear_w8a8_fp8 w: expected shape [*, 161]"),
    ("gdn_decode_step", 1, torch.zeros(B, HV + 1), f"gdn_decode_step a: expected shape [{B}, {HV}]"),
    ("gdn_decode_step", 0, torch.zeros(B, C + 1), f"qkv channels {C + 1} != 2*{HK}*{K} + {HV}*{V}"),
    ("gdn_decode_step", 3, torch.zeros(S, C, W), f"gdn_decode_step conv_state: expected shape [{S}, {C}, {W - 1}]"),
    ("gdn_decode_steps", 1, torch.zeros(2, 3, HV + 1), f"gdn_decode_step a: expected shape [2, {HV}]"),
    ("gdn_decode_steps", 2, torch.zeros(2, 4, HV), "gdn_decode_steps b: expected shape [2, 3, *]"),
    ("gdn_decode_steps", 0, torch.zeros(2, 0, C), "gdn_decode_steps: qkv holds no position"),
    ("gdn_decode_step_norm", 3, torch.zeros(B, HV * V + 1), f"gdn_decode_step_norm z: expected shape [{B}, {HV * V}]"),
    ("gdn_decode_step_norm", 10, torch.zeros(V + 1), f"gdn_decode_step_norm norm_weight: expected shape [{V}]"),
    ("gdn_prefill", 1, torch.zeros(T, HV - 1), f"gdn_prefill g: expected shape [{T}, {HV}]"),
    ("gdn_prefill", 4, i64([0, 1]), "gdn_prefill slot: expected shape [1]"),
    ("gdn_prefill", 0, torch.zeros(T, C - 1), f"x channels {C - 1} != 2*{HK}*{K} + {HV}*{V}"),
    ("sample", 2, i64([0, 1]), "sample top_k: expected shape [4]"),
    ("sample", 0, torch.zeros(40), "sample logits: expected shape [B, V]"),
]


@pytest.mark.parametrize("name,index,value,message", VALIDATION,
                         ids=[f"{n}-arg{i}-{k}" for k, (n, i, _, _) in enumerate(VALIDATION)])
def test_validation_names_expected_shape(name, index, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(ops, name)(*bad(name, index, value))


def test_validation_covers_every_op():
    assert {n for n, *_ in VALIDATION} >= set(REGISTRY)


@pytest.mark.parametrize("name,index,value,message", [
    ("gdn_decode_step", 4, lambda a: a[4].double(), "gdn_decode_step rec_state: expected dtype torch.float32"),
    ("gdn_prefill", 2, lambda a: a[2].bfloat16(), "gdn_prefill beta: expected dtype torch.float32"),
    ("sample", 5, lambda a: a[5].int(), "sample position: expected dtype torch.int64"),
    ("gdn_prefill", 6, 48, "chunk_size: expected a power of two"),
    ("fused_moe", 7, E + 1, f"fused_moe top_k: expected 1..{E}"),
    ("add_rms_norm_linear", 4, lambda a: a[4].double(), "add_rms_norm_linear w: expected dtype torch.float32"),
])
def test_validation_dtype_and_scalars(name, index, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(ops, name)(*bad(name, index, value))


# ---------------------------------------------------------------- independent recomputations

@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_unit_lower_inverse_matches_linalg_inv(n):
    g = torch.Generator().manual_seed(n)
    L = (torch.randn(3, n, n, generator=g) * 0.3).tril(-1)
    ref = torch.linalg.inv(torch.eye(n) + L.double()).float()
    got = unit_lower_inverse(L)
    assert (got - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_attention_matches_sdpa():
    q_dec, kc, vc, slots, pos, scale, gate = op_args("attention_decode")
    out = ops.attention_decode(q_dec, kc, vc, slots, pos, scale, gate)
    for b in range(B):
        s, p = int(slots[b]), int(pos[b])
        ref = F.scaled_dot_product_attention(q_dec[b][:, None], kc[s, :, : p + 1], vc[s, :, : p + 1], scale=scale,
                                             enable_gqa=True)[:, 0] * torch.sigmoid(gate[b])
        assert (out[b] - ref).abs().max() <= 1e-5, f"decode row {b}"
    q, kc, vc, slot, start, scale = op_args("attention_prefill")
    out = ops.attention_prefill(q, kc, vc, slot, start, scale)
    s, st = int(slot), int(start)
    mask = torch.arange(TMAX)[None, :] <= (st + torch.arange(T))[:, None]        # [T, TMAX]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), kc[s], vc[s], attn_mask=mask, scale=scale,
                                         enable_gqa=True).transpose(0, 1)
    assert (out - ref).abs().max() <= 1e-5


def test_rope_matches_complex_rotation():
    x, pos, inv_freq = op_args("rope")
    out = ops.rope(x, pos, inv_freq)
    rot = 2 * inv_freq.numel()
    half = rot // 2
    # rotate-half pairs dim j with dim j + rot/2: treat them as one complex number
    z = torch.complex(x[..., :half].double(), x[..., half:rot].double())
    ang = pos.double()[:, None] * inv_freq.double()[None, :]                       # [N, rot/2]
    zr = z * torch.polar(torch.ones_like(ang), ang)[:, None, :]
    ref = torch.cat([zr.real, zr.imag, x[..., rot:].double()], dim=-1)
    assert (out.double() - ref).abs().max() <= 1e-4
    assert torch.equal(out[..., rot:], x[..., rot:])


def test_fused_moe_matches_per_token_loop():
    g = Gen(3)
    args = materialise(case_fused_moe(g), torch.float32)
    x = g.f(12, H)                               # 12 * top_k > E: the all-experts loop path
    gu, down, sg, su, sd, k = args[2:]
    router, sgw = g.f(E, H), g.f(1, H, scale=H ** -0.5)
    lg = lambda x: F.linear(x, torch.cat([router, sgw]))           # noqa: E731  the logits fused_moe is given
    out = ops.fused_moe(x, lg(x), gu, down, sg, su, sd, k)
    for t in range(x.shape[0]):
        probs = torch.softmax(router @ x[t], -1)
        w, idx = probs.topk(k)
        w = w / w.sum()
        y = sum(wi * (down[e] @ (F.silu(gu[e, :I] @ x[t]) * (gu[e, I:] @ x[t]))) for wi, e in zip(w, idx.tolist()))
        y = y + torch.sigmoid(sgw @ x[t]) * (sd @ (F.silu(sg @ x[t]) * (su @ x[t])))
        assert (out[t] - y).abs().max() <= 1e-5, f"token {t}"
        # the single-token (gathered-experts) path agrees with the loop path
        alone = ops.fused_moe(x[t:t + 1], lg(x[t:t + 1]), gu, down, sg, su, sd, k)
        assert (alone[0] - out[t]).abs().max() <= 1e-5, f"token {t}: gather path differs from loop path"


def test_linear_f32_is_the_unrounded_product():
    """bf16 operands: the fp32 output equals the float64 product to fp32 accuracy (a bf16 linear is off by
    up to half a bf16 ulp), and rounding it to bf16 gives the bf16 linear."""
    x, w = op_args("linear_f32", torch.bfloat16)
    out = ops.linear_f32(x, w)
    exact = x.double() @ w.double().t()
    assert out.dtype == torch.float32
    assert (out.double() - exact).abs().max() <= 1e-6 * exact.abs().max()
    assert (F.linear(x, w).double() - exact).abs().max() > 1e-4 * exact.abs().max()
    assert torch.equal(out.bfloat16(), F.linear(x, w))


def test_fused_moe_fp32_out_is_the_unrounded_combine():
    """fp32_out on bf16 inputs (the all-experts loop path): given the bf16 activations the reference
    computes (bf16 F.linear / silu / product, recomputed here the same way), the routed and shared sums
    in float64 match to fp32 accuracy; the gathered (decode) path agrees up to an activation that rounds
    to the other bf16 neighbour."""
    g = Gen(5)
    _, _, gu, down, sg, su, sd, k = materialise(case_fused_moe(g), torch.bfloat16)
    x = g.f(12, H).bfloat16()                                   # 12 * top_k > E: the loop path
    router, sgw = g.f(E, H).bfloat16(), g.f(1, H, scale=H ** -0.5).bfloat16()
    lg = lambda x: F.linear(x, torch.cat([router, sgw]))       # noqa: E731  the logits fused_moe is given
    out = ops.fused_moe(x, lg(x), gu, down, sg, su, sd, k, True)
    assert out.dtype == torch.float32
    probs = torch.softmax(lg(x)[:, :E], -1, dtype=torch.float32)
    w, idx = probs.topk(k)
    w = (w / w.sum(-1, keepdim=True)).bfloat16()
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(E):
        act = (F.silu(F.linear(x, gu[e, :I])) * F.linear(x, gu[e, I:])).double()       # [T, I] bf16 values
        we = (w.double() * (idx == e)).sum(-1, keepdim=True)
        ref += (act @ down[e].double().t()) * we
    act_sh = (F.silu(F.linear(x, sg)) * F.linear(x, su)).double()
    ref += torch.sigmoid(lg(x)[:, E:]).double() * (act_sh @ sd.double().t())
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for t in range(x.shape[0]):
        alone = ops.fused_moe(x[t:t + 1], lg(x[t:t + 1]), gu, down, sg, su, sd, k, True)
        assert (alone[0] - out[t]).abs().max() <= 1e-2, f"token {t}: gather path differs from loop path"


def test_causal_conv_matches_conv1d():
    x, conv, slot, n_valid, w = op_args("causal_conv_prefill")
    y, new = ops.causal_conv_prefill(x, conv, slot, i64([T]), w)
    seq = torch.cat([conv[int(slot)], x.t()], dim=-1)                              # [C, W-1+T]
    ref = torch.stack([F.silu((seq[:, t:t + W] * w).sum(-1)) for t in range(T)])  # [T, C]
    assert (y - ref).abs().max() <= 1e-5
    assert torch.equal(new[0], seq[:, -(W - 1):])
    # n_valid < T: the new state is the last W-1 *valid* inputs
    _, new7 = ops.causal_conv_prefill(x, conv, slot, i64([7]), w)
    assert torch.equal(new7[0], seq[:, 7:7 + W - 1])
    # decode-step op over the same inputs agrees token by token
    state = conv.clone()
    for t in range(T):
        yt, row = ops.causal_conv_update(x[t:t + 1], state, slot, w)
        state[int(slot)] = row[0]
        assert (yt[0] - ref[t]).abs().max() <= 1e-5
