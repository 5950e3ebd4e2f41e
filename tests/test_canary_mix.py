"""The batch-invariance canary's logic on the CPU `tiny` artifact (tests/canary.py run_mix; the GPU canary,
tests/test_cuda_canary.py, runs 224 requests on a CUDA artifact exported with --batch-invariant): 48 requests
(3 prompts x greedy, temperature, top-k and top-p seeded samplers x 4 repeats), staggered through Engine.stream
on 3 slots (decode buckets 1, 2, 4), each equal to its solo run token for token; and the same over HTTP (SSE,
clients leaving mid-stream)."""
import canary
import pytest

from onegraph.runtime import Engine


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    eng = Engine.from_artifact(tiny_artifact, max_slots=3, max_queue=512)
    yield eng
    eng.close()


def test_mixed_samplers_equal_their_solo_runs(engine):
    n, failures = canary.run_mix(engine, n_prompts=3, repeats=4, max_new_tokens=24)
    assert n == 48
    assert not failures, f"{len(failures)} of {n} requests differ from their solo run; first: {failures[0]}"
    c = engine.stats()["counters"]
    assert c["decode_rows"] > c["decode_steps"], "no step ever batched two rows"


def test_mixed_samplers_over_http_equal_their_solo_runs(engine):
    """The same over the OpenAI server: half the requests streamed (SSE), 6 neighbours leaving mid-stream."""
    from onegraph.server.app import create_app
    from server_helpers import running
    before = engine.stats()["counters"].get("finished_cancelled", 0)
    with running(create_app(engine, "tiny-canary")) as url:
        n, failures = canary.run_mix_http(url, "tiny-canary", n_prompts=3, repeats=2, leavers=6, max_new_tokens=24)
    assert n == 24
    assert not failures, f"{len(failures)} of {n} requests differ from their solo run; first: {failures[0]}"
    assert engine.stats()["counters"].get("finished_cancelled", 0) - before == 6, "a leaving client was not cancelled"
