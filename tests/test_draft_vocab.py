"""The pruned draft vocabulary's user edges (checkpoint/draft_vocab.py, commands/draft_vocab.py, the export
options): `onegraph draft-vocab` ranks ids by their count in a text, the builtin tiny ranking matches its
tokenizer, and every bad `--draft-vocab` is one line on stderr with exit 2, before any weight is loaded.
(Exactness of speculation over a pruned head: tests/test_spec_eager.py.)
"""
import json

import pytest

from onegraph import cli
from onegraph.checkpoint.draft_vocab import TINY_DRAFT_VOCAB, draft_ids, tokenizer_sha256
from onegraph.checkpoint.load import model_dir


def test_draft_vocab_command_ranks_ids_by_count(tmp_path, capsys):
    """tiny's tokenizer is byte level: 'b' x3, 'a' x2, 'c' x1 (+ a newline) rank b, a, then c and '\\n' by id."""
    text = tmp_path / "t.txt"
    text.write_text("babcab\n")
    out = tmp_path / "dv.json"
    assert cli.main(["draft-vocab", "tiny", str(text), "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["ids"] == [ord("b"), ord("a"), ord("\n"), ord("c")] and d["counts"] == [3, 2, 1, 1]
    assert d["tokens"] == 7 and d["tokenizer_sha256"] == tokenizer_sha256(model_dir("tiny"))


def test_builtin_tiny_ranking_matches_its_tokenizer():
    d = json.loads(TINY_DRAFT_VOCAB.read_text())
    assert d["tokenizer_sha256"] == tokenizer_sha256(model_dir("tiny"))
    assert d["ids"][0] == ord(" ") and d["counts"] == sorted(d["counts"], reverse=True)
    assert draft_ids("tiny", 32, 264, None).tolist() == d["ids"][:32]


def _export_fails(args, tmp_path, capsys, match):
    capsys.readouterr()
    assert cli.main(["export", "tiny", "--out", str(tmp_path / "art"), "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("args,match", [
    (["--draft-vocab", "8"], "needs --speculative-tokens K"),
    (["--speculative-tokens", "2", "--draft-vocab", "0"], "--draft-vocab must be >= 1"),
    (["--speculative-tokens", "2", "--draft-vocab", "100000"], "--draft-vocab must be in 1..264"),
    (["--speculative-tokens", "2", "--draft-vocab", "8", "--weights", "reference"], "needs --weights copy"),
    (["--speculative-tokens", "2", "--draft-vocab-file", "x.json"], "needs --draft-vocab N"),
])
def test_bad_draft_vocab_is_one_line(args, match, tmp_path, capsys):
    _export_fails(args, tmp_path, capsys, match)


def test_a_ranking_of_another_tokenizer_is_refused(tmp_path, capsys):
    f = tmp_path / "other.json"
    f.write_text(json.dumps({"tokenizer_sha256": "0" * 64, "ids": list(range(100))}))
    _export_fails(["--speculative-tokens", "2", "--draft-vocab", "8", "--draft-vocab-file", str(f)], tmp_path,
                  capsys, "was made with another tokenizer")
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"tokenizer_sha256": tokenizer_sha256(model_dir("tiny")), "ids": [1, 2]}))
    _export_fails(["--speculative-tokens", "2", "--draft-vocab", "8", "--draft-vocab-file", str(short)], tmp_path,
                  capsys, "ranks only 2 ids")
