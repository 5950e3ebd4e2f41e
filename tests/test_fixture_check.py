"""The load-time parity fixture's rules (runtime/fixture.py), on synthetic fixtures: a step beyond the
tolerance is excused only where eager's MoE router had a near-tie (at that step or in the prefill),
and a fixture in which every prompt was excused at its prefill fails. The tolerance: the dtype's, widened
to GAP_FACTOR x eager's recorded bf16-vs-fp32 gap where that is larger (gaps at router near-ties and after
the two runs parted not counted); a fixture without gaps checks as before.
And export's fixture() records those gaps (tiny-shaped random models)."""
import pytest
import torch
from safetensors.torch import save_file

from onegraph.runtime.artifact import ArtifactError
from onegraph.runtime.fixture import GAP_FACTOR, ROUTER_NEAR_TIE, TOLERANCE, check_fixture

V, STEPS = 16, 4


class Replay:
    """An executor stand-in: returns eager's ids and logits with `bump` added at the given steps."""

    def __init__(self, fx, bumps):
        self.fx, self.bumps = fx, bumps

    def generate(self, prompt, n, slot=0):
        i = next(k for k in range(9) if self.fx[f"prompt{k}"].tolist() == prompt)
        logits = [row + self.bumps.get((i, s), 0.0) for s, row in enumerate(self.fx[f"logits{i}"])]
        return self.fx[f"ids{i}"].tolist(), logits


def _fixture(tmp_path, margins, gaps=None):
    g = torch.Generator().manual_seed(0)
    fx = {}
    for i, m in enumerate(margins):
        logits = torch.randn(STEPS, V, generator=g)
        logits[:, 3] = 10.0                        # a wide top-2 margin: ids are compared strictly
        fx |= {f"prompt{i}": torch.tensor([i + 1, 2, 3]), f"ids{i}": logits.argmax(-1), f"logits{i}": logits,
               f"router_margin{i}": torch.tensor(m, dtype=torch.float32)}
        if gaps is not None:
            fx[f"gap{i}"] = torch.tensor(gaps[i], dtype=torch.float32)
    save_file(fx, str(tmp_path / "fixture.safetensors"))
    return fx, (tmp_path / "fixture.safetensors", "bfloat16")


WIDE, TIE = 1.0, ROUTER_NEAR_TIE["bfloat16"] / 2
BIG = 4 * TOLERANCE["bfloat16"]


def test_divergence_at_a_router_near_tie_ends_that_prompt(tmp_path):
    fx, m = _fixture(tmp_path, [[WIDE, WIDE, TIE, WIDE], [WIDE] * STEPS])
    bumps = {(0, 2): BIG * torch.eye(V)[5], (0, 3): BIG * torch.eye(V)[7]}
    rep = check_fixture(Replay(fx, bumps), *m)
    assert rep["routing_flips"] == [{"prompt": 0, "step": 2, "logit_diff": BIG, "router_margin": round(TIE, 5)}]
    assert rep["max_logit_diff"] == 0.0


def test_divergence_with_wide_router_margins_fails(tmp_path):
    fx, m = _fixture(tmp_path, [[WIDE] * STEPS, [WIDE] * STEPS])
    with pytest.raises(ArtifactError, match="prompt 1 step 2: logits differ"):
        check_fixture(Replay(fx, {(1, 2): BIG * torch.eye(V)[5]}), *m)


def test_a_near_tie_in_the_prefill_excuses_later_steps_but_a_fixture_of_prefill_flips_fails(tmp_path):
    fx, m = _fixture(tmp_path, [[TIE, WIDE, WIDE, WIDE], [WIDE] * STEPS])
    assert check_fixture(Replay(fx, {(0, 3): BIG * torch.eye(V)[5]}), *m)["routing_flips"][0]["step"] == 3
    fx, m = _fixture(tmp_path, [[TIE, WIDE, WIDE, WIDE], [TIE, WIDE, WIDE, WIDE]])
    bumps = {(0, 0): BIG * torch.eye(V)[5], (1, 0): BIG * torch.eye(V)[5]}
    with pytest.raises(ArtifactError, match="no prompt could be compared"):
        check_fixture(Replay(fx, bumps), *m)


def test_a_fixture_without_router_margins_is_strict(tmp_path):
    fx, m = _fixture(tmp_path, [[TIE] * STEPS])
    fx = {k: v for k, v in fx.items() if not k.startswith("router_margin")}
    save_file(fx, str(tmp_path / "fixture.safetensors"))
    with pytest.raises(ArtifactError, match="prompt 0 step 1"):
        check_fixture(Replay(fx, {(0, 1): BIG * torch.eye(V)[5]}), *m)


TOL, NAN = TOLERANCE["bfloat16"], float("nan")


def test_a_gap_beyond_the_dtype_tolerance_widens_it(tmp_path):
    bump = {(1, 0): 1.5 * TOL * torch.eye(V)[5]}    # 0.375: beyond the dtype's tolerance
    fx, m = _fixture(tmp_path, [[WIDE] * STEPS] * 2, [[0.01, TOL, 0.02, 0.0], [0.03, NAN, NAN, NAN]])
    rep = check_fixture(Replay(fx, bump), *m)       # within GAP_FACTOR x 0.25 = 0.5
    assert rep["tolerance"] == GAP_FACTOR * TOL and rep["tolerance_source"] == "measured gap"
    assert rep["eager_fp32_gap"] == TOL and rep["max_logit_diff"] == pytest.approx(1.5 * TOL)
    fx, m = _fixture(tmp_path, [[WIDE] * STEPS] * 2, [[0.01, 0.0, 0.02, 0.0], [0.03, NAN, NAN, NAN]])
    with pytest.raises(ArtifactError, match="prompt 1 step 0: logits differ from eager by 0.375 > 0.25 "
                                            "\\(bfloat16 tolerance; eager's bf16-vs-fp32 gap 0.03\\)"):
        check_fixture(Replay(fx, bump), *m)


def test_a_small_gap_keeps_the_dtype_tolerance(tmp_path):
    fx, m = _fixture(tmp_path, [[WIDE] * STEPS], [[0.01, 0.02, 0.0, 0.05]])
    rep = check_fixture(Replay(fx, {(0, 1): 0.2 * torch.eye(V)[5]}), *m)
    assert rep["tolerance"] == TOL and rep["tolerance_source"] == "dtype"
    assert rep["eager_fp32_gap"] == pytest.approx(0.05)
    with pytest.raises(ArtifactError, match="by 0.3 > 0.25"):
        check_fixture(Replay(fx, {(0, 1): 0.3 * torch.eye(V)[5]}), *m)


def test_a_fixture_without_gaps_checks_as_before(tmp_path):
    fx, m = _fixture(tmp_path, [[WIDE] * STEPS])
    rep = check_fixture(Replay(fx, {(0, 1): 0.2 * torch.eye(V)[5]}), *m)
    assert rep["tolerance"] == TOL and rep["tolerance_source"] == "dtype" and rep["eager_fp32_gap"] is None
    with pytest.raises(ArtifactError, match="prompt 0 step 2: logits differ from eager by 0.3 > 0.25 "
                                            "\\(bfloat16 tolerance; no fp32 gap recorded\\)"):
        check_fixture(Replay(fx, {(0, 2): 0.3 * torch.eye(V)[5]}), *m)


def test_beyond_the_widened_tolerance_is_refused_naming_the_gap(tmp_path):
    fx, m = _fixture(tmp_path, [[WIDE] * STEPS], [[0.2, 0.31, 0.1, 0.0]])     # tolerance 0.62
    check_fixture(Replay(fx, {(0, 3): 0.6 * torch.eye(V)[5]}), *m)
    with pytest.raises(ArtifactError, match="prompt 0 step 3: logits differ from eager by 0.7 > 0.62 "
                                            "\\(2 x eager's bf16-vs-fp32 gap 0.31; bfloat16 tolerance 0.25\\)"):
        check_fixture(Replay(fx, {(0, 3): 0.7 * torch.eye(V)[5]}), *m)


def test_a_w8a8_refusal_names_its_own_tolerance(tmp_path):
    fx, m = _fixture(tmp_path, [[WIDE] * STEPS], [[0.01, 0.02, 0.0, 0.0]])
    with pytest.raises(ArtifactError, match="by 0.3 > 0.25 \\(bfloat16 tolerance; eager's bf16-vs-fp32 gap 0.02\\)"):
        check_fixture(Replay(fx, {(0, 1): 0.3 * torch.eye(V)[5]}), *m, quant="int8")     # bf16 is wider already
    fx, m = _fixture(tmp_path, [[WIDE] * STEPS], [[0.01, 0.04, 0.0, 0.0]])
    path = m[0]
    with pytest.raises(ArtifactError, match="by 0.1 > 0.08 \\(2 x eager's float32-vs-fp32 gap 0.04; int8 W8A8 "
                                            "tolerance 0.05\\)"):
        check_fixture(Replay(fx, {(0, 1): 0.1 * torch.eye(V)[5]}), path, "float32", "int8")


def test_gaps_at_router_near_ties_and_after_the_runs_parted_are_not_used(tmp_path):
    # step 1: a near-tie (the fp32 run may have routed elsewhere); steps 2-3: NaN (its ids had parted)
    fx, m = _fixture(tmp_path, [[WIDE, TIE, WIDE, WIDE]], [[0.05, 3.0, NAN, NAN]])
    rep = check_fixture(Replay(fx, {}), *m)
    assert rep["tolerance"] == TOL and rep["eager_fp32_gap"] == pytest.approx(0.05)
    fx, m = _fixture(tmp_path, [[TIE, WIDE, WIDE, WIDE]], [[0.05, 3.0, NAN, NAN]])    # a near-tie in the prefill
    assert check_fixture(Replay(fx, {}), *m)["eager_fp32_gap"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_fixture_records_gaps(dtype, one_thread):
    from onegraph.export.pipeline import FIXTURE_PROMPTS, FIXTURE_TOKENS, fixture
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.models.qwen3_5.tiny import TINY_HF_CONFIG, random_model
    from onegraph.runtime.fixture import fixture_tolerance
    model = random_model(ModelConfig.from_hf(TINY_HF_CONFIG), getattr(torch, dtype), "cpu", router="decisive")
    fx = fixture(model, 64)
    if dtype == "float32":                           # eager is the fp32 computation: nothing recorded
        assert not [k for k in fx if k.startswith("gap")] and fixture_tolerance(fx, dtype)[2:] == ("dtype", None)
        return
    gaps = [fx[f"gap{i}"] for i in range(len(FIXTURE_PROMPTS))]
    assert all(g.dtype == torch.float32 and g.shape == (FIXTURE_TOKENS,) for g in gaps)
    # every step finite up to the first id the two runs disagree on (then NaN), the prefill always
    for g in gaps:
        n = int(torch.isfinite(g).sum())
        assert n >= 1 and bool(torch.isnan(g[n:]).all()) and float(g[:n].min()) > 0, gaps
    # bf16 rounds every op of the 4-layer model: a real gap (0.04-0.15 when written), the load's tolerance
    # twice the largest where that exceeds the dtype's
    top = max(float(g.nan_to_num(0).max()) for g in gaps)
    tol, _, source, gap = fixture_tolerance(fx, dtype)
    assert 0 < top < 1 and gap == top and tol == max(TOLERANCE[dtype], GAP_FACTOR * top), gaps
    assert source == ("measured gap" if GAP_FACTOR * top > TOLERANCE[dtype] else "dtype")


def test_a_gap_ends_after_the_first_differing_id(one_thread):
    from onegraph.export.pipeline import fp32_gap
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.graphs.eager import generate_eager
    from onegraph.models.qwen3_5.tiny import TINY_HF_CONFIG, random_model
    model = random_model(ModelConfig.from_hf(TINY_HF_CONFIG), torch.bfloat16, "cpu", router="decisive")
    r = generate_eager(model, [5, 6, 7, 8, 9], 5, max_seq_len=64)
    assert bool(torch.isfinite(fp32_gap(model, [5, 6, 7, 8, 9], r, 64)).all())
    r.token_ids[2] = (r.token_ids[2] + 1) % model.cfg.vocab_size     # as if bf16 had parted at step 2
    g = fp32_gap(model, [5, 6, 7, 8, 9], r, 64)
    assert bool(torch.isfinite(g[:3]).all()) and bool(torch.isnan(g[3:]).all()), g
