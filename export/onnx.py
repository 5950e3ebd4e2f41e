"""Lower a traced entry point to an ONNX graph for onnxruntime's CPU execution provider.

    trace again, keeping the ops in TRANSLATED undecomposed (everything else: the aten references)
      -> functional re-export: the state inputs are cloned and returned, so every mutation
         (index_copy_ / index_put_) becomes a plain graph output (ONNX has no in-place inputs;
         `torch.onnx.export` drops the input mutations of an ExportedProgram)
      -> torch.onnx.export(dynamo=True, optimize=False, custom_translation_table=TRANSLATED ops ->
         onnxruntime ops, see `_translations`)
      -> the weights become named graph inputs (`model.<fqn>`, the keys of weights.safetensors),
         *then* constants are folded, so no weight is folded into a derived constant in the file
      -> save without weight data; check against the pipeline's fully decomposed trace `ep` on random
         nonzero state (fails the export on a difference > 1e-4)

Graph signature (the runtime checks it):
    inputs:  the GraphSpec inputs in order (head inputs, then the state; S dynamic), then one input
             per weight, named as in weights.safetensors; the runtime binds those once per process
             as initializers shared by every graph (runtime/onnx_graph.py)
    outputs: next_ids, logits, then `new.<state name>` for every state tensor (the whole tensor:
             the runtime copies it back into the state it passed)

Ops: gdn_decode_step and gdn_prefill -> com.microsoft.LinearAttention (gated_delta) plus primitive
ops; every other onegraph op -> its pure-torch reference traced to aten -> standard opset 23.
Nothing calls back into Python. fp32 only.
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import torch

from onegraph.custom_ops import REGISTRY, decompositions
from onegraph.graphs.signature import NEW_STATE_PREFIX, OUTPUTS, is_state

from .entry import GraphSpec, dynamic_shapes, entry_module, example_inputs
from .trace import ExportError

OPSET = 23
SUPPORTED_DTYPES = (torch.float32,)         # CPU EP kernels for bf16/fp16 are too sparse to rely on
CHECK_TOL = 1e-4                            # export-time ONNX vs traced graph, fp32
# onegraph op -> the schema version its translation was written for (see _translations)
TRANSLATED = {"gdn_decode_step": 1, "gdn_prefill": 1}


class _Functional(torch.nn.Module):
    """Clones the state, runs the (in-place) traced graph on the clones and returns them."""

    def __init__(self, gm: torch.nn.Module, n_head: int):
        super().__init__()
        self.gm, self.n_head = gm, n_head

    def forward(self, *args):
        state = [s.clone() for s in args[self.n_head:]]
        ids, logits = self.gm(*args[:self.n_head], *state)
        return (ids, logits, *state)


def signature(spec: GraphSpec, n_state: int) -> tuple[list[str], list[str]]:
    names = [n for n, _, _ in spec.inputs]
    return names, list(OUTPUTS) + [NEW_STATE_PREFIX + n for n in names[len(names) - n_state:]]


def _quiet():
    """torch.onnx prints progress and warns about torchvision: keep the export bar readable."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)
    stack.callback(log.setLevel, level)
    return stack


def lower_onnx(model, spec: GraphSpec, ep: torch.export.ExportedProgram, out_path: Path,
               translate=tuple(TRANSLATED)) -> Path:
    """Write the ONNX graph of `spec` to out_path. `ep` is the pipeline's fully decomposed trace: the
    ONNX graph is checked against it. The ops named in `translate` are traced again undecomposed and
    mapped to onnxruntime ops (see _translations); every other op is the aten decomposition."""
    import onnx_ir as ir
    import onnxscript

    dtype = model.embed_tokens.weight.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"--backend onnx supports --dtype float32 only (got {dtype}): onnxruntime's CPU "
                         f"execution provider lacks kernels for most ops in other dtypes")
    n_state = sum(is_state(shape) for _, shape, _ in spec.inputs)
    n_head = len(spec.inputs) - n_state
    in_names, out_names = signature(spec, n_state)
    args = example_inputs(spec, torch.device("cpu"))
    for name in translate:
        if REGISTRY[name].version != TRANSLATED[name]:
            raise ExportError(f"the ONNX translation of onegraph::{name} was written for schema "
                              f"v{TRANSLATED[name]}, the op is v{REGISTRY[name].version}: update export/onnx.py "
                              f"(or drop it from TRANSLATED)")
    table = _translations()
    table = {REGISTRY[name].overload: table[name] for name in translate}
    with torch.no_grad(), _quiet():
        src = _trace_keeping(model, spec, args, table) if table else ep
        fep = torch.export.export(_Functional(src.module(), n_head), args, dynamic_shapes=dynamic_shapes(spec),
                                  strict=False)
        prog = torch.onnx.export(fep, (), dynamo=True, input_names=in_names, output_names=out_names,
                                 opset_version=OPSET, optimize=False, verify=False, custom_translation_table=table)

    # weights -> named graph inputs (before folding constants, so no weight is folded into one)
    g = prog.model.graph
    weight_fqns = {n for n, _ in fep.named_parameters()} | {n for n, _ in fep.named_buffers()}
    weights = []
    for name in list(g.initializers):
        if name in weight_fqns:
            v = g.initializers.pop(name)
            v.const_value = None
            v.name = name.removeprefix("gm.")            # == the key in weights.safetensors
            weights.append(v)
    g.inputs.extend(weights)
    # constant folding + dead-node removal only: the full onnxscript optimizer (rewrite rules, CSE,
    # 2 iterations) costs ~10x the export here, and onnxruntime runs its own fusions at load anyway
    onnxscript.optimizer.fold_constants(prog.model)
    onnxscript.optimizer.remove_unused_nodes(prog.model)
    got_in = [v.name for v in prog.model.graph.inputs][:len(in_names)]
    got_out = [v.name for v in prog.model.graph.outputs]
    if got_in != in_names or got_out != out_names:
        raise ExportError(f"ONNX graph {spec.name}: signature {got_in} -> {got_out} differs from the spec")
    for node in prog.model.graph.all_nodes():
        node.metadata_props.clear()                     # per-node Python stack traces: ~80% of the file
    prog.model.metadata_props["onegraph.graph"] = spec.name
    prog.model.metadata_props["onegraph.translated_ops"] = ",".join(translate)
    out_path = Path(out_path)
    ir.save(prog.model, str(out_path))
    _check(out_path, ep, model, spec)
    return out_path


def _trace_keeping(model, spec: GraphSpec, args, keep: dict) -> torch.export.ExportedProgram:
    """The trace of `trace.py`, but the ops in `keep` stay undecomposed (custom ops with fakes)."""
    table = {op: fn for op, fn in decompositions("cpu").items() if op not in keep}
    ep = torch.export.export(entry_module(model, spec.kind), args, dynamic_shapes=dynamic_shapes(spec), strict=False)
    return ep.run_decompositions(table)


def _contrib_schema(name: str, standard_version: int):
    """The com.microsoft (version 1) twin of a standard op: onnxruntime registers both with one
    signature; onnx ships only the standard schema, and the graph stays at opset OPSET elsewhere."""
    import onnx
    from onnx.defs import OpSchema
    s = onnx.defs.get_schema(name, standard_version, "")
    return OpSchema(
        name, "com.microsoft", 1, s.doc,
        inputs=[OpSchema.FormalParameter(p.name, p.type_str, p.description, param_option=p.option)
                for p in s.inputs],
        outputs=[OpSchema.FormalParameter(p.name, p.type_str, p.description, param_option=p.option)
                 for p in s.outputs],
        type_constraints=[(t.type_param_str, list(t.allowed_type_strs), t.description) for t in s.type_constraints],
        attributes=[OpSchema.Attribute(a.name, a.type, a.description, required=a.required)
                    for a in s.attributes.values()])


def _translations() -> dict:
    """onegraph op -> ONNX builder (onnxscript, traced by torch.onnx), for ops with an onnxruntime
    kernel that matches the reference. Shapes other than S are static, read off the
    op's inputs (the values built here carry no shapes).

    gdn_decode_step / gdn_prefill: the delta-rule recurrence is com.microsoft.LinearAttention
    (update_rule="gated_delta"; q/k repeated up to the value heads, L2-normed and scaled here as in
    `split_qkv`, so the op runs with scale=1); the conv, gates and gathers stay primitive ops.
    """
    from onnxscript import opset23 as op
    from onnxscript.values import Op, Opset

    linear_attention = Op(Opset("com.microsoft", 1), "LinearAttention", _contrib_schema("LinearAttention", 27))
    eps = 1e-6                                    # custom_ops/gdn_decode_step.l2norm

    def l2norm(t):
        return op.Mul(t, op.Reciprocal(op.Sqrt(op.Add(op.ReduceSum(op.Mul(t, t), [-1], keepdims=1),
                                                       op.Constant(value_float=eps)))))

    def heads(x, HK, K, HV, V, lead):
        """x [N, C] -> q, k [*lead, HV*K] (normed; q scaled), v [*lead, HV*V]; lead = (B, 1) or (1, T)."""
        N = lead[0] * lead[1]
        kd = HK * K
        q, k, v = (op.Slice(x, [lo], [hi], [1]) for lo, hi in ((0, kd), (kd, 2 * kd), (2 * kd, 2 * kd + HV * V)))

        def rep(t):                               # [N, HK*K] -> [*lead, HV*K], head h reads key head h // r
            t = l2norm(op.Reshape(t, [N, HK, 1, K]))
            return op.Reshape(op.Expand(t, [N, HK, HV // HK, K]), list(lead) + [HV * K])

        q = op.Mul(rep(q), op.Constant(value_float=K ** -0.5))
        return q, rep(k), op.Reshape(v, list(lead) + [HV * V])

    def gates(a, b, A_log, dt_bias):              # custom_ops/gdn_decode_step.gdn_gates: [N, HV] each
        g = op.Mul(op.Neg(op.Exp(A_log)), op.Softplus(op.Add(a, dt_bias)))
        return g, op.Sigmoid(b)

    def recurrence(q, k, v, state, g, beta, HV):
        return linear_attention(q, k, v, state, g, beta, update_rule="gated_delta", q_num_heads=HV,
                                kv_num_heads=HV, scale=1.0, _num_outputs=2)

    def gdn_decode_step(qkv, a, b, conv_state, rec_state, slots, conv_weight, A_log, dt_bias, num_k_heads):
        B = qkv.shape[0]
        _, HV, K, V = rec_state.shape
        W = conv_weight.shape[1]
        window = op.Concat(op.Gather(conv_state, slots, axis=0), op.Unsqueeze(qkv, [2]), axis=2)   # [B, C, W]
        y = op.ReduceSum(op.Mul(window, conv_weight), [-1], keepdims=0)
        x = op.Mul(y, op.Sigmoid(y))                                                             # silu [B, C]
        q, k, v = heads(x, num_k_heads, K, HV, V, (B, 1))
        g, beta = gates(a, b, A_log, dt_bias)
        out, new_rec = recurrence(q, k, v, op.Gather(rec_state, slots, axis=0),
                                  op.Unsqueeze(g, [1]), op.Unsqueeze(beta, [1]), HV)          # [B, 1, HV*V]
        return op.Reshape(out, [B, HV, V]), op.Slice(window, [1], [W], [2]), new_rec

    def gdn_prefill(x, g, beta, rec_state, slot, num_k_heads, chunk_size):    # sequential: chunk unused
        T = x.shape[0]
        _, HV, K, V = rec_state.shape
        q, k, v = heads(x, num_k_heads, K, HV, V, (1, T))
        out, new_rec = recurrence(q, k, v, op.Gather(rec_state, slot, axis=0),
                                  op.Unsqueeze(g, [0]), op.Unsqueeze(beta, [0]), HV)          # [1, T, HV*V]
        return op.Reshape(out, [T, HV, V]), new_rec

    return {"gdn_decode_step": gdn_decode_step, "gdn_prefill": gdn_prefill}


def _check(path: Path, ep, model, spec: GraphSpec) -> None:
    """The saved graph (weights fed as inputs) reproduces the traced graph on random state."""
    import onnxruntime as ort
    g = torch.Generator().manual_seed(0)
    B = spec.bucket if spec.kind == "decode" else 1
    args = []
    for name, shape, dt in spec.inputs:
        shape = tuple(B + 1 if s == "S" else s for s in shape)        # distinct slots for every row
        args.append(torch.randn(shape, generator=g, dtype=dt) if dt.is_floating_point
                    else torch.zeros(shape, dtype=dt))                 # nonzero state
    args[0] = torch.randint(0, model.cfg.vocab_size, args[0].shape, generator=g)
    if spec.kind == "decode":
        args[1] = torch.randperm(B, generator=g)                         # slots
        args[2] = torch.randint(0, 9, (B,), generator=g)                 # positions
    else:
        args[1], args[2], args[3] = torch.tensor([0]), torch.tensor([5]), torch.tensor([max(1, spec.bucket - 1)])
    for i, (name, _, _) in enumerate(spec.inputs):
        if name in ("temperature", "top_p"):
            args[i] = torch.full_like(args[i], 0.0 if name == "temperature" else 1.0)   # greedy
    weights = dict(list(model.named_parameters(prefix="model")) + list(model.named_buffers(prefix="model")))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feeds = {}
    for i, inp in enumerate(sess.get_inputs()):
        feeds[inp.name] = (args[i] if i < len(args) else weights[inp.name]).detach().numpy()
    got = sess.run(None, feeds)
    with torch.no_grad():
        n_head = len(args) - (len(got) - 2)
        state = [t.clone() for t in args[n_head:]]
        want = list(ep.module()(*args[:n_head], *state)) + state          # ep mutates `state` in place
    for name, a, b in zip([o.name for o in sess.get_outputs()], got, want):
        diff = (torch.from_numpy(a).double() - b.double()).abs().max().item() if a.size else 0.0
        if not diff <= CHECK_TOL * max(1.0, b.abs().max().item()):
            raise ExportError(f"ONNX graph {spec.name}: output {name} differs from the traced graph by {diff:.3g}")
