"""Batch-invariant lowering of linear (contract: custom_ops/linear.py; export --batch-invariant).

linear.py sums a row with fp32 FMA into a [BN, BK] accumulator at M = 1, with tl.dot (tensor cores) at
1 < M <= GEMV_MAX_M, and with cuBLAS above: a row's bits depend on how many rows share the launch (the padding
rows of a decode bucket included). Here every M, M = 1 included, takes linear.py's tl.dot path in tiles of
16 rows (x [16, BK] . w-tile [BN, BK].T, fp32 accumulation, rows past M masked to 0) with the tile of
linear.tile(GEMV_MAX_M, K): a row's products and their summation order are those of the MMA instructions of one
fixed tile, which read no other row, so its bits do not depend on M. Above 16 rows the grid repeats the 16-row
tiles (linear.gemv's MT): a weight tile's row-tile programs run side by side, so it comes from DRAM once and from
L2 for the others. The tile depends on K only, so a column's sum does not depend on N either (the concatenated
projections, models/qwen3_5/fuse.py, stay exact). At M = 1 this costs the dot tile's time against the FMA GEMV's
(docs/design.md, "Batch invariance").
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _registry
from ..linear import _validate
from .linear import gemv


def gemv_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T, every row by the fixed 16-row tl.dot tile (module docstring) -> [M, N] in x.dtype."""
    return gemv(x, w, row_tiles=True)


@triton_op("onegraph::linear_invariant_triton", mutates_args=())
def linear_invariant_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _validate(x, w)
    return gemv_rows(x, w)


_registry.register_lowering("linear", _registry.INVARIANT, torch.ops.onegraph.linear_invariant_triton.default)
