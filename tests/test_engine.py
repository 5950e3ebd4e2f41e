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
    from onegraph.checkpoint.load import load_model
    _, model, _ = load_model(hf_checkpoint)
    eng = Engine.from_artifact(hf_artifact, max_slots=1)
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
    # the captured graph takes each row as an input where it lies: contiguous, 16-byte aligned (else AOTInductor
    # copies it first), the rows apart
    for B in (1, 3, 4, 64):
        st = Staging(B, 9, pin=False)
        rows_ = list(st.ints) + list(st.floats)
        offs = [r.data_ptr() - st.bytes.data_ptr() for r in rows_]
        assert all(r.is_contiguous() and r.numel() == B for r in rows_) and all(o % 16 == 0 for o in offs)
        assert all(b - a >= r.numel() * r.element_size() for a, b, r in zip(offs, offs[1:], rows_))

LONG = [(7 * i + 3) % 250 + 1 for i in range(100)]      # 100 tokens: 7 chunks of the artifact's 16


def long_prompt_among_runners(eng, cancel_mid_prefill=False):
    """Two streams decode; once each has 2 tokens, LONG is submitted (8 new tokens). Every event records
    engine.counters["prefill_chunks"] when it was emitted (on the engine thread) -> (runners' [(token,
    chunks)], long's tokens, long's finish reason, the chunk count at long's first token or finish).
    cancel_mid_prefill: a runner's emit cancels LONG once part of it, not all, is prefilled."""
    import threading
    runners, started, finished = [[1, 2, 3], COLOUR_CANARY], threading.Event(), threading.Event()
    got = {0: [], 1: []}
    long_out, long_end, long_id = [], [], []

    def runner_emit(k):
        def emit(ev):
            if ev.token_id is not None:
                got[k].append((ev.token_id, eng.counters["prefill_chunks"]))
            if len(got[0]) >= 2 and len(got[1]) >= 2:
                started.set()
            if cancel_mid_prefill and long_id and any(r.id == long_id[0] and 0 < r.prefilled < len(LONG)
                                                      for r in eng.prefilling):
                eng.cancel(long_id[0])                   # reentrant: emit runs under the engine's lock
        return emit

    def emit_long(ev):
        if ev.token_id is not None:
            long_out.append(ev.token_id)
        if not long_end and (ev.token_id is not None or ev.finish_reason is not None):
            long_end.append(eng.counters["prefill_chunks"])
        if ev.finish_reason is not None:
            long_end.append(ev.finish_reason)
            finished.set()
    done = [threading.Event(), threading.Event()]

    def ender(k, emit):
        return lambda ev: (emit(ev), ev.finish_reason is not None and done[k].set())
    for k, p in enumerate(runners):
        eng.submit(p, ender(k, runner_emit(k)), max_new_tokens=120)
    assert started.wait(60)
    long_id.append(eng.submit(LONG, emit_long, max_new_tokens=8))
    assert finished.wait(60) and all(d.wait(60) for d in done)
    return got, long_out, long_end[-1], long_end[0]


def test_long_prompt_prefills_chunk_by_chunk_between_decode_steps(engine, tiny_eager):
    """A 7-chunk prompt admitted while two streams decode: with the default budget (one 16-token chunk
    per step) the running streams get a token after each of its first 6 chunks, and every output equals
    its solo eager run."""
    assert engine.stats()["prefill_budget"] == 16
    before = engine.stats()["counters"].get("decode_steps_between_chunks", 0)
    got, long_out, reason, at_first = long_prompt_among_runners(engine)
    mid = {c for k in got for _, c in got[k] if at_first - 6 <= c < at_first}   # long part-fed
    assert mid == set(range(at_first - 6, at_first)), f"runners saw chunk counts {sorted(mid)} mid-prefill"
    assert engine.stats()["counters"]["decode_steps_between_chunks"] - before >= 6
    assert reason == "length" and long_out == solo(tiny_eager, LONG, 8)
    for k, p in enumerate([[1, 2, 3], COLOUR_CANARY]):
        toks = [t for t, _ in got[k]]
        assert toks == solo(tiny_eager, p, 120), f"runner {k} differs at {canary.first_diff(toks, solo(tiny_eager, p, 120))}"


def test_prefill_budget_of_a_whole_prompt_stalls_the_runners(tiny_artifact, tiny_eager):
    """The control: a budget holding all of LONG prefills it in one step, so no runner token arrives while
    it is part-fed (what interleaving removes); outputs are the same."""
    with pytest.raises(ValueError, match="prefill_budget"):
        Engine.from_artifact(tiny_artifact, max_slots=3, check_parity=False, prefill_budget=0)
    eng = Engine.from_artifact(tiny_artifact, max_slots=3, check_parity=False, prefill_budget=len(LONG))
    try:
        assert eng.stats()["prefill_budget"] == len(LONG)
        got, long_out, _, at_first = long_prompt_among_runners(eng)
        assert not [c for k in got for _, c in got[k] if at_first - 6 <= c < at_first]
        assert eng.stats()["counters"].get("decode_steps_between_chunks", 0) == 0
        assert long_out == solo(tiny_eager, LONG, 8)
    finally:
        eng.close()


def test_cancel_mid_prefill_frees_the_slot(engine, tiny_eager):
    got, long_out, reason, chunks_at_end = long_prompt_among_runners(engine, cancel_mid_prefill=True)
    assert reason == "cancelled" and long_out == []
    for k, p in enumerate([[1, 2, 3], COLOUR_CANARY]):
        assert [t for t, _ in got[k]] == solo(tiny_eager, p, 120)
    st = engine.stats()
    assert st["active_slots"] == 0 and st["prefilling"] == 0 and st["free_slots"] == 3
    # the part-prefilled slot is reused clean (every slot is taken by these three)
    for _ in range(3):
        assert engine.generate(LONG[:40], 12).token_ids == solo(tiny_eager, LONG[:40], 12)
