"""The batch-invariance canary on a GPU (run on the H200 through the device tool; skipped without CUDA): a bf16
`tiny` CUDA artifact exported with --batch-invariant (decode buckets 1, 4, 8; prefill chunks 16 and 64), one with
--quant fp8 --fp8-lm-head and one with --speculative-tokens 2 besides; on each, 224 requests (7 prompts x 4
samplers: greedy; temperature 0.8 seed 11; top-k 20 seed 3; top-p 0.9 at temperature 0.7 seed 5; x 8 repeats)
staggered through Engine.stream on 8 slots, each equal to the same request run alone, token for token
(tests/canary.py run_mix); and the same 224 over the OpenAI server (in this process, 8 slots): half streamed as
SSE, 16 long streamed neighbours whose clients leave after two chunks (run_mix_http). The same mix on the CPU
artifact: tests/test_canary_mix.py.
test_default_artifact_for_the_record runs the mix on the artifact exported without the option and prints its
count (batching may legitimately change a row's last bits there, so it asserts nothing about them)."""
import canary
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EXPORT = dict(device="cuda", dtype="bfloat16", batch_sizes=(1, 4, 8), prefill_chunks=(16, 64), max_seq_len=256)


def _export(tmp_path_factory, name, **kw):
    from onegraph.export.pipeline import ExportOptions, export
    out = tmp_path_factory.mktemp("canary") / name
    export("tiny", out, ExportOptions(**EXPORT, **kw), progress=False)
    return out


def _mix(path, http=False):
    from onegraph.runtime import Engine
    eng = Engine.from_artifact(path, max_slots=8, max_queue=512, device="cuda")
    try:
        if http:
            from onegraph.server.app import create_app
            from server_helpers import running
            with running(create_app(eng, "tiny-canary")) as url:
                n, failures = canary.run_mix_http(url, "tiny-canary", n_prompts=len(canary.MIX_PROMPTS), repeats=8,
                                                  leavers=16, max_new_tokens=32)
        else:
            n, failures = canary.run_mix(eng, n_prompts=len(canary.MIX_PROMPTS), repeats=8, max_new_tokens=32)
        c = eng.stats()["counters"]
        return n, failures, c
    finally:
        eng.close()


# bf16 weights; block-FP8 projections, experts and lm_head (--quant fp8 --fp8-lm-head); bf16 with the MTP head's
# speculative rounds (K = 2: every request of the mix runs them, its verify rows beside other slots')
INVARIANT = {"bf16": dict(), "fp8": dict(quant="fp8", fp8_lm_head=True), "spec": dict(speculative_tokens=2)}


@pytest.fixture(scope="module", params=list(INVARIANT))
def invariant_artifact(request, tmp_path_factory):
    return request.param, _export(tmp_path_factory, f"tiny-bi-{request.param}", batch_invariant=True,
                                  **INVARIANT[request.param])


def test_invariant_artifact_records_the_option(invariant_artifact):
    from onegraph.export.pipeline import inspect
    from onegraph.runtime.artifact import verify
    weights, path = invariant_artifact
    m = verify(path, files=False)
    assert m["options"]["batch_invariant"] is True
    assert "batch invariance: on" in inspect(path, m)
    lin, moe = ("linear_fp8", "fused_moe_fp8") if weights == "fp8" else ("linear", "fused_moe")
    for name, g in m["graphs"].items():
        ops = set(g["ops"])
        if g["kind"] in ("decode", "spec"):
            assert {f"onegraph::{lin}_invariant_triton", f"onegraph::{moe}_invariant_triton",
                    "onegraph::attention_decode_invariant_triton"} <= ops, name
            assert not {f"onegraph::{lin}_triton", f"onegraph::{moe}_triton"} & ops, name
        else:                               # prefill runs one request per call: the default kernels
            assert not any(o.endswith("_invariant_triton") for o in ops), name


def test_224_requests_equal_their_solo_runs(invariant_artifact):
    weights, path = invariant_artifact
    n, failures, c = _mix(path)
    print(f"batch-invariant {weights} artifact: {n - len(failures)} of {n} requests equal their solo run; "
          f"decode steps {c['decode_steps']}, rows {c['decode_rows']}")
    assert n == 224
    assert c["decode_rows"] > c["decode_steps"], "no step ever batched two rows"
    assert not failures, f"{len(failures)} of {n} requests differ from their solo run; first: {failures[0]}"


def test_224_requests_over_http_equal_their_solo_runs(invariant_artifact):
    weights, path = invariant_artifact
    n, failures, c = _mix(path, http=True)
    print(f"batch-invariant {weights} artifact over HTTP (SSE, 16 clients leaving): {n - len(failures)} of {n} "
          f"requests equal their solo run; decode steps {c['decode_steps']}, rows {c['decode_rows']}, "
          f"cancelled {c.get('finished_cancelled', 0)}")
    assert n == 224
    assert c.get("finished_cancelled", 0) > 0, "no leaving client was cancelled mid-stream"   # 192-token streams
    assert not failures, f"{len(failures)} of {n} requests differ from their solo run; first: {failures[0]}"


def test_default_artifact_for_the_record(tmp_path_factory):
    n, failures, _ = _mix(_export(tmp_path_factory, "tiny-default"))
    print(f"default artifact: {n - len(failures)} of {n} requests equal their solo run"
          + (f"; first differing: {failures[0]}" if failures else ""))
    assert n == 224
