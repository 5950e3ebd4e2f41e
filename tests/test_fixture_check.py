"""The load-time parity fixture's rules (runtime/fixture.py), on synthetic fixtures: a step beyond the
tolerance is excused only where eager's MoE router had a near-tie (at that step or in the prefill),
and a fixture in which every prompt was excused at its prefill fails."""
import pytest
import torch
from safetensors.torch import save_file

from onegraph.runtime.artifact import ArtifactError
from onegraph.runtime.fixture import ROUTER_NEAR_TIE, TOLERANCE, check_fixture

V, STEPS = 16, 4


class Replay:
    """An executor stand-in: returns eager's ids and logits with `bump` added at the given steps."""

    def __init__(self, fx, bumps):
        self.fx, self.bumps = fx, bumps

    def generate(self, prompt, n, slot=0):
        i = next(k for k in range(9) if self.fx[f"prompt{k}"].tolist() == prompt)
        logits = [row + self.bumps.get((i, s), 0.0) for s, row in enumerate(self.fx[f"logits{i}"])]
        return self.fx[f"ids{i}"].tolist(), logits


def _fixture(tmp_path, margins):
    g = torch.Generator().manual_seed(0)
    fx = {}
    for i, m in enumerate(margins):
        logits = torch.randn(STEPS, V, generator=g)
        logits[:, 3] = 10.0                        # a wide top-2 margin: ids are compared strictly
        fx |= {f"prompt{i}": torch.tensor([i + 1, 2, 3]), f"ids{i}": logits.argmax(-1), f"logits{i}": logits,
               f"router_margin{i}": torch.tensor(m, dtype=torch.float32)}
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
