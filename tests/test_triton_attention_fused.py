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
- the KV-cache writes folded into the norm + rope kernel (export/inplace_kv.py): the in-place twin
  equals the functional kernel + index_put bit for bit, and the folded exported layer (decode and
  prefill), also after export/aoti.py's pre-grad pass calls the twin on the caches, equals the unfolded
  one, caches included.
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

from triton_env import CATCH_KERNEL_WARNINGS, DEVICE, HAVE_TRITON, needs_triton, run_package_script

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


def close_rope(got, ref, normed, rot, dtype, what):
    """A rope output vs the reference: close_ulp, but a rotated dim also gets one bf16 ulp of |x| + |partner|
    (normed: the normed input the rotation read). torch's and Triton's fp32 cos/sin may round to neighbouring
    bf16 values, and x cos ± partner sin may cancel, so an ulp of cos or sin can exceed an ulp of the
    result (H200, 2048 rows at positions up to 262,144: 9.3e-4 beyond one ulp of |ref|)."""
    if dtype == torch.float32:
        return close_ulp(got, ref, dtype, what)
    got, ref, n = got.float().cpu(), ref.float().cpu(), normed.float().cpu()
    half = rot // 2
    partner = torch.cat([n[..., half:rot], n[..., :half]], dim=-1)
    err = (got - ref).abs() - 2.0 ** -7 * ref.abs()
    err[..., :rot] -= 2.0 ** -7 * (n[..., :rot].abs() + partner.abs())
    assert err.max().item() <= 1e-6, f"{what}: error beyond its bound: {err.max().item():.3g}"


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
    nq, nk = ops.rms_norm_triton(q, wq, 1e-6), ops.rms_norm_triton(k, wk, 1e-6)
    close_rope(gq, rq, nq, rot, dtype, "q vs reference")
    close_rope(gk, rk, nk, rot, dtype, "k vs reference")
    # today's kernels in sequence: the same values, bit for bit
    assert torch.equal(gq, ops.rope_triton(nq, positions, inv)), "q differs from rms_norm_triton + rope_triton"
    assert torch.equal(gk, ops.rope_triton(nk, positions, inv)), "k differs from rms_norm_triton + rope_triton"
    assert torch.equal(gq[..., rot:], nq[..., rot:]), "pass-through dims are not the normalised input"
    if N > 1:                                        # row 0 sits at position 0: rotated by nothing
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


# ---------------------------------------------------------------- KV writes folded into the kernel

@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_kv_inplace(dtype):
    """The in-place twin == qk_norm_rope_triton then k_cache[w_slots, :, w_pos] = k',
    v_cache[...] = v, bit for bit (v a strided view of the projection, as in the model)."""
    g = gen(9)
    N, HQ, KVH, D, rot, S, T = 3, 4, 2, 32, 8, 4, 10
    qkv = torch.randn(N, HQ * 2 * D + 2 * KVH * D, generator=g).to(dtype).to(DEVICE)
    qg, k, v = qkv.split([HQ * 2 * D, KVH * D, KVH * D], dim=-1)
    q, k, v = qg.view(N, HQ, 2 * D)[..., :D], k.view(N, KVH, D), v.view(N, KVH, D)
    wq, wk = [(torch.randn(D, generator=g) * 0.2).to(dtype).to(DEVICE) for _ in range(2)]
    positions = torch.tensor([0, 7, 4000], device=DEVICE)
    w_slots, w_pos = torch.tensor([3, 0, 2], device=DEVICE), torch.tensor([9, 0, 4], device=DEVICE)
    kc, vc = [torch.randn(S, KVH, T, D, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    ref_kc, ref_vc = kc.clone(), vc.clone()
    rq, rk = ops.qk_norm_rope_triton(q, k, wq, wk, positions, inv_freq(rot), 1e-6)
    ref_kc[w_slots, :, w_pos] = rk
    ref_vc[w_slots, :, w_pos] = v
    got = ops.qk_norm_rope_kv_inplace_triton(q, k, v, wq, wk, positions, inv_freq(rot), 1e-6, w_slots, w_pos, kc, vc)
    assert torch.equal(got, rq), "q' differs from the functional kernel"
    assert torch.equal(kc, ref_kc), "k cache differs from index_put of k'"
    assert torch.equal(vc, ref_vc), "v cache differs from index_put of v"


def _attention_layer_programs(model, kind):
    """The tiny attention layer's decode (one position past the cache) or prefill (2 padding rows),
    exported and lowered with the Triton ops: (module, inputs, unfolded program, folded program, folded count)."""
    from onegraph.custom_ops import decompositions
    from onegraph.export.inplace_kv import fold_kv_writes
    cfg = model.cfg
    attn, inv = model.layers[cfg.layer_types.index("full_attention")].self_attn, model.inv_freq

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, x, slots, positions, n_valid, kc, vc):
            if kind == "decode":
                return self.attn.decode(x, slots, positions, inv, kc, vc)        # clamps the positions
            return self.attn.prefill(x, slots, positions, n_valid, inv, kc, vc)

    g, dt, dev = gen(3), model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
    S, T = 4, 16
    N = 3 if kind == "decode" else 6
    cache = lambda: torch.randn(S, cfg.num_kv_heads, T, cfg.head_dim, generator=g).to(dt).to(dev)  # noqa: E731
    if kind == "decode":
        slots, positions = torch.tensor([2, 0, 3]), torch.tensor([5, 0, 20])             # 20: past the cache
    else:
        slots, positions = torch.tensor([1]), torch.tensor([4])
    inputs = (torch.randn(N, cfg.hidden_size, generator=g).to(dt).to(dev), slots.to(dev), positions.to(dev),
              torch.tensor([N - 2], device=dev), cache(), cache())
    with torch.no_grad():
        plain = torch.export.export(Layer(), tuple(t.clone() for t in inputs), strict=False)
        plain = plain.run_decompositions(decompositions("cuda"))
        folded = torch.export.export(Layer(), tuple(t.clone() for t in inputs), strict=False)
        folded = folded.run_decompositions(decompositions("cuda"))
    return Layer(), inputs, plain, folded, fold_kv_writes(folded)


@pytest.fixture(scope="module")
def tiny_dev():
    from onegraph.checkpoint.load import load_model
    return load_model("tiny", "float32", DEVICE)[1]


@needs_triton
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_fold_kv_writes(tiny_dev, kind):
    """export/inplace_kv.py: the layer's qk_norm_rope + two index_puts become one in-place twin (no
    index_put left), and the folded program computes what the unfolded one does, caches included,
    bit for bit (the Triton kernels run in the interpreter without a GPU)."""
    import operator

    layer, inputs, plain, folded, n = _attention_layer_programs(tiny_dev, kind)
    assert n == 1
    targets = [n.target for n in folded.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.index_put.default not in targets
    assert torch.ops.onegraph.qk_norm_rope_triton.default not in targets
    twins = [n for n in folded.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
             and n.args and n.args[0] is torch.ops.onegraph.qk_norm_rope_kv_inplace_triton.default]
    assert len(twins) == 1, targets
    # decode: the layer's positions clamp is the twin's (the kernel takes the raw positions); prefill's
    # rope positions and write rows differ (padding rows), so it keeps them
    assert twins[0].kwargs["clamp"] == (kind == "decode")
    assert (torch.ops.aten.clamp.default in targets) == (kind == "prefill"), targets
    a, b, e = ([t.clone() for t in inputs] for _ in range(3))
    with torch.no_grad():
        want = plain.module()(*a)
        got = folded.module()(*b)
        ref = layer(*e)
    assert torch.equal(got, want)
    assert torch.equal(b[4], a[4]) and torch.equal(b[5], a[5]), "KV caches differ from the unfolded program"
    assert not torch.equal(b[4], inputs[4]), "nothing was written into the k cache"
    assert (got - ref).abs().max().item() <= 1e-4                # the Triton kernels vs the eager references


@needs_triton
def test_fold_kv_writes_whole_decode_graph(tiny_dev):
    """tiny's whole decode graph (batch 2) lowered with the Triton ops: every attention layer folds, no
    index_put is left, and one step of the folded program (ids, logits, every state tensor) equals the
    unfolded one bit for bit."""
    from onegraph.custom_ops import decompositions
    from onegraph.export.entry import dynamic_shapes, entry_module, example_inputs, graph_spec
    from onegraph.export.inplace_kv import fold_kv_writes
    from onegraph.models.qwen3_5.model import new_state
    model = tiny_dev
    spec = graph_spec(model, "decode", 2, 32, torch.float32)
    progs = []
    with torch.no_grad():
        for _ in range(2):
            ep = torch.export.export(entry_module(model, "decode"), example_inputs(spec, DEVICE),
                                     dynamic_shapes=dynamic_shapes(spec), strict=False)
            progs.append(ep.run_decompositions(decompositions("cuda")))
    assert fold_kv_writes(progs[1]) == model.cfg.layer_types.count("full_attention")
    targets = [n.target for n in progs[1].graph.nodes]
    assert torch.ops.aten.index_put.default not in targets
    # the step's positions clamp is done in the twin's kernel: the twins take the positions input itself
    assert torch.ops.aten.clamp.default not in targets, targets
    twins = [n for n in progs[1].graph.nodes if n.op == "call_function" and n.args
             and n.args[0] is torch.ops.onegraph.qk_norm_rope_kv_inplace_triton.default]
    assert twins and all(n.kwargs["clamp"] and n.kwargs["positions"].op == "placeholder" for n in twins)
    g = gen(4)
    state = [(torch.randn(t.shape, generator=g) * 0.1).to(t.dtype).to(DEVICE)
             for t in new_state(model.cfg, 3, 32, torch.float32)]
    head = [torch.tensor(v, device=DEVICE) for v in ([7, 9], [2, 0], [5, 40])]       # 40: past the cache
    head += [torch.zeros(2, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE),
             torch.ones(2, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)]
    runs = []
    for ep in progs:
        st = [t.clone() for t in state]
        with torch.no_grad():
            runs.append((ep.module()(*head, *st), st))
    (out0, st0), (out1, st1) = runs
    assert all(torch.equal(a, b) for a, b in zip(out0, out1)), "ids / logits differ"
    assert all(torch.equal(a, b) for a, b in zip(st0, st1)), "state differs"


@needs_triton
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_pre_grad_pass_calls_the_kv_twin_on_the_caches(tiny_dev, kind):
    """export/aoti.py's pre-grad pass (the graph AOTInductor compiles) turns the folded layer's
    auto-functionalized twin into a direct call on the cache inputs: nothing auto-functionalized, no
    copy-back, no index_put left; it writes the caches in place and equals the unfolded program bit for bit."""
    from onegraph.export.inplace import inline_inplace_twins
    _, inputs, plain, folded, n = _attention_layer_programs(tiny_dev, kind)
    assert n == 1
    gm = folded.module()
    assert inline_inplace_twins(gm.graph) == 1
    targets = [str(t.target) for t in gm.graph.nodes if t.op == "call_function"]
    assert targets.count("onegraph.qk_norm_rope_kv_inplace_triton.default") == 1, targets
    assert not [t for t in targets if "auto_functionalized" in t or "copy" in t or "index_put" in t], targets
    a, b = [t.clone() for t in inputs], [t.clone() for t in inputs]
    with torch.no_grad():
        want, got = plain.module()(*a), gm(*b)
    assert torch.equal(got, want)
    assert torch.equal(b[4], a[4]) and torch.equal(b[5], a[5]), "KV caches differ from the unfolded program"


AOTI_FOLD_SCRIPT = """
import logging, re, sys, tempfile, zipfile, torch
sys.path.insert(0, {tests!r})
import test_triton_attention_fused as t
from triton_env import package_copies
from onegraph.custom_ops import PYTHON_CALLS
from onegraph.export.inplace import InlineInplaceTwins
from onegraph.checkpoint.load import load_model

""" + CATCH_KERNEL_WARNINGS + """model = load_model("tiny", "bfloat16", "cuda")[1]
for kind in ("decode", "prefill"):
    layer, inputs, plain, folded, n = t._attention_layer_programs(model, kind)
    assert n == 1, n
    # as export/aoti.py lowers (its pre-grad pass calls the twin on the caches), weights kept in the package
    cfg = {{"pre_grad_custom_pass": InlineInplaceTwins(), "emulate_precision_casts": True}}
    path = torch._inductor.aoti_compile_and_package(folded, package_path=tempfile.mkdtemp() + "/f.pt2",
                                                    inductor_configs=cfg)
    assert not [w for w in warnings if "assuming every input is mutated" in w], warnings
    src = "\\n".join(zipfile.ZipFile(path).read(f).decode(errors="ignore")
                     for f in zipfile.ZipFile(path).namelist() if f.endswith(".cpp"))
    kernels = sorted(set(re.findall(r"\\b(triton_[a-z]+_fused\\w*|_qk_norm_rope_kernel\\w*)", src)))
    print(kind, "kernels:", kernels)
    assert [k for k in kernels if k.startswith("_qk_norm_rope_kernel")], kernels
    assert not [k for k in kernels if "index_put" in k], f"a KV write kernel survived: {{kernels}}"
    if kind == "decode":   # the step's positions clamp is the kernel's (a prefill chunk clamps its padding rows' writes)
        assert not [k for k in kernels if "clamp" in k], f"a positions clamp kernel survived: {{kernels}}"
    assert "proxy_executor_call_function(" not in src, "an op is called back through Python (proxy executor)"
    assert not package_copies(src), f"a copy of a cache survived: {{package_copies(src)[:6]}}"
    pkg = torch._inductor.aoti_load_package(path)
    a, b = [x.clone() for x in inputs], [x.clone() for x in inputs]
    before = dict(PYTHON_CALLS)
    with torch.no_grad():
        want = plain.module()(*a)
        got = pkg(*b)
    torch.cuda.synchronize()
    assert dict(PYTHON_CALLS) == before, "Python reference called"
    got = got[0] if isinstance(got, (list, tuple)) else got
    assert torch.equal(got, want), (kind, (got.float() - want.float()).abs().max().item())
    assert torch.equal(b[4], a[4]) and torch.equal(b[5], a[5]), kind + ": KV caches differ"
    assert not torch.equal(b[4], inputs[4]), kind + ": k cache not written in place"
print("AOTI FOLD OK")
"""


@pytest.mark.cuda
@pytest.mark.skipif(not (DEVICE == "cuda" and HAVE_TRITON), reason="needs a CUDA device and triton")
def test_fold_kv_writes_aoti(tmp_path):
    """The folded attention layer (bf16 tiny, decode and prefill) compiled by AOTInductor with export's
    pre-grad pass: the twin's kernel is compiled in, no KV-write kernel, no Python callback, no cache copy;
    Inductor's mutation analysis understood the kernel (no 'assuming every input is mutated'); the package
    writes the caches in place and equals the unfolded program bit for bit. A subprocess: on the H200
    image loading a package segfaults unless LD_PRELOAD names the system libstdc++ (docs/design.md)."""
    run_package_script(tmp_path / "fold.py", AOTI_FOLD_SCRIPT, "AOTI FOLD OK")


# ---------------------------------------------------------------- model: one clamp per step

@pytest.fixture(scope="module")
def tiny32():
    from onegraph.checkpoint.load import load_model
    return load_model("tiny", "float32")[1]


def test_decode_past_the_cache_writes_the_last_row(tiny32):
    """positions >= Tmax: the KV write and the attention use row Tmax - 1 (never index past the
    cache), and the step computes what a step at Tmax - 1 computes; sampling still sees the real
    position. Eager, on the reference ops."""
    from onegraph.models.qwen3_5.model import new_state
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
