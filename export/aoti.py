"""Lower an ExportedProgram with AOTInductor into a .pt2 package *without* weights.

`package_constants_in_so=False`: the weights live once in the artifact's weights.safetensors and
are bound to every graph at load (`load_constants(..., user_managed=True)`), so N graphs cost one
copy of the weights, on disk and in memory.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch._inductor import aoti_compile_and_package
from torch.fx.experimental import proxy_tensor

from .inplace import InlineInplaceTwins

INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False}
# Tensor parallel: no weight's value may reach the generated code, so that one rank's package runs every rank's
# weights (export compiles each graph once, not once per rank; docs/design.md "Export: one compile serves every TP
# rank"). Inductor otherwise writes 0-d weights and 1-d weights of up to 8 elements into the kernels as literals,
# and folds a weight-only subgraph whose result is uniform (e.g. -exp(A_log) of a rank holding one GDN head) into
# a literal too.
RANK_INDEPENDENT = {"always_keep_tensor_constants": True, "joint_graph_constant_folding": False}


def inductor_configs(tp: int) -> dict:
    """The Inductor configs an export at tensor-parallel degree tp compiles with (recorded in its manifest)."""
    return dict(INDUCTOR_CONFIGS, **(RANK_INDEPENDENT if tp > 1 else {}))


def lower_aoti(ep: torch.export.ExportedProgram, out: Path, eager_rounding: bool = True, tp: int = 1) -> Path:
    """eager_rounding: Inductor rounds every intermediate to the model dtype where eager would
    (`emulate_precision_casts`). Without it, fused bf16 kernels keep fp32 intermediates: more
    precise, but measured on `tiny` bf16 the first token already differed from eager (logits off by
    1.36 vs 0.035 with it), so parity with the eager reference needs it. tp: inductor_configs(tp)."""
    # the in-place twins export put in (export/inplace.py) are called directly, so they compile to their kernels
    cfg = dict(inductor_configs(tp), emulate_precision_casts=eager_rounding, pre_grad_custom_pass=InlineInplaceTwins())
    try:
        return Path(aoti_compile_and_package(ep, package_path=str(out), inductor_configs=cfg))
    finally:
        release_last_trace()


def release_last_trace() -> None:
    """Drop what torch's export tracing keeps of its last trace. Its fake-tensor -> node map is a module global
    (torch.fx.experimental.proxy_tensor), cleared when the next trace starts, not when one ends; its nodes hold
    the traced graph and, through it, the module with the real weights. A lowering worker that received the
    weights from the exporting process (CUDA IPC) must free them before it exits, or that process warns at its
    exit "Producer process has been terminated before all shared CUDA tensors released"."""
    leftover = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if leftover is not None:
        leftover.clear()
