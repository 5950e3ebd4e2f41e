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
