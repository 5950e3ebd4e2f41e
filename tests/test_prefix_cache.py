"""The prefix cache (runtime/prefix_cache.py) on the trained tiny artifact: every request with the cache on
equals the same request on an engine without it (greedy and seeded), `cached_tokens` is the whole blocks a
cached prefix supplies, a tiny budget evicts and changes no output, a prefix ending mid-block reuses whole
blocks only, and a hit's logits equal a miss's bit for bit. Blocks are the artifact's prefill chunk: 16."""
import threading

import pytest
import torch

from onegraph.runtime import Engine
from onegraph.runtime.executor import GraphExecutor
from onegraph.runtime.prefix_cache import PrefixCache, block_bytes, for_executor, state_kind, unsupported

C = 16                                       # conftest TINY_EXPORT's prefill chunk
SEEDED = dict(temperature=0.9, top_p=0.95)   # each request with seed=its index


def ids(n, seed, vocab=256):
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engines(tiny_artifact, one_thread):
    """(off, on): 4 slots each, the same artifact; `on` with a cache that never evicts here (32 MiB)."""
    off = Engine.from_artifact(tiny_artifact, max_slots=4, max_queue=64, check_parity=False)
    on = Engine.from_artifact(tiny_artifact, max_slots=4, max_queue=64, check_parity=False,
                              prefix_cache_bytes=32 << 20)
    yield off, on
    off.close()
    on.close()


def run_all(engine, jobs):
    """Submit every (prompt, n, sampling kwargs) at once -> [(token ids, finish reason, cached_tokens)]."""
    out = [([], [], [0]) for _ in jobs]
    done = [threading.Event() for _ in jobs]

    def emit(i):
        def f(ev):
            if ev.token_id is not None:
                out[i][0].append(ev.token_id)
            if ev.finish_reason is not None:
                out[i][1].append(ev.finish_reason)
                out[i][2][0] = ev.cached_tokens
                done[i].set()
        return f
    for i, (prompt, n, sp) in enumerate(jobs):
        engine.submit(prompt, emit(i), n, **sp)
    for d in done:
        assert d.wait(120)
    return [(t, f[0], c[0]) for t, f, c in out]


def test_state_kinds_and_refusals(tiny_artifact):
    from onegraph.runtime.artifact import Artifact
    art = Artifact.load(tiny_artifact)
    kinds = [state_kind(t) for t in art.state]
    assert kinds.count("kv") == 2 and kinds.count("conv") == 3 and kinds.count("recurrent") == 3   # 1 attn, 3 GDN
    assert state_kind({"name": "layer0.rec", "kind": "kv"}) == "kv"          # the typed kind, never the name
    assert unsupported(art.state, 1) is None
    assert "tp=1" in unsupported(art.state, 2)
    spec = [{"name": "spec.y", "shape": [5, 8], "dtype": "float32", "kind": "spec"}]
    assert unsupported(art.state + spec, 1) is None          # the round carry is not cached (every chunk writes it)
    assert block_bytes(art.state + spec, C) == block_bytes(art.state, C)
    # one block: 16 KV rows of the attention layer's k and v + the GDN layers' whole slot rows
    per_slot = sum(torch.zeros(t["shape"][1:]).numel() * (4 if t["dtype"] == "float32" else 2) for t in art.state)
    kv = sum(torch.zeros(t["shape"][1:]).numel() * 4 for t in art.state if state_kind(t) == "kv")
    assert block_bytes(art.state, C) == per_slot - kv + kv * C // art.max_seq_len


def test_20_requests_sharing_a_200_token_prefix_equal_no_cache(engines):
    off, on = engines
    prefix = ids(200, 1)
    for k, sampling in enumerate((lambda i: {}, lambda i: dict(SEEDED, seed=i))):
        jobs = [(prefix + ids(8, 100 + i + 20 * k), 8, sampling(i)) for i in range(20)]
        ref = run_all(off, jobs)
        first = run_all(on, jobs[:1])                 # stores the prefix's 12 whole blocks (and its 13th)
        rest = run_all(on, jobs[1:])                  # submitted together: each resumes at token 192
        got = first + rest
        assert [g[:2] for g in got] == [r[:2] for r in ref]
        assert all(r[2] == 0 for r in ref)
        # the prompts differ from token 200 on, inside block 12 ([192, 208)): only blocks 0..11 are shared
        assert [g[2] for g in got] == [0 if k == 0 else 192] + [192] * 19
    st = on.stats()["prefix_cache"]
    assert st["hit_tokens"] == 39 * 192 and st["evictions"] == 0 and st["hits"] == 39
    assert st["queried_tokens"] == 40 * 208 and st["entries"] == 12 + 40 and st["bytes"] == 52 * st["block_bytes"]
    assert off.stats()["prefix_cache"] is None


def test_prefix_ending_mid_block_reuses_whole_blocks_only(engines):
    off, on = engines
    a = ids(40, 2)
    cases = [(a, 0),                       # stores blocks [0, 16) and [16, 32)
             (a[:24] + ids(20, 3), 0),     # shares 24 tokens: one whole block, without a GDN snapshot (a
                                           # takes them at its last boundaries only): this one takes it
             (a, 32),                      # the same prompt: two blocks, token 32.. prefilled
             (a[:32], 16),                 # a prompt of exactly two blocks: its last token is prefilled;
                                           # block 0's snapshot is the one the second prompt took
             (a[:33], 32)]
    for prompt, cached in cases:
        # the seeded run follows the greedy one, which stored the prompt's own whole blocks
        for sp, want in (({}, cached), (dict(SEEDED, seed=7), (len(prompt) - 1) // C * C)):
            got, ref = run_all(on, [(prompt, 6, sp)])[0], run_all(off, [(prompt, 6, sp)])[0]
            assert got[:2] == ref[:2] and got[2] == want, (len(prompt), want, got[2])


def test_eviction_under_a_tiny_budget_changes_no_output(tiny_artifact, engines, one_thread):
    off, on = engines
    per = on.cache.block_bytes
    small = Engine.from_artifact(tiny_artifact, max_slots=2, check_parity=False, prefix_cache_bytes=3 * per + per // 2)
    try:
        assert small.cache.capacity == 3
        prefixes = [ids(64, 10 + g) for g in range(3)]
        jobs = [(prefixes[i % 3] + ids(5, 50 + i), 6, dict(SEEDED, seed=i) if i % 2 else {}) for i in range(12)]
        got = [run_all(small, [j])[0] for j in jobs[:6]] + run_all(small, jobs[6:])
        ref = run_all(off, jobs)
        assert [g[:2] for g in got] == [r[:2] for r in ref]
        st = small.stats()["prefix_cache"]
        assert st["evictions"] > 0 and st["entries"] <= 3 and st["bytes"] <= 3 * per
        assert st["hit_tokens"] == sum(g[2] for g in got) and all(g[2] % C == 0 for g in got)
    finally:
        small.close()


def test_hit_logits_equal_miss_logits_bitwise(tiny_artifact, one_thread):
    """At the executor: a prompt prefilled from token 0 in slot 0 (storing its blocks), then in slot 1 from
    the cached 48 tokens on: the last chunk's logits and sampled id are the same bits."""
    ex = GraphExecutor.from_artifact(tiny_artifact, max_slots=2, check_parity=False)
    cache = for_executor(ex, 1 << 20)
    assert isinstance(cache, PrefixCache) and cache.C == C
    prompt = ids(53, 4)

    def prefill(slot, chain, start):
        i = start
        while i < len(prompt):
            out = ex.prefill_chunk(prompt, i, slot)
            i += ex.chunk_tokens(len(prompt) - i)
            cache.store(prompt, i, slot, chain)
        return out
    miss_chain, hit_chain = [], []
    miss_ids, miss_logits = prefill(0, miss_chain, 0)
    miss_logits = miss_logits.clone()
    assert len(miss_chain) == 3                       # blocks ending at 16, 32, 48
    P = cache.lookup(prompt, 1, hit_chain)
    assert P == 48
    hit_ids, hit_logits = prefill(1, hit_chain, P)
    assert torch.equal(hit_ids, miss_ids) and torch.equal(hit_logits, miss_logits)
    for t, kind in zip(ex.state, cache.kinds):     # the slots' state after the prompt: the same bits
        if kind == "kv":
            assert torch.equal(t[0, :, :len(prompt)], t[1, :, :len(prompt)])
        else:
            assert torch.equal(t[0], t[1])
    cache.release(miss_chain)
    cache.release(hit_chain)
    assert all(e.pins == 0 for e in cache.entries.values())


def test_server_reports_cached_tokens_and_metrics(engines):
    """usage.prompt_tokens_details.cached_tokens in chat and completions, streamed or not, and the /metrics
    counters, through a real server on the cached engine: a prompt's second request reuses its whole blocks."""
    import json
    import re

    import httpx
    from server_helpers import running

    from onegraph.server.app import create_app
    off, on = engines
    text = "The prefix cache keeps whole blocks of sixteen tokens: " + "".join(chr(96 + i) for i in ids(70, 5, 27))
    msgs = [{"role": "system", "content": text}, {"role": "user", "content": "and then?"}]

    def post(http, kind, stream):
        body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "stream": stream}
        body.update({"messages": msgs} if kind == "chat" else {"prompt": text})
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = http.post(f"/v1/{'chat/' if kind == 'chat' else ''}completions", json=body)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["usage"]
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        return chunks[-1]["usage"]
    with running(create_app(on, "tiny")) as url, httpx.Client(base_url=url, timeout=60) as http:
        for kind in ("completion", "chat"):
            first = post(http, kind, stream=False)
            assert first["prompt_tokens_details"] == {"cached_tokens": 0}
            whole = (first["prompt_tokens"] - 1) // C * C
            assert whole >= 4 * C
            for stream in (True, False):
                assert post(http, kind, stream)["prompt_tokens_details"] == {"cached_tokens": whole}
        st = on.stats()["prefix_cache"]
        page = httpx.get(url + "/metrics").text
        for key, name in (("queried_tokens", "queried_tokens_total"), ("hit_tokens", "hit_tokens_total"),
                          ("evictions", "evictions_total"), ("entries", "entries"), ("bytes", "bytes")):
            m = re.search(rf"^onegraph_prefix_cache_{name} ([0-9.e+]+)$", page, re.M)
            assert m and float(m.group(1)) == st[key], (name, m and m.group(1), st[key])
    with running(create_app(off, "tiny")) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert post(http, "completion", stream=False)["prompt_tokens_details"] == {"cached_tokens": 0}
        assert "onegraph_prefix_cache" not in httpx.get(url + "/metrics").text


@pytest.mark.parametrize("flags, needle", [
    (["--prefix-cache-gb", "-1"], "--prefix-cache-gb must be > 0 GiB"),
    (["--prefix-cache-gb", "nan"], "--prefix-cache-gb must be > 0 GiB"),
    (["--prefix-cache-gb", "1000000"], "does not fit"),              # checked before any graph loads
    (["--prefix-cache-gb", "1e-9"], "holds no block"),
])
def test_serve_prefix_cache_option_errors_are_one_line_exit_2(tiny_artifact, capsys, flags, needle):
    from onegraph.cli import main
    assert main(["serve", str(tiny_artifact), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and needle in err and err.startswith("onegraph serve: error:"), err


def test_serve_prefix_cache_flags_and_inspect(tiny_artifact, capsys):
    from onegraph.cli import build_parser, main, prefix_cache_bytes
    from onegraph.runtime.artifact import Artifact
    art = Artifact.load(tiny_artifact)
    parse = build_parser().parse_args
    assert prefix_cache_bytes(parse(["serve", str(tiny_artifact)]), art) is None          # the default budget
    assert prefix_cache_bytes(parse(["serve", str(tiny_artifact), "--no-prefix-cache"]), art) == 0
    assert prefix_cache_bytes(parse(["serve", str(tiny_artifact), "--prefix-cache-gb", "0.5"]), art) == 1 << 29
    from onegraph.runtime.memory import needed_bytes
    from onegraph.runtime.prefix_cache import budget
    per, fixed = block_bytes(art.state, C), needed_bytes(art.path, art.manifest, 4, "cpu")["total"]
    assert budget(art, 4, None, free_memory=1 << 50) == 64 * (256 // C) * per      # 64 prompts of max_seq_len
    assert budget(art, 4, None, free_memory=fixed + 100 * per) == 10 * per         # 10 % of what is left
    assert budget(art, 4, None, free_memory=fixed + 5 * per) == 0                  # holds no block: off
    with pytest.raises(SystemExit):            # argparse: the two are exclusive
        parse(["serve", str(tiny_artifact), "--no-prefix-cache", "--prefix-cache-gb", "1"])
    capsys.readouterr()
    assert main(["inspect", str(tiny_artifact)]) == 0
    want = block_bytes(art.state, C)
    assert f"prefix cache: {want} bytes" in capsys.readouterr().out


def test_bench_serve_shared_prefix_workload_on_and_off(engines, tmp_path, capsys):
    """bench-serve's shared-prefix workload (2 groups sharing 64 ids, then 6 of each request's own) against
    servers on the cached and the uncached engine: the same outputs, a hit rate only with the cache."""
    import json

    from server_helpers import running

    from onegraph.cli import main
    from onegraph.server.app import create_app
    res = {}
    for name, eng in zip(("off", "on"), engines):
        out = tmp_path / f"{name}.json"
        with running(create_app(eng, "tiny")) as url:
            assert main(["bench-serve", "--base-url", url, "--num-requests", "8", "--concurrency", "1",
                         "--input-len", "6", "--output-len", "4", "--shared-prefix-groups", "2",
                         "--shared-prefix-len", "64", "--seed", "9", "--save-outputs", "--quiet", "--no-plot",
                         "--out", str(out)]) == 0
        res[name] = json.loads(out.read_text())
    off, on = res["off"], res["on"]
    prompts = [o["prompt_ids"] for o in on["outputs"]]
    assert all(len(p) == 70 for p in prompts) and prompts[0][:64] == prompts[2][:64] != prompts[1][:64]
    assert [o["text"] for o in on["outputs"]] == [o["text"] for o in off["outputs"]]
    assert off["prefix_cache_hit_rate"] == 0 and off["cached_tokens"] == 0
    # one request at a time: each group's first request misses, the other 3 reuse its 4 whole blocks (64 ids)
    assert on["cached_tokens"] == 6 * 64 and on["prefix_cache_hit_rate"] == pytest.approx(6 * 64 / (8 * 70))
    assert main(["bench-serve", "--base-url", "http://127.0.0.1:9", "--num-requests", "1", "--concurrency", "1",
                 "--input-len", "1", "--output-len", "1", "--shared-prefix-groups", "2", "--out",
                 str(tmp_path / "x.json")]) == 2
    assert "--shared-prefix-groups and --shared-prefix-len go together" in capsys.readouterr().err


def test_pool_copies_chain_keys_and_leaf_first_eviction():
    """No artifact: a KV tensor [S+1, 2, 64, 4] and a recurrent one [S+1, 2, 4, 4], blocks of 16, room for 3."""
    meta = [{"name": "layer0.k_cache", "shape": ["S", 2, 64, 4], "dtype": "float32", "kind": "kv"},
            {"name": "layer1.rec", "shape": ["S", 2, 4, 4], "dtype": "float32", "kind": "recurrent"}]
    state = [torch.zeros(3, 2, 64, 4), torch.zeros(3, 2, 4, 4)]
    per = block_bytes(meta, 16)
    assert per == (2 * 16 * 4 + 2 * 4 * 4) * 4
    cache = PrefixCache(state, meta, 16, 3 * per, "scope")
    p = list(range(60))
    full = cache.keys(p, 3)
    assert cache.keys(p, 3, full[0], 1) == full[1:]                      # a block's key extends its parent's
    assert PrefixCache(state, meta, 16, per, "other").keys(p, 1) != full[:1]   # scoped
    state[0][0].normal_()
    state[1][0].normal_()
    chain = []
    for done in (16, 32, 48):
        cache.store(p, done, 0, chain)
    assert [e.key for e in chain] == full and cache.stats()["entries"] == 3
    hit = []
    assert cache.lookup(p, 1, hit) == 48
    assert torch.equal(state[0][1, :, :48], state[0][0, :, :48]) and not state[0][1, :, 48:].any()
    assert torch.equal(state[1][1], state[1][0])
    # full and every entry pinned: a fourth block is not stored, nothing is evicted
    other = list(range(100, 160))
    mine = []
    cache.store(other, 16, 2, mine)
    assert mine == [] and cache.stats()["store_skipped"] == 1 and cache.stats()["evictions"] == 0
    cache.release(chain)
    cache.release(hit)
    # unpinned: the leaf (the 48-token block) goes first, its parents stay
    cache.store(other, 16, 2, mine)
    assert len(mine) == 1 and cache.stats()["evictions"] == 1
    assert [k in cache.entries for k in full] == [True, True, False]
    # the 32-token block has its KV rows but no GDN snapshot (p took one at its last boundary only): no hit
    assert cache.lookup(p, 1, []) == 0 and cache.entries[full[1]].wanted


def test_snapshots_only_where_a_later_hit_can_end():
    """No artifact: blocks of 16, a KV tensor [S+1, 2, 128, 4] and a recurrent one [S+1, 2, 4, 4]. A prompt
    with nothing to share snapshots its GDN state at its last two block boundaries only; a prompt diverging
    from it inside block 2 matches 2 blocks without a snapshot (no hit), and its prefill snapshots block 1,
    so a third prompt of that prefix hits 32 tokens with the state of slot 0 after token 31."""
    meta = [{"name": "layer0.k_cache", "shape": ["S", 2, 128, 4], "dtype": "float32", "kind": "kv"},
            {"name": "layer1.rec", "shape": ["S", 2, 4, 4], "dtype": "float32", "kind": "recurrent"}]
    state = [torch.zeros(3, 2, 128, 4), torch.zeros(3, 2, 4, 4)]
    cache = PrefixCache(state, meta, 16, 20 * block_bytes(meta, 16), "scope")
    state[0][0].normal_()

    def prefill(prompt, start):
        """Stores after each chunk as the engine does; the recurrent state of slot 0 is set to each
        boundary's own value (its token count), so a snapshot says where it was taken."""
        chain = []
        for done in range(start + 16, len(prompt) + 1, 16):
            state[1][0].fill_(done)
            cache.store(prompt, done, 0, chain)
        cache.release(chain)
    p = list(range(80))                               # 5 whole blocks, the last ends the prompt
    prefill(p, 0)
    keys = cache.keys(p, 5)
    assert [cache.entries[k].state for k in keys] == [False, False, False, True, True]   # 64 and 80 tokens
    st = cache.stats()
    assert st["stored_blocks"] == 5 and st["state_snapshots"] == 2
    assert cache.lookup(p, 1, []) == 64 and float(state[1][1].max()) == 64.0   # the same prompt: 4 blocks
    q = p[:40] + list(range(200, 240))                # diverges inside block 2: blocks 0 and 1 match
    assert cache.lookup(q, 1, []) == 0 and cache.entries[keys[1]].wanted
    prefill(q, 0)
    assert cache.entries[keys[1]].state and not cache.entries[keys[0]].state
    assert cache.stats()["state_snapshots"] == 2 + 1 + 2              # block 1, and q's own last two
    r = p[:40] + list(range(300, 340))
    state[1][1].zero_()
    assert cache.lookup(r, 1, []) == 32 and float(state[1][1].min()) == 32.0
    assert torch.equal(state[0][1, :, :32], state[0][0, :, :32])


def test_hit_copy_is_one_foreach_copy_per_dtype():
    """No artifact: the hit's copy into the slot is one torch._foreach_copy_ per state dtype (bf16 KV and conv,
    fp32 recurrent: 2 ops), whatever the number of layers and cached blocks (it was an index_select and a copy_
    per KV tensor and a copy_ per GDN tensor: 100 at the 35B's 10 attention + 30 GDN layers), and copies the
    same bits: the slot's KV rows [0, P) and GDN state equal the ones the blocks were stored from. Counted at
    the dispatcher (every aten op the lookup issues; views are metadata and not counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    def hit_ops(attn, gdn, blocks):
        meta = ([{"shape": ["S", 2, 128, 4], "dtype": "bfloat16", "kind": "kv"}] * (2 * attn)
                + [{"shape": ["S", 6, 3], "dtype": "bfloat16", "kind": "conv"},
                   {"shape": ["S", 2, 4, 4], "dtype": "float32", "kind": "recurrent"}] * gdn)
        g = torch.Generator().manual_seed(attn + gdn + blocks)
        state = [torch.randn((3, *m["shape"][1:]), generator=g).to(getattr(torch, m["dtype"])) for m in meta]
        cache = PrefixCache(state, meta, 16, 8 * block_bytes(meta, 16), "scope")
        p, chain = list(range(blocks * 16 + 1)), []
        for done in range(16, blocks * 16 + 1, 16):
            cache.store(p, done, 0, chain)
        counts = []
        for _ in range(2):                                 # views made on the first hit, reused on the second
            with Ops() as mode:
                assert cache.lookup(p, 1, []) == blocks * 16
            counts.append(mode.ops)
        for t, m in zip(state, meta):
            assert torch.equal(t[1, :, :blocks * 16], t[0, :, :blocks * 16]) if m["kind"] == "kv" else \
                torch.equal(t[1], t[0])
        return counts
    for shape in [(1, 1, 1), (10, 30, 7)]:
        assert hit_ops(*shape) == [["aten._foreach_copy_.default"] * 2] * 2


def test_bench_prefix_cache_big_on_cpu(tmp_path, one_thread):
    """scripts/bench_prefix_cache_big (the H200 35B figures) on the tiny shape, fp32, its traced prefill graph run
    uncaptured: a 64-token prompt hits its 3 whole blocks (48 tokens) and a 40-token one its 2, the hit's
    logits equal the miss's bit for bit, the cache holds every block the stored misses wrote and nothing was
    skipped or evicted; a prompt with no whole block before its last token is refused in one line."""
    import json
    import subprocess
    import sys

    from onegraph.scripts.bench_prefix_cache_big import main
    out = tmp_path / "big.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--lower", "export", "--prompts",
                 "64,40", "--chunk", "16", "--max-seq-len", "128", "--reps", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["layers"] == 4 and res["block_tokens"] == 16
    rows = {r["prompt_tokens"]: r for r in res["prompts"]}
    assert {n: (r["cached_tokens"], r["prefilled_after_hit"], r["chunks_miss"]) for n, r in rows.items()} == {
        64: (48, 16, 4), 40: (32, 8, 3)}
    for r in rows.values():
        assert r["hit_ids_equal_miss"] and r["hit_logits_equal_miss"] and r["hit_vs_miss_max_logit_diff"] == 0
        assert r["miss_logits_equal_repeat"] and r["ttft_hit_ms"] >= r["hit_copy_ms"] > 0
    per = res["block_bytes"]
    assert rows[64]["hit_copy_bytes"] > rows[40]["hit_copy_bytes"] > per        # more KV rows, one GDN snapshot
    assert res["cache"]["stored_blocks"] == 2 * (4 + 2) and res["cache"]["hits"] == 4
    assert res["cache"]["evictions"] == 0 and res["cache"]["store_skipped"] == 0
    r = subprocess.run([sys.executable, "-m", "onegraph.scripts.bench_prefix_cache_big", "--prompts", "16",
                        "--chunk", "16", "--out", str(tmp_path / "x.json")], capture_output=True, text=True)
    assert r.returncode == 2 and "a whole block cached, one token left" in r.stderr and r.stderr.count("\n") == 1
