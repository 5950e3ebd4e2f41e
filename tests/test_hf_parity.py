"""Rung 2 of the parity ladder: eager onegraph vs HF transformers on tiny random checkpoints, fp32.

Logits within 1e-4 after prefill and after each of 32 greedy decode steps, identical greedy ids.
"""
import pytest
import torch

pytest.importorskip("transformers")
import hf_models  # noqa: E402

from onegraph.graphs.eager import generate_eager  # noqa: E402
from onegraph.checkpoint.load import load_model  # noqa: E402

STEPS = 32
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 11]


@pytest.mark.parametrize("fp32_reduce", [False, True], ids=["default", "fp32_reduce"])
@pytest.mark.parametrize("case", sorted(hf_models.CASES))
def test_matches_transformers(case, fp32_reduce, tmp_path):
    """fp32_reduce (fp32 row-parallel outputs: linear_f32, fused_moe fp32_out, the dense MLP's down) is the
    same arithmetic in an fp32 model, so it must meet transformers exactly as the default does."""
    hf = hf_models.build(case)
    hf.save_pretrained(tmp_path)
    ref_ids, ref_logits = hf_models.hf_greedy(hf, PROMPT, STEPS)
    _, model, _ = load_model(tmp_path, "float32", fp32_reduce=fp32_reduce)
    got = generate_eager(model, PROMPT, STEPS)
    for step, (a, b) in enumerate(zip(got.logits, ref_logits)):
        diff = (a - b).abs().max().item()
        assert diff <= 1e-4, f"{case}: logits differ by {diff:.3g} at step {step} (0 = after prefill)"
        assert got.token_ids[step] == ref_ids[step], (
            f"{case}: first differing token at step {step}: onegraph {got.token_ids[step]} vs HF {ref_ids[step]}")
    assert len(got.token_ids) == STEPS
