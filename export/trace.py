"""Trace one entry point with torch.export and lower every onegraph op for the target device.

Fails closed: after decomposition the graph may hold only aten / prims / functional-collective
ops and registered Triton ops. Anything else (a Python custom op that AOTInductor would call back
through Python on every run) raises ExportError naming it.
"""
from __future__ import annotations

import contextlib

import torch

from onegraph.custom_ops import decompositions

from .entry import GraphSpec, dynamic_shapes, entry_module, example_inputs
from .fold_norm import fold_input_norms
from .inplace import fold_state_writes, inplace_op_names
from .inplace_kv import fold_kv_writes, kv_inplace_op_names

ALLOWED_NAMESPACES = {"aten", "prims", "_c10d_functional", "c10d_functional"}


class ExportError(RuntimeError):
    pass


def allowed_extra_ops(device_type: str) -> set[str]:
    """Qualified names of custom ops that lower to compiled kernels on this device (triton_op)."""
    from onegraph.custom_ops._registry import REGISTRY, invariant_names
    if device_type == "cpu":
        return set()
    return ({getattr(s, "triton_name", None) for s in REGISTRY.values()} - {None}) | inplace_op_names() \
        | kv_inplace_op_names() | invariant_names()


def check_lowered(ep: torch.export.ExportedProgram, device_type: str) -> dict[str, int]:
    """-> op histogram; raises ExportError on any op that would run as Python."""
    extra = allowed_extra_ops(device_type)
    hist: dict[str, int] = {}
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            ns = t.namespace
            name = f"{ns}::{t._opname}"
            if ns not in ALLOWED_NAMESPACES and name not in extra:
                raise ExportError(f"graph still contains op {name} with no {device_type} lowering: it would be "
                                  f"called back through Python on every run")
        elif isinstance(t, torch._ops.HigherOrderOperator):
            name = t.name()
            inner = node.args[0] if name in ("auto_functionalized", "auto_functionalized_v2") and node.args else None
            if isinstance(inner, torch._ops.OpOverload) and f"{inner.namespace}::{inner._opname}" in extra:
                name = f"{inner.namespace}::{inner._opname}"      # an in-place twin put there by fold_state_writes
            elif name not in ("triton_kernel_wrapper_functional", "triton_kernel_wrapper_mutation"):
                raise ExportError(f"graph contains higher-order op {name} (e.g. a mutating custom op wrapped in "
                                  f"auto_functionalized); onegraph ops must be functional")
        else:
            name = getattr(t, "__name__", str(t))
        hist[name] = hist.get(name, 0) + 1
    return hist


def trace(model, spec: GraphSpec, device, kernels: str = "auto", batch: torch.export.Dim | None = None,
          fold_norms: bool = True, batch_invariant: bool = False) -> tuple[torch.export.ExportedProgram, dict]:
    """batch: a decode graph's batch dim made symbolic over that Dim's range (entry.dynamic_shapes).
    fold_norms=False (benchmarks only: the before of a before/after pair) keeps the batch-1 input norms apart.
    batch_invariant: the ops' batch-invariant Triton variants (custom_ops/_registry.py) and no norm folded into
    a projection (the fold exists at batch 1 only, and sums in another order than the norm kernel + GEMV)."""
    dev = torch.device(device)
    args = example_inputs(spec, dev)
    with torch.no_grad():
        ep = torch.export.export(entry_module(model, spec.kind, spec.k), args,
                                 dynamic_shapes=dynamic_shapes(spec, batch), strict=False)
        ep = ep.run_decompositions(decompositions(dev.type, kernels, batch_invariant))
        if dev.type != "cpu" and kernels == "auto":
            fold_state_writes(ep)          # the Triton kernels write decode state rows in place
            fold_kv_writes(ep)             # and the attention layers' KV-cache rows
            if fold_norms and not batch_invariant:
                fold_input_norms(ep)       # batch 1: a layer's input norm in its first projection's GEMV
    return ep, check_lowered(ep, dev.type)


@contextlib.contextmanager
def trace_group(tp: int):
    """A fake tp-rank default process group while tracing (functional collectives need a group to
    name; nothing runs). Yields the group name the graphs bind to."""
    import torch.distributed as dist
    if tp == 1:
        yield None
        return
    if dist.is_initialized():
        raise ValueError("export --tp N traces every rank in one process: run it without torchrun")
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
