"""The op registry: every onegraph op, its schema version, its reference and its lowerings.

An op is `torch.library.custom_op("onegraph::<name>")`, functional (returns new state, mutates
nothing: ops declared with `mutates_args` hide from `run_decompositions`, see docs/design.md). Its eager
implementation is the pure-torch reference, wrapped in a counter: an exported artifact must never
call it (that would be a Python callback on every run), and tests assert the counter stays 0.

Lowerings per device: "decompose" means export replaces the op by its reference traced to aten,
which AOTInductor compiles to C++ (CPU) or Triton (CUDA). "triton" means export replaces the op by
`onegraph::<name>_triton`, a `torch.library.triton_op` whose hand-written kernels AOTInductor
compiles into the artifact (custom_ops/triton/, registered through `register_lowering`). "aten" means
export replaces the op by another pure-aten function its own file registers (an aten op with no CPU
kernel, say). A device
with no lowering, or whose lowering is not registered (triton not installed), fails closed in
`decompositions()`.

Batch invariance (`export --batch-invariant`, docs/design.md "Batch invariance"): an op whose Triton lowering
picks its reduction plan from the number of rows in the launch registers a second lowering, "triton_invariant"
(`onegraph::<name>_invariant_triton`: every row computed with the one-row plan, whatever the batch), and
`decompositions(..., batch_invariant=True)` puts that variant in the graph, so the choice is an op in the
traced program (and its manifest's op histogram), not a flag read at run time. An op known to depend on the
batch with no invariant lowering yet (BATCH_VARIANT) is refused there, naming it.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import torch

NAMESPACE = "onegraph"
# name -> number of times the Python implementation ran (eager, or a leaked Python op).
PYTHON_CALLS: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    version: int
    schema: str
    reference: Callable
    op: object                      # the CustomOpDef (callable)
    lowerings: dict                 # device type -> "decompose" | "triton"

    @property
    def overload(self) -> torch._ops.OpOverload:
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default

    @property
    def triton_name(self) -> str | None:
        """Qualified name of the triton_op a "triton" lowering puts in the graph (export's allow-list)."""
        return f"{NAMESPACE}::{self.name}_triton" if "triton" in self.lowerings.values() else None


REGISTRY: dict[str, OpSpec] = {}
# Ops whose CUDA lowering is a hand-written Triton kernel (custom_ops/triton/<file>.py). Declared here,
# not discovered, so a machine without triton fails closed instead of silently decomposing.
TRITON_CUDA_OPS = frozenset({"gdn_decode_step", "gdn_prefill", "fused_moe", "attention_decode", "attention_prefill",
                             "rms_norm", "add_rms_norm", "gated_rms_norm", "rope", "qk_norm_rope",
                             "causal_conv_update", "causal_conv_prefill", "sample", "linear", "linear_fp8",
                             "add_rms_norm_linear", "gdn_decode_step_norm", "fused_moe_fp8",
                             "add_rms_norm_linear_fp8", "gdn_decode_steps"})
# Ops whose Triton plan depends on the rows in the launch and that have no "triton_invariant" lowering yet:
# a graph traced with batch_invariant=True that holds one is refused (the export options refuse their causes
# first: a W8A8 --quant, --fp32-reduce).
BATCH_VARIANT = frozenset({"linear_w8a8_fp8", "linear_w8a8_int8", "linear_f32", "gdn_decode_step"})
INVARIANT = "triton_invariant"
# (name, how) -> callable with the op's signature that export puts in the op's place.
LOWERINGS: dict[tuple[str, str], Callable] = {}


def define_op(name: str, *, version: int, schema: str, reference: Callable, validate: Callable,
              fake: Callable, lowerings: dict | None = None):
    """Register onegraph::<name>; returns the callable op."""
    if name in REGISTRY:
        raise RuntimeError(f"op onegraph::{name} registered twice")

    def impl(*args):
        validate(*args)
        PYTHON_CALLS[name] += 1
        return reference(*args)

    def fake_impl(*args):
        validate(*args)
        return fake(*args)

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake_impl)
    if lowerings is None:
        # XPU takes the same Triton source (Intel's Triton backend); untested: no XPU is available here
        gpu = "triton" if name in TRITON_CUDA_OPS else "decompose"
        lowerings = {"cpu": "decompose", "cuda": gpu, "xpu": gpu}
    REGISTRY[name] = OpSpec(name, version, schema, reference, op, dict(lowerings))
    return op


def register_lowering(name: str, how: str, impl: Callable) -> None:
    """Called by a lowering module (custom_ops/triton/*.py) for the op it implements."""
    if name not in REGISTRY:
        raise RuntimeError(f"lowering {how!r} for unknown op onegraph::{name}")
    if (name, how) in LOWERINGS:
        raise RuntimeError(f"lowering {how!r} of onegraph::{name} registered twice")
    LOWERINGS[(name, how)] = impl


def _lowering(name: str, how: str, device_type: str) -> Callable:
    if how == "triton" and (name, how) not in LOWERINGS:
        from . import triton as kernels          # registers the Triton ops when triton is installed
        if not kernels.AVAILABLE:
            raise NotImplementedError(
                f"op onegraph::{name} needs its 'triton' lowering for device {device_type!r}, but triton "
                f"cannot be imported ({kernels.IMPORT_ERROR}); install the `cuda` extra")
    impl = LOWERINGS.get((name, how))
    if impl is None:
        raise NotImplementedError(f"op onegraph::{name}: no {how!r} lowering registered for device {device_type!r}")
    return impl


def schema_versions() -> dict[str, int]:
    """Recorded in the artifact manifest; the runtime refuses an artifact whose versions differ."""
    return {n: s.version for n, s in sorted(REGISTRY.items())}


KERNEL_CHOICES = ("auto", "reference")


def _refuse_batch_variant(name: str) -> Callable:
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"onegraph::{name} has no batch-invariant lowering yet (its Triton plan depends "
                                  f"on the rows in the launch): export --batch-invariant cannot use it")
    return refuse


def decompositions(device_type: str, kernels: str = "auto", batch_invariant: bool = False) -> dict:
    """Decomposition table for `ExportedProgram.run_decompositions`; fails closed per device.

    kernels="auto": each op's registered lowering for the device (hand-written Triton on CUDA);
    kernels="reference": every op traced from its pure-torch reference (Inductor writes the kernels) —
    an explicit export option, recorded in the manifest, never a silent fallback.
    batch_invariant: each op's "triton_invariant" lowering where it has one (module docstring); an op in
    BATCH_VARIANT raises if the traced graph holds it. Needs kernels="auto" on a GPU device (Inductor's and
    aten's kernels, the CPU ones included, pick their plans from the shapes)."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if batch_invariant and (kernels != "auto" or device_type == "cpu"):
        raise ValueError("batch_invariant needs the hand-written kernels (kernels='auto') on a GPU device, "
                         f"got kernels={kernels!r} on {device_type!r}")
    table = {}
    for spec in REGISTRY.values():
        how = spec.lowerings.get(device_type)
        if how is None:
            raise NotImplementedError(f"op onegraph::{spec.name} has no lowering for device {device_type!r}")
        if how == "decompose" or kernels == "reference":
            table[spec.overload] = spec.reference
        else:
            table[spec.overload] = _lowering(spec.name, how, device_type)
        if batch_invariant and how == "triton":
            if spec.name in BATCH_VARIANT:
                table[spec.overload] = _refuse_batch_variant(spec.name)
            elif (spec.name, INVARIANT) in LOWERINGS:
                table[spec.overload] = LOWERINGS[(spec.name, INVARIANT)]
        elif batch_invariant and spec.name in BATCH_VARIANT:      # decomposed to aten: cuBLAS picks by shape
            table[spec.overload] = _refuse_batch_variant(spec.name)
    return table


def invariant_names() -> set[str]:
    """Qualified names of the batch-invariant Triton ops (export's allow-list)."""
    return {f"{NAMESPACE}::{name}_invariant_triton" for name, how in LOWERINGS if how == INVARIANT}


def check_shape(t: torch.Tensor, shape: tuple, what: str, dtype=None) -> None:
    """Raise ValueError naming `what` unless t matches `shape` (None = any size) and dtype."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what}: expected a tensor, got {type(t).__name__}")
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{what}: expected shape {want}, got {list(t.shape)}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise ValueError(f"{what}: expected dtype {dtype}, got {t.dtype}")
