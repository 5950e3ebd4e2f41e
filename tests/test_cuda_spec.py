"""Speculative decoding on a GPU (run on the H200; skipped without CUDA): the bf16 CUDA artifact of the
trained `tiny` exported with --speculative-tokens 3 (the head drafting over the full vocabulary, and over a
pruned one: --draft-vocab 128) gives, with speculation on, the ids it gives with speculation off (its own
decode graphs, CUDA-graph replay), for 64 tokens, with the rounds captured as CUDA graphs and uncaptured
alike, up to the fixture's near-tie rule: a verify step computes k+1 rows per projection where decode
computes one, so bf16 sums may round differently, and where the speculation-off top-2 logit margin is within
twice the bf16 tolerance the other id is a legitimate pick (runtime/fixture.py)."""
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [list(b"def main(argv):\n    "), list(b"import os\nimport sys\n\n\nclass "),
           list(b"Colours of the rainbow: red, orange,")]
K, N, TOL = 3, 64, 0.25


@pytest.fixture(scope="module", params=[0, 128], ids=["full-vocab", "draft-vocab-128"])
def spec_cuda_artifact(request, tmp_path_factory):
    from onegraph.export.pipeline import ExportOptions, export
    out = tmp_path_factory.mktemp("cuda") / f"tiny_spec_bf16_{request.param}"
    export("tiny", out, ExportOptions(device="cuda", dtype="bfloat16", batch_sizes=(1, 2), prefill_chunks=(16,),
                                      max_seq_len=128, speculative_tokens=K, draft_vocab=request.param),
           progress=False)
    return out


@pytest.fixture(scope="module")
def speculation_off(spec_cuda_artifact):
    """(ids, logits per step) per prompt, speculation off (the artifact's captured decode graphs)."""
    from onegraph.runtime.executor import GraphExecutor
    ex = GraphExecutor.from_artifact(spec_cuda_artifact, max_slots=2, device="cuda")
    assert ex.path.endswith("+cudagraphs") and ex.speculative_tokens == K
    refs = [ex.generate(p, N) for p in PROMPTS]
    del ex
    return refs


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["captured", "uncaptured"])
def test_cuda_speculation_matches_off(spec_cuda_artifact, speculation_off, cuda_graphs):
    from onegraph.runtime import Engine
    eng = Engine.from_artifact(spec_cuda_artifact, max_slots=2, device="cuda", check_parity=False,
                               cuda_graphs=cuda_graphs)
    try:
        assert sorted(eng.ex.captured_spec) == ([1, 2] if cuda_graphs else [])
        accepted = []
        for p, (ref_ids, ref_logits) in zip(PROMPTS, speculation_off):
            r = eng.generate(p, N)
            accepted.append(r.speculation["accepted_mean"])
            diff = next((i for i, (a, b) in enumerate(zip(r.token_ids, ref_ids)) if a != b), None)
            gap = None if diff is None else float(ref_logits[diff].float().topk(2).values.diff().abs())
            assert diff is None or gap <= 2 * TOL, (
                f"first differing token at step {diff}: {r.token_ids[diff]} vs {ref_ids[diff]}, speculation "
                f"off's top-2 margin {gap} > {2 * TOL}")
            print(f"prompt {p[:12]}: identical={diff is None} accepted_mean={r.speculation['accepted_mean']:.3f}")
        assert max(accepted) > 0.3
        assert eng.stats()["counters"]["spec_rounds"] > 0
    finally:
        eng.close()


def test_cuda_speculation_batched_rows_match_alone(spec_cuda_artifact):
    """Two requests in one captured round bucket (B = 2) give the ids each gives alone (bucket 1)."""
    import asyncio
    from onegraph.runtime import Engine
    eng = Engine.from_artifact(spec_cuda_artifact, max_slots=2, device="cuda", check_parity=False)
    try:
        alone = [eng.generate(p, N).token_ids for p in PROMPTS[:2]]

        async def both():
            async def one(p):
                return [e.token_id async for e in eng.stream(p, N) if e.token_id is not None]
            return await asyncio.gather(*(one(p) for p in PROMPTS[:2]))
        together = asyncio.run(both())
        assert together == alone
    finally:
        eng.close()
