"""Fold a layer's input norm into the projection that reads it (CUDA/XPU lowering, one-row graphs).

Between two decoder layers the model computes `x, h = add_rms_norm(mlp_out, h, next_norm_w, eps)` and the
next layer's token mixer starts with one projection of x (the concatenated GDN in_proj, or attention's
[q; k; v]; graphs/fuse.py). Lowered as such at batch 1, the norm is a kernel of its own: a launch and a
kernel boundary for a few KB (35B: 39 a step, ~2.2 us each on the H200). After the Triton lowering is in
the graph, this pass rewrites

    normed, h' = onegraph.add_rms_norm_triton(x, res, nw, eps);  y = onegraph.linear_triton(normed, W)

into `y, _, h' = onegraph.add_rms_norm_linear_triton(x, res, nw, eps, W)`, whose GEMV makes the normed
row in registers (custom_ops/triton/linear.py, REGS). Same values by the ops' contracts (add_rms_norm_linear
is add_rms_norm then linear); the GEMV sums in its norm-row tile's order, another order than the plain
GEMV's, as any tile change. Only that exact pattern is rewritten: one row (decode at batch 1: larger
batches keep the norm kernel, whose rows the fused op would write once per program), the normed rows
read by that one projection and nothing else, a float weight of at most MAX_ROWS rows. Everything else
keeps its ops: the first layer's plain rms_norm, and the final norm before lm_head (248,320 rows at 35B,
a 225 us GEMV already at copy bandwidth with its own tile, where the norm kernel is 1 %).
"""
from __future__ import annotations

import operator

import torch

ADD_NORM = "onegraph::add_rms_norm_triton"
LINEAR = "onegraph::linear_triton"
MAX_ROWS = 65536


def _qualname(target) -> str | None:
    return f"{target.namespace}::{target._opname}" if isinstance(target, torch._ops.OpOverload) else None


def fold_input_norms(ep: torch.export.ExportedProgram) -> int:
    """Rewrites `ep` in place (see the module docstring); returns how many norms were folded."""
    graph = ep.graph
    fused_op = torch.ops.onegraph.add_rms_norm_linear_triton.default
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or _qualname(node.target) != ADD_NORM or len(node.args) != 4 or node.kwargs:
            continue                                  # (x, residual, weight, eps), all positional as export writes
        outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if len(outs) != len(node.users) or 0 not in outs:
            continue
        normed = outs[0]
        rows = normed.meta["val"].shape[0]
        if not (isinstance(rows, int) and rows == 1) or len(normed.users) != 1:   # a symbolic batch: not folded
            continue
        lin = next(iter(normed.users))
        if _qualname(lin.target) != LINEAR or lin.args[0] is not normed or lin.kwargs:
            continue
        weight = lin.args[1]
        w_val = weight.meta["val"]
        if w_val.dtype != normed.meta["val"].dtype or w_val.shape[0] > MAX_ROWS:
            continue
        with graph.inserting_before(node):            # its inputs are node's and a weight: all defined by here
            fused = graph.call_function(fused_op, (*node.args, weight))
            y, h = (graph.call_function(operator.getitem, (fused, i)) for i in (0, 2))
        h_val = outs[1].meta["val"] if 1 in outs else node.meta["val"][1]
        fused.meta["val"] = (lin.meta["val"], normed.meta["val"], h_val)
        y.meta["val"], h.meta["val"] = lin.meta["val"], h_val
        for n in (fused, y, h):
            n.meta["stack_trace"] = node.meta.get("stack_trace")
            n.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
        lin.replace_all_uses_with(y)
        if 1 in outs:
            outs[1].replace_all_uses_with(h)
        for dead in (lin, *outs.values(), node):
            graph.erase_node(dead)
        folded += 1
    if folded:
        graph.lint()
        ep.graph_module.recompile()
    return folded
