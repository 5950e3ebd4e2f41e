"""Fold the gated attention layer's KV-cache writes into the q/k norm + rope kernel (CUDA/XPU lowering).

The model writes this step's k and v rows with two index_puts (models/qwen3_5/model.py GatedAttention):

    q', k' = onegraph.qk_norm_rope_triton(q, k, ..., positions, ...)
    kc' = aten.index_put(kc, [w_slots, None, w_pos], k');  vc' = aten.index_put(vc, [w_slots, None, w_pos], v)
    ... attention_{decode,prefill}_triton(q', kc', vc', ...)

Lowered as such, Inductor writes both rows in a kernel of its own (one launch per attention layer and
step, for a few KB). After the Triton lowering is in the graph, this pass rewrites that pattern into
the functionalized call of the in-place twin, the form torch.export itself gives a mutating op:

    q', kc', vc' = auto_functionalized_v2(onegraph.qk_norm_rope_kv_inplace_triton, q, k, v, ...,
                                          w_slots, w_pos, _all_bases=[kc, vc])

kc' and vc' take the index_put results' place (the graph's input-mutation outputs and the attention
op's inputs). The values are the same by the twin's contract; AOTInductor re-inplaces an
auto-functionalized op whose mutated bases are graph inputs the graph mutates anyway, so the kernel
writes the rows in place: no clone, no copy, no extra launch. Only that exact pattern is rewritten:
the caches user inputs read by nothing else before the write, k' used only by its index_put (directly
or through one same-shape view), v of k's shape, both
index_puts at the same (w_slots, w_pos) nodes and consumed by one attention op as its k/v caches.

Where the rope positions and w_pos are one `aten.clamp(p, 0, Tmax - 1)` (the decode step's clamp into the
cache), the twin takes p itself with clamp=True and clamps in its kernel: a graph input, where AOTInductor
recomputed the clamp into a one-element buffer of its own for each kernel that took it (2 launches per
attention layer at batch 1 on the H200).
"""
from __future__ import annotations

import operator

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2
from torch.export.graph_signature import InputKind

from .inplace import rename_outputs

FUNCTIONAL = "onegraph::qk_norm_rope_triton"
TWIN = "onegraph::qk_norm_rope_kv_inplace_triton"


def kv_inplace_op_names() -> set[str]:
    """The qualified names this pass may put in a graph (export's allow-list)."""
    return {TWIN}


def _qualname(target) -> str | None:
    return f"{target.namespace}::{target._opname}" if isinstance(target, torch._ops.OpOverload) else None


def _index_put(node):
    """(base, w_slots, w_pos, value) if node is aten.index_put(base, [w_slots, None, w_pos], value), else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.index_put.default or len(node.args) != 3:
        return None
    base, idx, value = node.args
    if not isinstance(idx, (list, tuple)) or len(idx) != 3 or idx[1] is not None:
        return None
    return base, idx[0], idx[2], value


def _same_rows(value_shape, shape) -> bool:
    """index_put broadcasts its value to the indexed shape [N, KVH, D]: a value of `shape` with leading
    size-1 dims dropped writes the same rows."""
    value_shape, shape = tuple(value_shape), tuple(shape)
    lead = len(shape) - len(value_shape)
    return lead >= 0 and value_shape == shape[lead:] and all(d == 1 for d in shape[:lead])


def _clamped_input(pos, w_pos, kc):
    """p if pos and w_pos are the one node aten.clamp(p, 0, Tmax - 1), Tmax the cache length, else None."""
    if pos is not w_pos or w_pos.op != "call_function" or w_pos.target is not torch.ops.aten.clamp.default:
        return None
    t_max = kc.meta["val"].shape[2]
    if not isinstance(t_max, int) or w_pos.kwargs or tuple(w_pos.args[1:]) != (0, t_max - 1):
        return None                      # (a symbolic cache length is not compared: no guard is added)
    return w_pos.args[0]


def fold_kv_writes(ep: torch.export.ExportedProgram) -> int:
    """Rewrites `ep` in place (see the module docstring); returns how many layers were folded."""
    gm, graph = ep.graph_module, ep.graph
    user_inputs = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    order = {n: i for i, n in enumerate(graph.nodes)}
    twin_op = torch.ops.onegraph.qk_norm_rope_kv_inplace_triton.default
    renamed: dict[str, str] = {}
    clamps: set[torch.fx.Node] = set()
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or _qualname(node.target) != FUNCTIONAL:
            continue
        outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if len(outs) != len(node.users) or set(outs) != {0, 1} or len(outs[1].users) != 1:
            continue
        k_val, k_view = outs[1], None
        shape = tuple(k_val.meta["val"].shape)                         # [N, KVH, D]
        user = next(iter(k_val.users))
        if user.target is torch.ops.aten.view.default and len(user.users) == 1 \
                and _same_rows(user.meta["val"].shape, shape):       # export views a batch-1 value as [KVH, D]
            k_view, k_val = user, user
        k_put = next(iter(k_val.users))
        kp = _index_put(k_put)
        if kp is None or kp[3] is not k_val:
            continue
        kc, w_slots, w_pos, _ = kp
        # the attention op reading kc' as its k cache and, next to it, vc' written at the same rows
        attn = [u for u in k_put.users if u.op == "call_function" and len(u.args) > 2 and u.args[1] is k_put]
        if len(attn) != 1:
            continue
        v_put = attn[0].args[2]
        vp = _index_put(v_put) if isinstance(v_put, torch.fx.Node) else None
        if vp is None or vp[1] is not w_slots or vp[2] is not w_pos:
            continue
        vc, v = vp[0], vp[3]
        if not _same_rows(v.meta["val"].shape, shape):
            continue
        if not all(b.op == "placeholder" and b.name in user_inputs and len(b.users) == 1 for b in (kc, vc)) or kc is vc:
            continue
        last = max(k_put, v_put, key=order.__getitem__)
        if any(order[u] <= order[last] for u in outs[0].users):
            continue
        args = dict(zip([a.name for a in node.target._schema.arguments], node.args))
        args.update(node.kwargs)
        kwargs = dict(args, v=v, w_slots=w_slots, w_pos=w_pos, clamp=False, _k_cache_base_index=0,
                      _v_cache_base_index=1, _all_bases=[kc, vc])
        raw = _clamped_input(args["positions"], w_pos, kc)
        if raw is not None:
            kwargs.update(positions=raw, w_pos=raw, clamp=True)
            clamps.add(w_pos)
        with graph.inserting_before(last):
            if tuple(v.meta["val"].shape) != shape:                      # the twin reads v as [N, KVH, D]
                v = graph.call_function(torch.ops.aten.view.default, (v, list(shape)))
                v.meta["val"] = kwargs["v"].meta["val"].view(shape)
                kwargs["v"] = v
            af = graph.call_function(auto_functionalized_v2, (twin_op,), kwargs)
            news = [graph.call_function(operator.getitem, (af, i)) for i in range(3)]
        af.meta["val"] = (outs[0].meta["val"], k_put.meta["val"], v_put.meta["val"])
        for n, val in zip(news, af.meta["val"]):
            n.meta["val"] = val
        for n in (af, *news):
            n.meta["stack_trace"] = node.meta.get("stack_trace")
            n.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
        outs[0].replace_all_uses_with(news[0])
        for put, new in ((k_put, news[1]), (v_put, news[2])):
            renamed[put.name] = new.name
            put.replace_all_uses_with(new)
        for dead in (k_put, v_put, *([k_view] if k_view is not None else []), outs[1], outs[0], node):
            graph.erase_node(dead)
        folded += 1
    for c in clamps:
        if not c.users:
            graph.erase_node(c)
    if folded:
        rename_outputs(ep, renamed)
    return folded
