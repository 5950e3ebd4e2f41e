"""Lower an ExportedProgram with AOTInductor into a .pt2 package *without* weights.

`package_constants_in_so=False`: the weights live once in the artifact's weights.safetensors and
are bound to every graph at load (`load_constants(..., user_managed=True)`), so N graphs cost one
copy of the weights, on disk and in memory.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch._inductor import aoti_compile_and_package

INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False}


def lower_aoti(ep: torch.export.ExportedProgram, out: Path) -> Path:
    return Path(aoti_compile_and_package(ep, package_path=str(out), inductor_configs=dict(INDUCTOR_CONFIGS)))
