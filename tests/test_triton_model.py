"""Parity rung 3 for the CUDA lowering, on a CPU: the whole `tiny` model traced as export does it and
lowered with decompositions("cuda") — every onegraph op swapped for its hand-written Triton op — then run
as an ExportedProgram with the kernels in Triton's interpreter, against the eager model (the pure-torch
references). This is the CUDA graph minus AOTInductor: it catches a lowering that is right alone but wrong
in the model (a strided input, a state row written to the wrong slot, a prefill chunk that leaks padding).
With a GPU the same test runs the compiled kernels on it.

fp32: greedy and seeded top-k/top-p ids identical for 8 tokens on a GPU; interpreted (each decode step costs
tens of seconds on a CPU) 3 greedy tokens after the prompt's 2 prefill chunks (the second padded): 2 decode steps,
the second reading the state the first wrote; and 2 sampled ones after a 16-token prompt's one chunk: a sampled
prefill token and one sampled decode step; logits within 1e-4; no Python reference ran during the lowered generation. The decode graph runs with export/inplace.py's fold applied (the GDN
state rows written by the in-place kernel, no index_copy left) and export/fold_norm.py's (no norm kernel
between layers), as export does.
"""
import pytest
import torch
from triton_env import CUDA, DEVICE, needs_triton

from onegraph.custom_ops import PYTHON_CALLS, decompositions
from onegraph.export.entry import dynamic_shapes, entry_module, example_inputs, graph_spec
from onegraph.export.fold_norm import fold_input_norms
from onegraph.export.inplace import fold_state_writes, inline_inplace_twins
from onegraph.export.inplace_kv import fold_kv_writes
from onegraph.export.trace import check_lowered
from onegraph.checkpoint.load import load_model
from onegraph.runtime.executor import GraphExecutor, Sampling

pytestmark = needs_triton
MAX_SEQ = 64
PROMPT = list(b"Colours: red, orange,")            # 21 tokens: one full prefill chunk of 16 + a padded one


@pytest.fixture(scope="module")
def executors():
    _, model, _ = load_model("tiny", "float32", DEVICE)   # on a GPU: the compiled kernels
    kinds = {"decode": [1], "prefill": [16]}
    graphs, meta = {}, {}
    for kind, buckets in kinds.items():
        for b in buckets:
            spec = graph_spec(model, kind, b, MAX_SEQ, torch.float32)
            with torch.no_grad():
                ep = torch.export.export(entry_module(model, kind), example_inputs(spec, DEVICE),
                                         dynamic_shapes=dynamic_shapes(spec), strict=False)
                ep = ep.run_decompositions(decompositions("cuda"))
            # as export/trace.py does: decode's GDN state rows written in place by the kernel
            n_gdn = sum(k == "linear_attention" for k in model.cfg.layer_types)
            assert fold_state_writes(ep) == (n_gdn if kind == "decode" else 0)
            assert fold_kv_writes(ep) == len(model.cfg.layer_types) - n_gdn   # KV rows written by the kernel
            # batch 1: each later layer's input norm in its first projection's GEMV, and the final norm in
            # tiny's lm_head (264 rows): as many as layers; prefill chunks keep theirs
            assert fold_input_norms(ep) == (len(model.cfg.layer_types) if kind == "decode" else 0)
            hist = check_lowered(ep, "cuda")
            assert kind != "decode" or "aten::index_copy" not in hist, hist
            assert kind != "decode" or "onegraph::add_rms_norm_triton" not in hist, hist
            assert "aten::index_put" not in hist, hist
            assert not any(n.startswith("onegraph::") and not n.endswith("_triton") for n in hist), hist
            gm = ep.module()
            inline_inplace_twins(gm.graph)      # the graph AOTInductor compiles: twins called on the state inputs
            assert "auto_functionalized" not in gm.code, gm.code
            graphs[spec.name] = (lambda f: lambda inputs: f(*inputs))(gm)
            meta[spec.name] = spec.manifest()
    state = meta["decode_b1"]["inputs"][-len(model.cfg.layer_types) * 2:]
    lowered = GraphExecutor(graphs, meta, state, 1, MAX_SEQ, model.cfg.vocab_size, torch.device(DEVICE))
    eager = GraphExecutor.from_model(model, kinds, max_slots=1, max_seq_len=MAX_SEQ)
    return lowered, eager


# on a CPU the sampled run takes the prompt's first 16 tokens: one full chunk (the greedy run has the padded one)
@pytest.mark.parametrize("sampling, n, prompt", [(Sampling(), 8 if CUDA else 3, PROMPT),
                                                 (Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7), 8 if CUDA else 2,
                                                  PROMPT if CUDA else PROMPT[:16])],
                         ids=["greedy", "top_k_top_p"])
def test_tiny_through_triton_lowerings_matches_eager(executors, sampling, n, prompt):
    lowered, eager = executors
    with torch.no_grad():
        ref_ids, ref_logits = eager.generate(prompt, n, sampling)
        before = dict(PYTHON_CALLS)
        ids, logits = lowered.generate(prompt, n, sampling)
        assert dict(PYTHON_CALLS) == before, "a Python reference ran inside the lowered graphs"
    diff = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), None)
    assert diff is None, f"first differing token at step {diff}: {ids[diff]} vs {ref_ids[diff]}"
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
    assert worst <= 1e-4, f"max logit difference {worst}"
