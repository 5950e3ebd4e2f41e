"""The prefix cache (runtime/prefix_cache.py) on a CUDA bf16 artifact of `tiny`, with and without CUDA graphs (run
on the H200 through the device tool; skipped without CUDA):
- at the executor: a prompt prefilled from token 0 (storing its blocks) and the same prompt resumed from its
  cached whole blocks in another slot give the same bits: the last chunk's logits and id, and the logits
  and ids of the decode steps after it (captured or not), greedy and seeded;
- through the Engine: 8 requests sharing a 100-token prefix with distinct suffixes, greedy and seeded, equal
  the same requests on an engine without the cache, and cached_tokens is the 96 tokens of the prefix's whole
  blocks (6 blocks of 16) for every request but the first.

DEVICE is the one switch for a dry run elsewhere (`"cpu"` exports a float32 CPU artifact); the committed test
targets CUDA. One export per session (three graphs); the file takes about a minute on the H200 after it.
"""
import pytest
import torch

from test_prefix_cache import run_all

DEVICE = "cuda"
DTYPE = {"cuda": "bfloat16", "cpu": "float32"}[DEVICE]
C = 16                                        # the artifact's one prefill chunk: the cache's block

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")]


def ids(n, seed, vocab=256):
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="session")
def prefix_artifact(tmp_path_factory):
    """Decode buckets 1 and 4, prefill chunk 16, 256 tokens."""
    from onegraph.export.pipeline import ExportOptions, export
    out = tmp_path_factory.mktemp("prefix") / "tiny"
    export("tiny", out, ExportOptions(device=DEVICE, dtype=DTYPE, batch_sizes=(1, 4), prefill_chunks=(C,),
                                      max_seq_len=256), progress=False)
    return out


@pytest.fixture(scope="module", params=[True, False], ids=["cuda_graphs", "no_cuda_graphs"])
def cuda_graphs(request):
    return request.param


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.9, top_p=0.95, seed=5)], ids=["greedy", "seeded"])
def test_hit_equals_miss_bitwise_through_decode(prefix_artifact, cuda_graphs, sampling):
    from onegraph.runtime.executor import GraphExecutor, Sampling
    from onegraph.runtime.prefix_cache import for_executor
    ex = GraphExecutor.from_artifact(prefix_artifact, max_slots=2, device=DEVICE, cuda_graphs=cuda_graphs,
                                     check_parity=False)
    assert ex.path.endswith("+cudagraphs") == (cuda_graphs and DEVICE == "cuda")
    cache = for_executor(ex, 1 << 24)
    samp = Sampling(**sampling)
    prompt = ids(77, 3)                               # 4 whole blocks before its last token: 64 cached

    def run(slot, start, chain):
        """Prefill from `start` (storing each block), then 6 decode steps -> (ids, logits) per token."""
        i = start
        while i < len(prompt):
            tok, logits = ex.prefill_chunk(prompt, i, slot, samp)
            i += ex.chunk_tokens(len(prompt) - i)
            cache.store(prompt, i, slot, chain)
        out, lg = [int(tok[0])], [logits[0].clone()]
        for k in range(6):                            # captured outputs are static buffers: cloned
            tok, logits = ex.decode_step([slot], [len(prompt) + k], [samp])
            out.append(int(tok[0]))
            lg.append(logits[0].clone())
        return out, torch.stack(lg)
    miss_chain, hit_chain = [], []
    miss = run(0, 0, miss_chain)
    P = cache.lookup(prompt, 1, hit_chain)
    assert P == 64 and len(hit_chain) == 4
    hit = run(1, P, hit_chain)
    assert hit[0] == miss[0]
    assert torch.equal(hit[1], miss[1]), float((hit[1].float() - miss[1].float()).abs().max())
    cache.release(miss_chain)
    cache.release(hit_chain)
    assert cache.stats()["hit_tokens"] == 64 and cache.stats()["evictions"] == 0


@pytest.fixture(scope="module")
def engines(prefix_artifact, cuda_graphs):
    """(off, on) engines of one CUDA-graph mode: 4 slots each, `on` with a 32 MiB cache (no eviction here)."""
    from onegraph.runtime import Engine
    kw = dict(max_slots=4, max_queue=64, device=DEVICE, cuda_graphs=cuda_graphs, check_parity=False)
    off = Engine.from_artifact(prefix_artifact, **kw)
    on = Engine.from_artifact(prefix_artifact, prefix_cache_bytes=32 << 20, **kw)
    yield off, on
    off.close()
    on.close()


def test_engine_shared_prefix_equals_no_cache(engines):
    off, on = engines
    prefix = ids(100, 1)
    for k, sampling in enumerate((lambda i: {}, lambda i: dict(temperature=0.9, top_p=0.95, seed=i))):
        jobs = [(prefix + ids(8, 100 + i + 20 * k), 10, sampling(i)) for i in range(8)]
        # one request at a time in both engines: on the GPU a row's bits depend on the decode batch it runs
        # in (the default kernels' plans follow the row count; docs/design.md "Batch invariance"), and a hit
        # changes when a request joins the batch, so concurrent runs would compare batches, not the cache
        ref = [r for j in jobs for r in run_all(off, [j])]
        got = [r for j in jobs for r in run_all(on, [j])]
        assert [g[:2] for g in got] == [r[:2] for r in ref]
        # the prompts differ from token 100 on, inside block 6 ([96, 112)): blocks 0..5 are shared, and the
        # first prompt snapshots its GDN state at 96 (its last whole block before its last token)
        assert [g[2] for g in got] == [0 if k == 0 else 96] + [96] * 7
        assert all(r[2] == 0 for r in ref)
    st = on.stats()["prefix_cache"]
    assert st["hits"] == 15 and st["hit_tokens"] == 15 * 96 and st["evictions"] == 0
