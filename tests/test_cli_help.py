"""`onegraph --help` and docs/cli.md cannot drift: the doc's usage block is the parser's, every command's
help shows its defaults and an example, and the README's command 1 samples as `generate` does by default."""
import re
import shlex
from pathlib import Path

import pytest

from onegraph.cli import EXAMPLES, build_parser, reference
from onegraph.runtime.text import DEFAULT_SAMPLING

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("doc", ["docs/cli.md", "README.md"])
def test_docs_cli_block_is_the_parser(doc):
    text = (ROOT / doc).read_text()
    block = re.search(r"```\n(onegraph init-tiny.*?)\n```", text, re.S).group(1)
    want = reference(build_parser())
    assert block == want, (f"{doc} drifted from the parser; paste the output of `python -c \"from "
                           "onegraph.cli import build_parser, reference; print(reference(build_parser()))\"`")


@pytest.mark.parametrize("cmd", list(EXAMPLES))
def test_every_command_help_has_defaults_and_an_example(cmd):
    parser = build_parser()
    sub = parser.subcommands[cmd]
    text = sub.format_help()
    assert f"example:\n  {EXAMPLES[cmd]}" in text
    assert EXAMPLES[cmd].startswith(f"onegraph {cmd} ")
    sub.parse_args(shlex.split(EXAMPLES[cmd])[2:])            # the example parses
    defaults = [a for a in sub._actions if a.option_strings and a.nargs != 0 and a.default is not None]
    for a in defaults:
        assert re.search(rf"{re.escape(a.option_strings[-1])}.*?\(default: ", text, re.S), (cmd, a.dest)


def test_generate_defaults_are_readme_command_1s_sampling():
    readme = (ROOT / "README.md").read_text()
    cmd1 = next(line for line in readme.splitlines() if "onegraph generate artifacts/tiny" in line)
    words = shlex.split(cmd1.split("onegraph generate", 1)[1])
    flags = {w: words[i + 1] for i, w in enumerate(words[:-1])}
    args = build_parser().parse_args(["generate", "artifacts/tiny", "--prompt", "x"])
    assert float(flags["--temperature"]) == args.temperature == DEFAULT_SAMPLING["temperature"]
    assert int(flags["--top-k"]) == args.top_k == DEFAULT_SAMPLING["top_k"]
