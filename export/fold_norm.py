"""Fold a layer's input norm into the projection that reads it (CUDA/XPU lowering, one-row graphs).

Between two decoder layers the model computes `x, h = add_rms_norm(mlp_out, h, next_norm_w, eps)` and the
next layer's token mixer starts with a projection of x (the concatenated GDN in_proj, or attention's
[q; k; v]; models/qwen3_5/fuse.py). Lowered as such at batch 1, the norm is a kernel of its own: a launch and a
kernel boundary for a few KB (35B: 39 a step, ~2.2 us each on the H200). After the Triton lowering is in
the graph, this pass rewrites

    normed, h' = onegraph.add_rms_norm_triton(x, res, nw, eps);  y = onegraph.linear_triton(normed, W)

into `y, normed', h' = onegraph.add_rms_norm_linear_triton(x, res, nw, eps, W)` (a block-FP8 projection,
linear_fp8_triton(normed, W, S[, tail]): add_rms_norm_linear_fp8_triton(x, res, nw, eps, W, S[, tail]), the float
tail carried as it is), whose GEMV makes the normed row in registers (custom_ops/triton/linear.py, linear_fp8.py:
REGS). Same values by the ops' contracts (the fused op is add_rms_norm then the projection); the GEMV sums in its
norm-row tile's order, another order than the plain GEMV's, as any tile change. Only one row is folded (decode at
batch 1: larger batches keep the norm kernel, whose rows the fused op would write once per program). An FP8
model's GDN in_proj is one projection too: the e4m3 [qkv; z] run with the float [b; a] rows as its tail
(models/qwen3_5/fuse.py), whose programs multiply the same normed row. Where several ops read the normed row (runs
left apart, e.g. attention's [q; k] + [v] on tiny), the widest projection (by output columns) takes the norm and
the others read the fused op's normed output, which its program 0 writes. Projections of more than MAX_ROWS output
columns are not folded: the final norm before lm_head (248,320 rows at 35B, a 225 us GEMV already at copy
bandwidth with its own tile, where the norm kernel is 1 %). The first layer's plain rms_norm is not an
add_rms_norm and stays.
"""
from __future__ import annotations

import operator

import torch

ADD_NORM = "onegraph::add_rms_norm_triton"
# projection op -> (its fused op, its args after the input: the least and the most (linear_fp8's optional tail));
# the weight is the first of them, and the fused op takes them in the same order after (x, residual, nw, eps)
FUSED = {"onegraph::linear_triton": ("add_rms_norm_linear_triton", 1, 1),
         "onegraph::linear_fp8_triton": ("add_rms_norm_linear_fp8_triton", 2, 3)}
MAX_ROWS = 65536


def _qualname(target) -> str | None:
    return f"{target.namespace}::{target._opname}" if isinstance(target, torch._ops.OpOverload) else None


def _projection(user, normed):
    """user if it is a foldable projection of `normed` (normed its input, a weight of normed's dtype, or e4m3
    with scales and an optional tail, of at most MAX_ROWS output columns), else None."""
    spec = FUSED.get(_qualname(user.target)) if user.op == "call_function" else None
    if spec is None or user.kwargs or not 1 + spec[1] <= len(user.args) <= 1 + spec[2] or user.args[0] is not normed:
        return None
    w = user.args[1].meta["val"]
    dtype_ok = w.dtype == normed.meta["val"].dtype if spec[1] == 1 else w.dtype == torch.float8_e4m3fn
    # the fused op goes where the norm was: its weights (scales, tail) must be graph inputs, as the lifted
    # parameters of an exported model are, not values computed later in the graph
    inputs = all(a.op == "placeholder" for a in user.args[1:] if isinstance(a, torch.fx.Node))
    return user if dtype_ok and inputs and _columns(user) <= MAX_ROWS else None


def _columns(proj) -> int:
    """A projection's output columns (an FP8 weight's rows and its tail's)."""
    return proj.meta["val"].shape[-1]


def fold_input_norms(ep: torch.export.ExportedProgram) -> int:
    """Rewrites `ep` in place (see the module docstring); returns how many norms were folded."""
    graph = ep.graph
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or _qualname(node.target) != ADD_NORM or len(node.args) != 4 or node.kwargs:
            continue                                  # (x, residual, weight, eps), all positional as export writes
        outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if len(outs) != len(node.users) or 0 not in outs:
            continue
        normed = outs[0]
        rows = normed.meta["val"].shape[0]
        if not (isinstance(rows, int) and rows == 1):  # a symbolic batch: not folded either
            continue
        projs = [p for p in (_projection(u, normed) for u in normed.users) if p is not None]
        if not projs:
            continue
        lin = max(projs, key=_columns)               # the widest takes the norm
        fused_op = getattr(torch.ops.onegraph, FUSED[_qualname(lin.target)][0]).default
        with graph.inserting_before(node):            # its inputs are node's and graph inputs: all defined here
            fused = graph.call_function(fused_op, (*node.args, *lin.args[1:]))
            y, n2, h = (graph.call_function(operator.getitem, (fused, i)) for i in range(3))
        h_val = outs[1].meta["val"] if 1 in outs else node.meta["val"][1]
        fused.meta["val"] = (lin.meta["val"], normed.meta["val"], h_val)
        for n, v in zip((y, n2, h), fused.meta["val"]):
            n.meta["val"] = v
        for n in (fused, y, n2, h):
            n.meta["stack_trace"] = node.meta.get("stack_trace")
            n.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
        lin.replace_all_uses_with(y)
        graph.erase_node(lin)
        normed.replace_all_uses_with(n2)              # the other readers, if any
        if 1 in outs:
            outs[1].replace_all_uses_with(h)
        for dead in (*outs.values(), node):
            graph.erase_node(dead)
        if not n2.users:
            graph.erase_node(n2)
        folded += 1
    if folded:
        graph.lint()
        ep.graph_module.recompile()
    return folded
