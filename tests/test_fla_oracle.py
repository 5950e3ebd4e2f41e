"""Oracle rung for the GDN ops: `reference_gdn_prefill`, `reference_gdn_decode_step` and the Triton
lowering `onegraph::gdn_prefill_triton` against flash-linear-attention (fla-core 0.6.0, a test-only
dependency: the `test` extra). Skipped as a whole when `fla` is not importable.

How Qwen3.5's conventions map onto fla's (fla has its own code for each, so each is checked):
- heads: HK key heads for q, k and HV = REP * HK value heads; value head h reads key head h // REP.
  fla's Triton kernels take q, k with HK heads (their GVA uses the same grouping, i_h // (HV // H));
  its naive references have no GVA, so q, k are repeated (repeat_interleave) to HV heads for them.
- q, k are L2-normed as x * rsqrt(sum x^2 + 1e-6): fla's kernels do it with
  use_qk_l2norm_in_kernel (same eps inside the root); the naive references get normed inputs.
- q is scaled by K^-0.5: fla's default scale (passed explicitly).
- g is the log-space decay per token and value head, -exp(A_log) * softplus(a + dt_bias): computed
  by fla's `naive_gdn_gate` (CPU) or inside fla's kernel (use_gate_in_kernel, CUDA);
  beta = sigmoid(b) (use_beta_sigmoid_in_kernel on CUDA).
- the recurrent state is [N, HV, K, V] fp32, K-major (fla's default layout, state_v_first=False),
  starting from a nonzero initial state; the per-head decay runs from fast to slow so the initial
  state still matters at the end of the longest prompt.
- the decode step's causal conv + SiLU is recomputed here by hand to get fla's (post-conv) inputs.
Where: fla's pure-torch `naive_recurrent_gated_delta_rule` and `naive_chunk_gated_delta_rule` on the
CPU (the Triton op in Triton's interpreter there: TRITON_INTERPRET=1 is set for this test process
before the kernels are defined, as in test_triton_ops.py); with a CUDA device (`cuda` mark) also
fla's Triton `chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule`.

Tolerances (max abs error, fp32 throughout; outputs O(0.1..1), states O(1)): 1e-4 for outputs and
final states against the naive references and fla's fused_recurrent kernel (fp32 math in another
order); 5e-3 against fla's chunk kernel (its products take tf32 inputs).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import CUDA  # noqa: F401  (sets up the interpreter before any Triton kernel is defined)

pytest.importorskip("fla", reason="flash-linear-attention (fla-core) is a test-only oracle, carried to the GPU "
                                  "as a wheel (see pyproject.toml)")
from fla.ops.gated_delta_rule import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.gated_delta_rule.gate import naive_gdn_gate  # noqa: E402

from onegraph.custom_ops.gdn_decode_step import reference_gdn_decode_step  # noqa: E402
from onegraph.custom_ops.gdn_prefill import reference_gdn_prefill  # noqa: E402
from onegraph.custom_ops.triton import AVAILABLE as HAVE_TRITON  # noqa: E402

if HAVE_TRITON:
    from onegraph.custom_ops.triton import gdn_prefill as prefill_mod
TRITON_RUNS = HAVE_TRITON and (CUDA or type(prefill_mod._wy_kernel).__name__ == "InterpretedFunction")

HK, HV, K, V, W = 2, 4, 32, 32, 4                  # REP = 2, as Qwen3.5 (16 k-heads, 32 v-heads)
C = 2 * HK * K + HV * V
T_AWKWARD = [1, 35, 64, 65, 200]
TOL = 1e-4
TOL_FLA_CHUNK = 5e-3


def close(got, ref, atol, what):
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape, f"{what}: shape {list(got.shape)} != {list(ref.shape)}"
    assert torch.isfinite(got).all() and torch.isfinite(ref).all(), f"{what}: non-finite values"
    err = (got - ref).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol:.3g}"


def gate_params(gen):
    """A_log from fast (exp ~ 1.6) to slow (~0.007) decay per head; dt_bias random."""
    return torch.linspace(-5.0, 0.5, HV) + 0.1 * torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)


def l2norm(t):
    return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)


def fla_qkv(x, repeat):
    """Post-conv x [N, T, C] -> fla's q, k [N, T, HK (or HV if repeat), K], v [N, T, HV, V] (fp32).
    Normed (and repeated to the value heads) only for the naive references (repeat=True)."""
    N, T = x.shape[:2]
    q, k, v = x.float().split([HK * K, HK * K, HV * V], dim=-1)
    q, k, v = q.reshape(N, T, HK, K), k.reshape(N, T, HK, K), v.reshape(N, T, HV, V)
    if repeat:
        q = l2norm(q).repeat_interleave(HV // HK, dim=2)
        k = l2norm(k).repeat_interleave(HV // HK, dim=2)
    return q.contiguous(), k.contiguous(), v.contiguous()


def prefill_inputs(T, seed, S=3, slot=1):
    """Raw model-side inputs of one prefill: x [T, C], a, b [T, HV], A_log, dt_bias [HV],
    rec_state [S, HV, K, V], slot [1]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=gen)
    a, b = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    A_log, dt_bias = gate_params(gen)
    rec = torch.randn(S, HV, K, V, generator=gen) * 0.5
    return x, a, b, A_log, dt_bias, rec, torch.tensor([slot])


# ---------------------------------------------------------------- CPU: fla's naive references

@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("T", T_AWKWARD)
def test_prefill_matches_fla_naive(T, impl):
    if impl == "triton" and not TRITON_RUNS:
        pytest.skip("triton not installed, or its kernels were defined without TRITON_INTERPRET and there is no GPU")
    x, a, b, A_log, dt_bias, rec, slot = prefill_inputs(T, seed=T)
    g, beta = naive_gdn_gate(a, A_log, dt_bias), b.sigmoid()               # [T, HV] fp32
    if impl == "reference":
        out, state = reference_gdn_prefill(x, g, beta, rec, slot, HK, 64)
    else:
        dev = "cuda" if CUDA else "cpu"
        out, state = torch.ops.onegraph.gdn_prefill_triton(x.to(dev), g.to(dev), beta.to(dev), rec.to(dev),
                                                            slot.to(dev), HK, 64)
    q, k, v = fla_qkv(x[None], repeat=True)
    h0 = rec[slot]                                                          # [1, HV, K, V]
    o_rec, s_rec = naive_recurrent_gated_delta_rule(q, k, v, beta=beta[None], g=g[None], scale=K ** -0.5,
                                                    initial_state=h0.clone(), output_final_state=True)
    o_chk, s_chk = naive_chunk_gated_delta_rule(q, k, v, g=g[None], beta=beta[None], chunk_size=64,
                                                scale=K ** -0.5, initial_state=h0.clone(), output_final_state=True)
    assert (s_rec - h0).abs().max() > 1e-2, "the prompt left the state unchanged: a vacuous comparison"
    close(out, o_rec[0], TOL, f"{impl} T={T} out vs fla naive recurrent")
    close(state, s_rec, TOL, f"{impl} T={T} state vs fla naive recurrent")
    close(out, o_chk[0], TOL, f"{impl} T={T} out vs fla naive chunk")
    close(state, s_chk, TOL, f"{impl} T={T} state vs fla naive chunk")


def decode_inputs(T, seed, B=2, S=3):
    gen = torch.Generator().manual_seed(seed)
    A_log, dt_bias = gate_params(gen)
    return dict(qkv=torch.randn(T, B, C, generator=gen), a=torch.randn(T, B, HV, generator=gen),
                b=torch.randn(T, B, HV, generator=gen), conv_state=torch.randn(S, C, W - 1, generator=gen),
                rec=torch.randn(S, HV, K, V, generator=gen) * 0.5, slots=torch.tensor([2, 0]),
                conv_w=torch.randn(C, W, generator=gen) * 0.5, A_log=A_log, dt_bias=dt_bias)


def run_decode_steps(d):
    """T reference decode steps, the new rows written back at `slots` as the model does.
    -> out [B, T, HV, V], rec_state after the last step."""
    conv, rec, outs = d["conv_state"], d["rec"], []
    for t in range(d["qkv"].shape[0]):
        out, new_conv, new_rec = reference_gdn_decode_step(d["qkv"][t], d["a"][t], d["b"][t], conv, rec, d["slots"],
                                                           d["conv_w"], d["A_log"], d["dt_bias"], HK)
        conv, rec = conv.index_copy(0, d["slots"], new_conv), rec.index_copy(0, d["slots"], new_rec)
        outs.append(out)
    return torch.stack(outs, dim=1), rec


def post_conv(d):
    """The causal depthwise conv + SiLU by hand: x [B, T, C] fp32, fla's input."""
    window, xs = d["conv_state"][d["slots"]], []                            # [B, C, W-1]
    for t in range(d["qkv"].shape[0]):
        full = torch.cat([window, d["qkv"][t][:, :, None]], dim=-1)          # [B, C, W]
        xs.append(F.silu((full * d["conv_w"]).sum(-1)))
        window = full[:, :, 1:]
    return torch.stack(xs, dim=1)


@pytest.mark.parametrize("T", [1, 35, 65])
def test_decode_steps_match_fla_naive(T):
    """T decode steps of two rows (slots 2 and 0 of 3) = fla's naive recurrence over the post-conv
    sequence, with fla's gate from the raw a."""
    d = decode_inputs(T, seed=100 + T)
    out, rec = run_decode_steps(d)
    q, k, v = fla_qkv(post_conv(d), repeat=True)
    g = naive_gdn_gate(d["a"].transpose(0, 1), d["A_log"], d["dt_bias"])   # [B, T, HV]
    beta = d["b"].transpose(0, 1).sigmoid()
    h0 = d["rec"][d["slots"]]
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, beta=beta, g=g, scale=K ** -0.5,
                                                    initial_state=h0.clone(), output_final_state=True)
    assert (s_ref - h0).abs().max() > 1e-2
    close(out, o_ref, TOL, f"T={T} decode outputs")
    close(rec[d["slots"]], s_ref, TOL, f"T={T} decode state")


# ---------------------------------------------------------------- CUDA: fla's Triton kernels

def cuda_test(fn):
    return pytest.mark.cuda(pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(fn))


@cuda_test
@pytest.mark.parametrize("T", T_AWKWARD)
def test_prefill_matches_fla_kernels(T):
    """Our reference (on the GPU) and Triton op against fla's chunk and fused_recurrent kernels, which
    do the l2norm and the GVA head grouping themselves."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    x, a, b, A_log, dt_bias, rec, slot = (t.cuda() for t in prefill_inputs(T, seed=T))
    g, beta = naive_gdn_gate(a, A_log, dt_bias), b.sigmoid()
    q, k, v = fla_qkv(x[None], repeat=False)
    h0 = rec[slot]
    kw = dict(scale=K ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_chk, s_chk = chunk_gated_delta_rule(q, k, v, g[None], beta[None], initial_state=h0.clone(), **kw)
    o_rec, s_rec = fused_recurrent_gated_delta_rule(q, k, v, g=g[None], beta=beta[None], initial_state=h0.clone(), **kw)
    ours = {"reference": reference_gdn_prefill(x, g, beta, rec, slot, HK, 64)}
    if HAVE_TRITON:
        ours["triton"] = torch.ops.onegraph.gdn_prefill_triton(x, g, beta, rec, slot, HK, 64)
    for impl, (out, state) in ours.items():
        close(out, o_rec[0], TOL, f"{impl} T={T} out vs fla fused_recurrent")
        close(state, s_rec, TOL, f"{impl} T={T} state vs fla fused_recurrent")
        close(out, o_chk[0], TOL_FLA_CHUNK, f"{impl} T={T} out vs fla chunk")
        close(state, s_chk, TOL_FLA_CHUNK, f"{impl} T={T} state vs fla chunk")


@cuda_test
@pytest.mark.parametrize("T", [1, 35, 65])
def test_decode_steps_match_fla_fused_recurrent_gate_in_kernel(T):
    """Decode steps against fla's fused_recurrent computing the gate (-exp(A_log) softplus(a + dt_bias)),
    sigmoid(b) and the q/k l2norm itself from the raw a, b and post-conv q, k."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    d = {key: t.cuda() for key, t in decode_inputs(T, seed=200 + T).items()}
    out, rec = run_decode_steps(d)
    q, k, v = fla_qkv(post_conv(d), repeat=False)
    h0 = d["rec"][d["slots"]]
    o_ref, s_ref = fused_recurrent_gated_delta_rule(
        q, k, v, g=d["a"].transpose(0, 1).contiguous(), beta=d["b"].transpose(0, 1).contiguous(),
        scale=K ** -0.5, initial_state=h0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=d["A_log"], dt_bias=d["dt_bias"], use_beta_sigmoid_in_kernel=True)
    close(out, o_ref, TOL, f"T={T} decode outputs")
    close(rec[d["slots"]], s_ref, TOL, f"T={T} decode state")
