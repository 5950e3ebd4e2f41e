"""The repeated canaries (replay corruption elsewhere showed only after 21-60 repeats): two byte-token
prompts, each repeated under continuous batching with staggered admission, varying lengths and
sampled noise neighbours; every repeat is compared with its solo reference stream."""
import asyncio
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
