"""Model families. Each lives in a folder `models/<family>/` whose `__init__` defines `FAMILY`, a `Family`:
its config mapping from the hub's config.json, its `nn.Module` written for tracing (explicit state:
`state_spec`, `decode`, `prefill`), its tensor-parallel plan, its projection fusion and its MTP head. The
loader (checkpoint/load.py) reaches a model only through `family_of(model_type)`; the exporter and the
runtime take the module it returns. Adding a family is adding a folder and naming it in `PACKAGES`."""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

PACKAGES = ("qwen3_5",)                    # the folders under models/ that hold a family
_REGISTERED: dict[str, "Family"] = {}      # families defined outside models/ (register())


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]        # config.json `model_type` values it reads (the outer and the text one)
    config: type                        # frozen dataclass: from_hf(dict), from_dict(dict), to_dict(), .model_type
    model: type                         # nn.Module(cfg, tp=1, group=None, fp32_reduce=False); rope_inv_freq(cfg)
    shard_state_dict: Callable          # (TP-1 state dict, cfg, rank, tp) -> rank's state dict
    check_divisible: Callable           # (cfg, tp) -> None; ValueError when the heads do not split over tp
    fuse_projections: Callable          # (model) -> None: same-input projections concatenated, after sharding
    attach_mtp: Callable | None = None  # (model, checkpoint dir, tp) -> the MTP head as model.mtp; None: no head
    # (fused model) -> {"<module>.<fused name>": {"<a layer's launches>": layers}}: the artifact manifest's
    # `projection_groups` (how the fused projections run, e.g. an FP8 run with a float tail in one launch); None: none
    projection_groups: Callable | None = None


def register(family: Family) -> None:
    """Make a family defined outside models/ loadable (a test's); its model types must be new."""
    taken = {t for f in families().values() for t in f.model_types} & set(family.model_types)
    if taken:
        raise ValueError(f"model family {family.name}: model types {sorted(taken)} belong to another family")
    _REGISTERED[family.name] = family


def families() -> dict[str, Family]:
    out = {name: importlib.import_module(f"onegraph.models.{name}").FAMILY for name in PACKAGES}
    return {**out, **_REGISTERED}


def family_of(model_type: str | None) -> Family:
    """The family that reads config.json's `model_type`; ValueError naming every accepted one."""
    for f in families().values():
        if model_type in f.model_types:
            return f
    accepted = sorted(t for f in families().values() for t in f.model_types)
    raise ValueError(f"config field 'model_type': unsupported {model_type!r}; expected one of {accepted}")
