"""Rung 4: the replaying Engine vs eager — repeated canaries under continuous batching with
one-step-late output, seeded sampling, slot hygiene, cancellation and bad input."""
import asyncio

import canary
import pytest

from onegraph.custom_ops.sample import Sampling
from onegraph.graphs.eager import generate_eager
from onegraph.runtime import Engine

COLOUR_CANARY = canary.PROMPTS["colour"]
REPEATS = 96


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    eng = Engine.from_artifact(tiny_artifact, max_slots=3, max_queue=512)
    yield eng
    eng.close()


def solo(model, prompt, n, **sp):
    return generate_eager(model, prompt, n, Sampling(**sp), max_seq_len=256).token_ids


def test_replay_equals_eager_64_tokens(engine, tiny_eager):
    for prompt in ([1, 2, 3], COLOUR_CANARY):
        got = engine.generate(prompt, 64)
        ref = solo(tiny_eager, prompt, 64)
        assert got.token_ids == ref, f"first differing step {canary.first_diff(got.token_ids, ref)}"
        assert got.finish_reason == "length"


def test_replay_equals_eager_transformers_checkpoint(hf_artifact, hf_checkpoint):
    from onegraph.graphs.load import load_model
    _, model, _ = load_model(hf_checkpoint)
    eng = Engine.from_artifact(hf_artifact, max_slots=2)
    try:
        prompt = [5, 17, 42, 99, 3, 250, 7, 64, 11]
        got = eng.generate(prompt, 64).token_ids
        ref = generate_eager(model, prompt, 64, max_seq_len=128).token_ids
        assert got == ref, f"first differing step {canary.first_diff(got, ref)}"
    finally:
        eng.close()


def test_canaries_repeated_under_mixed_batches(engine, tiny_eager):
    """96 repeats of each canary, admitted at staggered steps into different slots, with different
    lengths and neighbours (sampled noise requests among them); every repeat must equal its solo
    eager run token for token."""
    refs = {name: solo(tiny_eager, p, 40) for name, p in canary.PROMPTS.items()}
    failures = canary.run(engine, refs, REPEATS)
    assert not failures, f"{len(failures)} of {2 * REPEATS} canaries differ; first: {failures[0]}"
    stats = engine.stats()
    assert stats["active_slots"] == 0 and stats["queue_depth"] == 0
    assert stats["counters"]["decode_rows"] > stats["counters"]["decode_steps"], "no step ever batched two rows"


def test_seeded_sampling_is_reproducible_and_neighbour_independent(engine, tiny_eager):
    prompt, sp = [9, 8, 7, 6], dict(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    alone = engine.generate(prompt, 24, **sp).token_ids
    assert alone == solo(tiny_eager, prompt, 24, **sp), "replayed sampling differs from eager sampling"

    async def crowd():
        others = [engine.stream([k, k + 1], max_new_tokens=30, temperature=1.0, seed=k) for k in range(4)]

        async def drain(it):
            return [ev.token_id async for ev in it if ev.token_id is not None]
        res = await asyncio.gather(drain(engine.stream(prompt, max_new_tokens=24, **sp)), *map(drain, others))
        return res[0]
    assert asyncio.run(crowd()) == alone
    assert engine.generate(prompt, 24, **dict(sp, seed=4321)).token_ids != alone


def test_slot_reuse_after_long_request_matches_fresh(engine, tiny_eager):
    engine.generate(list(range(100, 180)), 120)          # fills a slot deep into its cache and state
    for _ in range(3):                                    # every slot gets reused at least once
        assert engine.generate([1, 2, 3], 20).token_ids == solo(tiny_eager, [1, 2, 3], 20)


def test_stop_ids_end_one_step_late_without_leaking(engine, tiny_eager):
    ref = solo(tiny_eager, [1, 2, 3], 16)
    stop = ref[5]
    got = engine.generate([1, 2, 3], 16, stop_ids=[stop])
    assert got.finish_reason == "stop"
    assert got.token_ids == ref[:ref.index(stop)]


def test_cancel_mid_decode_frees_the_slot(engine):
    async def main():
        rid, seen = [], 0
        async for ev in engine.stream([4, 5, 6], max_new_tokens=200, request_id=rid):
            seen += 1
            if seen == 3:
                assert engine.cancel(rid[0])
            if ev.finish_reason is not None:
                return ev.finish_reason, seen
    reason, seen = asyncio.run(main())
    assert reason == "cancelled" and seen < 200
    for _ in range(100):
        if engine.stats()["active_slots"] == 0:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert engine.stats()["active_slots"] == 0


@pytest.mark.parametrize("prompt,n,match", [
    ([], 4, "prompt is empty"),
    ([1, 2, 999], 4, "outside the vocabulary"),
    ([1] * 250, 10, "exceeds the artifact's max_seq_len"),
    ([1], 0, "max_new_tokens"),
])
def test_bad_input_is_a_value_error_and_engine_keeps_serving(engine, tiny_eager, prompt, n, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompt, n)
    assert engine.generate([1, 2, 3], 4).token_ids == solo(tiny_eager, [1, 2, 3], 4)
    assert engine.stats()["error"] is None


def test_decode_staging_rows_and_padding(engine):
    """Both decode paths take their per-row inputs from one staging buffer (runtime/cuda_graphs.Staging);
    it must hold what the graphs expect: the rows' values, then padding rows on the scratch slot with
    position 0 and greedy sampling — checked against the prefill path's own sampling tensors."""
    import torch

    from onegraph.runtime import Sampling
    from onegraph.runtime.cuda_graphs import Staging
    rows = [Sampling(0.7, 5, 0.9, 2**62 + 3), Sampling(), Sampling(1.3, 0, 0.5, -4)]
    st = Staging(4, 9, pin=False)
    st.fill([2, 0, 5, 1], [1, 2, 3, 4], rows + [Sampling(0.5, 1, 0.5, 1)])   # a full step, then a short one
    st.fill([2, 0, 5], [17, 0, 255], rows)
    temperature, top_k, top_p, seed = engine.ex._sampling(rows, 4)
    assert torch.equal(st.ints[0], torch.tensor([2, 0, 5, 9])) and torch.equal(st.ints[1], torch.tensor([17, 0, 255, 0]))
    assert torch.equal(st.ints[2], top_k) and torch.equal(st.ints[3], seed)
    assert torch.equal(st.floats[0], temperature) and torch.equal(st.floats[1], top_p)