"""The CLI's error contract on what a new user does wrong (issue 52's table): one line on stderr, exit 2,
and refused before any load, trace or compile. In-process (`main`) where the refusal comes before the
model: cheap, and a stub that fails the test proves the expensive step never started."""
import json
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from onegraph.cli import main
from onegraph.runtime.artifact import write_manifest


def one_line(capsys, code, *needles):
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    assert code == 2


@pytest.fixture
def no_load(monkeypatch):
    """Any load, export or trace fails the test: the refusal must come first."""
    def boom(*a, **k):
        raise AssertionError("reached the expensive step")
    import onegraph.cli as cli
    import onegraph.export.pipeline as pipeline
    import onegraph.checkpoint.load as load
    monkeypatch.setattr(cli, "lead_or_follow", boom)
    monkeypatch.setattr(pipeline, "export", boom)
    monkeypatch.setattr(load, "load_model", boom)


def fake_artifact(tmp_path, manifest_text="{}"):
    d = tmp_path / "art"
    d.mkdir()
    (d / "manifest.json").write_text(manifest_text)
    return d


def test_export_onnx_without_the_extra_names_the_pip_install(tmp_path, capsys, monkeypatch, no_load):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx_ir" else real(name, *a))
    code = main(["export", "tiny", "--out", str(tmp_path / "x"), "--backend", "onnx"])
    one_line(capsys, code, "onnx_ir", "pip install", ".[onnx]")
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only torch refuses --device cuda")
@pytest.mark.parametrize("argv", [["export", "tiny", "--out", "OUT", "--device", "cuda"],
                                  ["eval", "tiny", "--device", "cuda"],
                                  ["generate", "tiny", "--eager", "--device", "cuda", "--prompt-ids", "1"]])
def test_device_cuda_on_a_cpu_torch(argv, tmp_path, capsys, no_load):
    code = main([str(tmp_path / "x") if a == "OUT" else a for a in argv])
    one_line(capsys, code, "--device cuda")


@pytest.mark.parametrize("port,needle", [("99999", "--port must be in 0..65535, got 99999"),
                                         ("-1", "--port must be in 0..65535")])
def test_serve_port_out_of_range(port, needle, tmp_path, capsys, no_load):
    one_line(capsys, main(["serve", str(fake_artifact(tmp_path)), "--port", port]), needle)


def test_serve_port_in_use_is_refused_before_the_load(tmp_path, capsys, no_load):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", str(fake_artifact(tmp_path)), "--port", str(port)])
    one_line(capsys, code, f"cannot listen on 127.0.0.1:{port}")


def test_serve_max_request_bytes_is_checked(tmp_path, capsys, no_load):
    one_line(capsys, main(["serve", str(fake_artifact(tmp_path)), "--port", "0", "--max-request-bytes", "0"]),
             "--max-request-bytes must be >= 1")


@pytest.mark.parametrize("text,needle", [("[1, 2]", "manifest is a JSON list"), ('"x"', "manifest is a JSON str"),
                                         ("{}", "format None")])
@pytest.mark.parametrize("cmd", ["inspect", "generate"])
def test_manifest_that_is_not_an_object(text, needle, cmd, tmp_path, capsys):
    art = fake_artifact(tmp_path, text)
    argv = [cmd, str(art)] + (["--prompt-ids", "1"] if cmd == "generate" else [])
    one_line(capsys, main(argv), needle)


def truncate_weights(art):
    w = art / "weights.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    return "weights.safetensors: sha256 mismatch"


def delete_graph(art):
    (art / "graphs" / "decode_b1.pt2").unlink()
    return "graphs/decode_b1.pt2 is missing"


def tamper_manifest(art):
    m = json.loads((art / "manifest.json").read_text())
    m["max_seq_len"] = 4096
    (art / "manifest.json").write_text(json.dumps(m))
    return "manifest hash mismatch"


def test_inspect_verifies_a_healthy_artifact(tiny_artifact, capsys):
    assert main(["inspect", str(tiny_artifact)]) == 0
    assert "verified (sha256)" in capsys.readouterr().out


@pytest.mark.parametrize("damage", [truncate_weights, delete_graph, tamper_manifest])
def test_inspect_exits_2_naming_the_damage(damage, artifact_copy, capsys):
    needle = damage(artifact_copy)
    one_line(capsys, main(["inspect", str(artifact_copy)]), needle)


def test_inspect_no_verify_skips_the_file_hashes(artifact_copy, capsys):
    truncate_weights(artifact_copy)
    assert main(["inspect", str(artifact_copy), "--no-verify"]) == 0
    assert "not verified (--no-verify)" in capsys.readouterr().out
    tamper_manifest(artifact_copy)                   # the manifest's own hash is still checked
    one_line(capsys, main(["inspect", str(artifact_copy), "--no-verify"]), "manifest hash mismatch")


def test_inspect_into_a_closed_pipe_is_quiet(tiny_artifact):
    p = subprocess.Popen([sys.executable, "-m", "onegraph", "inspect", str(tiny_artifact), "--no-verify"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()                           # the reader (`| head`) is gone before the first line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_init_tiny_refuses_an_existing_directory(tmp_path, capsys):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    one_line(capsys, main(["init-tiny", str(d)]), str(d), "exists")
    assert [p.name for p in d.iterdir()] == ["notes.txt"]


def test_bench_default_buckets_beyond_the_artifact_hint_batch_sizes(tiny_artifact, tmp_path, capsys, no_load):
    art = tmp_path / "b12"
    shutil.copytree(tiny_artifact, art)
    m = json.loads((art / "manifest.json").read_text())
    m["graphs"] = {n: g for n, g in m["graphs"].items() if not (g["kind"] == "decode" and g["bucket"] > 2)}
    write_manifest(art, {k: v for k, v in m.items() if k not in ("files", "manifest_sha256")})
    one_line(capsys, main(["bench", "--artifact", str(art)]), "largest decode bucket 2", "pass --batch-sizes 1,2")


def test_bare_onegraph_prints_every_command_and_version(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for cmd in ("init-tiny", "generate", "export", "inspect", "eval", "bench", "bench-serve", "serve"):
        assert f"onegraph {cmd} " in out, cmd          # each with its example
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    from onegraph import __version__
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"onegraph {__version__} (torch ")
