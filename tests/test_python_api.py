"""The embedding API a Python user meets: the README's `## Python API` block, run verbatim against the tiny
artifact, and text in / text out agreeing with the token-id API."""
import re
from pathlib import Path

import pytest

from onegraph.runtime import Engine
from onegraph.runtime.text import DEFAULT_SAMPLING

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block() -> str:
    section = README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_api_runs_verbatim(tiny_artifact, tmp_path, monkeypatch, capsys):
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "tiny").symlink_to(tiny_artifact)
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_block(), "README.md", "exec"), {})
    out = capsys.readouterr().out
    # the first print is command 1's documented text (README: seed 0), the last the ids
    assert out.startswith("\n        Decimal('-')\n        >>") and out.splitlines()[-1].startswith("["), out
    assert "\"text\": \"\\n        Decimal('-')\\n        >>\"" in README.read_text()


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    eng = Engine.from_artifact(tiny_artifact, max_slots=1, check_parity=False)
    yield eng
    eng.close()


def test_text_agrees_with_ids(engine):
    tok, eos = engine.tokenizer, engine.artifact.model["eos_token_ids"]
    ids = tok.encode("def main(argv):")
    for sampling in ({"temperature": 0}, {}):             # greedy, and the default (seeded) sampling
        want = engine.generate(ids, 24, stop_ids=eos, **{**DEFAULT_SAMPLING, **sampling}).token_ids
        assert engine.generate_text("def main(argv):", 24, **sampling) == tok.decode(want)
        assert "".join(engine.stream_text("def main(argv):", 24, **sampling)) == tok.decode(want)


def test_stream_closed_early_frees_the_slot(engine):
    it = engine.stream_text("x", 200, temperature=0, stop_ids=())
    next(d for d in it if d)
    it.close()                                         # max_slots=1: the next request needs that slot
    assert engine.generate_text("y", 4, temperature=0)  is not None


def test_generate_with_text_says_what_to_call(engine):
    with pytest.raises(ValueError, match="generate_text"):
        engine.generate("hello")
