"""Artifacts whose weights are referenced from the checkpoint (export --weights reference) instead of copied:
the manifest records the checkpoint's files (path, size, sha256), the recipe and the digest of the weights it
makes; every load verifies the files and makes the weights again by the export's own code path.

The referencing export re-uses tiny_artifact's compiled graphs from the session cache (same program, same
weights digest), so it costs two traces and the fixture, not two compiles.
"""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from onegraph.export.pipeline import ExportOptions, export, inspect, reference
from onegraph.checkpoint.recipe import recipe_of, tensors_sha256
from onegraph.runtime import GraphExecutor
from onegraph.runtime.artifact import Artifact, ArtifactError, sha256_file
from onegraph.runtime.weight_refs import rebuild, verify_files

# two of tiny_artifact's graphs (conftest.TINY_EXPORT: the same prefill chunk and max_seq_len): decode_b1, prefill_t16
REF_EXPORT = dict(batch_sizes=(1,), prefill_chunks=(16,), max_seq_len=256)
TINY_RECIPE = recipe_of("float32", "none", False, False, False, 1)       # tiny_artifact's options


@pytest.fixture(scope="session")
def ref_checkpoint(tmp_path_factory):
    """tiny as a checkpoint directory of its own (the tests modify and restore its files)."""
    from onegraph.models.qwen3_5.tiny import write_tiny
    return write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def ref_artifact(tiny_artifact, ref_checkpoint, aoti_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "ref"
    s = export(str(ref_checkpoint), out, ExportOptions(**REF_EXPORT, weights="reference"), progress=False,
               cache_dir=aoti_cache)
    return out, s


def test_builtin_tiny_reference_is_made_again_and_checked(tiny_artifact):
    """`tiny` as the checkpoint: the runtime writes it again (byte-identical) and verifies it; weights made
    by another code path than the recorded one (here: a wrong digest) are refused."""
    from onegraph.checkpoint.load import model_dir
    copy = load_file(str(tiny_artifact / "weights.safetensors"))
    ref = reference("tiny", model_dir("tiny"), TINY_RECIPE, [tensors_sha256(copy)], [0])
    assert ref["checkpoint"] == "tiny"
    verify_files(ref)
    timings = {}
    w = rebuild(ref, 0, timings=timings)               # the files hashed while the recipe reads them
    assert w.keys() == copy.keys() and all(torch.equal(w[n], copy[n]) for n in w)
    assert timings.keys() == {"weights_make", "sha256_wait", "checkpoint_sha256_overlapped", "weights_digest"}
    assert all(v >= 0 for v in timings.values()) and timings["checkpoint_sha256_overlapped"] > 0
    timings = {}
    w = rebuild(ref, 0, files_verified=True, timings=timings)     # Artifact.load hashed them already
    assert all(torch.equal(w[n], copy[n]) for n in w) and timings.keys() == {"weights_make", "weights_digest"}
    for verified in (False, True):
        with pytest.raises(ArtifactError, match="differ from the exported ones"):
            rebuild(dict(ref, tensors_sha256=["0" * 64]), 0, files_verified=verified)


def test_reference_artifact_generates_what_the_copy_generates(tiny_artifact, ref_artifact, ref_checkpoint):
    out, s = ref_artifact
    assert sorted(s["cached"]) == ["decode_b1", "prefill_t16"], s      # the copy's packages: the same cache key
    m = json.loads((out / "manifest.json").read_text())
    assert not (out / "weights.safetensors").exists() and m["weights"] is None
    assert m["options"]["weights"] == "reference"
    ref = m["weights_reference"]
    assert ref["checkpoint"] == str(ref_checkpoint.resolve())
    assert ref["files"] == {n: {"sha256": sha256_file(ref_checkpoint / n), "size": (ref_checkpoint / n).stat().st_size}
                            for n in ("config.json", "model.safetensors")}
    assert ref["recipe"] == dict(TINY_RECIPE)
    copy = json.loads((tiny_artifact / "manifest.json").read_text())     # the copy mode as it was
    assert copy["weights"] == "weights.safetensors" and "weights_reference" not in copy
    assert copy["options"]["weights"] == "copy"
    # the weights the reference makes are the copy's, tensor for tensor
    assert ref["tensors_sha256"] == [tensors_sha256(load_file(str(tiny_artifact / "weights.safetensors")))]
    assert "weights: referenced" in inspect(out) and str(ref_checkpoint.resolve() / "model.safetensors") in inspect(out)
    assert "weights: copied (weights.safetensors)" in inspect(tiny_artifact)
    a = GraphExecutor.from_artifact(out, max_slots=1)                    # the load-time fixture passes too
    b = GraphExecutor.from_artifact(tiny_artifact, max_slots=1)
    # given a path, the checkpoint files are hashed while the weights are made; each stage's wall seconds
    assert not a.artifact.checkpoint_hashed
    stages = ["artifact_files", "check_fits", "graph_packages", "graph_bind", "state", "fixture"]
    apart = lambda ex: [f"graph_package:{name}" for name in ex.artifact.graphs]    # noqa: E731 (each package's load)
    assert set(stages + apart(a) + ["checkpoint_files", "weights_make", "sha256_wait", "weights_digest",
                                    "weights_to_device", "checkpoint_sha256_overlapped"]) == a.load_timings_s.keys()
    assert set(stages + apart(b) + ["weights_read"]) == b.load_timings_s.keys()
    for t in (a.load_timings_s, b.load_timings_s):
        assert all(isinstance(v, float) and v >= 0 for v in t.values()), t
        assert t["graph_packages"] > 0 and t["fixture"] > 0
        assert abs(sum(v for k, v in t.items() if k.startswith("graph_package:")) - t["graph_packages"]) < 1e-9
    for prompt in ([1, 2, 3], list(range(40, 60))):
        ids_a, lg_a = a.generate(prompt, 24)
        ids_b, lg_b = b.generate(prompt, 24)
        assert ids_a == ids_b
        # same graphs, same weight values; MKL's fp32 GEMM sums in an order that depends on its operands'
        # alignment (export/pipeline.py), and a tensor made in memory is aligned otherwise than one read from a file
        assert max((x - y).abs().max().item() for x, y in zip(lg_a, lg_b)) <= 1e-5


def test_engine_logs_the_load_stages(ref_artifact, caplog):
    from onegraph.runtime import Engine
    with caplog.at_level("INFO", logger="onegraph.runtime"):
        eng = Engine.from_artifact(ref_artifact[0], max_slots=1, check_parity=False)
    eng.close()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("onegraph load (wall s): "))
    got = dict(kv.rsplit(" ", 1) for kv in line.removeprefix("onegraph load (wall s): ").split(", "))
    assert got.keys() == eng.ex.load_timings_s.keys() and "fixture" not in got
    assert {"artifact_files", "checkpoint_files", "weights_make", "sha256_wait", "graph_packages"} <= got.keys()
    assert all(float(v) >= 0 for v in got.values())


def test_modified_referenced_file_is_refused(ref_artifact, ref_checkpoint):
    f = ref_checkpoint / "model.safetensors"
    want, orig = sha256_file(f), f.read_bytes()
    refused = rf"referenced checkpoint file {f}: sha256 [0-9a-f]{{64}}, the manifest expects {want}"
    data = bytearray(orig)
    data[len(data) // 2] ^= 0x01                         # one byte of weight data, the size unchanged
    try:
        f.write_bytes(bytes(data))
        with pytest.raises(ArtifactError, match=refused):
            Artifact.load(ref_artifact[0])
        # hashed as the weights are made: the same refusal, before any weights reach a graph
        art = Artifact.load(ref_artifact[0], defer_sha256=True)
        with pytest.raises(ArtifactError, match=refused):
            art.load_weights()
        with pytest.raises(ArtifactError, match=refused):
            GraphExecutor.from_artifact(ref_artifact[0], max_slots=1)
        data = bytearray(orig)
        data[8] ^= 0x01                                  # the header's JSON: the recipe fails on the file itself,
        f.write_bytes(bytes(data))                       # and the refusal names the modified file, not that failure
        with pytest.raises(Exception, match="header"):
            safe_open(str(f), framework="pt")
        with pytest.raises(ArtifactError, match=refused):
            art.load_weights()
    finally:
        f.write_bytes(orig)
    assert sha256_file(f) == want


def test_missing_or_resized_referenced_file_is_refused(ref_artifact, ref_checkpoint, tmp_path):
    f = ref_checkpoint / "model.safetensors"
    shutil.move(f, tmp_path / f.name)
    try:
        for defer in (False, True):                          # deferring the hashes checks presence and size
            with pytest.raises(ArtifactError, match=rf"referenced checkpoint file {f} is missing"):
                Artifact.load(ref_artifact[0], defer_sha256=defer)
        with open(f, "wb") as w:                             # truncated: refused on its size, before any hashing
            w.write((tmp_path / f.name).read_bytes()[:1000])
        for defer in (False, True):
            with pytest.raises(ArtifactError, match=rf"referenced checkpoint file {f}: 1000 bytes"):
                Artifact.load(ref_artifact[0], defer_sha256=defer)
    finally:
        shutil.move(tmp_path / f.name, f)
    Artifact.load(ref_artifact[0])


def test_reference_refused_with_onnx():
    with pytest.raises(ValueError, match="--weights reference needs --backend aoti"):
        ExportOptions(backend="onnx", weights="reference").validate(4096)
    with pytest.raises(ValueError, match="--weights must be copy or reference"):
        ExportOptions(weights="link").validate(4096)


def test_cli_threads_weights_into_export_and_inspect_shows_the_reference(ref_artifact, ref_checkpoint, tmp_path,
                                                                          monkeypatch, capsys):
    import onegraph.export.pipeline as pipeline
    from onegraph import cli
    assert cli.main(["inspect", str(ref_artifact[0])]) == 0            # inspect's memory lines read the reference
    out = capsys.readouterr().out
    assert "weights: referenced" in out and str(ref_checkpoint.resolve() / "config.json") in out
    seen = []
    monkeypatch.setattr(pipeline, "export", lambda model, out, opts, progress, **kw: seen.append(opts) or
                        {"out": str(out), "graphs": {}, "weights_bytes": 0, "timings_s": {}, "cached": [],
                         "workers": 0, "total_s": 0})
    assert cli.main(["export", "tiny", "--out", str(tmp_path / "a"), "--weights", "reference"]) == 0
    assert cli.main(["export", "tiny", "--out", str(tmp_path / "b")]) == 0
    assert [o.weights for o in seen] == ["reference", "copy"]
