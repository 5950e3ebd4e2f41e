"""`onegraph eval` (commands/eval.py): bits per byte and perplexity, the same from eager and from the exported
artifact, the same as an independent full-sequence computation, and low for the shipped weights.
"""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from onegraph.commands import eval as ev

# ~4 windows of 128 tokens: each side runs 127 decode steps
N_TOKENS, CTX = 500, 128


@pytest.fixture(scope="module")
def eager_result(one_thread):
    return ev.evaluate("tiny", max_tokens=N_TOKENS, ctx=CTX)


def test_windows_score_every_token_but_the_first_once():
    ids = list(range(10))
    w = ev.token_windows(ids, 4)
    assert w == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert sum(len(x) - 1 for x in w) == len(ids) - 1
    assert ev.token_windows(list(range(5)), 4) == [[0, 1, 2, 3], [3, 4]]


def test_eager_matches_a_full_sequence_reference(eager_result, one_thread):
    """The decode-step loop's sum of -ln p == the training forward's cross-entropy (the ops' references
    over whole windows, no state, no executor) on the same windows: fp32, relative 1e-5."""
    from tokenizers import Tokenizer
    from onegraph.checkpoint.load import load_model
    from onegraph.scripts.train_tiny import forward
    _, model, path = load_model("tiny", fuse=False)
    ids, n_bytes = ev.encode(Tokenizer.from_file(str(path / "tokenizer.json")),
                             ev.HELDOUT_TEXT.read_text(encoding="utf-8"), N_TOKENS)
    nll = 0.0
    with torch.no_grad():
        for w in ev.token_windows(ids, CTX):
            logits, _, _ = forward(model, torch.tensor([w + [0, 0]]))      # two pad tokens: T = len(w)
            nll += float(F.cross_entropy(logits[0, : len(w) - 1], torch.tensor(w[1:]), reduction="sum"))
    r = eager_result
    assert r["tokens"] == N_TOKENS - 1 and r["bytes"] == n_bytes == N_TOKENS - 1     # byte-level: 1 token = 1 byte
    assert math.isclose(r["nll_nats"], nll, rel_tol=1e-5)
    assert math.isclose(r["bits_per_byte"], nll / math.log(2) / n_bytes, rel_tol=1e-5)
    assert math.isclose(r["perplexity"], math.exp(nll / (N_TOKENS - 1)), rel_tol=1e-5)


def test_shipped_weights_predict_the_heldout_text(eager_result):
    """The trained builtin weights on held-out Python (never trained on): measured 1.377 bits/byte on this
    slice (1.534 on the whole bundled text at ctx 256); a byte-level model with random weights scores ~8."""
    assert eager_result["bits_per_byte"] < 1.45
    assert eager_result["perplexity"] < 2.0 ** (1.45)          # byte-level: bits per byte == bits per token


def test_artifact_matches_eager(tiny_artifact, eager_result, one_thread):
    """Its own prefill and decode graphs (decode bucket 4 < eager's rows), fp32 CPU: relative 1e-4."""
    r = ev.evaluate(str(tiny_artifact), max_tokens=N_TOKENS, ctx=CTX)
    assert r["mode"].startswith("aoti") and r["rows_per_step"] == 4
    assert r["tokens"] == eager_result["tokens"] and r["windows"] == eager_result["windows"] == 4
    assert math.isclose(r["bits_per_byte"], eager_result["bits_per_byte"], rel_tol=1e-4)
    assert math.isclose(r["perplexity"], eager_result["perplexity"], rel_tol=1e-4)


def test_cli_json_and_errors(tiny_artifact, capsys, tmp_path, one_thread):
    from onegraph.cli import main
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 4)
    assert main(["eval", "tiny", "--text", str(text), "--ctx", "32", "--json"]) == 0
    out = capsys.readouterr()
    res = json.loads(out.out.strip().splitlines()[-1])
    assert res["tokens"] == len(text.read_bytes()) - 1 and res["windows"] == 4
    assert res["bits_per_byte"] > 0 and res["perplexity"] > 1
    for argv, msg in ((["eval", str(tiny_artifact), "--ctx", "1000"], "exceeds the artifact's max_seq_len 256"),
                      (["eval", str(tiny_artifact), "--dtype", "bfloat16"], "runs in the dtype it was exported"),
                      (["eval", "tiny", "--text", str(tmp_path / "missing.txt")], "is not a file"),
                      (["eval", "tiny", "--max-tokens", "1"], "--max-tokens must be >= 2")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and msg in err, (argv, err)
