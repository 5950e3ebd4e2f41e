"""scripts/lockstep.py: an artifact's graphs vs eager over the artifact's own weights, teacher-forced.

- on the shared `tiny` artifact every step of 8 agrees (ids, logits, every state tensor), and the eager
  twin built from the artifact's weights walks the same greedy ids as eager from the checkpoint;
- a graph that corrupts one state tensor at its third decode call is named: first_diff 3, that tensor;
- bad CLI input exits 2 with a message. (TP-2 under torchrun: tests/test_tp.py.)
"""
import subprocess
import sys

from onegraph.graphs.eager import generate_eager
from onegraph.runtime.executor import GraphExecutor
from onegraph.scripts.lockstep import DEFAULT_PROMPT, lockstep


def test_lockstep_tiny_artifact_agrees(tiny_artifact, tiny_eager, one_thread):
    ex = GraphExecutor.from_artifact(tiny_artifact, max_slots=1, check_parity=False)
    r = lockstep(ex, DEFAULT_PROMPT, 8)
    assert r["first_diff"] is None, r["rows"]
    assert [row["step"] for row in r["rows"]] == list(range(9))
    eager_ids = [row["ids"][1] for row in r["rows"]]
    assert eager_ids == generate_eager(tiny_eager, DEFAULT_PROMPT, 9, max_seq_len=64).token_ids
    assert all(row["ids"][0] == row["ids"][1] for row in r["rows"])
    assert len(r["rows"][0]["state_diff"]) == 2 * tiny_eager.cfg.num_layers


def test_lockstep_names_the_first_diverging_state(tiny_artifact, one_thread):
    ex = GraphExecutor.from_artifact(tiny_artifact, max_slots=1, check_parity=False)
    names = [t["name"] for t in ex.manifest["state"]]
    target = 1                                    # layer 0's recurrent GDN state
    decode, calls = ex.graphs["decode_b1"], []

    def corrupting(inputs):
        out = decode(inputs)
        calls.append(1)
        if len(calls) == 3:
            ex.state[target][0].add_(1.0)
        return out
    ex.graphs["decode_b1"] = corrupting
    r = lockstep(ex, DEFAULT_PROMPT, 5)
    assert r["first_diff"] == 3, r["rows"]
    row = r["rows"][3]
    assert max(row["state_diff"], key=row["state_diff"].get) == names[target], row


def test_lockstep_cli_bad_input(tiny_artifact):
    r = subprocess.run([sys.executable, "-m", "onegraph.scripts.lockstep", str(tiny_artifact), "--steps", "1000"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "exceed max_seq_len" in r.stderr and "Traceback" not in r.stderr, r.stderr
