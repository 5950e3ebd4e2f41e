"""Text in, text out over an Engine, for a Python user (the Engine itself takes token ids):

    engine = Engine.from_artifact("artifacts/tiny")
    print(engine.generate_text("def fibonacci(n):"))
    for delta in engine.stream_text("def fibonacci(n):"):
        print(delta, end="")

The tokenizer is the artifact's tokenizer.json through runtime/codec.py's TextCodec and its incremental
detokenizer (text deltas never split a UTF-8 character): the one text pipeline the HTTP server uses.

DEFAULT_SAMPLING is what `onegraph generate` and these methods do without sampling arguments: the
sampling of the README's command 1 (temperature 0.7, top-k 40), seeded. Greedy decoding (temperature 0)
of the tiny byte model falls into a run of spaces after a newline, so greedy as the first thing a user
meets looks broken; a fixed seed keeps the default output reproducible. Pass temperature=0 for greedy.
"""
from __future__ import annotations

import queue
from typing import Iterator

DEFAULT_SAMPLING = {"temperature": 0.7, "top_k": 40, "top_p": 1.0, "seed": 0}


def tokenizer(engine):
    """The engine's artifact's TextCodec (encode / decode), loaded once; FileNotFoundError without a
    tokenizer.json."""
    if getattr(engine, "_codec", None) is None:
        from .codec import TextCodec
        if engine.artifact is None:
            raise ValueError("text needs an engine over an artifact (Engine.from_artifact): its tokenizer.json")
        engine._codec = TextCodec.from_artifact(engine.artifact.path)
    return engine._codec


def _sampling(engine, temperature, top_k, top_p, seed, stop_ids) -> dict:
    stop = tuple(engine.artifact.model.get("eos_token_ids") or ()) if stop_ids is None else tuple(stop_ids)
    d = DEFAULT_SAMPLING
    return dict(temperature=d["temperature"] if temperature is None else temperature,
                top_k=d["top_k"] if top_k is None else top_k, top_p=d["top_p"] if top_p is None else top_p,
                seed=d["seed"] if seed is None else seed, stop_ids=stop)


def stream_text(engine, prompt: str, max_new_tokens: int = 32, temperature: float | None = None,
                top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                stop_ids=None) -> Iterator[str]:
    """Text deltas of the continuation of `prompt`, as the engine produces them (blocking iterator;
    closing it early cancels the request). Validation errors raise before the first delta."""
    from .codec import IncrementalDetokenizer
    codec = tokenizer(engine)
    ids = codec.encode(prompt)
    events: queue.SimpleQueue = queue.SimpleQueue()
    rid = engine.submit(ids, events.put, max_new_tokens, **_sampling(engine, temperature, top_k, top_p, seed,
                                                                    stop_ids))
    return _deltas(engine, rid, events, IncrementalDetokenizer(codec))


def _deltas(engine, rid: int, events: queue.SimpleQueue, detok) -> Iterator[str]:
    try:
        while True:
            ev = events.get()
            if ev.token_id is not None:
                delta = detok.push(ev.token_id)
                if delta:
                    yield delta
            if ev.finish_reason is not None:
                if ev.finish_reason == "error":
                    raise RuntimeError(f"the engine failed: {engine.error}")
                tail = detok.flush()
                if tail:
                    yield tail
                return
    finally:
        engine.cancel(rid)              # a consumer that stops early frees the slot


def generate_text(engine, prompt: str, max_new_tokens: int = 32, **sampling) -> str:
    """The continuation of `prompt` as one string (stream_text's deltas joined)."""
    return "".join(stream_text(engine, prompt, max_new_tokens, **sampling))
