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


def lowered(mod, rows, dtype=torch.float32):
    g = torch.Generator().manual_seed(rows)
    args = (torch.randn(rows, K, generator=g).to(dtype).to(DEVICE), torch.randn(rows, K, generator=g).to(dtype).to(DEVICE),
            (torch.randn(K, generator=g) * 0.1).to(dtype).to(DEVICE), torch.randn(N, K, generator=g).to(dtype).to(DEVICE))
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


@pytest.mark.parametrize("mod,rows", [(TwoReaders(), 1), (OneReader(), 2)], ids=["two_readers", "two_rows"])
def test_leaves_other_patterns(mod, rows):
    ep, _ = lowered(mod, rows)
    assert fold_input_norms(ep) == 0
    assert "onegraph::add_rms_norm_triton" in check_lowered(ep, "cuda")
