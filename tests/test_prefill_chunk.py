"""The engine's prefill chunk (GraphExecutor.set_max_chunk; Engine.from_artifact(prefill_chunk=...); serve
--prefill-chunk) on the eager executor of the trained tiny model with prefill buckets 8 and 16: a prompt is fed
in chunks of at most the chosen size, the last one in the smallest bucket that holds it, and its first id is
the eager model's; through an Engine whose prefix cache blocks are that chunk, a hit equals a miss bit for bit;
a size the artifact has no prefill graph for is one line (the API and `serve`, exit 2)."""
import pytest
import torch

from onegraph.custom_ops.sample import Sampling
from onegraph.runtime.executor import GraphExecutor

PROMPT = list(b"Colours of the rainbow: red, orange, yellow, green,")     # 51 byte tokens


@pytest.fixture(scope="module")
def model(one_thread):
    from onegraph.checkpoint.load import load_model
    return load_model("tiny")[1]


def executor(model):
    """Eager graphs (decode bucket 2; prefill 8 and 16), 2 slots; every graph call recorded by name."""
    ex = GraphExecutor.from_model(model, {"decode": [2], "prefill": [8, 16]}, 2, 128)
    ex.calls = []
    for name, f in list(ex.graphs.items()):
        ex.graphs[name] = (lambda n, f: lambda inputs: (ex.calls.append(n), f(inputs))[1])(name, f)
    return ex


@pytest.mark.parametrize("chunk, calls", [(None, ["prefill_t16"] * 3 + ["prefill_t8"]),      # 48 + 3
                                          (8, ["prefill_t8"] * 7)])                        # 48 + 3
def test_a_prompt_is_fed_in_chunks_of_at_most_the_chunk(model, chunk, calls):
    from onegraph.graphs.eager import generate_eager
    ex = executor(model)
    if chunk is not None:
        ex.set_max_chunk(chunk)
    assert ex.max_chunk == (chunk or 16)
    ids, logits = ex.prefill(PROMPT, 0)
    assert ex.calls == calls
    ref = generate_eager(model, PROMPT, 1)
    assert int(ids[0]) == ref.token_ids[0]
    torch.testing.assert_close(logits[0], ref.logits[0], atol=2e-4, rtol=0)


def test_a_chunk_without_a_graph_is_refused(model):
    ex = executor(model)
    with pytest.raises(ValueError, match="^a prefill chunk of 12 tokens: the artifact's prefill chunks are 8, 16$"):
        ex.set_max_chunk(12)
    assert ex.max_chunk == 16


def test_prefix_cache_blocks_are_the_chunk_and_hits_equal_misses(model):
    """Engines over the eager graphs with chunk 8: one without a cache, one whose cache blocks are 8 tokens. A
    prompt's second run hits its 6 whole blocks (48 of 51 tokens) and equals the first, greedy and seeded."""
    from onegraph.graphs.signature import state_manifest
    from onegraph.runtime import Engine
    from onegraph.runtime.prefix_cache import PrefixCache
    engines = []
    for cached in (False, True):
        ex = executor(model)
        ex.set_max_chunk(8)
        cache = PrefixCache(ex.state, state_manifest(model, 128, torch.float32), 8, 1 << 22, "test") if cached else None
        engines.append(Engine(ex, prefix_cache=cache))
    off, on = engines
    try:
        with pytest.raises(ValueError, match=r"the prefix cache's blocks \(16 tokens\) are not the prefill chunk \(8\)"):
            Engine(off.ex, prefix_cache=PrefixCache(off.ex.state, state_manifest(model, 128, torch.float32), 16,
                                                    1 << 22, "test"))
        assert on.prefill_budget == 8
        for sp in (Sampling(), Sampling(0.9, 40, 0.95, 3)):
            want = off.generate(PROMPT, 12, sp.temperature, sp.top_k, sp.top_p, sp.seed)
            first = on.generate(PROMPT, 12, sp.temperature, sp.top_k, sp.top_p, sp.seed)
            again = on.generate(PROMPT, 12, sp.temperature, sp.top_k, sp.top_p, sp.seed)
            assert first.token_ids == again.token_ids == want.token_ids
            assert again.cached_tokens == 48
    finally:
        for e in engines:
            e.close()


def test_serve_prefill_chunk_not_in_the_artifact_is_one_line_exit_2(tiny_artifact, capsys):
    from onegraph.cli import main
    assert main(["serve", str(tiny_artifact), "--prefill-chunk", "12"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith("prefill chunks are 16"), err
