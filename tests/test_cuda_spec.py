"""Speculative decoding on a GPU (run on the H200; skipped without CUDA): the bf16 CUDA artifact of the
trained `tiny` exported with --speculative-tokens 3 gives, with speculation on, the ids it gives with
speculation off (its own decode graphs, CUDA-graph replay), for 64 tokens, up to the fixture's near-tie
rule: a verify step computes k+1 rows per projection where decode computes one, so bf16 sums may round
differently, and where the speculation-off top-2 logit margin is within twice the bf16 tolerance the other
id is a legitimate pick (runtime/fixture.py)."""
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [list(b"def main(argv):\n    "), list(b"import os\nimport sys\n\n\nclass "),
           list(b"Colours of the rainbow: red, orange,")]
K, N, TOL = 3, 64, 0.25


@pytest.fixture(scope="module")
def spec_cuda_artifact(tmp_path_factory):
    from onegraph.export.pipeline import ExportOptions, export
    out = tmp_path_factory.mktemp("cuda") / "tiny_spec_bf16"
    export("tiny", out, ExportOptions(device="cuda", dtype="bfloat16", batch_sizes=(1, 2), prefill_chunks=(16,),
                                      max_seq_len=128, speculative_tokens=K), progress=False)
    return out


def test_cuda_speculation_matches_off(spec_cuda_artifact):
    from onegraph.runtime import Engine
    from onegraph.runtime.executor import GraphExecutor
    ex = GraphExecutor.from_artifact(spec_cuda_artifact, max_slots=2, device="cuda")
    assert ex.path.endswith("+cudagraphs") and ex.speculative_tokens == K
    refs = [ex.generate(p, N) for p in PROMPTS]                  # speculation off: (ids, logits per step)
    del ex
    eng = Engine.from_artifact(spec_cuda_artifact, max_slots=2, device="cuda", check_parity=False)
    try:
        accepted = []
        for p, (ref_ids, ref_logits) in zip(PROMPTS, refs):
            r = eng.generate(p, N)
            accepted.append(r.speculation["accepted_mean"])
            diff = next((i for i, (a, b) in enumerate(zip(r.token_ids, ref_ids)) if a != b), None)
            gap = None if diff is None else float(ref_logits[diff].float().topk(2).values.diff().abs())
            assert diff is None or gap <= 2 * TOL, (
                f"first differing token at step {diff}: {r.token_ids[diff]} vs {ref_ids[diff]}, speculation "
                f"off's top-2 margin {gap} > {2 * TOL}")
            print(f"prompt {p[:12]}: identical={diff is None} accepted_mean={r.speculation['accepted_mean']:.3f}")
        assert max(accepted) > 0.3
    finally:
        eng.close()
