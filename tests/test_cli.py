"""The `onegraph` command line, run as a subprocess (`python -m onegraph ...`), checked against
`generate_eager` in-process and against the CLI's error contract (non-zero exit, one stderr line,
no traceback).

The subprocesses are independent, so they all start in one module fixture, two at a time (this
machine has two cores), and each test reads its result.
"""
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from onegraph import cli
from onegraph.custom_ops.sample import Sampling
from onegraph.graphs.eager import generate_eager
from onegraph.checkpoint.load import load_model
from onegraph.models.qwen3_5.tiny import TINY_HF_CONFIG, write_tiny

TIMEOUT = 120
# one intra-op thread in the subprocesses and in-process alike: the same arithmetic on both sides of
# each comparison, and no thread thrash on a shared 2-core machine
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def onegraph(*args):
    return subprocess.run([sys.executable, "-m", "onegraph", *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT, env=ENV)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    llama = write_tiny(root / "llama")
    (llama / "config.json").write_text(json.dumps(dict(TINY_HF_CONFIG, model_type="llama")))
    return {"root": root, "llama": llama, "init": root / "init"}


@pytest.fixture(scope="module")
def runs(dirs):
    gen = ["generate", "tiny", "--eager", "--json", "--temperature", 0]          # greedy: compared with eager
    jobs = {
        "ids": ["generate", "tiny", "--eager", "--prompt-ids", "1,2,3", "--max-new-tokens", 8, "--json",
                "--temperature", 0],
        "prompt": [*gen, "--prompt", "Hi", "--max-new-tokens", 6],
        "defaults": ["generate", "tiny", "--eager", "--prompt-ids", "9,8,7", "--max-new-tokens", 12, "--json"],
        "sampled": [*gen, "--prompt-ids", "9,8,7", "--max-new-tokens", 12,
                    "--temperature", "0.9", "--top-k", 0, "--seed", 5, "--ignore-eos"],
        "err_missing_dir": ["generate", dirs["root"] / "does-not-exist", "--eager", "--prompt-ids", "1,2"],
        "err_bad_ids": ["generate", "tiny", "--eager", "--prompt-ids", "1,x"],
        "err_oov": ["generate", "tiny", "--eager", "--prompt-ids", f"1,{TINY_HF_CONFIG['vocab_size']}"],
        "err_llama": ["generate", dirs["llama"], "--eager", "--prompt-ids", "1,2"],
        "err_max_new": ["generate", "tiny", "--eager", "--prompt-ids", "1,2", "--max-new-tokens", 0],
        "err_fp32_reduce_onnx": ["export", "tiny", "--out", dirs["root"] / "onnx", "--backend", "onnx",
                                 "--fp32-reduce"],
        "err_fp32_reduce_replay": ["generate", "tiny", "--prompt-ids", "1,2", "--fp32-reduce"],
    }

    def init_then_generate():
        init = onegraph("init-tiny", dirs["init"])
        return init, onegraph("generate", dirs["init"], "--eager", "--prompt-ids", "1,2,3",
                              "--max-new-tokens", 8, "--json", "--temperature", 0)

    with ThreadPoolExecutor(max_workers=2) as pool:
        chained = pool.submit(init_then_generate)
        futures = {name: pool.submit(onegraph, *args) for name, args in jobs.items()}
        out = {name: f.result() for name, f in futures.items()}
        out["init"], out["init_generate"] = chained.result()
    return out


@pytest.fixture(scope="module")
def tiny_model():
    cfg, model, path = load_model("tiny", "float32")
    return cfg, model, path


def last_json(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}"
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_generate_prompt_ids_matches_in_process(runs, tiny_model):
    cfg, model, _ = tiny_model
    res = last_json(runs["ids"])
    ref = generate_eager(model, [1, 2, 3], 8, stop_ids=cfg.eos_token_ids)
    assert len(res["token_ids"]) == 8
    assert res["token_ids"] == ref.token_ids
    assert res["prompt_ids"] == [1, 2, 3]
    assert res["finish_reason"] == ref.finish_reason


def test_generate_sampled_matches_in_process(runs, tiny_model):
    _, model, _ = tiny_model
    res = last_json(runs["sampled"])
    ref = generate_eager(model, [9, 8, 7], 12, Sampling(temperature=0.9, seed=5))
    assert res["token_ids"] == ref.token_ids
    assert res["token_ids"] != generate_eager(model, [9, 8, 7], 12).token_ids   # really sampled


def test_generate_defaults_sample_as_readme_command_1(runs, tiny_model):
    """No sampling flags: temperature 0.7, top-k 40, seed 0 (runtime/text.py DEFAULT_SAMPLING says why)."""
    cfg, model, _ = tiny_model
    res = last_json(runs["defaults"])
    want = generate_eager(model, [9, 8, 7], 12, Sampling(temperature=0.7, top_k=40, seed=0),
                          stop_ids=cfg.eos_token_ids).token_ids
    assert res["token_ids"] == want
    assert want != generate_eager(model, [9, 8, 7], 12, stop_ids=cfg.eos_token_ids).token_ids   # not greedy


def test_generate_text_prompt(runs, tiny_model):
    cfg, model, path = tiny_model
    res = last_json(runs["prompt"])
    assert res["prompt_ids"] == list(b"Hi")          # the tiny tokenizer is byte-level: byte b is id b
    ref = generate_eager(model, list(b"Hi"), 6, stop_ids=cfg.eos_token_ids)
    assert res["token_ids"] == ref.token_ids
    assert isinstance(res["text"], str)
    from tokenizers import Tokenizer
    assert res["text"] == Tokenizer.from_file(str(path / "tokenizer.json")).decode(ref.token_ids)


def test_init_tiny_then_generate_matches_builtin(runs, dirs):
    assert runs["init"].returncode == 0, runs["init"].stderr
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (dirs["init"] / f).is_file(), f
    assert last_json(runs["init_generate"])["token_ids"] == last_json(runs["ids"])["token_ids"]


@pytest.mark.parametrize("name,needle", [
    ("err_missing_dir", "does-not-exist"),
    ("err_bad_ids", "1,x"),
    ("err_oov", str(TINY_HF_CONFIG["vocab_size"])),
    ("err_llama", "model_type"),
    ("err_max_new", "max-new-tokens"),
    ("err_fp32_reduce_onnx", "--fp32-reduce needs --backend aoti"),
    ("err_fp32_reduce_replay", "--fp32-reduce applies to --eager"),
])
def test_user_errors_are_one_line(runs, name, needle):
    p = runs[name]
    assert p.returncode != 0, f"{name}: exit 0, stdout {p.stdout!r}"
    assert "Traceback" not in p.stderr, f"{name}: traceback on stderr:\n{p.stderr}"
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, f"{name}: expected one stderr line, got {lines}"
    assert needle in lines[0], f"{name}: {needle!r} not in {lines[0]!r}"


def test_bad_export_options_leave_an_existing_artifact_alone(tmp_path):
    """Options are checked before the output directory (replaced by a good export) is touched."""
    out = tmp_path / "art"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    for bad in (["--backend", "onnx", "--dtype", "bfloat16"], ["--tp", "3"], ["--max-seq-len", "0"],
                ["--max-seq-len", "64"]):                  # the default prefill chunks run to 256
        p = onegraph("export", "tiny", "--out", out, "--quiet", *bad)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (bad, p.stderr)
        assert (out / "manifest.json").read_text() == "{}", f"{bad}: the existing directory was removed"


@pytest.mark.parametrize("temperature,top_k,top_p,seed", [(-0.1, 0, 1.0, 0), (0.0, 2**31, 1.0, 0),
                                                          (0.0, 0, 0.0, 0), (float("nan"), 0, 1.0, 0),
                                                          (0.0, 0, 1.0, 2**63)])
def test_sampling_is_checked_by_the_engine_rule(temperature, top_k, top_p, seed):
    """The CLI reports custom_ops/sample.py check_sampling's message (the engine's own check), so it refuses
    exactly what the engine would: a top_k of 2^31 and a seed beyond int64 included."""
    from argparse import Namespace

    from onegraph.custom_ops.sample import check_sampling
    with pytest.raises(ValueError) as want:
        check_sampling(temperature, top_k, top_p, seed)
    args = Namespace(max_new_tokens=4, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    with pytest.raises(cli.UserError, match=re.escape(str(want.value))):
        cli.check_sampling(args)


# A meta-path finder that makes the HTTP server's packages look uninstalled, as on a GPU host installed with
# `pip install --no-deps`: every command but `serve` must run there (only cmd_serve imports server/).
NO_SERVER_PACKAGES = """
import sys
class NoServerPackages:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"fastapi", "uvicorn", "pydantic", "prometheus_client"}:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
sys.meta_path.insert(0, NoServerPackages())
"""


def without_server_packages(code: str):
    return subprocess.run([sys.executable, "-c", NO_SERVER_PACKAGES + code], capture_output=True, text=True,
                          timeout=TIMEOUT, env=ENV)


def test_commands_but_serve_need_no_server_packages():
    p = without_server_packages("""
import onegraph.runtime.engine, onegraph.runtime.text
from onegraph.cli import build_parser, main
build_parser()
for cmd in ("export", "inspect"):
    try:
        main([cmd, "--help"])
    except SystemExit as e:
        assert e.code == 0, (cmd, e.code)
assert not [m for m in sys.modules if m.startswith("onegraph.server")], "server/ imported outside serve"
print("ok")
""")
    assert p.returncode == 0 and p.stdout.rstrip().endswith("ok"), p.stderr


def test_serve_without_server_packages_is_one_line_naming_fastapi():
    p = without_server_packages("from onegraph.cli import main; sys.exit(main(['serve', 'artifacts/none']))")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "fastapi" in lines[0] and "pip install" in lines[0], lines
