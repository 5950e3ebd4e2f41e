"""Batch-invariant lowering of linear_fp8 (contract: custom_ops/linear_fp8.py; export --batch-invariant).

linear_fp8.py picks its tile from the M class: the FMA GEMV at M = 1, FMA tiles over all rows at M = 2..4 (where
measured), the 16-row tl.dot tile up to GEMV_MAX_M, larger dot tiles above: a row's bits depend on how many rows
share the launch. Here every M, M = 1 included, takes the "few" class's 16-row dot tile (tile(GEMV_MAX_M, K)): a
row's products, their per-K-tile fp32 sums and the block-scale steps are those of one fixed tile's MMA
instructions, which read no other row. Above 16 rows the grid repeats the 16-row tiles, a weight tile's M tiles
side by side (GM = their count), so it comes from DRAM once. The float tail (an FP8 model's GDN [b; a] rows)
rides in the same launch at the same tile, as in the default. At M = 1 this costs the dot tile's time against
the GEMV's (docs/design.md, "Batch invariance").
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
from torch.library import triton_op

from .. import _registry
from ..linear_fp8 import _validate
from .linear import GEMV_MAX_M
from .linear_fp8 import matmul, tile


def matmul_rows(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                tail: Optional[torch.Tensor] = None) -> torch.Tensor:
    """linear_fp8.matmul with every row by the fixed 16-row dot tile (module docstring)."""
    return matmul(x, w, scale, cfg=tile(GEMV_MAX_M, x.shape[1]), tail=tail,
                  group_m=triton.cdiv(x.shape[0], GEMV_MAX_M))


@triton_op("onegraph::linear_fp8_invariant_triton", mutates_args=())
def linear_fp8_invariant_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                                tail: Optional[torch.Tensor] = None) -> torch.Tensor:
    _validate(x, w, scale, tail)
    return matmul_rows(x, w, scale, tail)


_registry.register_lowering("linear_fp8", _registry.INVARIANT, torch.ops.onegraph.linear_fp8_invariant_triton.default)
