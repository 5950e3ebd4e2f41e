"""Fold a decode step's state write-back into the kernel that computes the new rows (CUDA/XPU lowering).

The model and the ops are functional (docs/design.md): GDN decode returns the new state rows and the
model writes them back, `conv.index_copy_(0, slots, new_conv)` and `rec.index_copy_(0, slots, new_rec)`.
Lowered as such, each write-back is its own kernel that reads the rows the step just wrote and writes
them again (35B, batch 1: 2 launches and 2 x 2 MiB of extra traffic per GDN layer). After the Triton
lowering is in the graph, this pass rewrites, per GDN layer,

    y, new_conv, new_rec = onegraph.gdn_decode_step_norm_triton(qkv, a, b, z, conv, rec, slots, ...)
    conv' = aten.index_copy(conv, 0, slots, new_conv);  rec' = aten.index_copy(rec, 0, slots, new_rec)

into the functionalized call of the in-place twin, the form torch.export itself gives a mutating op:

    y, conv', rec' = auto_functionalized_v2(onegraph.gdn_decode_step_norm_inplace_triton, ..., _all_bases=[conv, rec])

conv' and rec' take the index_copy results' place (the graph's input-mutation outputs). The value is the
same by the op's contract (rows at `slots` replaced, the rest kept). Only that exact pattern is rewritten
(the state a graph input, both new-row outputs used only by their index_copy at the op's own slots);
anything else, e.g. speculative verify's per-position snapshots, keeps the functional op.

The program stays functional and serialisable this way, but AOTAutograd keeps an auto-functionalized op
opaque: compiled as is, the twin would be an external op called back through Python. So lower_aoti
(export/aoti.py) runs `inline_inplace_twins` as Inductor's pre-grad pass: the twin called directly on the
state inputs, which AOTAutograd traces to its kernel and Inductor re-inplaces (docs/design.md).
"""
from __future__ import annotations

import operator

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.export.graph_signature import TensorArgument

# functional Triton op -> its in-place twin; the mutated args' names in the twin's schema (in order)
INPLACE = {"onegraph::gdn_decode_step_norm_triton": ("onegraph::gdn_decode_step_norm_inplace_triton",
                                                       ("conv_state", "rec_state")),
           # export --batch-invariant's variant (custom_ops/triton/gdn_decode_step_norm_invariant.py)
           "onegraph::gdn_decode_step_norm_invariant_triton": ("onegraph::gdn_decode_step_norm_invariant_inplace_triton",
                                                                 ("conv_state", "rec_state"))}


def inplace_op_names() -> set[str]:
    """The qualified names this pass may put in a graph (export's allow-list)."""
    return {twin for twin, _ in INPLACE.values()}


def _qualname(target) -> str | None:
    return f"{target.namespace}::{target._opname}" if isinstance(target, torch._ops.OpOverload) else None


def _write_back(getitem_node, base, slots):
    """The one user of `getitem_node` if it is aten.index_copy(base, 0, slots, getitem_node), else None."""
    users = list(getitem_node.users)
    if len(users) != 1:
        return None
    ic = users[0]
    if ic.target is not torch.ops.aten.index_copy.default or tuple(ic.args) != (base, 0, slots, getitem_node):
        return None
    return ic


def fold_state_writes(ep: torch.export.ExportedProgram) -> int:
    """Rewrites `ep` in place (see the module docstring); returns how many ops were folded."""
    gm, graph = ep.graph_module, ep.graph
    user_inputs = {s.arg.name for s in ep.graph_signature.input_specs
                   if s.kind == torch.export.graph_signature.InputKind.USER_INPUT}
    renamed: dict[str, str] = {}
    folded = 0
    for node in list(graph.nodes):
        twin = INPLACE.get(_qualname(node.target)) if node.op == "call_function" else None
        if twin is None:
            continue
        twin_name, mutated = twin
        twin_op = getattr(getattr(torch.ops, twin_name.split("::")[0]), twin_name.split("::")[1]).default
        schema = node.target._schema
        args = dict(zip([a.name for a in schema.arguments], node.args))
        args.update(node.kwargs)
        outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if len(outs) != len(node.users) or set(outs) - {0, 1, 2} or 1 not in outs or 2 not in outs:
            continue
        bases = [args[m] for m in mutated]
        if not all(b.op == "placeholder" and b.name in user_inputs for b in bases):
            continue
        writes = [_write_back(outs[i], b, args["slots"]) for i, b in zip((1, 2), bases)]
        if any(w is None for w in writes):
            continue
        kwargs = {k: v for k, v in args.items() if k not in mutated}
        kwargs.update({f"_{m}_base_index": i for i, m in enumerate(mutated)})
        kwargs["_all_bases"] = bases
        with graph.inserting_before(node):
            af = graph.call_function(auto_functionalized_v2, (twin_op,), kwargs)
            news = [graph.call_function(operator.getitem, (af, i)) for i in range(1 + len(mutated))]
        y_val = outs[0].meta["val"] if 0 in outs else node.meta["val"][0]
        af.meta["val"] = (y_val, *[w.meta["val"] for w in writes])
        for n, v in zip(news, af.meta["val"]):
            n.meta["val"] = v
        for n in (af, *news):
            n.meta["stack_trace"] = node.meta.get("stack_trace")
            n.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
        if 0 in outs:
            outs[0].replace_all_uses_with(news[0])
        for w, new in zip(writes, news[1:]):
            renamed[w.name] = new.name
            w.replace_all_uses_with(new)
        for dead in (*writes, *outs.values(), node):
            graph.erase_node(dead)
        folded += 1
    if folded:
        rename_outputs(ep, renamed)
    return folded


def rename_outputs(ep: torch.export.ExportedProgram, renamed: dict[str, str]) -> None:
    """After a fold: the graph signature's outputs that named a replaced write now name its replacement
    (the input-mutation outputs), then lint and recompile the graph module."""
    for spec in ep.graph_signature.output_specs:
        if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed:
            spec.arg = TensorArgument(name=renamed[spec.arg.name])
    ep.graph.lint()
    ep.graph_module.recompile()


def _is_triton_twin(op) -> bool:
    """A onegraph Triton op (torch.library.triton_op): its Python body only launches kernels, so AOTAutograd
    can trace it to them when it meets the op itself (not wrapped in auto_functionalized)."""
    return isinstance(op, torch._ops.OpOverload) and op.namespace == "onegraph" and op._opname.endswith("_triton")


def inline_inplace_twins(graph: torch.fx.Graph) -> int:
    """Inductor pre-grad pass for AOTInductor (export/aoti.py): `auto_functionalized_v2(twin, ..., _all_bases=[x, ..])`
    whose bases are graph inputs that are only copied back (`x.copy_(new_x)`, the unlifted program's input
    mutation) becomes the twin called on the inputs themselves. Returns how many were inlined.

    Why: AOTAutograd keeps an auto-functionalized op opaque, so Inductor would lower the twin as an external
    op, called back through Python on every run (AOTInductor's proxy executor). Called directly, AOTAutograd
    functionalizes the triton_op into its kernel launch, and Inductor re-inplaces the kernel on the inputs
    it mutates anyway: one kernel, no clone, no copy-back. Same value: the bases are read by nothing else,
    and whoever read the new values reads the inputs, now written in place, at the same point."""
    inlined = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not auto_functionalized_v2 or not _is_triton_twin(node.args[0]):
            continue
        op, kw = node.args[0], dict(node.kwargs)
        schema = op._schema
        mutable = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        bases = kw.get("_all_bases", [])
        view_keys = [k for k in kw if k.startswith("_") and k not in ("_all_bases",)
                     and not k.endswith("_base_index")]
        if view_keys or any(kw.get(f"_{m}_base_index") is None for m in mutable):
            continue                                     # a mutated arg that is a view of its base: leave it
        if not all(isinstance(b, torch.fx.Node) and b.op == "placeholder" for b in bases):
            continue
        n_out = len(schema.returns)
        items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if n_out != 1 or len(items) != len(node.users):
            continue                                     # the twins return one tensor
        order = {n: i for i, n in enumerate(graph.nodes)}
        write_backs = []
        for i, b in enumerate(bases):
            new = items.get(n_out + i)
            # reads of the old value before the op (shape guards) stay valid; nothing may read it after
            copies = [u for u in b.users if u is not node and order[u] > order[node]]
            ok = (new is not None and len(copies) == 1 and copies[0].target is torch.ops.aten.copy_.default
                  and tuple(copies[0].args) == (b, new) and not copies[0].users)
            if not ok:
                break
            write_backs.append(copies[0])
        else:
            args = [bases[kw[f"_{a.name}_base_index"]] if a.name in mutable else kw[a.name] for a in schema.arguments]
            with graph.inserting_before(node):
                call = graph.call_function(op, tuple(args))
            call.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            for w in write_backs:
                graph.erase_node(w)
            for idx, item in list(items.items()):
                if idx == 0:                             # the twin's output
                    call.meta["val"] = item.meta.get("val")
                    item.replace_all_uses_with(call)
                else:                                    # a base's new value: the base itself, written in place
                    item.replace_all_uses_with(bases[idx - 1])
                graph.erase_node(item)
            graph.erase_node(node)
            inlined += 1
    if inlined:
        graph.lint()
        if graph.owning_module is not None:
            graph.owning_module.recompile()
    return inlined


class InlineInplaceTwins(CustomGraphPass):
    """`inline_inplace_twins` as an Inductor custom pass; its uuid (this file's hash) keys Inductor's own
    compile cache, which bypasses a pass it cannot identify."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        inline_inplace_twins(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
