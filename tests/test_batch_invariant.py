"""export --batch-invariant's Triton variants (custom_ops/triton/*_invariant.py): every row of a batched call equals
the same row called alone, bit for bit (and the sampler, whose one plan serves every batch), and the reference
within the op's usual tolerance; the option's validation, its manifest record and `inspect` line; the decode graph
traced with it holds the variants only.

Without a GPU the kernels run in Triton's interpreter (small shapes): that checks each variant's indexing and
plan (a row's programs read only that row), not the compiled reduction trees. With a GPU the same tests run
compiled, plus the `cuda` tests at Qwen3.5-35B-A3B shapes and batches 1, 8, 64 — the check that matters, since
there the default kernels' rows differ between batches (the test asserts the default kernels do differ
somewhere, so the invariant ones are not equal by accident of the inputs).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import CUDA, DEVICE, HAVE_TRITON, kernels, needs_triton  # noqa: F401

from onegraph.custom_ops.attention_decode import reference_attention_decode
from onegraph.custom_ops.fused_moe import reference_fused_moe
from onegraph.custom_ops.gdn_decode_step_norm import reference_gdn_decode_step_norm
from onegraph.custom_ops.sample import reference_sample

ops = torch.ops.onegraph


def rows_alone(op, batched_args, row_args, B):
    """op over all B rows, and op over each row alone -> (batched output, [row outputs])."""
    return op(*batched_args), [op(*row_args(i)) for i in range(B)]


def assert_rows_equal(got, alone, what):
    for i, a in enumerate(alone):
        g = got[i:i + 1]
        assert torch.equal(g, a), f"{what}: row {i} differs from its solo call by {(g.float() - a.float()).abs().max()}"


def rand(g, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# ---------------------------------------------------------------- linear
def linear_case(M, N, K, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return rand(g, M, K, dtype=dtype), rand(g, N, K, scale=K ** -0.5, dtype=dtype)


def check_linear(M, N, K, dtype=torch.bfloat16):
    x, w = linear_case(M, N, K, dtype)
    y, alone = rows_alone(ops.linear_invariant_triton, (x, w), lambda i: (x[i:i + 1], w), M)
    assert_rows_equal(y, alone, f"linear M={M}")
    ref = F.linear(x.double(), w.double())
    tol = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-4
    assert ((y.double() - ref).abs() / ref.abs().amax().clamp(min=1.0)).max() <= tol
    return x, w, y


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [3, 20])                 # 20: past linear.py's GEMV rows (where it takes cuBLAS)
def test_linear_rows_equal_alone(M, dtype):
    check_linear(M, 37, 300, dtype)                   # N and K not multiples of the tile


@needs_triton
def test_add_rms_norm_linear_rows_equal_alone():
    from onegraph.custom_ops.add_rms_norm_linear import reference_add_rms_norm_linear
    g = torch.Generator().manual_seed(3)
    x, res, nw, w = rand(g, 5, 96), rand(g, 5, 96), rand(g, 96, scale=0.1), rand(g, 9, 96, scale=96 ** -0.5)

    def op(*a):
        return torch.cat(ops.add_rms_norm_linear_invariant_triton(*a), 1)       # y ‖ normed ‖ h per row
    got, alone = rows_alone(op, (x, res, nw, 1e-6, w), lambda i: (x[i:i + 1], res[i:i + 1], nw, 1e-6, w), 5)
    assert_rows_equal(got, alone, "add_rms_norm_linear")
    ref = torch.cat(reference_add_rms_norm_linear(x.cpu(), res.cpu(), nw.cpu(), 1e-6, w.cpu()), 1)
    assert (got.float().cpu() - ref.float()).abs().max() <= 3e-2


# ---------------------------------------------------------------- fused_moe
def moe_case(T, E, k, H, I, Is, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = rand(g, T, H)
    logits = rand(g, T, E + 1)
    return [x, logits, rand(g, E, 2 * I, H, scale=H ** -0.5), rand(g, E, H, I, scale=I ** -0.5),
            rand(g, Is, H, scale=H ** -0.5), rand(g, Is, H, scale=H ** -0.5), rand(g, H, Is, scale=Is ** -0.5), k]


def check_moe(T, E, k, H, I, Is):
    args = moe_case(T, E, k, H, I, Is)

    def row(i):
        return [args[0][i:i + 1], args[1][i:i + 1], *args[2:]]
    y, alone = rows_alone(ops.fused_moe_invariant_triton, args, row, T)
    assert_rows_equal(y, alone, f"fused_moe T={T}")
    host = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]          # the weights copied once
    top = host[1][:, :E].float().topk(k + 1).values                                # [T, k+1]
    for i in range(T):                                # the reference's decode branch, one token
        if top[i, k - 1] == top[i, k]:                # a tie at the k-th logit: the kernel takes the lower index,
            continue                                  # the reference's topk any of them (both are the model's pick)
        ref = reference_fused_moe(host[0][i:i + 1], host[1][i:i + 1], *host[2:])
        assert (y[i:i + 1].float().cpu() - ref.float()).abs().max() <= 3e-2, f"fused_moe token {i} vs reference"
    return args, y


@needs_triton
def test_fused_moe_rows_equal_alone_past_the_grouped_path():
    """T * k > E: fused_moe.py would take the grouped GEMM of the prefill branch; the variant keeps the one-token
    kernels, so each token is its solo result."""
    check_moe(T=6, E=8, k=2, H=64, I=32, Is=48)


# ---------------------------------------------------------------- block FP8: linear_fp8 (+ norm), fused_moe_fp8
def check_linear_fp8(M, N, K, tail_rows=0, dtype=torch.bfloat16, seed=0):
    from test_triton_linear_fp8 import _check, _check_tail, _fp8_weight, _x
    w, scale = _fp8_weight(N, K, seed)
    x = _x(M, K, dtype, seed)
    tail = _x(tail_rows, K, dtype, seed + 7) * K ** -0.5 if tail_rows else None
    y, alone = rows_alone(ops.linear_fp8_invariant_triton, (x, w, scale, tail), lambda i: (x[i:i + 1], w, scale, tail),
                          M)
    assert_rows_equal(y, alone, f"linear_fp8 M={M}")
    (_check_tail if tail_rows else _check)(y, x, w, scale, *([tail] if tail_rows else []))
    return x, w, scale, y


@needs_triton
@pytest.mark.parametrize("M, tail_rows", [(3, 0), (20, 5)])     # 20: two 16-row tiles; 5: a float tail
def test_linear_fp8_rows_equal_alone(M, tail_rows):
    check_linear_fp8(M, 200, 300, tail_rows)                      # N, K: a partial 128-block each


@needs_triton
def test_add_rms_norm_linear_fp8_rows_equal_alone():
    from test_triton_linear_fp8 import _fp8_weight
    from onegraph.custom_ops.add_rms_norm_linear_fp8 import reference_add_rms_norm_linear_fp8
    g = torch.Generator().manual_seed(4)
    x, res, nw = rand(g, 5, 160), rand(g, 5, 160), rand(g, 160, scale=0.1)
    w, scale = _fp8_weight(136, 160, 4)
    tail = rand(g, 3, 160, scale=160 ** -0.5)

    def op(*a):
        return torch.cat(ops.add_rms_norm_linear_fp8_invariant_triton(*a), 1)   # y ‖ normed ‖ h per row
    got, alone = rows_alone(op, (x, res, nw, 1e-6, w, scale, tail),
                            lambda i: (x[i:i + 1], res[i:i + 1], nw, 1e-6, w, scale, tail), 5)
    assert_rows_equal(got, alone, "add_rms_norm_linear_fp8")
    ref = reference_add_rms_norm_linear_fp8(*[a.cpu() if isinstance(a, torch.Tensor) else a
                                              for a in (x, res, nw, 1e-6, w, scale, tail)])
    ref = torch.cat(ref, 1)
    assert ((got.float().cpu() - ref.float()).abs() / ref.float().abs().amax()).max() <= 2.0 ** -7


def check_moe_fp8(T, E, k, H, I, Is):
    from test_triton_moe_fp8 import fp8_args
    from onegraph.custom_ops.fused_moe_fp8 import reference_fused_moe_fp8
    args, _ = fp8_args(T, H, E, I, Is, k, torch.bfloat16, seed=0, pow2=False)

    def row(i):
        return [args[0][i:i + 1], args[1][i:i + 1], *args[2:]]
    y, alone = rows_alone(ops.fused_moe_fp8_invariant_triton, args, row, T)
    assert_rows_equal(y, alone, f"fused_moe_fp8 T={T}")
    host = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    top = host[1][:, :E].float().topk(k + 1).values
    for i in range(T):                                # the reference's decode branch, one token (ties: as check_moe)
        if top[i, k - 1] == top[i, k]:
            continue
        ref = reference_fused_moe_fp8(host[0][i:i + 1], host[1][i:i + 1], *host[2:])
        assert (y[i:i + 1].float().cpu() - ref.float()).abs().max() <= 3e-2, f"fused_moe_fp8 token {i} vs reference"
    return args, y


@needs_triton
def test_fused_moe_fp8_rows_equal_alone_past_the_grouped_path():
    """T * k > E: fused_moe_fp8.py would take the grouped GEMMs; the variant keeps the one-token kernels."""
    check_moe_fp8(T=6, E=8, k=2, H=192, I=136, Is=136)


# ---------------------------------------------------------------- attention_decode
def attn_case(B, H, KVH, D, Tmax, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = B + 1
    pos = torch.randint(0, Tmax, (B,), generator=g)
    return [rand(g, B, H, D), rand(g, S, KVH, Tmax, D), rand(g, S, KVH, Tmax, D),
            torch.arange(B, 0, -1).to(DEVICE), pos.to(DEVICE), D ** -0.5, rand(g, B, H, D)]


def check_attention(B, H, KVH, D, Tmax):
    args = attn_case(B, H, KVH, D, Tmax)

    def row(i):
        return [args[0][i:i + 1], args[1], args[2], args[3][i:i + 1], args[4][i:i + 1], args[5], args[6][i:i + 1]]
    y, alone = rows_alone(ops.attention_decode_invariant_triton, args, row, B)
    assert_rows_equal(y, alone, f"attention_decode B={B}")
    ref = reference_attention_decode(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    assert (y.float().cpu() - ref.float()).abs().max() <= 3e-2
    return args, y


@needs_triton
def test_attention_rows_equal_alone():
    check_attention(B=3, H=4, KVH=2, D=32, Tmax=200)


# ---------------------------------------------------------------- sample (one plan at every batch: the default op)
def sample_case(B, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 3).to(DEVICE)
    temp = torch.tensor([0.0, 0.8, 1.0, 0.7] * B)[:B]
    top_k = torch.tensor([0, 0, 20, 0] * B)[:B]
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9] * B)[:B]
    return [logits, temp.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE),
            torch.arange(B, dtype=torch.int64).add(5).to(DEVICE), torch.arange(B, dtype=torch.int64).add(9).to(DEVICE)]


def check_sample(B, V):
    args = sample_case(B, V)
    ids, alone = rows_alone(ops.sample_triton, args, lambda i: [a[i:i + 1] for a in args], B)
    assert_rows_equal(ids, alone, f"sample B={B}")
    if V <= 4096:             # the reference's sort: slow at a 248,320-token vocabulary, and its ties unordered
        assert ids.cpu().tolist() == reference_sample(*[a.cpu() for a in args]).tolist()
    return args, ids


@needs_triton
def test_sample_rows_equal_alone():
    check_sample(B=8, V=3000)                         # 3 vocabulary tiles: chunked at one row


# ---------------------------------------------------------------- gdn_decode_step_norm
def gdn_case(B, HK, HV, K, V, W=4, seed=0):
    from test_triton_gdn_decode_norm import make
    return make(B, B + 1, HK, HV, K, V, W, torch.bfloat16, seed, list(range(B, 0, -1)))


def check_gdn(B, HK, HV, K, V):
    args = gdn_case(B, HK, HV, K, V)

    def row(i):
        return [t[i:i + 1] if j in (0, 1, 2, 3, 6) else t for j, t in enumerate(args)]
    outs, alone = rows_alone(ops.gdn_decode_step_norm_invariant_triton, args, row, B)
    for j, what in enumerate(("y", "new_conv", "new_rec")):
        assert_rows_equal(outs[j], [a[j] for a in alone], f"gdn {what} B={B}")
    ref = reference_gdn_decode_step_norm(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    assert (outs[0].float().cpu() - ref[0].float()).abs().max() <= 3.2e-2
    return args, outs


@needs_triton
def test_gdn_rows_equal_alone():
    check_gdn(B=3, HK=2, HV=4, K=16, V=32)


# ---------------------------------------------------------------- gdn_decode_steps (a speculative verify's GDN layer)
def check_gdn_steps(B, T, HK, HV, K, V):
    from test_triton_gdn_decode_steps import make
    from onegraph.custom_ops.gdn_decode_steps import reference_gdn_decode_steps
    args = make(B, T, B + 1, HK, HV, K, V, 4, torch.bfloat16, 0, list(range(B, 0, -1)))

    def row(i):
        return [t[i:i + 1] if j in (0, 1, 2, 5) else t for j, t in enumerate(args)]
    outs, alone = rows_alone(ops.gdn_decode_steps_invariant_triton, args, row, B)
    assert_rows_equal(outs[0], [a[0] for a in alone], f"gdn_decode_steps out B={B}")
    for j, what in ((1, "conv_after"), (2, "rec_after")):         # [T, B, ...]: slot i is column i
        for i, a in enumerate(alone):
            assert torch.equal(outs[j][:, i:i + 1], a[j]), f"gdn_decode_steps {what}: slot {i} differs from its solo call"
    ref = reference_gdn_decode_steps(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    assert (outs[0].float().cpu() - ref[0].float()).abs().max() <= 3.2e-2
    return args, outs


@needs_triton
def test_gdn_steps_rows_equal_alone():
    check_gdn_steps(B=3, T=3, HK=2, HV=4, K=16, V=32)


# ---------------------------------------------------------------- CUDA: the 35B shapes, where the defaults differ
@pytest.mark.cuda
@pytest.mark.parametrize("B", [8, 64])
def test_35b_shapes_rows_equal_alone_where_the_defaults_do_not(B):
    """Each variant at the 35B shapes (bf16): rows equal alone; and over all five ops, some default kernel's row
    differs from its solo call (the plans this option exists for)."""
    if not (CUDA and HAVE_TRITON):
        pytest.skip("needs a CUDA device and triton")
    default_differs = []
    x, w, _ = check_linear(B, 2048, 4096)
    default_differs.append(not torch.equal(ops.linear_triton(x, w)[:1], ops.linear_triton(x[:1], w)))
    x, w, _ = check_linear(B, 12352, 2048)
    default_differs.append(not torch.equal(ops.linear_triton(x, w)[:1], ops.linear_triton(x[:1], w)))
    args, _ = check_moe(B, 256, 8, 2048, 512, 512)
    default_differs.append(not torch.equal(ops.fused_moe_triton(*args)[:1],
                                           ops.fused_moe_triton(args[0][:1], args[1][:1], *args[2:])))
    args, _ = check_attention(B, 16, 2, 256, 4096)
    args, _ = check_sample(B, 248320)
    args, _ = check_gdn(B, 16, 32, 128, 128)
    args, _ = check_gdn_steps(B, 4, 16, 32, 128, 128)            # a K = 3 verify's GDN layer over B slots
    print(f"B={B}: default kernels differing from their solo row (linear K=4096, linear K=2048, moe): {default_differs}")
    assert any(default_differs), "no default kernel differed from its solo row: the test's inputs show nothing"


@pytest.mark.cuda
@pytest.mark.parametrize("B", [8, 64])
def test_35b_fp8_shapes_rows_equal_alone_where_the_defaults_do_not(B):
    """The block-FP8 variants at the 35B shapes: the GDN [qkv; z] projection with its float [b; a] tail, out_proj
    (K = 4096) and the MoE; rows equal alone, and some default FP8 kernel's row differs from its solo call."""
    if not (CUDA and HAVE_TRITON):
        pytest.skip("needs a CUDA device and triton")
    default_differs = []
    for N, K, tail_rows in ((12288, 2048, 64), (2048, 4096, 0)):
        x, w, scale, _ = check_linear_fp8(B, N, K, tail_rows)
        default_differs.append(not torch.equal(ops.linear_fp8_triton(x, w, scale)[:1],
                                               ops.linear_fp8_triton(x[:1], w, scale)))
    args, _ = check_moe_fp8(B, 256, 8, 2048, 512, 512)
    default_differs.append(not torch.equal(ops.fused_moe_fp8_triton(*args)[:1],
                                           ops.fused_moe_fp8_triton(args[0][:1], args[1][:1], *args[2:])))
    print(f"B={B}: default FP8 kernels differing from their solo row (K=2048, K=4096, moe): {default_differs}")
    assert any(default_differs), "no default FP8 kernel differed from its solo row: the test's inputs show nothing"


# ---------------------------------------------------------------- the option
@pytest.mark.parametrize("kw, needle", [(dict(device="cpu"), "--device cuda"),
                                        (dict(device="cuda", kernels="reference"), "--kernels auto"),
                                        (dict(device="cuda", quant="int8"), "--quant none or fp8"),
                                        (dict(device="cuda", fp32_reduce=True), "--fp32-reduce"),
                                        (dict(device="cuda", tp=2), "--tp 1")])
def test_option_refuses_what_it_does_not_cover(kw, needle):
    from onegraph.export.pipeline import ExportOptions
    with pytest.raises(ValueError, match="--batch-invariant") as e:
        ExportOptions(batch_invariant=True, **kw).validate(1024)
    assert needle in str(e.value)


def test_cli_flag_reaches_the_options_and_refuses_in_one_line(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "onegraph", "export", "tiny", "--out", str(tmp_path / "a"),
                        "--batch-invariant", "--quiet"], capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "--batch-invariant needs --device cuda" in lines[0], r.stderr


def test_inspect_says_whether_batch_invariant(tiny_artifact):
    from onegraph.export.pipeline import inspect
    from onegraph.runtime.artifact import verify
    m = verify(tiny_artifact, files=False)
    assert "batch invariance: off" in inspect(tiny_artifact, m)
    m = dict(m, options=dict(m["options"], batch_invariant=True))
    assert "batch invariance: on" in inspect(tiny_artifact, m)


@needs_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_decode_graph_holds_only_the_invariant_variants(fp8):
    """tiny's decode graph at bucket 4, traced as export does under the option (CUDA lowerings, traced on this
    machine's device): linear, fused_moe, attention and the GDN step are the variants (sample has one plan at every batch) (with --quant fp8
    --fp8-lm-head: the FP8 projections', experts' and head's too), no norm is folded into a projection, and the
    GDN state is still written in place (the variant's twin)."""
    from onegraph.checkpoint.load import load_model
    from onegraph.export.entry import graph_spec
    from onegraph.export.trace import trace
    _, model, _ = load_model("tiny", "float32", DEVICE, quant="fp8" if fp8 else None, fp8_lm_head=fp8)
    from onegraph.models.qwen3_5.fuse import fuse_projections
    fuse_projections(model)
    spec = graph_spec(model, "decode", 4, 64, torch.float32)
    if CUDA:
        _, hist = trace(model, spec, "cuda", batch_invariant=True)
    else:
        _, hist = _trace_as_cuda(model, spec)
    names = {n for n in hist if n.startswith("onegraph::")}
    ops_ = ("linear_fp8", "add_rms_norm_linear", "fused_moe_fp8", "attention_decode") if fp8 else \
        ("linear", "add_rms_norm_linear", "fused_moe", "attention_decode")
    for op in ops_:
        assert f"onegraph::{op}_invariant_triton" in names and f"onegraph::{op}_triton" not in names, names
    assert "onegraph::gdn_decode_step_norm_invariant_inplace_triton" in names, names
    assert "onegraph::add_rms_norm_linear_triton" not in names, names      # no fold_norm at batch 1 either
    assert not {"aten::index_copy", "aten::index_put", "aten::mm", "aten::addmm"} & set(hist), hist   # state in place, no GEMM


@needs_triton
def test_speculative_graph_holds_only_the_invariant_variants():
    """tiny's speculative round graph (K = 2, bucket 2) traced under the option: the draft head's and the verify's
    rows take the variants too (the verify's GDN layers gdn_decode_steps'), no default Triton op of a row-dependent
    plan is left."""
    from onegraph.checkpoint.load import load_model
    from onegraph.custom_ops import _registry
    from onegraph.export.entry import graph_spec
    from onegraph.export.trace import trace
    _, model, _ = load_model("tiny", "float32", DEVICE, mtp=True)
    spec = graph_spec(model, "spec", 2, 64, torch.float32, 2)
    _, hist = trace(model, spec, "cuda", batch_invariant=True) if CUDA else _trace_as_cuda(model, spec)
    names = {n for n in hist if n.startswith("onegraph::")}
    for op in ("linear", "fused_moe", "attention_decode", "gdn_decode_steps"):
        assert f"onegraph::{op}_invariant_triton" in names and f"onegraph::{op}_triton" not in names, names
    variant = {f"onegraph::{op}_triton" for op in _registry.BATCH_VARIANT} | \
        {f"onegraph::{op}_triton" for op, how in _registry.LOWERINGS if how == _registry.INVARIANT}
    assert not variant & names, variant & names


def _trace_as_cuda(model, spec):
    """export/trace.py's steps with the CUDA decomposition table on CPU tensors (as tests/test_triton_model.py)."""
    from onegraph.custom_ops import decompositions
    from onegraph.export.entry import dynamic_shapes, entry_module, example_inputs
    from onegraph.export.inplace import fold_state_writes
    from onegraph.export.inplace_kv import fold_kv_writes
    from onegraph.export.trace import check_lowered
    with torch.no_grad():
        ep = torch.export.export(entry_module(model, spec.kind, spec.k), example_inputs(spec, DEVICE),
                                 dynamic_shapes=dynamic_shapes(spec), strict=False)
        ep = ep.run_decompositions(decompositions("cuda", "auto", batch_invariant=True))
    fold_state_writes(ep)
    fold_kv_writes(ep)
    return ep, check_lowered(ep, "cuda")
