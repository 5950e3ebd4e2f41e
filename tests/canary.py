"""The repeated canaries (replay corruption elsewhere showed only after 21-60 repeats): two byte-token
prompts, each repeated under continuous batching with staggered admission, varying lengths and
sampled noise neighbours; every repeat is compared with its solo reference stream."""
import asyncio
import json
import random

PROMPTS = {
    "json": list(b'Q: reply with JSON. A: {"answer":"42","unit":"widgets"}'),
    "colour": list(b"Colours of the rainbow: red, orange, yellow, green, blue,"),
}


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def run(engine, refs: dict, repeats: int, vocab_bytes: int = 256, seed: int = 7) -> list[str]:
    """-> one message per repeat that differs from refs[name][:n] (empty when all match)."""
    rng = random.Random(seed)
    jobs = [(name, i, 8 + (i * 7 + len(name)) % 33) for i in range(repeats) for name in PROMPTS]
    rng.shuffle(jobs)

    async def one(name, i, n, delay):
        await asyncio.sleep(delay)
        toks = [ev.token_id async for ev in engine.stream(PROMPTS[name], max_new_tokens=n)
                if ev.token_id is not None]
        return name, i, n, toks

    async def noise(k):
        await asyncio.sleep(rng.random() * 0.3)
        p = [rng.randrange(vocab_bytes) for _ in range(rng.randrange(1, 30))]
        return [ev async for ev in engine.stream(p, max_new_tokens=rng.randrange(1, 20), temperature=0.9, seed=k)]

    async def main():
        tasks = [one(name, i, n, rng.random() * 0.5) for name, i, n in jobs] + [noise(k) for k in range(24)]
        return await asyncio.gather(*tasks)

    failures = []
    for name, i, n, toks in [r for r in asyncio.run(main()) if isinstance(r, tuple)]:
        ref = refs[name][:n]
        if toks != ref:
            failures.append(f"{name} repeat {i}: first differing step {first_diff(toks, ref)} "
                            f"(got {toks[:12]} vs {ref[:12]}, len {len(toks)} vs {len(ref)})")
    return failures


# ---------------------------------------------------------------- the batch-invariance mix (issue: a request's
# tokens must not depend on its neighbours). Prompts x samplers x repeats, staggered through Engine.stream, each
# request compared with the same request run alone on the same engine (not with eager: the claim is about
# batching, and the engine's solo run is what a user gets alone).
MIX_PROMPTS = [list(p) for p in (b"red, green, blue, ", b"def main():\n    ", b"import os\nimport ",
                                 b"Colours of the rainbow: red, orange,", b"class Point:\n    def __init__(self",
                                 b'{"name": "', b"The quick brown fox")]
SAMPLERS = {"greedy": dict(),
            "t0.8-s11": dict(temperature=0.8, seed=11),
            "topk20-s3": dict(temperature=1.0, top_k=20, seed=3),
            "topp0.9-t0.7-s5": dict(temperature=0.7, top_p=0.9, seed=5)}


def run_mix(engine, n_prompts: int, repeats: int, max_new_tokens: int = 32, seed: int = 7) -> tuple[int, list[str]]:
    """n_prompts of MIX_PROMPTS x every SAMPLERS entry x repeats requests, admitted in shuffled order at staggered
    times, vs each (prompt, sampler) run alone first -> (requests compared, one message per differing request)."""
    pairs = [(p, s) for p in range(n_prompts) for s in SAMPLERS]
    solo = {(p, s): engine.generate(MIX_PROMPTS[p], max_new_tokens, **SAMPLERS[s]).token_ids for p, s in pairs}
    rng = random.Random(seed)
    jobs = [(p, s, i) for p, s in pairs for i in range(repeats)]
    rng.shuffle(jobs)

    async def one(p, s, i, delay):
        await asyncio.sleep(delay)
        toks = [ev.token_id async for ev in engine.stream(MIX_PROMPTS[p], max_new_tokens=max_new_tokens,
                                                          **SAMPLERS[s]) if ev.token_id is not None]
        return p, s, i, toks

    async def main():
        return await asyncio.gather(*[one(p, s, i, rng.random() * 0.5) for p, s, i in jobs])

    failures = []
    for p, s, i, toks in asyncio.run(main()):
        ref = solo[(p, s)]
        if toks != ref:
            failures.append(f"prompt {bytes(MIX_PROMPTS[p])!r} sampler {s} repeat {i}: first differing token "
                            f"{first_diff(toks, ref)} (len {len(toks)} vs {len(ref)})")
    return len(jobs), failures


# ---------------------------------------------------------------- the same mix over HTTP: /v1/completions with
# token-id prompts, half the requests streamed (SSE), and neighbours whose clients leave mid-stream, so rows join
# and are cancelled between any two steps of the compared requests.
def _body(model, p, s, max_new_tokens, stream):
    kw = SAMPLERS[s]
    return {"model": model, "prompt": MIX_PROMPTS[p], "max_tokens": max_new_tokens, "stream": stream,
            "temperature": kw.get("temperature", 0.0), "top_k": kw.get("top_k", 0), "top_p": kw.get("top_p", 1.0),
            "seed": kw.get("seed"), "return_token_ids": True}


async def _http_ids(client, url, body, leave_after=None):
    """One request -> its token ids (plain or SSE), or None when the client leaves after `leave_after` chunks."""
    if not body["stream"]:
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    ids, n = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            n += 1
            if leave_after is not None and n >= leave_after:
                return None                             # closing the stream is the disconnect
            ch = json.loads(line[6:])
            assert "error" not in ch, ch
            if ch["choices"] and ch["choices"][0].get("finish_reason"):
                ids = ch["choices"][0]["token_ids"]
    return ids


def run_mix_http(url: str, model: str, n_prompts: int, repeats: int, leavers: int, max_new_tokens: int = 32,
                 seed: int = 7) -> tuple[int, list[str]]:
    """run_mix through a server at `url`: each (prompt, sampler) sent alone first (not streamed), then every
    request `repeats` times in shuffled order at staggered times, alternately plain and streamed, with `leavers`
    long streamed neighbours that disconnect after 2 chunks -> (requests compared, one message per differing one)."""
    import httpx
    pairs = [(p, s) for p in range(n_prompts) for s in SAMPLERS]
    rng = random.Random(seed)
    jobs = [(p, s, i) for p, s in pairs for i in range(repeats)]
    rng.shuffle(jobs)

    async def main():
        async with httpx.AsyncClient(timeout=300) as c:
            solo = {ps: await _http_ids(c, url, _body(model, *ps, max_new_tokens, False)) for ps in pairs}

            async def one(j, p, s, i):
                await asyncio.sleep(rng.random() * 0.5)
                return p, s, i, await _http_ids(c, url, _body(model, p, s, max_new_tokens, j % 2 == 1))

            async def leaver(k):
                await asyncio.sleep(rng.random() * 0.5)
                body = {**_body(model, k % n_prompts, "t0.8-s11", 6 * max_new_tokens, True), "ignore_eos": True}
                assert await _http_ids(c, url, body, leave_after=2) is None

            got = await asyncio.gather(*[one(j, *job) for j, job in enumerate(jobs)],
                                       *[leaver(k) for k in range(leavers)])
            return solo, got[:len(jobs)]

    solo, got = asyncio.run(main())
    failures = [f"prompt {bytes(MIX_PROMPTS[p])!r} sampler {s} repeat {i} ({'SSE' if j % 2 else 'plain'}): "
                f"first differing token {first_diff(toks, solo[(p, s)])} (len {len(toks)} vs {len(solo[(p, s)])})"
                for j, (p, s, i, toks) in enumerate(got) if toks != solo[(p, s)]]
    return len(jobs), failures
