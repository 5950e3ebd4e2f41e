"""Speculative decoding through an exported artifact (export --speculative-tokens, runtime Engine, CLI, metrics).

One artifact of the trained builtin tiny model (fp32 CPU, K = 3, the head drafting over the 128 ids of its builtin
ranking (--draft-vocab 128), decode / spec bucket 2 (one row runs it padded), prefill chunk 16, max_seq_len 192) runs with speculation on and off (the same artifact: speculation off uses its decode
graphs). The reference is speculation off, and for the first test also the eager model (graphs/eager.py).
Checked: greedy token identity for 128 tokens with real acceptances; the canaries (staggered requests,
mixed batches of greedy and sampled rows, a slot reused after rounds with rejections); seeded sampling
token-identical (the target samples every position with the request's (seed, position) noise, as decode
does, so speculation changes no token, graphs/spec.py); a chi-square test that the first speculative
token follows the target's distribution; rejected positions' KV rows inert (overwritten with garbage
between rounds); a request that ends exactly at max_seq_len; the refusals (K out of range, no MTP head,
speculation asked of an artifact without the graphs); generate --json and /metrics.
"""
import json
import math

import pytest
import torch

from onegraph.custom_ops.sample import Sampling
from onegraph.runtime.artifact import Artifact

K = 3
MAX_SEQ = 192
DRAFT_VOCAB = 128


def heldout_prompts(n, length):
    from onegraph.scripts.bench_spec import HELDOUT_TEXT, heldout_prompts as prompts
    return prompts(HELDOUT_TEXT, n, length)


@pytest.fixture(scope="module")
def spec_artifact(tmp_path_factory):
    from onegraph.export.pipeline import ExportOptions, export
    out = tmp_path_factory.mktemp("art") / "tiny_spec"
    export("tiny", out, ExportOptions(batch_sizes=(2,), prefill_chunks=(16,), max_seq_len=MAX_SEQ,
                                      speculative_tokens=K, draft_vocab=DRAFT_VOCAB), progress=False)
    return out


@pytest.fixture(scope="module")
def engines(spec_artifact, one_thread):
    """(speculation on, off): two engines over one artifact, 2 slots each."""
    from onegraph.runtime import Engine
    on = Engine.from_artifact(spec_artifact, max_slots=2)
    off = Engine.from_artifact(spec_artifact, max_slots=2, check_parity=False, speculation=False)
    yield on, off
    on.close()
    off.close()


def test_manifest_and_graphs(spec_artifact):
    m = json.loads((spec_artifact / "manifest.json").read_text())
    assert m["speculative_tokens"] == K and m["options"]["speculative_tokens"] == K
    assert sorted(m["graphs"]) == ["decode_b2", "prefill_t16", "spec_b2"]
    names = [t["name"] for t in m["state"]]
    assert names[-4:] == ["mtp0.k_cache", "mtp0.v_cache", "spec.y", "spec.pos"]
    # every state tensor carries its kind; Artifact.state_tensors reads them typed
    kinds = {t["name"]: t["kind"] for t in m["state"]}
    assert [kinds[n] for n in names[-4:]] == ["kv", "kv", "spec", "spec"]
    assert {kinds["layer0.conv"], kinds["layer0.rec"], kinds["layer3.k_cache"]} == {"conv", "recurrent", "kv"}
    assert [t.kind for t in Artifact.load(spec_artifact).state_tensors] == [kinds[n] for n in names]
    assert not any(i["name"].startswith(("mtp", "spec.")) for i in m["graphs"]["decode_b2"]["inputs"])
    assert m["graphs"]["spec_b2"]["outputs"] == ["next_ids", "n_accepted", "targets", "drafts"]
    from onegraph.checkpoint.draft_vocab import draft_ids, ids_sha256
    ids = draft_ids("tiny", DRAFT_VOCAB, 264, None)
    assert m["draft_vocab"]["size"] == DRAFT_VOCAB and m["draft_vocab"]["sha256"] == ids_sha256(ids)
    assert m["weight_shapes"]["model.mtp.draft_ids"] == [DRAFT_VOCAB]


def test_greedy_identical_128_tokens(engines, tiny_eager):
    """Trained tiny, greedy: speculation on == off == eager for 128 tokens, with drafts accepted."""
    from onegraph.graphs.eager import generate_eager
    on, off = engines
    accepted = []
    for p in heldout_prompts(2, 48):
        want = off.generate(p, 128).token_ids
        assert want == generate_eager(tiny_eager, p, 128).token_ids
        r = on.generate(p, 128)
        assert r.token_ids == want
        assert r.speculation["tokens"] == K and r.speculation["rounds"] < 128
        accepted.append(r.speculation["accepted_mean"])
    assert min(accepted) > 0.3          # the trained head's drafts are accepted (measured: 1.2-2.0 of 3)
    assert max(accepted) < K            # and some are rejected


def test_rounds_are_the_eager_reference_rounds(engines):
    """The artifact's rounds draft what the eager one-slot reference (graphs/spec.py generate_spec) drafts: the
    same number of rounds and accepted drafts, with the prompt prefilled in three 16-token chunks (the head
    catches up chunk by chunk in the graphs, over the whole prompt at once in the reference)."""
    from onegraph.checkpoint.load import load_model
    from onegraph.graphs.spec import generate_spec
    on, _ = engines
    model = load_model("tiny", mtp=True)[1]
    p = heldout_prompts(3, 40)[1]
    ref = generate_spec(model, p, 64, K)
    r = on.generate(p, 64)
    assert r.token_ids == ref.token_ids
    assert r.speculation["rounds"] == len(ref.accepted)
    assert r.speculation["accepted_mean"] == pytest.approx(ref.accepted_mean) and 0 < ref.accepted_mean < K


def _solo(off, p, n, sp=Sampling()):
    return off.generate(p, n, sp.temperature, sp.top_k, sp.top_p, sp.seed).token_ids


def test_canaries_staggered_mixed_and_slot_reuse(engines):
    """Five requests of different lengths and sampling through 2 slots (so slots are reused after rounds
    with rejections, and rows join and leave batches in the middle of each other's rounds): each request's
    ids are its speculation-off ids generated alone."""
    import threading
    on, off = engines
    prompts = heldout_prompts(5, 24)
    reqs = [(prompts[0], 40, Sampling()), (prompts[1], 7, Sampling(0.8, 20, 0.9, 3)), (prompts[2][:5], 25, Sampling()),
            (prompts[3], 33, Sampling(1.0, 0, 1.0, 11)), (prompts[4], 18, Sampling())]
    want = [_solo(off, p, n, sp) for p, n, sp in reqs]
    rounds0 = on.stats()["speculation"]
    got = [None] * len(reqs)

    def run(i):
        p, n, sp = reqs[i]
        got[i] = on.generate(p, n, sp.temperature, sp.top_k, sp.top_p, sp.seed).token_ids

    threads = []
    for i in range(len(reqs)):                      # staggered: each arrives while others run
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        threads[-1].join(0.02 * (i % 2))
    for t in threads:
        t.join(120)
    assert got == want
    s = on.stats()["speculation"]
    drafted = (s["rounds"] - rounds0["rounds"]) * K
    assert 0 < s["accepted_drafts"] - rounds0["accepted_drafts"] < drafted     # rejections happened


def test_seeded_sampling_identical(engines):
    """temperature > 0, seeded: token-identical to speculation off (shared (seed, position) noise)."""
    on, off = engines
    p = heldout_prompts(3, 32)[2]
    for seed in (0, 7):
        sp = Sampling(0.9, 40, 0.95, seed)
        assert on.generate(p, 64, 0.9, 40, 0.95, seed).token_ids == _solo(off, p, 64, sp)
    assert _solo(off, p, 64, Sampling(0.9, 40, 0.95, 0)) != _solo(off, p, 64, Sampling(0.9, 40, 0.95, 7))


def test_prefix_cache_hits_equal_misses(spec_artifact, engines, one_thread):
    """The prefix cache on a speculative artifact: requests sharing a 48-token prefix (3 blocks of 16) hit it,
    and each equals its run on the cache-less speculative engine: the same ids (greedy and seeded) and the same
    rounds and accepted drafts (the head's KV rows [0, 48) come from the cache: wrong rows change its drafts)."""
    from onegraph.runtime import Engine
    on, _ = engines
    cached = Engine.from_artifact(spec_artifact, max_slots=2, check_parity=False, prefix_cache_bytes=8 << 20)
    try:
        ps = heldout_prompts(4, 60)
        for k, sp in enumerate((Sampling(), Sampling(0.9, 40, 0.95, 5))):
            for i, p in enumerate(ps):
                prompt = ps[0][:48] + p[48:]
                args = (prompt, 40, sp.temperature, sp.top_k, sp.top_p, sp.seed)
                want, got = on.generate(*args), cached.generate(*args)
                assert got.token_ids == want.token_ids, (k, i)
                assert (got.speculation["rounds"], got.speculation["accepted_mean"]) == \
                    (want.speculation["rounds"], want.speculation["accepted_mean"]), (k, i)
                assert got.cached_tokens == (0 if k == i == 0 else 48), (k, i)
        assert cached.stats()["prefix_cache"]["hits"] == 7
        # a prompt of exactly 3 blocks, then one that extends it (a next turn): the head's row at position 47
        # was made on the id sampled there, not on the extension's 49th token, so that block is not reused
        base, ext = ps[1][:40] + ps[2][:8], ps[1][:40] + ps[2][:8] + ps[3][:12]
        cached.generate(base, 8)
        want, got = on.generate(ext, 40), cached.generate(ext, 40)
        assert got.token_ids == want.token_ids and got.speculation == want.speculation
        assert got.cached_tokens == 32
    finally:
        cached.close()


def chi2_sf(x: float, df: int) -> float:
    """P[chi2(df) >= x] (the regularised upper incomplete gamma function)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2,
                                         dtype=torch.float64)))


def test_sampled_distribution_is_the_targets(engines, tiny_eager):
    """Over 400 seeds, the second token (the first a speculative round emits) at temperature 1, top_k 8
    follows the target's distribution: a chi-square test of the counts against sum over seeds of the
    eager model's top-8 softmax after (prompt, that seed's first token). Cells expected < 5 are pooled."""
    from onegraph.graphs.eager import generate_eager
    on, _ = engines
    p = heldout_prompts(4, 24)[3]
    n, topk = 400, 8
    firsts, seconds = [], []
    for seed in range(n):
        ids = on.generate(p, 2, 1.0, topk, 1.0, seed).token_ids
        firsts.append(ids[0])
        seconds.append(ids[1])
    expected = torch.zeros(tiny_eager.cfg.vocab_size, dtype=torch.float64)
    probs = {}
    for f in set(firsts):
        logits = generate_eager(tiny_eager, p + [f], 1).logits[0].double()
        top = logits.topk(topk)
        q = torch.zeros_like(logits)
        q[top.indices] = torch.softmax(top.values, -1)
        probs[f] = q
    for f in firsts:
        expected += probs[f]
    observed = torch.bincount(torch.tensor(seconds), minlength=expected.numel()).double()
    assert observed[expected == 0].sum() == 0                         # never a token outside the kept set
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 3
    assert chi2_sf(stat, df) > 1e-3, (stat, df)
    assert chi2_sf(3 * df + 30, df) < 1e-3                 # the test can fail: its threshold


def test_rejected_rows_are_inert(spec_artifact, one_thread):
    """Between rounds, every KV row at or past a slot's committed length (spec.pos), main model and head,
    is overwritten with large garbage: a query reading one would change the logits. The ids stay those
    of speculation off, and rejections happened."""
    from onegraph.runtime.executor import GraphExecutor
    ex = GraphExecutor.from_artifact(spec_artifact, max_slots=2, check_parity=False)
    names = [t["name"] for t in ex.manifest["state"]]
    st = dict(zip(names, ex.state))
    kv = [t for n, t in st.items() if n.endswith(("k_cache", "v_cache"))]
    p = heldout_prompts(1, 40)[0]
    want, _ = ex.generate(p, 48)                                       # speculation off (decode graphs)
    ids, _ = ex.prefill(p, 0)
    out, acc, gen = [int(ids[0])], [], torch.Generator().manual_seed(0)
    while len(out) < 48:
        L = int(st["spec.pos"][0])
        for t in kv:
            t[0, :, L:] = torch.randn(t[0, :, L:].shape, generator=gen) * 1e3
        n_acc, targets = ex.spec_step([0], [Sampling()])
        a = int(n_acc[0])
        acc.append(a)
        out += targets[0, :a + 1].tolist()
    assert out[:48] == want
    assert any(a < K for a in acc) and any(a > 0 for a in acc)


def test_ends_at_max_seq_len(engines):
    """prompt + max_new_tokens == max_seq_len: the last rounds verify positions past the KV cache (their
    rows write the scratch slot); the ids are speculation off's."""
    on, off = engines
    p = heldout_prompts(1, 40)[0]
    n = MAX_SEQ - len(p)
    assert on.generate(p, n).token_ids == off.generate(p, n).token_ids
    with pytest.raises(ValueError, match="max_seq_len"):
        on.generate(p, n + 1)


def test_refusals(tmp_path, tiny_artifact):
    from onegraph.cli import main
    from onegraph.export.pipeline import ExportOptions, export
    from onegraph.models.qwen3_5 import tiny
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.models.qwen3_5.model import Qwen35Model
    from onegraph.runtime import Engine
    for k in (0, 5):
        assert main(["export", "tiny", "--out", str(tmp_path / "x"), "--speculative-tokens", str(k)]) == 2
    with pytest.raises(ValueError, match=r"--speculative-tokens must be an integer in 1\.\.4, got 5"):
        export("tiny", tmp_path / "x", ExportOptions(speculative_tokens=5), progress=False)
    with pytest.raises(ValueError, match="--speculative-tokens needs --backend aoti"):
        export("tiny", tmp_path / "x", ExportOptions(speculative_tokens=2, backend="onnx"), progress=False)
    cfg = ModelConfig.from_hf(tiny.TINY_HF_CONFIG)
    with torch.device("meta"):
        bare = Qwen35Model(cfg)                                        # no MTP head: no mtp.* weights
    ckpt = tiny.write_checkpoint(tmp_path / "nomtp", tiny.random_hf_weights(bare, 0))
    with pytest.raises(ValueError, match=r"needs a checkpoint with an MTP head \(mtp\.\* weights\)"):
        export(str(ckpt), tmp_path / "x", ExportOptions(speculative_tokens=2), progress=False)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="--speculative-tokens K"):
        Engine.from_artifact(tiny_artifact, speculation=True)
    assert main(["generate", str(tiny_artifact), "--prompt-ids", "1,2", "--speculation"]) == 2


def test_cli_generate_json(spec_artifact, capsys, one_thread):
    from onegraph.cli import main
    args = ["generate", str(spec_artifact), "--prompt", "def main(argv):", "--max-new-tokens", "24", "--json",
            "--temperature", "0"]
    assert main(args) == 0
    on = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(args + ["--no-speculation"]) == 0
    off = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert on["token_ids"] == off["token_ids"] and len(on["token_ids"]) == 24
    assert on["speculation"]["tokens"] == K and 0 <= on["speculation"]["accepted_mean"] <= K
    assert off["speculation"] is None
    assert on["fixture"]["speculation"]["rounds"] > 0       # the load-time fixture also checks the rounds


def test_metrics_report_acceptance(engines):
    import httpx
    from server_helpers import running
    from onegraph.server.app import create_app
    on, _ = engines
    with running(create_app(on, "tiny")) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "import os\n", "max_tokens": 16,
                                                       "temperature": 0}, timeout=60)
        assert r.status_code == 200
        text = httpx.get(url + "/metrics").text
    vals = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("onegraph_spec_")}
    s = on.stats()["speculation"]
    assert vals["onegraph_spec_draft_tokens"] == K and vals["onegraph_spec_rounds"] == s["rounds"] > 0
    assert math.isclose(vals["onegraph_spec_acceptance_rate"], s["acceptance_rate"])
    assert math.isclose(vals["onegraph_spec_mean_accepted_length"], 1 + K * s["acceptance_rate"])


def test_bench_engine_host_with_and_without_speculation(spec_artifact, one_thread):
    """`onegraph bench --speculative-tokens K`'s engine rows: a round per step speculating, a token per step not."""
    from onegraph.commands.bench import engine_host_us
    on = engine_host_us(spec_artifact, "cpu", n_tokens=24, runs=1)
    off = engine_host_us(spec_artifact, "cpu", n_tokens=24, runs=1, speculation=False)
    assert on["speculative_tokens"] == K and off["speculative_tokens"] == 0
    assert 1 <= on["mean_accepted_length"] <= K + 1 and off["mean_accepted_length"] is None
    assert on["host_us_per_step"] > 0 and off["host_us_per_step"] > 0 and on["tok_s"] > 0 and off["tok_s"] > 0


def test_fp8_artifact_speculation_identical(tmp_path, one_thread):
    """`--quant fp8 --fp8-lm-head` with speculation: the spec round over FP8 projections and experts and the
    block-FP8 output head (the drafts' pruned rows of it too); greedy output equals speculation off on the same
    artifact for 48 tokens, with drafts accepted (the trained MTP head still agrees with the FP8 model)."""
    from onegraph.export.pipeline import ExportOptions, export
    from onegraph.runtime import Engine
    out = tmp_path / "tiny_fp8_spec"
    export("tiny", out, ExportOptions(batch_sizes=(1,), prefill_chunks=(16,), max_seq_len=96, quant="fp8",
                                      fp8_lm_head=True, speculative_tokens=2, draft_vocab=DRAFT_VOCAB), progress=False)
    m = json.loads((out / "manifest.json").read_text())
    assert m["options"]["quant"] == "fp8" and m["options"]["fp8_lm_head"] and m["speculative_tokens"] == 2
    on = Engine.from_artifact(out, max_slots=1)
    off = Engine.from_artifact(out, max_slots=1, check_parity=False, speculation=False)
    try:
        for p in heldout_prompts(2, 32):
            want = off.generate(p, 48).token_ids
            r = on.generate(p, 48)
            assert r.token_ids == want
            assert r.speculation["rounds"] < 48 and r.speculation["accepted_mean"] > 0.3
    finally:
        on.close()
        off.close()
