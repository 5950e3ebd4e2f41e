"""Rung 3 for the ONNX backend: artifacts exported with `backend="onnx"` and run by onnxruntime's CPU
execution provider reproduce eager (fp32: logits <= 1e-4, greedy ids identical).

One session-scoped export of `tiny` (batch buckets 1, 2; prefill chunk 16) is shared by every test:
exporting is the slow part. The executor uses max_slots=4 (S = 5), not the S = 3 of the export
example, so the dynamic slot dimension is exercised too.
"""
import copy
import dataclasses

import pytest
import torch

from onegraph.custom_ops import PYTHON_CALLS
from onegraph.export.pipeline import ExportOptions, export
from onegraph.graphs.eager import generate_eager
from onegraph.checkpoint.load import load_model
from onegraph.runtime.artifact import Artifact, ArtifactError
from onegraph.runtime.executor import GraphExecutor, Sampling

LOGIT_TOL = 1e-4
MAX_SEQ = 128
PROMPTS = ([1, 2, 3, 4, 5], list(range(30, 53)), [(7 * i + 3) % 256 for i in range(40)])   # 1, 2 and 3 chunks
NEW_TOKENS = 32


@pytest.fixture(scope="session")
def tiny_onnx(tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "tiny"
    export("tiny", out, ExportOptions(backend="onnx", batch_sizes=(1, 2), prefill_chunks=(16,), max_seq_len=MAX_SEQ),
           progress=False)
    return out


@pytest.fixture(scope="session")
def executor(tiny_onnx):
    return GraphExecutor.from_artifact(tiny_onnx, max_slots=4)


@pytest.fixture(scope="session")
def tiny_model():
    return load_model("tiny", "float32")[1]


def assert_stream(ids, logits, ref, what):
    for step, (a, b) in enumerate(zip(ids, ref.token_ids)):
        assert a == b, f"{what}: first differing token at step {step}: onnx {a} vs eager {b}"
    assert len(ids) == len(ref.token_ids)
    worst = max((x - y).abs().max().item() for x, y in zip(logits, ref.logits))
    assert worst <= LOGIT_TOL, f"{what}: logits differ from eager by {worst:.3g}"
    return worst


def test_artifact_loads_and_fixture_passes(executor, tiny_onnx):
    m = executor.manifest
    assert m["backend"] == "onnx"
    assert sorted(m["graphs"]) == ["decode_b1", "decode_b2", "prefill_t16"]
    assert executor.fixture_report["prompts"] == 3
    assert executor.fixture_report["max_logit_diff"] <= LOGIT_TOL
    # the load's stages (wall seconds): onnxruntime's sessions and their weights are one stage, graphs
    t = executor.load_timings_s
    assert t.keys() == {"artifact_files", "check_fits", "graphs", "state", "fixture"}
    assert all(v >= 0 for v in t.values()) and t["graphs"] > 0
    assert sorted(p.suffix for p in (tiny_onnx / "graphs").iterdir()) == [".onnx"] * 3
    # weights live once in weights.safetensors: each graph file is far smaller than the weights
    wbytes = (tiny_onnx / "weights.safetensors").stat().st_size
    assert all(p.stat().st_size < wbytes / 2 for p in (tiny_onnx / "graphs").iterdir())


def test_greedy_matches_eager_and_runs_no_python(executor, tiny_model):
    refs = [generate_eager(tiny_model, p, NEW_TOKENS, Sampling(), max_seq_len=MAX_SEQ) for p in PROMPTS]
    PYTHON_CALLS.clear()
    for i, (p, ref) in enumerate(zip(PROMPTS, refs)):
        ids, logits = executor.generate(p, NEW_TOKENS, slot=i % executor.max_slots)
        assert_stream(ids, logits, ref, f"prompt {i}")
    assert not PYTHON_CALLS, f"onegraph ops ran as Python inside the ONNX graphs: {dict(PYTHON_CALLS)}"


def test_seeded_sampling_matches_eager(executor, tiny_model):
    sp = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    ref = generate_eager(tiny_model, PROMPTS[1], 16, sp, max_seq_len=MAX_SEQ)
    ids, logits = executor.generate(PROMPTS[1], 16, Sampling(0.8, 20, 0.9, 1234), slot=1)
    assert_stream(ids, logits, ref, "sampled stream")


def test_two_row_decode_equals_each_row_alone(executor):
    ex = executor
    a, _ = ex.prefill(PROMPTS[0], slot=2)
    b, _ = ex.prefill(PROMPTS[2], slot=0)
    toks, slots, pos = [int(a[0]), int(b[0])], [2, 0], [len(PROMPTS[0]), len(PROMPTS[2])]
    saved = [s.clone() for s in ex.state]

    ids2, logits2 = ex.decode(toks, slots, pos, [Sampling()] * 2)
    after_batch = [s.clone() for s in ex.state]
    for row in range(2):
        for s, v in zip(ex.state, saved):
            s.copy_(v)
        ids1, logits1 = ex.decode([toks[row]], [slots[row]], [pos[row]], [Sampling()])
        assert int(ids1[0]) == int(ids2[row]), f"row {row}: batch id {int(ids2[row])} vs alone {int(ids1[0])}"
        diff = (logits1[0] - logits2[row]).abs().max().item()
        assert diff <= 1e-5, f"row {row}: batch logits differ from the row alone by {diff:.3g}"
        for i, (s, ref) in enumerate(zip(ex.state, after_batch)):
            d = (s[slots[row]] - ref[slots[row]]).abs().max().item()
            assert d <= 1e-5, f"row {row}: state tensor {i} of slot {slots[row]} differs by {d:.3g}"
    # slots the batch did not touch stay bit-identical
    for s, v in zip(after_batch, saved):
        assert torch.equal(s[1], v[1]) and torch.equal(s[3], v[3])


def test_load_fails_closed(tiny_onnx, tmp_path):
    from onegraph.runtime.onnx_graph import onnx_graphs
    art = Artifact.load(tiny_onnx)
    m = art.manifest

    missing = copy.deepcopy(m)
    missing["graphs"]["decode_b1"]["file"] = "graphs/nope.onnx"
    with pytest.raises(ArtifactError, match="nope.onnx is missing"):
        onnx_graphs(dataclasses.replace(art, manifest=missing))

    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a protobuf at all")
    bad = copy.deepcopy(m)
    bad["graphs"]["decode_b1"]["file"] = str(garbage)
    with pytest.raises(ArtifactError, match="garbage.onnx"):
        onnx_graphs(dataclasses.replace(art, manifest=bad))

    renamed = copy.deepcopy(m)
    renamed["graphs"]["prefill_t16"]["inputs"][0]["name"] = "token_ids"
    with pytest.raises(ArtifactError, match="prefill_t16.onnx: inputs"):
        onnx_graphs(dataclasses.replace(art, manifest=renamed))

    no_weight = copy.deepcopy(m)
    no_weight["weight_shapes"] = dict(no_weight["weight_shapes"], **{"model.not_a_weight": [3]})
    with pytest.raises(ArtifactError, match="model.not_a_weight"):
        onnx_graphs(dataclasses.replace(art, manifest=no_weight))


def test_onnx_export_refuses_half_dtypes():
    from onegraph.export.entry import graph_spec
    from onegraph.export.onnx import lower_onnx
    _, model, _ = load_model("tiny", "bfloat16")
    spec = graph_spec(model, "decode", 1, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="float32 only"):
        lower_onnx(model, spec, None, "unused.onnx")


def test_transformers_checkpoint(tmp_path):
    """A checkpoint written by transformers' save_pretrained exports and runs like eager."""
    hf_models = pytest.importorskip("hf_models")
    pytest.importorskip("transformers")
    src = tmp_path / "hf"
    hf_models.build("moe_i4_top2").save_pretrained(src)
    out = tmp_path / "art"
    export(str(src), out, ExportOptions(backend="onnx", batch_sizes=(1,), prefill_chunks=(16,), max_seq_len=64),
           progress=False)
    ex = GraphExecutor.from_artifact(out, max_slots=1)
    assert ex.fixture_report["max_logit_diff"] <= LOGIT_TOL
    model = load_model(src, "float32")[1]
    prompt = [(11 * i + 5) % 300 for i in range(21)]
    ref = generate_eager(model, prompt, 16, Sampling(), max_seq_len=64)
    PYTHON_CALLS.clear()
    ids, logits = ex.generate(prompt, 16)
    assert not PYTHON_CALLS
    assert_stream(ids, logits, ref, "transformers checkpoint")


def test_graphs_hold_standard_ops_and_linear_attention(tiny_onnx):
    """GDN recurrences map to onnxruntime's LinearAttention; nothing else leaves the standard opset."""
    import onnx
    for path in sorted((tiny_onnx / "graphs").iterdir()):
        m = onnx.load(str(path))
        domains = {n.domain or "ai.onnx" for n in m.graph.node}
        assert domains <= {"ai.onnx", "com.microsoft"}, f"{path.name}: unexpected op domains {domains}"
        la = [n for n in m.graph.node if n.op_type == "LinearAttention"]
        assert len(la) == 3, f"{path.name}: {len(la)} LinearAttention nodes for 3 GDN layers"
        assert not m.graph.initializer or max(i.ByteSize() for i in m.graph.initializer) < 64 * 1024
