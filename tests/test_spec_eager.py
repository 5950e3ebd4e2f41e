"""Speculative decoding with the MTP head, eager, CPU fp32 (graphs/spec.py).

The reference is speculation off: graphs/eager.py generate_eager (prefill + one decode step per token),
an independent loop over the model's own entry points. Checked: token-identical output for 128 tokens at
k = 1..4 (the tiny model + a seeded random head: acceptance near 0), with drafts forced right (acceptance
k) and wrong (acceptance 0) through the explicit `draft_fn` argument, at temperature > 0 with a seed; the
committed state after every round equals the speculation-off state at the same length, position by
position; and rows written from rejected tokens are inert: overwriting them with garbage changes nothing.
The exported round (graphs/spec_graphs.py), run eagerly under the Engine with the trained head, gives
the same ids for concurrent greedy and sampled requests at k = 1, 2, 4.
"""
import itertools

import pytest
import torch

from onegraph.custom_ops.sample import Sampling
from onegraph.graphs.eager import generate_eager, i64
from onegraph.models.qwen3_5.model import new_state
from onegraph.graphs.spec import generate_spec, mtp_catch_up, new_mtp_state, prefill_hidden

N = 128
PROMPT = list(b"def main(argv):\n    ")
V = 264


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, one_thread):
    from onegraph.scripts.bench_spec import random_mtp_checkpoint
    return random_mtp_checkpoint(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def model(checkpoint):
    from onegraph.checkpoint.load import load_model
    return load_model(checkpoint, mtp=True)[1]


@pytest.fixture(scope="module")
def ref(model):
    """Speculation-off ids, N + 4 of them (forced drafts of the last round read past N)."""
    return generate_eager(model, PROMPT, N + 4).token_ids


def forced(ref, wrong_after):
    """draft_fn drafting the reference's tokens, wrong from the `wrong_after(p, k)`-th draft on
    (wrong: the reference token + 1, never the target)."""
    P = len(PROMPT)

    def draft(p, k):
        # drafts are x_{p+1..p+k}; the reference's generated token i sits at position P + i
        right = [ref[p + 1 + j - P] for j in range(k)]
        n = wrong_after(p, k)
        return right[:n] + [(t + 1) % V for t in right[n:]]
    return draft


def cycling():
    """wrong_after for `forced`: 0, 1, .., k, 0, 1, .. right drafts in successive rounds."""
    calls = itertools.count()
    return lambda p, k: next(calls) % (k + 1)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_identical_with_the_head(model, ref, k):
    r = generate_spec(model, PROMPT, N, k)
    assert r.token_ids == ref[:N]
    assert len(r.accepted) >= N // (k + 1) and all(0 <= a <= k for a in r.accepted)


@pytest.mark.parametrize("k", [1, 4])
def test_drafts_always_right_accept_k(model, ref, k):
    r = generate_spec(model, PROMPT, N, k, draft_fn=forced(ref, lambda p, k: k))
    assert r.token_ids == ref[:N]
    assert r.accepted == [k] * len(r.accepted) and len(r.accepted) == -(-(N - 1) // (k + 1))


@pytest.mark.parametrize("k", [1, 4])
def test_drafts_always_wrong_accept_0(model, ref, k):
    r = generate_spec(model, PROMPT, N, k, draft_fn=forced(ref, lambda p, k: 0))
    assert r.token_ids == ref[:N]
    assert r.accepted == [0] * (N - 1)


@pytest.mark.parametrize("k", [2, 4])
def test_seeded_sampling_identical(model, k):
    """The target samples each position with the request's (seed, position) noise, as decode does, so
    speculation on gives speculation off's ids at temperature > 0 too (not only the same distribution)."""
    sp = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=11)
    want = generate_eager(model, PROMPT, 64 + k, sp).token_ids
    assert generate_spec(model, PROMPT, 64, k, sp).token_ids == want[:64]
    r = generate_spec(model, PROMPT, 64, k, sp, draft_fn=forced(want, cycling()))
    assert r.token_ids == want[:64] and len(set(r.accepted)) > 1        # partial acceptances, same ids
    assert generate_eager(model, PROMPT, 64, Sampling(0.9, 40, 0.95, 12)).token_ids != want  # the seed matters


def test_prefill_hidden_is_prefill(model):
    def run(fn):
        state = new_state(model.cfg, 1, 64, torch.float32)
        out = fn(i64(PROMPT, "cpu"), i64([0], "cpu"), i64([0], "cpu"), i64([len(PROMPT)], "cpu"),
                 *Sampling().tensors(1, "cpu"), *state)
        return out, state
    (nxt, logits, hidden), st = run(lambda *a: prefill_hidden(model, *a))
    (nxt2, logits2), st2 = run(model.prefill)
    assert hidden.shape == (len(PROMPT), model.cfg.hidden_size)
    assert torch.equal(nxt, nxt2) and torch.equal(logits, logits2)
    assert all(torch.equal(a, b) for a, b in zip(st, st2))


@torch.no_grad()
def test_head_is_the_training_forward(model, checkpoint):
    """The head's catch-up over a prompt gives the MTP logits of the training forward (scripts/train_tiny.py:
    the ops' references over whole windows, head position t on (h_t, x_{t+1}) at rotary position t), so
    a head trained there drafts here as it was trained."""
    from onegraph.checkpoint.load import load_model
    from onegraph.scripts.train_tiny import forward
    tokens = PROMPT + [10, 32]
    T = len(PROMPT)
    unfused = load_model(checkpoint, mtp=True, fuse=False)[1]            # the training forward reads q/k/v_proj
    _, want, _ = forward(unfused, torch.tensor([tokens]))                # [1, T, V]: predicts tokens[2:]
    z, slot, sp = i64([0], "cpu"), i64([0], "cpu"), Sampling().tensors(1, "cpu")
    _, _, hidden = prefill_hidden(model, i64(PROMPT, "cpu"), slot, z, i64([T], "cpu"), *sp,
                                  *new_state(model.cfg, 1, 64, torch.float32))
    y = mtp_catch_up(model, hidden, i64(tokens[1:T + 1], "cpu"), slot, z, i64([T], "cpu"),
                     *new_mtp_state(model, 1, 64))
    torch.testing.assert_close(model._logits(y), want[0], rtol=1e-4, atol=1e-4)


def off_states(model, ids, max_seq_len):
    """Speculation-off state (prefill + decode steps over ids) at every committed length L -> {L: clones}."""
    sp = Sampling().tensors(1, "cpu")
    state = new_state(model.cfg, 1, max_seq_len, torch.float32)
    slot = i64([0], "cpu")
    P = len(PROMPT)
    model.prefill(i64(PROMPT, "cpu"), slot, i64([0], "cpu"), i64([P], "cpu"), *sp, *state)
    out = {P: [t.clone() for t in state]}
    for i, t in enumerate(ids[:-1]):
        model.decode(i64([t], "cpu"), slot, i64([P + i], "cpu"), *sp, *state)
        out[P + i + 1] = [s.clone() for s in state]
    return out


@pytest.mark.parametrize("k", [3])
def test_committed_state_equals_speculation_off(model, ref, k):
    """After every round (random head; and forced drafts right for a varying prefix then wrong), each
    GDN conv / recurrent state of the slot and every KV row below the committed length equals the
    speculation-off state at that length. fp32: a verify computes its k+1 rows in one matmul where decode
    computes one, so sums may differ in the last bits (measured: <= 6e-6 on values up to 5; a state
    committed at the wrong position differs by O(0.1))."""
    n = 48
    names = [t.name for t in model.state_spec(1, 1, torch.float32)]
    want = off_states(model, ref, len(PROMPT) + n + k + 1)
    for draft_fn in (None, forced(ref, cycling())):
        seen = []

        def hook(L, state, mtp_state):
            seen.append(L)
            for name, got, exp in zip(names, state, want[L]):
                if name.endswith(("k_cache", "v_cache")):
                    for pos in range(L):                                  # position by position
                        torch.testing.assert_close(got[0, :, pos], exp[0, :, pos], rtol=1e-5, atol=5e-5,
                                                   msg=lambda m: f"{name} row {pos} at length {L}: {m}")
                else:
                    torch.testing.assert_close(got[0], exp[0], rtol=1e-5, atol=5e-5,
                                               msg=lambda m: f"{name} at length {L}: {m}")

        r = generate_spec(model, PROMPT, n, k, draft_fn=draft_fn, state_hook=hook)
        assert r.token_ids == ref[:n]
        assert len(seen) == len(r.accepted) and any(a < k for a in r.accepted)
        if draft_fn is not None:
            assert len(set(r.accepted)) > 1                              # partial acceptances happened


def test_rejected_rows_are_inert(model, ref):
    """After every round, every KV row at or beyond the committed length (main model and head; the
    rejected positions' rows among them) is overwritten with large finite garbage. Read by any query,
    it would change the logits; the ids and every round's acceptance stay those of the clean run."""
    k, n = 4, 64
    clean = generate_spec(model, PROMPT, n, k)
    names = [t.name for t in model.state_spec(1, 1, torch.float32)]
    gen = torch.Generator().manual_seed(0)
    head_from = [len(PROMPT)]                     # the head's rows >= the previous committed length are drafts'

    def poison(L, state, mtp_state):
        for name, t in zip(names, state):
            if name.endswith(("k_cache", "v_cache")):
                t[0, :, L:] = torch.randn(t[0, :, L:].shape, generator=gen) * 1e3
        for t in mtp_state:
            t[0, :, head_from[0]:] = torch.randn(t[0, :, head_from[0]:].shape, generator=gen) * 1e3
        head_from[0] = L

    r = generate_spec(model, PROMPT, n, k, state_hook=poison)
    assert r.token_ids == ref[:n] == clean.token_ids
    assert r.accepted == clean.accepted and r.drafts == clean.drafts


def test_refuses(model, tiny_eager):
    with pytest.raises(ValueError, match="speculative tokens must be an integer in 1..4"):
        generate_spec(model, PROMPT, 8, 5)
    with pytest.raises(ValueError, match="speculative tokens"):
        generate_spec(model, PROMPT, 8, 0)
    with pytest.raises(ValueError, match="needs the model's MTP head"):
        generate_spec(tiny_eager, PROMPT, 8, 2)


@pytest.fixture(scope="module")
def trained(one_thread):
    from onegraph.checkpoint.load import load_model
    return load_model("tiny", mtp=True)[1]


def _engine_round(model, k):
    """Two concurrent requests (one greedy, one sampled) through the Engine on the exported round run eagerly
    -> speculation stats; each request's ids must be generate_eager's."""
    import threading
    from onegraph.runtime.engine import Engine
    from onegraph.runtime.executor import GraphExecutor
    ex = GraphExecutor.from_model(model, {"decode": [2], "prefill": [16], "spec": [2]}, 2, 128, speculative_tokens=k)
    eng = Engine(ex)
    reqs = [(PROMPT, 32, Sampling()), (list(b"import os\nimport sys\n"), 24, Sampling(0.8, 40, 0.95, 5))]
    got = [None, None]

    def run(i):
        p, n, sp = reqs[i]
        got[i] = eng.generate(p, n, sp.temperature, sp.top_k, sp.top_p, sp.seed)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        s = eng.stats()["speculation"]
    finally:
        eng.close()
    for (p, n, sp), r in zip(reqs, got):
        assert r.token_ids == generate_eager(model, p, n, sp).token_ids
    return s


@pytest.mark.parametrize("k", [1, 2, 4])
def test_batched_round_through_the_engine(trained, k):
    """The exported round (graphs/spec_graphs.py: batched slots, positions on the device), run eagerly under
    the runtime Engine (GraphExecutor.from_model), with the trained head: two concurrent requests, one greedy
    and one sampled, give generate_eager's ids; drafts are accepted and rejected."""
    s = _engine_round(trained, k)
    assert 0 < s["accepted_drafts"] < s["rounds"] * k


@pytest.fixture(scope="module")
def pruned(one_thread):
    """The trained tiny whose head drafts over the 64 ids its training corpus uses most (the builtin ranking)."""
    from onegraph.checkpoint.draft_vocab import draft_ids
    from onegraph.checkpoint.load import load_model
    from onegraph.graphs.spec import prune_draft_vocab
    cfg, model, _ = load_model("tiny", mtp=True)
    prune_draft_vocab(model, draft_ids("tiny", 64, cfg.vocab_size, None))
    return model


def test_pruned_draft_logits_are_the_heads_at_its_ids(pruned):
    """draft_logits: at the 64 ids the full head's logits (the same rows), -inf at every other id."""
    from onegraph.graphs.spec import draft_logits
    y = torch.randn(3, pruned.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = pruned.mtp.draft_ids
    got, full = draft_logits(pruned, y), pruned._logits(y)
    assert got.shape == full.shape and ids.numel() == 64
    assert torch.allclose(got[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)
    rest = torch.ones(full.shape[1], dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(got[:, rest]).all()


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.8, 40, 0.95, 5)], ids=["greedy", "sampled"])
def test_pruned_draft_vocab_keeps_the_output(pruned, sampling):
    """Drafts over 64 ids: every draft is one of them, drafts are accepted, and the output is speculation
    off's, greedy and seeded sampling alike (the verify decides over the whole vocabulary)."""
    r = generate_spec(pruned, PROMPT, 64, 3, sampling)
    assert r.token_ids == generate_eager(pruned, PROMPT, 64, sampling).token_ids
    allowed = set(pruned.mtp.draft_ids.tolist())
    assert all(d in allowed for ds in r.drafts for d in ds) and sum(r.accepted) > 0


def test_pruned_round_through_the_engine(pruned):
    """The exported round with the pruned head, through the Engine: generate_eager's ids, drafts accepted."""
    s = _engine_round(pruned, 2)
    assert 0 < s["accepted_drafts"] < s["rounds"] * 2


def test_verify_past_the_kv_cache_is_inert(model, ref):
    """A verify whose last positions lie past the KV cache (start_pos + k >= Tmax, a request's last round)
    writes those rows to the scratch slot: it raises nothing, and the in-cache targets and the slot's KV rows
    equal those of the same verify with a longer cache."""
    from onegraph.graphs.spec import verify
    k, P = 4, len(PROMPT)
    names = [t.name for t in model.state_spec(1, 1, torch.float32)]

    def run(tmax):
        state = new_state(model.cfg, 1, tmax, torch.float32)
        sp, slot = Sampling().tensors(1, "cpu"), i64([0], "cpu")
        model.prefill(i64(PROMPT, "cpu"), slot, i64([0], "cpu"), i64([P], "cpu"), *sp, *state)
        targets, *_ = verify(model, i64([ref[0]], "cpu"), i64(ref[1:k + 1], "cpu"), slot, i64([P], "cpu"), *sp,
                             *state)
        return targets, state

    t_long, st_long = run(P + 16)
    t_short, st_short = run(P + 2)                       # rows P+2..P+4 past the cache
    torch.testing.assert_close(t_short[:2], t_long[:2], rtol=0, atol=0)
    assert t_long[:k].tolist() == ref[1:k + 1]
    for name, a, b in zip(names, st_short, st_long):
        if name.endswith(("k_cache", "v_cache")):
            torch.testing.assert_close(a[0], b[0, :, :P + 2], rtol=1e-6, atol=1e-6)
