"""Batch-invariant lowering of gdn_decode_steps (contract: custom_ops/gdn_decode_steps.py; export --batch-invariant
with --speculative-tokens): a speculative verify's GDN layer. gdn_decode_steps.py tiles a value head's state with
gdn_decode_step.block_v(B, ...), whose V tile sets the order of the sums over K; here every B takes B = 1's tile,
so a slot's K + 1 positions compute the same sums whatever the other slots in the round. Programs read their own
slot's rows only (grid (B, HV, V tiles)).
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _registry
from ..gdn_decode_steps import _validate
from .gdn_decode_steps import run


@triton_op("onegraph::gdn_decode_steps_invariant_triton", mutates_args=())
def gdn_decode_steps_invariant_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor,
                                      rec_state: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                                      A_log: torch.Tensor, dt_bias: torch.Tensor,
                                      num_k_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _validate(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads)
    return run(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads, plan_rows=1)


_registry.register_lowering("gdn_decode_steps", _registry.INVARIANT,
                            torch.ops.onegraph.gdn_decode_steps_invariant_triton.default)
