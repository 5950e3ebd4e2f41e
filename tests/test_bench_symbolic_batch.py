"""scripts/bench_symbolic_batch.py and scripts/bench_lower_set.py on the tiny shape, CPU, no AOTInductor (the
traced programs run as torch.export modules: seconds, where lowering them would take minutes on 2 cores).

- the symbolic-batch graphs cover every batch, each equal to its per-bucket graph (ids exact, fp32 logits);
  a batch a symbolic graph refuses is refused by a guard the JSON names;
- traced through the Triton lowerings (the interpreter), a symbolic batch traces and the report says what
  the trace left of it: symbolic, or specialized to the example with the Triton source that decided;
- bench_lower_set --graphs / --resume split a graph set over runs and complete it.
"""
import json

import pytest
import torch
from triton_env import needs_triton


def test_symbolic_batch_equals_per_bucket_graphs_on_cpu(tmp_path):
    from onegraph.scripts.bench_symbolic_batch import main
    out = tmp_path / "sym.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--lower", "export", "--kernels", "auto",
                 "--batches", "1,8", "--steps", "1", "--max-seq-len", "64", "--position", "8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rep = res["symbolic"]["auto"]
    assert rep["uncovered"] == [] and rep["graphs_needed"] == len(rep["segments"]) >= 1
    for seg in rep["segments"]:
        assert seg["symbolic"] and seg["range"] == [1, 8], seg
        assert seg["example_batch"] in seg["covers"] or seg["example_batch"] == 2      # B = 1 is traced at 2
        if seg["refused"]:                        # a refusal is a guard the trace logged, named in the JSON
            assert seg["guards"] and all(v.startswith("Guard failed") for v in seg["refused"].values()), seg
    for row in res["replay"]:
        sym = [t for t in row["us_per_step"] if t.startswith("symbolic_auto_")]
        assert len(sym) == 1 and f"static_auto_b{row['batch']}" in row["us_per_step"], row
        p = row["parity"][sym[0]]
        assert p["vs"] == f"static_auto_b{row['batch']}" and p["ids_equal"] and p["max_logit_diff"] < 1e-5, p
    assert set(res["summary"]["auto"]["symbolic_over_static_replay"]) == {"1", "8"}


@needs_triton
def test_symbolic_batch_through_triton_lowerings_is_reported_as_traced():
    """The Triton GEMV's tile lookup keyed on M == 1 used to crash the decomposition under a symbolic M."""
    from torch.export import Dim

    from onegraph.custom_ops import decompositions
    from onegraph.export.entry import dynamic_shapes, entry_module, example_inputs
    from onegraph.graphs.signature import graph_spec
    from onegraph.commands.bench_common import random_shape_model
    from onegraph.scripts.bench_symbolic_batch import accepted, batch_dim, guard_messages
    model, _ = random_shape_model("tiny", 0, torch.float32, "cpu")
    spec = graph_spec(model, "decode", 8, 64, torch.float32)
    with torch.no_grad(), guard_messages() as guards:
        ep = torch.export.export(entry_module(model, "decode"), example_inputs(spec, "cpu"),
                                 dynamic_shapes=dynamic_shapes(spec, Dim("B", min=1, max=8)), strict=False)
        ep = ep.run_decompositions(decompositions("cuda"))
    rep = batch_dim(ep)
    if rep["symbolic"]:
        assert 8 in accepted(ep, model, [1, 8], 64)[0]
    else:                                        # specialized: to the example, by a Triton lowering's decision
        assert rep["specialized_to"] == 8
        assert any("custom_ops/triton/" in g for g in guards), guards


def test_lower_set_splits_and_resumes(tmp_path):
    from onegraph.scripts.bench_lower_set import main
    out = tmp_path / "set.json"
    common = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1,2",
              "--prefill-chunks", "16", "--max-seq-len", "64", "--trace-only", "--out", str(out)]
    assert main(common + ["--graphs", "decode_b9"]) == 2            # not in the set: refused, nothing run
    assert main(common + ["--graphs", "decode_b2"]) == 0
    res = json.loads(out.read_text())
    assert list(res["graphs"]) == ["decode_b2"] and not res["all_done"]
    assert main(common + ["--resume"]) == 0
    res = json.loads(out.read_text())
    assert res["all_done"] and sorted(res["graphs"]) == ["decode_b1", "decode_b2", "prefill_t16"]
    assert [r["graphs"] for r in res["runs"]] == [["decode_b2"], ["prefill_t16", "decode_b1"]]
    assert all(g["nodes"] > 0 and g["program_MB"] > 0 for g in res["graphs"].values())


def test_symbolic_batch_usage_errors(tmp_path):
    from onegraph.scripts.bench_symbolic_batch import main
    base = ["--shape", "tiny", "--device", "cpu", "--out", str(tmp_path / "x.json")]
    assert main(base + ["--batches", "8"]) == 2
    assert main(base + ["--kernels", "fast"]) == 2
    with pytest.raises(ValueError, match="--layers"):
        main(base + ["--layers", "9"])
