"""Parity rung 1 for the CUDA lowerings of the prefill-side ops: attention_prefill, sample,
causal_conv_update / causal_conv_prefill and rope (custom_ops/triton/{attention_prefill,sample,
causal_conv,rope}.py), each kernel against its op's pure-torch reference.

Where the kernels run (as tests/test_triton_ops.py): without a CUDA device, in Triton's CPU
interpreter (TRITON_INTERPRET=1 set for THIS test process before the kernels are defined) on small
awkward shapes; with one, compiled, on the same shapes plus the `cuda`-marked tests at
Qwen3.5-35B-A3B shapes.

Tolerances (max abs error; the kernels reproduce the references' roundings to the model dtype):
- attention_prefill: fp32 5e-5; bf16 1e-2 + 1e-2 * |ref| (probabilities are rounded to bf16
  unnormalised inside an online softmax where the reference rounds the normalised ones: up to 2 ulps);
- causal conv: fp32 1e-5, bf16 one ulp of |y| (1.6e-2 for |y| < 4); new states exact (copies);
- rope: fp32 1e-5, bf16 one ulp of |y|;
- sample: ids identical (greedy, and seeded sampling for the same (seed, position)) -- on logits
  without ties in the scaled values at a top-k/top-p boundary (the reference's CPU sort is not stable
  there; the kernel ranks ties by token id, as a stable sort does).
"""
from __future__ import annotations


import pytest
import torch

from onegraph.custom_ops.attention_prefill import reference_attention_prefill
from onegraph.custom_ops.causal_conv_prefill import reference_causal_conv_prefill
from onegraph.custom_ops.causal_conv_update import reference_causal_conv_update
from onegraph.custom_ops.rope import reference_rope
from onegraph.custom_ops.sample import reference_sample, uniform

from triton_env import CUDA, DEVICE, HAVE_TRITON, INTERPRETED, kernels, needs_triton  # noqa: F401

if kernels.AVAILABLE:
    from onegraph.custom_ops.triton import attention_prefill as attn_mod
    from onegraph.custom_ops.triton import causal_conv as conv_mod
    from onegraph.custom_ops.triton import rope as rope_mod  # noqa: F401  (registers rope_triton)
    from onegraph.custom_ops.triton import sample as sample_mod

ops = torch.ops.onegraph
DTYPES = [torch.float32, torch.bfloat16]
BF16 = torch.bfloat16


def close(got, ref, atol, rtol=0.0, what=""):
    """|got - ref| <= atol + rtol * |ref| elementwise, with the same non-finite pattern."""
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape, f"{what}: shape {list(got.shape)} != {list(ref.shape)}"
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), f"{what}: non-finite values differ"
    if not got.numel():
        return
    excess = ((got - ref).abs() - (atol + rtol * ref.abs())).nan_to_num(0.0)
    i = int(excess.argmax())
    assert excess.flatten()[i] <= 0, (f"{what}: error {(got - ref).abs().flatten()[i]:.3g} at |ref| = "
                                      f"{ref.abs().flatten()[i]:.3g} > {atol:.3g} + {rtol:.3g} * |ref|")


def one_ulp(dtype):
    """(atol, rtol) of one ulp of |ref| (bf16: 2^-7 relative bounds an ulp) or fp32's 1e-5."""
    return (1e-5, 0.0) if dtype == torch.float32 else (1e-6, 2.0 ** -7)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, scale=1.0, g=None):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def i64(values):
    return torch.as_tensor(values, dtype=torch.int64).to(DEVICE)


def cuda_test(fn):
    fn = pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a CUDA device and triton")(fn)
    return pytest.mark.cuda(fn)


# ---------------------------------------------------------------- attention_prefill

def attn_args(T, H, KVH, D, S, Tmax, slot, start_pos, dtype, seed):
    g = gen(seed)
    k, v = randn(S, KVH, Tmax, D, dtype=dtype, g=g), randn(S, KVH, Tmax, D, dtype=dtype, g=g)
    others = [s for s in range(S) if s != slot]
    k[others] = float("nan")                     # the kernel must read only its slot
    v[others] = float("nan")
    return [randn(T, H, D, dtype=dtype, g=g), k, v, i64([slot]), i64([start_pos]), D ** -0.5]


ATTN_TOL = {torch.float32: (5e-5, 0.0), torch.bfloat16: (1e-2, 1e-2)}

ATTN_CASES = [
    # T, H, KVH, D, S, Tmax, slot, start_pos
    (1, 8, 1, 32, 2, 40, 0, 39),          # one token (decode-like), G = 8, full cache
    (35, 4, 2, 16, 3, 80, 2, 7),          # G = 2, start_pos > 0, last slot
    (64, 4, 2, 32, 2, 64, 1, 0),          # a chunk filling the cache from 0
    (65, 16, 2, 16, 3, 100, 1, 3),        # G = 8, T*G not a multiple of the row block
    (200, 2, 1, 16, 2, 256, 0, 50),       # many row and key tiles
    (16, 6, 2, 24, 2, 40, 1, 30),         # G = 3, D = 24 (padded); padding tokens past Tmax
]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,KVH,D,S,Tmax,slot,start_pos", ATTN_CASES)
def test_attention_prefill(T, H, KVH, D, S, Tmax, slot, start_pos, dtype):
    args = attn_args(T, H, KVH, D, S, Tmax, slot, start_pos, dtype, seed=T)
    ref = reference_attention_prefill(*args)
    assert torch.isfinite(ref).all()
    atol, rtol = ATTN_TOL[dtype]
    close(ops.attention_prefill_triton(*args), ref, atol, rtol, f"T={T} plan")
    if T * H // KVH <= 512:             # (the interpreter is slow) forced small tiles: several row
        # blocks and key tiles, diagonal tiles masked per row
        close(attn_mod.run(*args, block_m=16, block_n=16), ref, atol, rtol, f"T={T} 16x16 tiles")
        # the long-chunk tile of a 16-bit model (128 rows x 64 keys; the plan picks it at >= 256 programs)
        close(attn_mod.run(*args, block_m=128, block_n=64), ref, atol, rtol, f"T={T} 128x64 tiles")


@needs_triton
def test_attention_prefill_depends_on_start_pos():
    """The causal limit moves with start_pos: a different start_pos gives a different answer."""
    args = attn_args(8, 4, 2, 16, 2, 48, 1, 10, torch.float32, seed=1)
    a = ops.attention_prefill_triton(*args)
    args[4] = i64([30])
    b = ops.attention_prefill_triton(*args)
    close(b, reference_attention_prefill(*args), 5e-5, what="start_pos 30")
    assert (a - b).abs().max() > 1e-2


@cuda_test
@pytest.mark.parametrize("T,start_pos", [(1, 4095), (64, 1000), (2048, 0), (2048, 2048)])
def test_attention_prefill_35b(T, start_pos):
    args = attn_args(T, 16, 2, 256, 3, 4096, 1, start_pos, BF16, seed=T)
    close(ops.attention_prefill_triton(*args), reference_attention_prefill(*args), 1e-2, 1e-2, f"35B T={T}")


# ---------------------------------------------------------------- sample

def sample_args(logits, temperature, top_k, top_p, seeds, positions):
    B = logits.shape[0]
    full = lambda v, dt: torch.as_tensor(v if isinstance(v, (list, tuple)) else [v] * B, dtype=dt).to(DEVICE)
    return [logits.to(DEVICE), full(temperature, torch.float32), full(top_k, torch.int64),
            full(top_p, torch.float32), full(seeds, torch.int64), full(positions, torch.int64)]


def path_of(args, row, R):
    """Which branch the kernel takes for `row` (computed independently, with a stable sort):
    'all' (no filtering), 'top' (kept set inside the top R), 'deep' (winner inside the kept set,
    beyond the top R) or 'bisect' (kept set beyond the top R, winner outside it)."""
    logits, t, k, p, seed, pos = (a[row:row + 1].cpu() for a in args)
    V = logits.shape[1]
    k_eff = int(k) if 0 < int(k) < V else V
    if k_eff >= V and float(p) >= 1:
        return "all"
    s = logits.float() / t[:, None]
    srt, order = torch.sort(s, descending=True, stable=True)
    probs = torch.softmax(srt, -1)
    before = probs.cumsum(-1) - probs
    rank = torch.arange(V)
    keep = ((rank < k_eff) & (before < p) | (rank == 0))[0]
    if keep[:R].all() and k_eff > R:
        g = -torch.log(-torch.log(uniform(seed, pos, V, "cpu"))).float()
        w = int((s + g).argmax())
        w_rank = int((order[0] == w).nonzero())
        return "deep" if keep[w_rank] else "bisect"
    return "top"


def check_sample(args, what, **plan):
    got = sample_mod.run(*args, **plan) if plan else ops.sample_triton(*args)
    ref = reference_sample(*args)
    assert got.dtype == torch.int64 and got.shape == ref.shape
    assert torch.equal(got.cpu(), ref.cpu()), f"{what}: ids {got.tolist()} != reference {ref.tolist()}"
    return got


@needs_triton
def test_sample_greedy():
    """temperature <= 0: first index of the largest logit, NaN counting as largest (torch.argmax);
    bf16-valued logits (many ties), an all -inf row, the maximum in the last chunk."""
    g = gen(0)
    V = 1000
    logits = torch.randn(6, V, generator=g) * 4
    logits[1] = logits[1].to(BF16).float().clamp(max=2.0)         # many tied maxima: the first wins
    logits[2, 517] = float("nan")
    logits[2, 900] = float("nan")
    logits[3] = float("-inf")
    logits[4, V - 1] = 100.0
    args = sample_args(logits, [0.0, 0.0, 0.0, 0.0, 0.0, -1.0], 5, 0.5, 3, 7)
    got = check_sample(args, "greedy plan")
    assert got.tolist()[2:5] == [517, 0, V - 1]
    check_sample(args, "greedy 8 chunks", nsplit=8, nb=1, bv=128, r=16)


@needs_triton
def test_sample_temperature_matches_reference_rng():
    """Plain temperature sampling (no filtering, one pass): the same ids as the reference for the
    same (seed, position), over steps; the ids move with the position and the seed."""
    g = gen(1)
    V, B = 3000, 4
    logits = torch.randn(B, V, generator=g) * 2
    seen = []
    for step in range(6):
        args = sample_args(logits, [0.7, 1.0, 1.5, 4.0], 0, 1.0, [11, 11, 12, -(2 ** 40)], [step, step, step, 1 << 33])
        seen.append(check_sample(args, f"step {step}").tolist())
    assert len({tuple(r[:3]) for r in seen}) > 1, "ids do not change with the position"
    assert any(r[0] != r[1] for r in seen), "rows with different temperatures always agree"
    args = sample_args(logits, 1.0, 0, 1.0, 5, 9)
    check_sample(args, "forced 8 chunks", nsplit=8, nb=3, bv=128, r=16)


@needs_triton
def test_sample_top_k_top_p():
    """top-k / top-p whose kept set fits in the top R candidates, top_p <= 0 (rank 0 only), top_k = 1
    and top_k > V; kernel tilings with several chunks per row."""
    g = gen(2)
    V, B = 1000, 6
    logits = torch.randn(B, V, generator=g) * 3
    args = sample_args(logits, [1.0, 0.8, 2.0, 1.0, 1.0, 1.3], [5, 0, 12, 1, 5000, 0], [1.0, 0.6, 0.9, 1.0, 0.0, 0.3],
                       [0, 1, 2, 3, 4, 5], 17)
    paths = [path_of(args, b, 16) for b in range(B)]
    assert paths.count("top") >= 4, paths
    check_sample(args, "2 chunks of 4 tiles", nsplit=2, nb=4, bv=128, r=16)
    args[5] = i64([18] * B)
    check_sample([a[:3] for a in args], "plan")                    # R = 64, one 1024-token tile per row


@needs_triton
def test_sample_wide_top_p():
    """A wide top-p on a flat distribution: the kept set reaches past the top R candidates, and the
    all-token winner is either kept (one counting pass) or not (bisection of the threshold)."""
    g = gen(3)
    V, B = 1200, 4
    logits = torch.randn(B, V, generator=g) * 0.5
    args = sample_args(logits, 1.0, [0, 0, 900, 0], [0.5, 0.7, 1.0, 0.5], [21, 22, 23, 24], 5)
    paths = []
    for pos in (5, 6):
        args[5] = i64([pos] * B)
        paths += [path_of(args, b, 16) for b in range(B)]
        check_sample(args, f"position {pos}", nsplit=2, nb=5, bv=128, r=16)
    assert "deep" in paths and "bisect" in paths, paths


@needs_triton
def test_sample_reads_no_unwritten_partial(monkeypatch):
    """The kernels' partial buffers are not zero-filled: with every new buffer filled with garbage (NaN,
    -1) greedy, plain, top-k and top-p rows mixed in one call still give the reference's ids."""
    empty = torch.empty

    def garbage(*shape, **kw):
        t = empty(*shape, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(sample_mod.torch, "empty", garbage)
    g = gen(5)
    logits = torch.randn(4, 1000, generator=g) * 3
    args = sample_args(logits, [0.0, 0.8, 1.0, 1.2], [0, 0, 7, 0], [1.0, 1.0, 1.0, 0.6], [1, 2, 3, 4], 9)
    check_sample(args, "garbage partials, 2 chunks", nsplit=2, nb=4, bv=128, r=16)
    check_sample(args, "garbage partials, plan")


@cuda_test
@pytest.mark.parametrize("B", [1, 64])
def test_sample_35b(B):
    """Vocabulary 248,320: greedy, temperature, top-k 20 + top-p 0.95, top-p 0.5 rows mixed."""
    g = gen(B)
    V = 248320
    logits = torch.randn(B, V, generator=g) * 3
    kinds = [(0.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 20, 0.95), (1.0, 0, 0.5)]
    t, k, p = zip(*[kinds[i % 4] for i in range(B)])
    for step in range(3):
        args = sample_args(logits, list(t), list(k), list(p), list(range(B)), [step] * B)
        check_sample(args, f"35B B={B} step {step}")
    bf = logits.to(BF16).float()                                   # model logits are bf16 values: ties
    check_sample(sample_args(bf, 0.0, 0, 1.0, 0, 0), "35B greedy on bf16 values")


# ---------------------------------------------------------------- causal_conv_update / causal_conv_prefill

@needs_triton
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (BF16, BF16), (BF16, torch.float32)])
@pytest.mark.parametrize("B,C,S,W,slots", [(1, 16, 2, 4, [1]), (5, 300, 7, 4, [6, 0, 3, 3, 1]), (3, 40, 4, 3, [2, 0, 1])])
def test_causal_conv_update(B, C, S, W, slots, dtype, state_dtype):
    g = gen(C)
    args = [randn(B, C, dtype=dtype, g=g), randn(S, C, W - 1, dtype=state_dtype, g=g), i64(slots),
            randn(C, W, dtype=dtype, scale=0.5, g=g)]
    y, new = ops.causal_conv_update_triton(*args)
    ry, rnew = reference_causal_conv_update(*args)
    close(y, ry, *one_ulp(dtype), what="y")
    assert new.dtype == rnew.dtype and torch.equal(new.cpu(), rnew.cpu()), "new state rows"


PREFILL_CASES = [
    # T, n_valid, C, W
    (1, 1, 24, 4),          # a single token: the state supplies W-1 of the taps
    (35, 35, 40, 4),
    (35, 20, 40, 4),        # padded chunk: the state takes the last 3 *valid* inputs
    (64, 2, 130, 4),        # n_valid < W-1: the new state mixes old state and inputs
    (65, 0, 40, 4),         # nothing valid: the state is unchanged
    (200, 117, 16, 3),      # W = 3
]


@needs_triton
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (BF16, BF16), (BF16, torch.float32)])
@pytest.mark.parametrize("T,n_valid,C,W", PREFILL_CASES)
def test_causal_conv_prefill(T, n_valid, C, W, dtype, state_dtype):
    g = gen(T)
    args = [randn(T, C, dtype=dtype, g=g), randn(3, C, W - 1, dtype=state_dtype, g=g), i64([1]), i64([n_valid]),
            randn(C, W, dtype=dtype, scale=0.5, g=g)]
    ry, rnew = reference_causal_conv_prefill(*args)
    for got, what in ((ops.causal_conv_prefill_triton(*args), "plan"), (conv_mod.run_prefill(*args, 8, 32), "8x32")):
        close(got[0], ry, *one_ulp(dtype), what=f"y {what}")
        assert got[1].dtype == rnew.dtype and torch.equal(got[1].cpu(), rnew.cpu()), f"new state {what}"


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv_carries_state(dtype):
    """A padded prefill chunk, then decode updates of two slots, each new state written back as
    the model does: the kernels' outputs track the reference chain."""
    g = gen(9)
    C, W = 48, 4
    w = randn(C, W, dtype=dtype, scale=0.5, g=g)
    state = randn(4, C, W - 1, dtype=dtype, g=g)
    ref_state = state.clone()
    x = randn(12, C, dtype=dtype, g=g)
    slot, n_valid = i64([2]), i64([9])
    y, new = ops.causal_conv_prefill_triton(x, state, slot, n_valid, w)
    ry, rnew = reference_causal_conv_prefill(x, ref_state, slot, n_valid, w)
    close(y, ry, *one_ulp(dtype), what="prefill")
    state, ref_state = state.index_copy(0, slot, new), ref_state.index_copy(0, slot, rnew)
    slots = i64([2, 0])
    for step in range(3):
        xs = randn(2, C, dtype=dtype, g=g)
        y, new = ops.causal_conv_update_triton(xs, state, slots, w)
        ry, rnew = reference_causal_conv_update(xs, ref_state, slots, w)
        close(y, ry, *one_ulp(dtype), what=f"update {step}")
        state, ref_state = state.index_copy(0, slots, new), ref_state.index_copy(0, slots, rnew)
    assert torch.equal(state.cpu(), ref_state.cpu())


@cuda_test
@pytest.mark.parametrize("T", [1, 2048])
def test_causal_conv_35b(T):
    g = gen(T)
    C, W = 8192, 4
    w = randn(C, W, dtype=BF16, scale=0.5, g=g)
    state = randn(9, C, W - 1, dtype=BF16, g=g)
    args = [randn(T, C, dtype=BF16, g=g), state, i64([8]), i64([max(1, T - 5)]), w]
    y, new = ops.causal_conv_prefill_triton(*args)
    ry, rnew = reference_causal_conv_prefill(*args)
    close(y, ry, *one_ulp(BF16), what="prefill")
    assert torch.equal(new, rnew)
    uargs = [randn(64, C, dtype=BF16, g=g), state, i64(list(range(8, 0, -1)) * 8), w]
    y, new = ops.causal_conv_update_triton(*uargs)
    ry, rnew = reference_causal_conv_update(*uargs)
    close(y, ry, *one_ulp(BF16), what="update")
    assert torch.equal(new, rnew)


# ---------------------------------------------------------------- rope

def rope_inv_freq(rot, theta=1e7):
    return (1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))).to(DEVICE)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H,D,rot", [(1, 2, 16, 16), (35, 3, 32, 8), (64, 16, 64, 16), (7, 2, 24, 12)])
def test_rope(N, H, D, rot, dtype):
    g = gen(N)
    x = randn(N, H, D, dtype=dtype, g=g)
    positions = i64(torch.randint(0, 5000, (N,), generator=g))
    inv = rope_inv_freq(rot)
    y = ops.rope_triton(x, positions, inv)
    ref = reference_rope(x, positions, inv)
    close(y, ref, *one_ulp(dtype), what="rope")
    assert torch.equal(y[..., rot:].cpu(), x[..., rot:].cpu()), "pass-through dims changed"
    assert (y[..., :rot] - x[..., :rot]).abs().max() > 0.1, "nothing rotated"
    xs = randn(N, H, 2 * D, dtype=dtype, g=g)[..., :D]                # a strided view (q half of q ‖ gate)
    close(ops.rope_triton(xs, positions, inv), reference_rope(xs, positions, inv), *one_ulp(dtype), what="strided")


@cuda_test
@pytest.mark.parametrize("N", [1, 64, 2048])
def test_rope_35b(N):
    g = gen(N)
    q = randn(N, 16, 512, dtype=BF16, g=g)[..., :256]
    positions = i64(torch.randint(0, 262144, (N,), generator=g))
    inv = rope_inv_freq(64)
    close(ops.rope_triton(q, positions, inv), reference_rope(q, positions, inv), *one_ulp(BF16), what="35B rope")


# ---------------------------------------------------------------- export

PREFILL_OPS = ("attention_prefill", "rope", "causal_conv_update", "causal_conv_prefill", "sample")


class _Prefill(torch.nn.Module):
    """An attention + conv prefill step and the sampling, as the model calls the ops."""

    def forward(self, q, k_cache, v_cache, slot, start_pos, positions, inv_freq, x, conv, n_valid, w, logits,
                temperature, top_k, top_p, seed):
        q = ops.rope(q, positions, inv_freq)
        o = ops.attention_prefill(q, k_cache, v_cache, slot, start_pos, q.shape[-1] ** -0.5)
        y, new_conv = ops.causal_conv_prefill(x, conv, slot, n_valid, w)
        conv.index_copy_(0, slot, new_conv)
        y2, new_rows = ops.causal_conv_update(y[-2:], conv, slot.expand(2), w)
        return o, y2, new_rows, ops.sample(logits, temperature, top_k, top_p, seed, positions[-2:])


@needs_triton
def test_export_swaps_prefill_ops_for_triton_ops():
    """torch.export + run_decompositions with these lowerings leaves only the *_triton ops, and the
    program computes what eager does without calling a Python reference."""
    from onegraph.custom_ops import PYTHON_CALLS, _registry
    g = gen(4)
    T, C, W = 6, 24, 4
    inputs = (randn(T, 4, 16, g=g), randn(3, 2, 32, 16, g=g), randn(3, 2, 32, 16, g=g), i64([1]), i64([5]),
              i64(list(range(5, 5 + T))), rope_inv_freq(8), randn(T, C, g=g), randn(3, C, W - 1, g=g), i64([5]),
              randn(C, W, scale=0.5, g=g), randn(2, 300, scale=3.0, g=g), torch.tensor([0.0, 0.8], device=DEVICE),
              i64([0, 0]), torch.tensor([1.0, 1.0], device=DEVICE), i64([3, 4]))
    ep = torch.export.export(_Prefill(), tuple(t.clone() for t in inputs), strict=False)
    table = {_registry.REGISTRY[n].overload: _registry.LOWERINGS[(n, "triton")] for n in PREFILL_OPS}
    ep = ep.run_decompositions(table)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {f"onegraph.{n}_triton.default" for n in PREFILL_OPS} <= targets, targets
    assert not {f"onegraph.{n}.default" for n in PREFILL_OPS} & targets, targets
    eager_in, lowered_in = [t.clone() for t in inputs], [t.clone() for t in inputs]
    ref = _Prefill()(*eager_in)
    before = dict(PYTHON_CALLS)
    got = ep.module()(*lowered_in)
    assert dict(PYTHON_CALLS) == before, "a Python reference ran inside the lowered program"
    for a, b in zip(got[:3], ref[:3]):
        close(a, b, 1e-4, what="exported prefill")
    assert torch.equal(got[3], ref[3]), "sampled ids"
    assert torch.equal(lowered_in[8], eager_in[8]), "conv state written in place"
