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
from triton_env import (CATCH_KERNEL_WARNINGS, CUDA, DEVICE, HAVE_TRITON, INTERPRETED, TTIR_WRITES, needs_triton,
                        run_package_script)

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


class _GdnDecode(torch.nn.Module):
    """A GDN decode step as models/qwen3_5/model.py writes it: views of one fused projection output, the op, the
    state rows written back with index_copy_."""

    def __init__(self, HK, HV, K, V):
        super().__init__()
        self.HK, self.sizes = HK, [2 * HK * K + HV * V, HV * V, HV, HV]

    def forward(self, fused, conv, rec, slots, conv_w, A_log, dt_bias, norm_w):
        qkv, z, b, a = fused.split(self.sizes, dim=-1)
        y, new_conv, new_rec = ops.gdn_decode_step_norm(qkv, a, b, z, conv, rec, slots, conv_w, A_log, dt_bias,
                                                        norm_w, self.HK, 1e-6)
        conv.index_copy_(0, slots, new_conv)
        rec.index_copy_(0, slots, new_rec)
        return y


def gdn_block_inputs(B, S, HK, HV, K, V, dtype, seed):
    args = make(B, S, HK, HV, K, V, 4, dtype, seed, list(range(S - 1, S - 1 - B, -1)))
    qkv, a, b, z = args[:4]
    fused = torch.cat([qkv, z, b, a], dim=-1)
    return [fused, *args[4:11]]


def export_gdn_block(inputs, HK, HV, K, V):
    from onegraph.custom_ops import decompositions
    from onegraph.export.inplace import fold_state_writes
    from onegraph.export.trace import check_lowered
    S = torch.export.Dim("S", min=2, max=1 << 16)              # the state's slot dim is dynamic, as in export/
    dyn = tuple({0: S} if i in (1, 2) else None for i in range(len(inputs)))
    ep = torch.export.export(_GdnDecode(HK, HV, K, V), tuple(t.clone() for t in inputs), dynamic_shapes=dyn,
                             strict=False)
    ep = ep.run_decompositions(decompositions("cuda"))
    folded = fold_state_writes(ep)
    return ep, folded, check_lowered(ep, "cuda")


@needs_triton
def test_export_folds_the_state_write_back():
    """export/inplace.py turns op + 2 x index_copy into the in-place twin (auto-functionalized, as export
    writes a mutating op); the program computes what eager does, state included, over 3 steps."""
    HK, HV, K, V = 2, 4, 16, 16
    inputs = gdn_block_inputs(2, 4, HK, HV, K, V, torch.float32, 3)
    ep, folded, hist = export_gdn_block(inputs, HK, HV, K, V)
    assert folded == 1
    # nothing but the split into views and the one in-place op: no index_copy, no copy of a strided view
    assert hist == {"aten::split_with_sizes": 1, "getitem": 7, "onegraph::gdn_decode_step_norm_inplace_triton": 1}, hist
    eager = [t.clone() for t in inputs]
    lowered = [t.clone() for t in inputs]
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.randn(inputs[0].shape, generator=g).to(DEVICE)
        eager[0], lowered[0] = x, x.clone()
        ref = _GdnDecode(HK, HV, K, V)(*eager)
        got = ep.module()(*lowered)
        close(got, ref, 1e-4, f"step {step} y")
        close(lowered[1], eager[1], 0.0, f"step {step} conv state")
        close(lowered[2], eager[2], 1e-4, f"step {step} recurrent state")


AOTI_SCRIPT = """
import logging, re, sys, tempfile, zipfile, torch
sys.path.insert(0, {tests!r})
import test_triton_gdn_decode_norm as t
from triton_env import package_copies
from onegraph.custom_ops import PYTHON_CALLS

""" + CATCH_KERNEL_WARNINGS + """
HK, HV, K, V = 16, 32, 128, 128                  # Qwen3.5-35B-A3B's GDN layer
from pathlib import Path
from onegraph.export.aoti import lower_aoti
# the launcher's three kernels (custom_ops/triton/gdn_decode_step_norm.py) at every batch
expected = {{"_conv_update_kernel", "_gdn_decode_kernel", "_gated_rms_norm_kernel"}}
for B in (1, 16):
    inputs = t.gdn_block_inputs(B, B + 2, HK, HV, K, V, torch.bfloat16, B)
    ep, folded, hist = t.export_gdn_block(inputs, HK, HV, K, V)
    assert folded == 1, hist
    path = str(lower_aoti(ep, Path(tempfile.mkdtemp()) / "gdn.pt2"))
    z = zipfile.ZipFile(path)
    src = "\\n".join(z.read(n).decode(errors="ignore") for n in z.namelist() if n.endswith(".cpp"))
    ours = set(re.findall(r"\\b(_(?:gdn_decode\\w*|conv_update|gated_rms_norm)_kernel)", src))
    glue = sorted(set(re.findall(r"\\btriton_[a-z]+_fused\\w*", src)))
    print(f"B={{B}} kernels:", sorted(ours), glue)
    assert ours == expected, f"B={{B}}: compiled {{sorted(ours)}}, expected {{sorted(expected)}}"
    assert not glue, f"B={{B}}: Inductor kernels (a write-back, or a copy of a view or of the state): {{glue}}"
    assert "proxy_executor_call_function(" not in src, "an op is called back through Python (proxy executor)"
    assert not package_copies(src), f"a copy of the state or of a view survived: {{package_copies(src)[:6]}}"
    assert not [w for w in warnings if "assuming every input is mutated" in w], warnings
    pkg = torch._inductor.aoti_load_package(path)
    eager, aoti = [x.clone() for x in inputs], [x.clone() for x in inputs]
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(inputs[0].shape, generator=g).to(torch.bfloat16).cuda()
        eager[0], aoti[0] = x, x.clone()
        ref = t._GdnDecode(HK, HV, K, V)(*eager)
        before = dict(PYTHON_CALLS)
        got = pkg(*aoti)
        torch.cuda.synchronize()
        assert dict(PYTHON_CALLS) == before, "Python reference called from the package"
        t.close(got[0] if isinstance(got, (list, tuple)) else got, ref, 3.2e-2, f"B={{B}} step {{step}} y")
        t.close(aoti[1], eager[1], 0.0, f"B={{B}} step {{step}} conv state")
        t.close(aoti[2], eager[2], 3e-3, f"B={{B}} step {{step}} recurrent state")
print("AOTI OK")
"""


def test_package_copies_ignores_only_the_alignment_guards():
    """The AOTI package checks' copy finder: the wrapper's run-time alignment guard of an input is not a copy;
    a clone of a buffer, a guard-shaped clone of another tensor and a copy_ are."""
    from triton_env import package_copies
    guard = ("if ((reinterpret_cast<std::uintptr_t>(arg2_1.data_ptr()) & (16 -1)) != 0) {\n"
             "    AtenTensorHandle arg2_1_aligned;\n"
             "    aoti_torch_clone_preserve_strides(arg2_1, &arg2_1_aligned);\n}")
    assert package_copies(guard) == []
    real = ["aoti_torch_clone(buf3, &buf4);", "aoti_torch_clone_preserve_strides(arg2_1, &buf7);",
            "aoti_torch_copy_(arg5_1, buf9, 0);"]
    assert package_copies(guard + "\n" + "\n".join(real)) == real


@pytest.mark.cuda
@pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a CUDA device and triton")
def test_aoti_package_writes_state_in_place(tmp_path):
    """35B GDN layer shape, B = 1 and 16: the folded program compiled through
    lower_aoti launches the op's own kernels and nothing else (no index_copy write-back, no clone of the
    state, no copy of the strided projection views, no Python call) and carries the state as eager does
    over 3 steps. Subprocess: on the H200 image loading a package needs
    LD_PRELOAD of the system libstdc++ (docs/design.md)."""
    run_package_script(tmp_path / "aoti.py", AOTI_SCRIPT, "AOTI OK")



@needs_triton
def test_aoti_pre_grad_pass_calls_the_twin_on_the_inputs():
    """export/aoti.py's pre-grad pass (what AOTInductor compiles) turns the folded op back into a direct call of
    the in-place twin on the state inputs: nothing auto-functionalized is left (AOTInductor would call that
    back through Python) and no copy-back; the graph mutates the inputs itself and matches eager over 3 steps."""
    from onegraph.export.inplace import inline_inplace_twins
    HK, HV, K, V = 2, 4, 16, 16
    inputs = gdn_block_inputs(2, 4, HK, HV, K, V, torch.float32, 4)
    ep, folded, _ = export_gdn_block(inputs, HK, HV, K, V)
    gm = ep.module()
    assert inline_inplace_twins(gm.graph) == 1
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("onegraph.gdn_decode_step_norm_inplace_triton.default") == 1, targets
    assert not [t for t in targets if "auto_functionalized" in t or "copy" in t or "index_copy" in t], targets
    eager, direct = [t.clone() for t in inputs], [t.clone() for t in inputs]
    g = torch.Generator().manual_seed(8)
    for step in range(3):
        x = torch.randn(inputs[0].shape, generator=g).to(DEVICE)
        eager[0], direct[0] = x, x.clone()
        ref = _GdnDecode(HK, HV, K, V)(*eager)
        close(gm(*direct), ref, 1e-4, f"step {step} y")
        close(direct[1], eager[1], 0.0, f"step {step} conv state")
        close(direct[2], eager[2], 1e-4, f"step {step} recurrent state")


class _ReadsOldState(_GdnDecode):
    """Reads the old recurrent state after the op, before its write-back: inlining would change that value."""

    def forward(self, fused, conv, rec, slots, conv_w, A_log, dt_bias, norm_w):
        qkv, z, b, a = fused.split(self.sizes, dim=-1)
        y, new_conv, new_rec = ops.gdn_decode_step_norm(qkv, a, b, z, conv, rec, slots, conv_w, A_log, dt_bias,
                                                        norm_w, self.HK, 1e-6)
        old = rec.sum()
        conv.index_copy_(0, slots, new_conv)
        rec.index_copy_(0, slots, new_rec)
        return y, old


@needs_triton
def test_inline_leaves_a_twin_whose_old_state_is_read_later():
    from onegraph.custom_ops import decompositions
    from onegraph.export.inplace import fold_state_writes, inline_inplace_twins
    HK, HV, K, V = 2, 4, 16, 16
    inputs = gdn_block_inputs(2, 4, HK, HV, K, V, torch.float32, 6)
    ep = torch.export.export(_ReadsOldState(HK, HV, K, V), tuple(t.clone() for t in inputs), strict=False)
    ep = ep.run_decompositions(decompositions("cuda"))
    assert fold_state_writes(ep) == 1                  # still the same value: auto_functionalized reads a copy
    gm = ep.module()
    assert inline_inplace_twins(gm.graph) == 0
    eager, lowered = [t.clone() for t in inputs], [t.clone() for t in inputs]
    ref, got = _ReadsOldState(HK, HV, K, V)(*eager), gm(*lowered)
    close(got[1], ref[1], 1e-3, "the old state's sum")
    close(lowered[2], eager[2], 1e-4, "recurrent state")


@needs_triton
@pytest.mark.parametrize("in_place", [False, True])
def test_launch_matches_reference(in_place):
    """The launcher (conv update, step, norm as three launches) functional and in place, into caller-given
    outputs, against the reference; in place the rows at slots are the reference's new rows, the others untouched."""
    from onegraph.custom_ops.triton import gdn_decode_step_norm as mod
    B, S, HK, HV, K, V, W, slots = SHAPES[1]
    for dtype in (torch.float32, torch.bfloat16):
        args = make(B, S, HK, HV, K, V, W, dtype, 31, slots)
        ry, rc, rr = reference_gdn_decode_step_norm(*args)
        y = args[0].new_empty((B, HV, V))
        conv, rec = args[4].clone(), args[5].clone()
        if in_place:
            nc, nr = conv, rec
        else:
            nc, nr = conv.new_empty((B, C_of(args), W - 1)), rec.new_empty((B, HV, K, V))
        mod._launch(*args[:4], conv, rec, *args[6:], y, nc, nr)
        close(y, ry, TOL[dtype], f"{dtype} y")
        if in_place:
            rc, rr = args[4].index_copy(0, args[6], rc), args[5].index_copy(0, args[6], rr)
        close(nc, rc, 0.0, f"{dtype} conv rows")
        close(nr, rr, REC_TOL[dtype], f"{dtype} rec rows")


def C_of(args):
    return args[0].shape[1]


_MUTATION_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from onegraph.custom_ops.triton import causal_conv, gdn_decode_step, gdn_decode_step_norm, norms
from test_triton_gdn_decode_norm import make
launches = []
for mod in (gdn_decode_step_norm, causal_conv, gdn_decode_step, norms):
    mod.launch = lambda kernel, grid, *a, **meta: launches.append((kernel, a, meta))
for B in (1, 16):
    args = [a.cpu() if isinstance(a, torch.Tensor) else a
            for a in make(B, B + 1, 16, 32, 128, 128, 4, torch.bfloat16, 0, list(range(B)))]
    torch.ops.onegraph.gdn_decode_step_norm_inplace_triton(*args)
for kernel, a, meta in launches:
    kw = dict(zip([n for n in kernel.arg_names if n not in meta], a))
    kw.update({{k: v for k, v in meta.items() if k not in ("num_warps", "num_stages")}})
    print(kernel.fn.__name__, sorted(writes(kernel, kw)))
"""


@needs_triton
def test_inplace_kernels_write_the_state_through_the_argument_they_read():
    """Inductor's TTIR analysis of the in-place twin's kernels, at the 35B shape, B = 1 and 16: each state is
    written through the very argument it is read from (the same tensor passed again for its strides is never
    stored to), so AOTInductor neither clones the state nor copies it back. Compiled for sm_90 without a GPU."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = TTIR_WRITES + _MUTATION_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.split("\n")[:6] == 2 * [
        "_conv_update_kernel ['state', 'y']", "_gdn_decode_kernel ['out', 'rec_state']",
        "_gated_rms_norm_kernel ['y']"], res.stdout
