"""export/fold_norm.py on small hand-built graphs (the whole tiny model: tests/test_triton_model.py): the
pattern it folds, add_rms_norm whose normed rows feed one float projection at one row, and the ones it
must leave alone. Values: the folded program against the unfolded one on the same inputs."""
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


def lowered(mod, rows, dtype=torch.float32, extra=False):
    """-> (mod exported and lowered for CUDA, its inputs): m, h [rows, K], norm weight [K], w [N, K] (extra: and
    an e4m3 weight [N, K] with its one block scale)."""
    g = torch.Generator().manual_seed(rows)
    args = tuple(t.to(dtype).to(DEVICE) for t in (torch.randn(rows, K, generator=g), torch.randn(rows, K, generator=g),
                                                  torch.randn(K, generator=g) * 0.1, torch.randn(N, K, generator=g)))
    if extra:
        args += ((torch.randn(N, K, generator=g) * 8).to(torch.float8_e4m3fn).to(DEVICE),
                 torch.full((1, 1), 0.01).to(DEVICE))
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
