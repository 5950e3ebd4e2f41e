"""export/fold_norm.py on small hand-built graphs (the whole tiny model: tests/test_triton_model.py): the
pattern it folds, add_rms_norm whose normed rows feed one float projection at one row (or a block-FP8 one,
with or without its float tail), and the ones it must leave alone. Values: the folded program against the unfolded one on the same inputs."""
import pytest
import torch
from triton_env import DEVICE, needs_triton

from onegraph.custom_ops import decompositions
from onegraph.export.fold_norm import fold_input_norms
from onegraph.export.trace import check_lowered

pytestmark = needs_triton
ops = torch.ops.onegraph
K, N = 48, 40


class OneReader(torch.nn.Module):
    def forward(self, m, h, nw, w):
        x, h = ops.add_rms_norm(m, h, nw, 1e-6)
        return ops.linear(x, w), h


class TwoReaders(torch.nn.Module):
    def forward(self, m, h, nw, w):
        x, h = ops.add_rms_norm(m, h, nw, 1e-6)
        return ops.linear(x, w), ops.linear(x, w[:8]), h


def lowered(mod, rows, dtype=torch.float32, extra=False, tail=False):
    """-> (mod exported and lowered for CUDA, its inputs): m, h [rows, K], norm weight [K], w [N, K] (extra: and
    an e4m3 weight [N, K] with its one block scale; tail: and a float weight [8, K])."""
    g = torch.Generator().manual_seed(rows)
    args = tuple(t.to(dtype).to(DEVICE) for t in (torch.randn(rows, K, generator=g), torch.randn(rows, K, generator=g),
                                                  torch.randn(K, generator=g) * 0.1, torch.randn(N, K, generator=g)))
    if extra:
        args += ((torch.randn(N, K, generator=g) * 8).to(torch.float8_e4m3fn).to(DEVICE),
                 torch.full((1, 1), 0.01).to(DEVICE))
    if tail:
        args += (torch.randn(8, K, generator=g).to(dtype).to(DEVICE),)
    with torch.no_grad():
        ep = torch.export.export(mod, args, strict=False).run_decompositions(decompositions("cuda"))
    return ep, args


def test_folds_one_row_one_reader_and_keeps_the_values():
    ep, args = lowered(OneReader(), 1)
    before = ep.module()(*args)
    assert fold_input_norms(ep) == 1
    hist = check_lowered(ep, "cuda")
    assert "onegraph::add_rms_norm_triton" not in hist and "onegraph::linear_triton" not in hist, hist
    assert hist.get("onegraph::add_rms_norm_linear_triton") == 1, hist
    after = ep.module()(*args)
    assert torch.equal(after[1], before[1])                          # h: the same sum
    assert torch.allclose(after[0], before[0], rtol=1e-5, atol=1e-5)  # y: another summation order


def test_two_readers_the_widest_takes_the_norm_the_other_reads_its_normed_rows():
    ep, args = lowered(TwoReaders(), 1)
    before = ep.module()(*args)
    assert fold_input_norms(ep) == 1
    hist = check_lowered(ep, "cuda")
    assert hist.get("onegraph::add_rms_norm_linear_triton") == 1 and hist.get("onegraph::linear_triton") == 1, hist
    wide = next(n for n in ep.graph.nodes if "add_rms_norm_linear" in str(n.target))
    assert wide.args[4].meta["val"].shape[0] == N                    # the 40-row weight, not the 8-row slice
    after = ep.module()(*args)
    assert torch.equal(after[2], before[2])
    for a, b in zip(after[:2], before[:2]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_leaves_two_rows():
    ep, _ = lowered(OneReader(), 2)
    assert fold_input_norms(ep) == 0
    assert "onegraph::add_rms_norm_triton" in check_lowered(ep, "cuda")


class Fp8Reader(torch.nn.Module):
    """An FP8 model's GDN in_proj: an e4m3 run and a float run read the same normed row."""
    def forward(self, m, h, nw, w, w8, s8):
        x, h = ops.add_rms_norm(m, h, nw, 1e-6)
        return ops.linear_fp8(x, w8, s8), ops.linear(x, w[:8]), h


def test_fp8_projection_takes_the_norm():
    ep, args = lowered(Fp8Reader(), 1, extra=True)
    before = ep.module()(*args)
    assert fold_input_norms(ep) == 1
    hist = check_lowered(ep, "cuda")
    assert hist.get("onegraph::add_rms_norm_linear_fp8_triton") == 1 and hist.get("onegraph::linear_triton") == 1
    assert "onegraph::add_rms_norm_triton" not in hist and "onegraph::linear_fp8_triton" not in hist, hist
    after = ep.module()(*args)
    assert torch.equal(after[2], before[2])
    for a, b in zip(after[:2], before[:2]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


class Fp8TailReader(torch.nn.Module):
    """An FP8 model's GDN in_proj as models/qwen3_5/fuse.py makes it: the e4m3 run with the float rows as its tail."""
    def forward(self, m, h, nw, w, w8, s8, tail):
        x, h = ops.add_rms_norm(m, h, nw, 1e-6)
        return ops.linear_fp8(x, w8, s8, tail), h


def test_fp8_projection_takes_the_norm_with_its_tail():
    """One reader of the normed row: the fused op carries the tail, and no projection is left in the graph."""
    ep, args = lowered(Fp8TailReader(), 1, extra=True, tail=True)
    before = ep.module()(*args)
    assert fold_input_norms(ep) == 1
    hist = check_lowered(ep, "cuda")
    assert hist.get("onegraph::add_rms_norm_linear_fp8_triton") == 1, hist
    assert not {"onegraph::add_rms_norm_triton", "onegraph::linear_fp8_triton", "onegraph::linear_triton"} & set(hist)
    fused = next(n for n in ep.graph.nodes if "add_rms_norm_linear_fp8" in str(n.target))
    assert len(fused.args) == 7 and tuple(fused.args[6].meta["val"].shape) == (8, K)     # (x, res, nw, eps, w, s, tail)
    after = ep.module()(*args)
    assert after[0].shape == (1, N + 8) and torch.equal(after[1], before[1])
    assert torch.allclose(after[0], before[0], rtol=1e-5, atol=1e-5)


class ComputedWeight(torch.nn.Module):
    def forward(self, m, h, nw, w):
        x, h = ops.add_rms_norm(m, h, nw, 1e-6)
        return ops.linear(x, w[:8]), h


def test_leaves_a_projection_whose_weight_is_computed_in_the_graph():
    """The fused op takes the norm's place: a weight made after it (here a slice) cannot move there."""
    ep, _ = lowered(ComputedWeight(), 1)
    assert fold_input_norms(ep) == 0
    assert "onegraph::add_rms_norm_triton" in check_lowered(ep, "cuda")


def test_fp8_tiny_decode_graph_has_one_projection_per_gdn_input():
    """The FP8 tiny model's one-row decode graph as export traces it (models/qwen3_5/fuse.py's Fp8WithTail): every
    GDN layer's in_proj is one launch, the e4m3 [qkv; z] rows with the float [b; a] tail; after layer 0 (whose
    input norm is a plain rms_norm) the fold takes the norm and the tail with it. Attention's [q; k] + [v] (k is
    half a block on tiny) stays two FP8 launches, the wider one folded. (Values: the op tests and the hand-built
    graphs above; the whole FP8 model through the kernels costs a minute in the interpreter.)"""
    from onegraph.checkpoint.load import load_model
    from onegraph.export.entry import dynamic_shapes, entry_module, example_inputs, graph_spec
    _, model, _ = load_model("tiny", "float32", quant="fp8")
    spec = graph_spec(model, "decode", 1, 64, torch.float32)
    with torch.no_grad():
        ep = torch.export.export(entry_module(model, "decode"), example_inputs(spec, "cpu"),
                                 dynamic_shapes=dynamic_shapes(spec), strict=False)
        ep = ep.run_decompositions(decompositions("cuda"))
    n_gdn = sum(k == "linear_attention" for k in model.cfg.layer_types)
    assert fold_input_norms(ep) == len(model.cfg.layer_types)          # layers 1.. and the final norm (lm_head)
    hist = check_lowered(ep, "cuda")
    assert "onegraph::add_rms_norm_triton" not in hist, hist

    def projections(qualname):
        return [n for n in ep.graph.nodes if n.op == "call_function" and qualname in str(n.target)]
    with_tail = [n for n in projections("onegraph.add_rms_norm_linear_fp8_triton") if len(n.args) == 7]
    unfolded = [n for n in projections("onegraph.linear_fp8_triton") if len(n.args) == 4]
    assert len(with_tail) == n_gdn - 1 and len(unfolded) == 1                  # layer 0's in_proj, not folded
    hv = model.cfg.linear_v_heads
    for n in with_tail + unfolded:
        y = n.meta["val"][0] if isinstance(n.meta["val"], tuple) else n.meta["val"]           # (y, normed, h) or y
        assert tuple(y.shape) == (1, sum(model.layers[1].linear_attn.fused_sizes))         # [qkv; z; b; a]
        assert n.args[-1].meta["val"].shape[0] == 2 * hv                    # the tail: [b; a]
    assert not [n for n in projections("onegraph.linear_triton") if n.args[0].meta["val"].shape[-1] ==
                model.cfg.hidden_size and n.args[1].meta["val"].shape[0] == 2 * hv]   # no [b; a] launch of its own
