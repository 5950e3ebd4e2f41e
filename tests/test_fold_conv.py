"""export/fold_conv.py: a batch-1 GDN layer's conv update folded into its in_proj GEMV's epilogue
(custom_ops/triton/linear_conv.py, gdn_decode_step_norm.py's gdn_step_norm_inplace_triton).

A GDN decode layer as graphs/qwen3_5.py writes it (input norm, the fused in_proj, its split, the step op, the
state write-backs), exported and lowered for CUDA as export/trace.py does; the program with the conv folded
against the same program without, on the same inputs over 3 steps: outputs and both states bit for bit with
the kernels interpreted (the conv is the conv kernel's arithmetic on the value the GEMV stored). The whole
`tiny` decode graph with the fold runs against eager in tests/test_triton_model.py. On the H200 the
`cuda`-marked test compiles the folded layer at the 35B shape with AOTInductor and checks its kernels.
"""
from __future__ import annotations

import copy

import pytest
import torch
from triton_env import CATCH_KERNEL_WARNINGS, CUDA, DEVICE, HAVE_TRITON, INTERPRETED, needs_triton, run_package_script

ops = torch.ops.onegraph


class GdnLayer(torch.nn.Module):
    """norm: the layer's input add + RMSNorm (a later layer: fold_norm puts it in the in_proj GEMV), else the
    first layer's plain RMSNorm (its in_proj a plain GEMV)."""

    def __init__(self, HK, HV, K, V, norm: bool):
        super().__init__()
        self.HK, self.norm, self.sizes = HK, norm, [2 * HK * K + HV * V, HV * V, HV, HV]

    def forward(self, m, h, nw, w, conv, rec, slots, conv_w, A_log, dt_bias, norm_w):
        if self.norm:
            x, h = ops.add_rms_norm(m, h, nw, 1e-6)
        else:
            x = ops.rms_norm(m, nw, 1e-6)
        qkv, z, b, a = ops.linear(x, w).split(self.sizes, dim=-1)
        y, new_conv, new_rec = ops.gdn_decode_step_norm(qkv, a, b, z, conv, rec, slots, conv_w, A_log, dt_bias,
                                                        norm_w, self.HK, 1e-6)
        conv.index_copy_(0, slots, new_conv)
        rec.index_copy_(0, slots, new_rec)
        return y, h


def layer_inputs(B, S, H, HK, HV, K, V, dtype, seed, W=4):
    g = torch.Generator().manual_seed(seed)
    C, N = 2 * HK * K + HV * V, 2 * HK * K + 2 * HV * V + 2 * HV

    def rn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(DEVICE)

    return [rn(B, H), rn(B, H), rn(H, scale=0.1), rn(N, H, scale=H ** -0.5), rn(S, C, W - 1),
            rn(S, HV, K, V, scale=0.5, dt=torch.float32), torch.arange(S - 1, S - 1 - B, -1).to(DEVICE),
            rn(C, W, scale=0.5), rn(HV, scale=0.5), rn(HV), rn(V)]


def export_layer(inputs, HK, HV, K, V, norm):
    """-> (the lowered program with the state write-backs and the input norm folded, the same with the conv
    folded too, how many convs were folded, the folded program's op histogram)."""
    from onegraph.custom_ops import decompositions
    from onegraph.export.fold_conv import fold_conv_updates
    from onegraph.export.fold_norm import fold_input_norms
    from onegraph.export.inplace import fold_state_writes
    from onegraph.export.trace import check_lowered
    S = torch.export.Dim("S", min=2, max=1 << 16)              # the state's slot dim is dynamic, as in export/
    dyn = tuple({0: S} if i in (4, 5) else None for i in range(len(inputs)))
    ep = torch.export.export(GdnLayer(HK, HV, K, V, norm), tuple(t.clone() for t in inputs), dynamic_shapes=dyn,
                             strict=False)
    ep = ep.run_decompositions(decompositions("cuda"))
    assert fold_state_writes(ep) == 1
    fold_input_norms(ep)
    before = copy.deepcopy(ep)
    folded = fold_conv_updates(ep)
    return before, ep, folded, check_lowered(ep, "cuda")


def run_steps(programs, inputs, steps, seed):
    """Each program on its own copy of the inputs, a new layer input each step -> [(outputs, inputs)] per step."""
    states = [[t.clone() for t in inputs] for _ in programs]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        m = torch.randn(inputs[0].shape, generator=g).to(inputs[0].dtype).to(DEVICE)
        step = []
        for prog, st in zip(programs, states):
            st[0] = m.clone()
            step.append(([t.clone() for t in prog(*st)], [t.clone() for t in st]))
        out.append(step)
    return out


def assert_same(a, b, what, atol=0.0):
    for i, (x, y) in enumerate(zip(a, b)):
        err = (x.float() - y.float()).abs().max().item()
        assert err <= atol, f"{what} [{i}]: max abs difference {err:.3g} > {atol}"


@needs_triton
@pytest.mark.parametrize("norm, dtype", [(True, torch.bfloat16), (False, torch.float32)],
                         ids=["add_rms_norm_in_proj_bf16", "first_layer_in_proj_fp32"])
def test_fold_keeps_outputs_and_state(norm, dtype):
    """bf16: the conv's roundings (the value the GEMV stored, the products, the sum, SiLU) as the conv kernel's;
    the first layer's in_proj (a plain GEMV, no norm prologue) takes the loop form of the GEMV."""
    from onegraph.export.inplace import inline_inplace_twins
    HK, HV, K, V, H = 2, 4, 16, 16, 48
    inputs = layer_inputs(1, 3, H, HK, HV, K, V, dtype, 11)
    before, ep, folded, hist = export_layer(inputs, HK, HV, K, V, norm)
    assert folded == 1
    twin = "onegraph::add_rms_norm_linear_conv_inplace_triton" if norm else "onegraph::linear_conv_inplace_triton"
    assert hist.get(twin) == 1 and hist.get("onegraph::gdn_step_norm_inplace_triton") == 1, hist
    assert "onegraph::gdn_decode_step_norm_inplace_triton" not in hist and "aten::index_copy" not in hist, hist
    gm = ep.module()
    assert inline_inplace_twins(gm.graph) == 2        # what AOTInductor compiles: both twins on the state inputs
    assert "auto_functionalized" not in gm.code and "copy_" not in gm.code, gm.code
    atol = 0.0 if INTERPRETED else {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for i, ((ref, ref_in), (got, got_in), (inl, inl_in)) in enumerate(
            run_steps([before.module(), ep.module(), gm], inputs, 3, 5)):
        assert_same(got, ref, f"step {i} outputs", atol)
        assert_same(got_in[4:6], ref_in[4:6], f"step {i} conv, recurrent state", atol)
        assert_same(inl, got, f"step {i} inlined outputs")
        assert_same(inl_in[4:6], got_in[4:6], f"step {i} inlined state")
        assert not torch.equal(got_in[4], inputs[4]), "the conv state did not move"


@needs_triton
def test_leaves_two_rows_and_a_qkv_with_another_reader():
    HK, HV, K, V, H = 2, 4, 16, 16, 48
    _, _, folded, hist = export_layer(layer_inputs(2, 4, H, HK, HV, K, V, torch.float32, 3), HK, HV, K, V, True)
    assert folded == 0 and hist.get("onegraph::gdn_decode_step_norm_inplace_triton") == 1, hist

    from onegraph.custom_ops import decompositions
    from onegraph.export.fold_conv import fold_conv_updates
    from onegraph.export.inplace import fold_state_writes

    class Shared(GdnLayer):
        """The projection's qkv part is also returned: its values would change under the fold."""
        def forward(self, m, h, nw, w, conv, rec, slots, conv_w, A_log, dt_bias, norm_w):
            x = ops.rms_norm(m, nw, 1e-6)
            qkv, z, b, a = ops.linear(x, w).split(self.sizes, dim=-1)
            y, new_conv, new_rec = ops.gdn_decode_step_norm(qkv, a, b, z, conv, rec, slots, conv_w, A_log, dt_bias,
                                                            norm_w, self.HK, 1e-6)
            conv.index_copy_(0, slots, new_conv)
            rec.index_copy_(0, slots, new_rec)
            return y, qkv * 2
    inputs = layer_inputs(1, 3, H, HK, HV, K, V, torch.float32, 4)
    ep = torch.export.export(Shared(HK, HV, K, V, False), tuple(t.clone() for t in inputs), strict=False)
    ep = ep.run_decompositions(decompositions("cuda"))
    assert fold_state_writes(ep) == 1
    assert fold_conv_updates(ep) == 0


AOTI_SCRIPT = """
import logging, re, sys, tempfile, zipfile, torch
sys.path.insert(0, {tests!r})
import test_fold_conv as t
from triton_env import package_copies
from onegraph.custom_ops import PYTHON_CALLS

""" + CATCH_KERNEL_WARNINGS + """
HK, HV, K, V, H = 16, 32, 128, 128, 2048          # Qwen3.5-35B-A3B's GDN layer
from pathlib import Path
from onegraph.export.aoti import lower_aoti
for norm in (True, False):
    inputs = t.layer_inputs(1, 3, H, HK, HV, K, V, torch.bfloat16, 2)
    before, ep, folded, hist = t.export_layer(inputs, HK, HV, K, V, norm)
    assert folded == 1, hist
    path = str(lower_aoti(ep, Path(tempfile.mkdtemp()) / "layer.pt2"))
    z = zipfile.ZipFile(path)
    src = "\\n".join(z.read(n).decode(errors="ignore") for n in z.namelist() if n.endswith(".cpp"))
    ours = set(re.findall(r"\\b(_(?:gemv|gdn_decode|conv_update|gated_rms_norm|rms_norm)_kernel)", src))
    glue = sorted(set(re.findall(r"\\btriton_[a-z]+_fused\\w*", src)))
    print(f"norm={{norm}} kernels:", sorted(ours), glue)
    expected = {{"_gemv_kernel", "_gdn_decode_kernel", "_gated_rms_norm_kernel"}} | (set() if norm else {{"_rms_norm_kernel"}})
    assert ours == expected, f"compiled {{sorted(ours)}}, expected {{sorted(expected)}}"
    assert not glue, f"Inductor kernels (a write-back, a copy of a view or of the state): {{glue}}"
    assert "proxy_executor_call_function(" not in src, "an op is called back through Python (proxy executor)"
    assert not package_copies(src), f"a copy of the state or of a view survived: {{package_copies(src)[:6]}}"
    assert not [w for w in warnings if "assuming every input is mutated" in w], warnings
    pkg = torch._inductor.aoti_load_package(path)
    before_pkg = torch._inductor.aoti_load_package(str(lower_aoti(before, Path(tempfile.mkdtemp()) / "b.pt2")))
    for i, ((ref, ref_in), (got, got_in)) in enumerate(t.run_steps([before_pkg, pkg], inputs, 3, 7)):
        torch.cuda.synchronize()
        # the same GEMV sums (one compiled tile), the conv on the value it stored: bit for bit or one bf16 ulp
        t.assert_same(got, ref, f"norm={{norm}} step {{i}} outputs", 2e-2)
        t.assert_same(got_in[4:5], ref_in[4:5], f"norm={{norm}} step {{i}} conv state", 2e-2)
        t.assert_same(got_in[5:6], ref_in[5:6], f"norm={{norm}} step {{i}} recurrent state", 1e-3)
        d = max((a.float() - b.float()).abs().max().item() for a, b in zip(got + got_in[4:6], ref + ref_in[4:6]))
        print(f"norm={{norm}} step {{i}}: max difference folded vs unfolded package {{d:.3g}}")
print("AOTI OK")
"""


@pytest.mark.cuda
@pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a CUDA device and triton")
def test_aoti_package_has_no_conv_kernel(tmp_path):
    """35B GDN layer at batch 1, both in_proj forms: the folded layer compiled by lower_aoti launches the GEMV, the
    step and the gated norm (the first-layer form also its rms_norm), no conv kernel, no write-back, no copy,
    no Python call; over 3 steps it gives the unfolded package's outputs and states."""
    run_package_script(tmp_path / "aoti.py", AOTI_SCRIPT, "AOTI OK")
