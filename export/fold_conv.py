"""Fold a GDN layer's conv update into the projection that feeds it (CUDA/XPU lowering, one-row graphs).

After export/inplace.py and export/fold_norm.py, a batch-1 GDN decode layer is

    P = onegraph.add_rms_norm_linear_triton(x, res, nw, eps, W)   (the first layer: linear_triton(x, W))
    qkv, z, b, a = aten.split_with_sizes(P[0], [C, ...], -1)
    y, conv', rec' = auto_functionalized_v2(onegraph.gdn_decode_step_norm_inplace_triton, qkv, a, b, z,
                                            conv, rec, slots, conv_w, ..., _all_bases=[conv, rec])

and its Triton lowering launches the projection GEMV, then the conv update (grid (B, C / 64)), the step and
the gated norm. The conv's programs own channels, and so do the GEMV's: this pass rewrites the layer into

    P', conv' = auto_functionalized_v2(onegraph.add_rms_norm_linear_conv_inplace_triton, x, res, nw, eps, W,
                                       conv, slots, conv_w, _all_bases=[conv])
    qkv', z, b, a = aten.split_with_sizes(P'[0], [C, ...], -1)              (qkv' convolved)
    y, rec' = auto_functionalized_v2(onegraph.gdn_step_norm_inplace_triton, qkv', a, b, z, rec, slots, ...,
                                     _all_bases=[rec])

(custom_ops/triton/linear_conv.py, gdn_decode_step_norm.py): the conv + SiLU in the GEMV's epilogue, the
state row shifted in place there, one launch a layer fewer (35B: 30 a step). Same values by the ops'
contracts: the projection's columns >= C are untouched, its first C columns are read by the step alone.
Only that exact pattern is rewritten (one row, a float projection, the qkv part only read by the step, the
conv state a graph input); FP8 projections and larger batches keep the conv kernel. The ops put here are
in-place twins in the functional form, inlined for AOTInductor by export/inplace.py's pre-grad pass.
"""
from __future__ import annotations

import operator

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

from .inplace import _qualname, rename_outputs

STEP = "onegraph::gdn_decode_step_norm_inplace_triton"
# projection op -> (its conv twin, how many outputs it has: 1 = a bare tensor)
PROJ = {"onegraph::linear_triton": ("linear_conv_inplace_triton", 1),
        "onegraph::add_rms_norm_linear_triton": ("add_rms_norm_linear_conv_inplace_triton", 3)}
TWINS = {"onegraph::linear_conv_inplace_triton", "onegraph::add_rms_norm_linear_conv_inplace_triton",
         "onegraph::gdn_step_norm_inplace_triton"}


def conv_op_names() -> set[str]:
    """The qualified names this pass may put in a graph (export's allow-list)."""
    return set(TWINS)


def _op(name: str):
    return getattr(torch.ops.onegraph, name).default


def _projection(qkv):
    """(P, y) if qkv is the first part of split_with_sizes(y, sizes, -1 | 1) of a one-row projection y of P
    whose split is y's only reader and qkv the step's only input from it; else None."""
    if qkv.op != "call_function" or qkv.target is not operator.getitem or qkv.args[1] != 0 or len(qkv.users) != 1:
        return None
    split = qkv.args[0]
    if split.target is not torch.ops.aten.split_with_sizes.default or split.args[2] not in (-1, 1):
        return None
    y = split.args[0]
    if len(y.users) != 1 or y.meta["val"].dim() != 2 or y.meta["val"].shape[0] != 1:
        return None
    p = y.args[0] if y.target is operator.getitem and y.args[1] == 0 else y
    spec = PROJ.get(_qualname(p.target)) if p.op == "call_function" else None
    if spec is None or p.kwargs or (spec[1] == 1) != (p is y):
        return None
    return p, y


def _hoist(node, before, order) -> bool:
    """Moves node (and, first, its inputs) before `before` if it is computed after it; only pure aten ops and
    getitems move. False if some input cannot."""
    if not isinstance(node, torch.fx.Node) or order[node] < order[before]:
        return True
    if node.op != "call_function" or not (isinstance(node.target, torch._ops.OpOverload)
                                          and node.target.namespace == "aten"):
        return False
    if not all(_hoist(a, before, order) for a in node.all_input_nodes):
        return False
    before.prepend(node)
    order[node] = order[before] - 0.5
    return True


def fold_conv_updates(ep: torch.export.ExportedProgram) -> int:
    """Rewrites `ep` in place (see the module docstring); returns how many conv updates were folded."""
    graph = ep.graph
    renamed: dict[str, str] = {}
    folded = 0
    for af in list(graph.nodes):
        if af.op != "call_function" or af.target is not auto_functionalized_v2 or _qualname(af.args[0]) != STEP:
            continue
        kw = dict(af.kwargs)
        found = _projection(kw["qkv"])
        items = {u.args[1]: u for u in af.users if u.target is operator.getitem}
        bases = kw["_all_bases"]
        conv, rec = bases[kw["_conv_state_base_index"]], bases[kw["_rec_state_base_index"]]
        if found is None or len(items) != len(af.users) or conv.op != "placeholder":
            continue
        p, y = found
        C = kw["conv_weight"].meta["val"].shape[0]
        if kw["qkv"].meta["val"].shape[-1] != C:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        if not all(_hoist(kw[k], p, order) for k in ("slots", "conv_weight")):
            continue
        twin, n_out = PROJ[_qualname(p.target)]
        with graph.inserting_before(p):
            pc = graph.call_function(auto_functionalized_v2, (_op(twin),), {
                **dict(zip([a.name for a in p.target._schema.arguments], p.args)),
                "slots": kw["slots"], "conv_weight": kw["conv_weight"], "_conv_state_base_index": 0,
                "_all_bases": [conv]})
            pc_items = [graph.call_function(operator.getitem, (pc, i)) for i in range(n_out + 1)]
        p_vals = (p.meta["val"],) if n_out == 1 else tuple(p.meta["val"])
        conv_val = items[1 + kw["_conv_state_base_index"]].meta["val"] if 1 + kw["_conv_state_base_index"] in items \
            else conv.meta["val"]
        pc.meta["val"] = (*p_vals, conv_val)
        for n, v in zip(pc_items, pc.meta["val"]):
            n.meta["val"] = v
        with graph.inserting_before(af):
            step_kw = {k: v for k, v in kw.items() if k in ("a", "b", "z", "slots", "A_log", "dt_bias", "norm_weight",
                                                             "num_k_heads", "eps")}
            step = graph.call_function(auto_functionalized_v2, (_op("gdn_step_norm_inplace_triton"),), {
                "xc": kw["qkv"], **step_kw, "_rec_state_base_index": 0, "_all_bases": [rec]})
            step_items = [graph.call_function(operator.getitem, (step, i)) for i in range(2)]
        rec_i = 1 + kw["_rec_state_base_index"]
        step.meta["val"] = (items[0].meta["val"] if 0 in items else af.meta["val"][0],
                            items[rec_i].meta["val"] if rec_i in items else rec.meta["val"])
        for n, v in zip(step_items, step.meta["val"]):
            n.meta["val"] = v
        for n in (pc, *pc_items, step, *step_items):
            n.meta["stack_trace"] = af.meta.get("stack_trace")
            n.meta["nn_module_stack"] = af.meta.get("nn_module_stack")
        # the projection's outputs: P itself (linear) or its getitems; then the step's y, conv' and rec'
        if n_out == 1:
            p.replace_all_uses_with(pc_items[0])
        else:
            for u in list(p.users):
                u.replace_all_uses_with(pc_items[u.args[1]])
                graph.erase_node(u)
        for idx, new in ((0, step_items[0]), (1 + kw["_conv_state_base_index"], pc_items[n_out]), (rec_i, step_items[1])):
            if idx in items:
                renamed[items[idx].name] = new.name
                items[idx].replace_all_uses_with(new)
        for dead in (*items.values(), af, p):
            graph.erase_node(dead)
        folded += 1
    if folded:
        rename_outputs(ep, renamed)
    return folded
