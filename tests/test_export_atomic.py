"""Export is atomic, parallel, reusable and quiet: --out is untouched by a failed or interrupted export,
two exports run side by side, a re-export reuses the compiled graphs byte for byte, a dead lowering
worker is named with its graph and signal, and the CLI hides only the known third-party warnings.

Exports here are `tiny` with one decode and one prefill graph at max_seq_len 64 (two AOTInductor
compiles, tens of seconds each on 2 cores); the interrupt and worker-death tests stop before any
compile finishes.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from onegraph.export import staging
from onegraph.export.pipeline import ExportOptions, export
from onegraph.export.workers import LoweringError
from onegraph.runtime.artifact import load_manifest

SMALL = ["--batch-sizes", "1", "--prefill-chunks", "16", "--max-seq-len", "64"]
OPTS = ExportOptions(batch_sizes=(1,), prefill_chunks=(16,), max_seq_len=64)
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def cli(*args):
    return [sys.executable, "-m", "onegraph", *map(str, args)]


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.onegraph-"))


def fake_artifact(path: Path) -> str:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text('{"an": "older artifact"}')
    return (path / "manifest.json").read_text()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---------------------------------------------------------------- staging rules (no compile)

def test_existing_out_rules(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an onegraph artifact: refusing"):
        staging.check_target(foreign, force=True)             # force never touches a foreign directory
    art = tmp_path / "art"
    fake_artifact(art)
    with pytest.raises(ValueError, match="already holds an artifact: pass --force"):
        staging.check_target(art, force=False)
    staging.check_target(art, force=True)
    (tmp_path / "empty").mkdir()
    staging.check_target(tmp_path / "empty", force=False)

    # publish: an artifact is replaced only with force; an empty directory is replaced; the stage moves
    for target, force, ok in ((art, False, False), (art, True, True), (tmp_path / "empty", False, True)):
        with staging.staging(target) as stage:
            (stage / "manifest.json").write_text('{"new": 1}')
            if ok:
                staging.publish(stage, target, force)
            else:
                with pytest.raises(ValueError, match="pass --force"):
                    staging.publish(stage, target, force)
        assert (target / "manifest.json").read_text() == ('{"new": 1}' if ok else '{"an": "older artifact"}')
        assert leftovers(target) == []


def test_stale_staging_of_a_dead_export_is_removed(tmp_path):
    out = tmp_path / "art"
    host = socket.gethostname()
    dead = tmp_path / f".art.onegraph-tmp+{host}+{dead_pid()}+abcd"
    live = tmp_path / f".art.onegraph-tmp+{host}+{os.getpid()}+abcd"          # a concurrent export: kept
    other_host = tmp_path / f".art.onegraph-old+not-{host}+1+abcd"           # cannot tell: kept
    for d in (dead, live, other_host):
        (d / "graphs").mkdir(parents=True)
    with staging.staging(out) as stage:
        assert stage.parent == tmp_path and stage.name.startswith(f".art.onegraph-tmp+{host}+{os.getpid()}+")
        assert not dead.exists() and live.exists() and other_host.exists()
    assert not stage.exists() and not out.exists()


def test_cli_filters_only_the_known_warnings():
    from onegraph.cli import quiet_known_warnings
    known = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)` instead."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_known_warnings()
        warnings.warn_explicit(known, FutureWarning, "copyreg.py", 105, module="copyreg")
        warnings.warn_explicit("`torch._prims_common.check` is deprecated", FutureWarning, "lowering.py", 1,
                               module="torch._inductor.lowering")
        warnings.warn_explicit(known, FutureWarning, "mine.py", 1, module="mypackage")           # other module
        warnings.warn_explicit(known, UserWarning, "copyreg.py", 105, module="copyreg")         # other category
        warnings.warn_explicit("something else", FutureWarning, "lowering.py", 1, module="torch._inductor.lowering")
        ro = "The given buffer is not writable, and PyTorch does not support non-writable tensors."
        warnings.warn_explicit(ro, UserWarning, "_package.py", 790, module="torch.export.pt2_archive._package")
        warnings.warn_explicit(ro, UserWarning, "mine.py", 1, module="mypackage")                # other module
    assert [(str(w.message)[:14], w.category.__name__) for w in seen] == [
        ("`isinstance(tr", "FutureWarning"), ("`isinstance(tr", "UserWarning"), ("something else", "FutureWarning"),
        ("The given buff", "UserWarning")]


# ---------------------------------------------------------------- failures leave --out untouched

def test_a_killed_worker_names_the_graph_and_the_signal(tmp_path):
    out = tmp_path / "art"
    before = fake_artifact(out)
    killed = []

    def kill_first(tag, pid):                   # the test hook: SIGKILL the worker as it takes its graph
        if not killed:
            killed.append(tag)
            os.kill(pid, signal.SIGKILL)
    with pytest.raises(LoweringError) as e:
        export("tiny", out, OPTS, progress=False, force=True, cache_dir=None, jobs=2, on_lower_start=kill_first)
    msg = str(e.value)
    assert f"lowering {killed[0]} failed: worker pid" in msg and "was killed by SIGKILL (signal 9)" in msg, msg
    log = Path(msg.split("last lines of its log (")[1].split("):")[0])
    assert log.is_file() and "lowering worker" in msg.split("):", 1)[1] and "ready" in msg, msg   # the log's tail
    log.unlink()
    assert (out / "manifest.json").read_text() == before and sorted(os.listdir(out)) == ["manifest.json"]
    assert leftovers(out) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_export_leaves_out_untouched(tmp_path, sig):
    out = tmp_path / "art"
    before = fake_artifact(out)
    p = subprocess.Popen(cli("export", "tiny", "--out", out, *SMALL, "--force", "--no-cache", "--jobs", "2",
                             "--quiet"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    # SIGTERM once a graph is traced (its workers are starting), SIGINT as soon as the staging directory exists
    wait_for = ".art.onegraph-tmp+*/.work/*.program.pt2" if sig == signal.SIGTERM else ".art.onegraph-tmp+*/.work"
    deadline = time.time() + 240
    while not list(tmp_path.glob(wait_for)):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.1)
    workers = _spawned_children(p.pid)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1] == f"onegraph export: interrupted by {sig.name}; --out {out} is untouched"
    assert "Traceback" not in err
    assert (out / "manifest.json").read_text() == before and sorted(os.listdir(out)) == ["manifest.json"]
    assert leftovers(out) == []
    time.sleep(1)
    assert [w for w in workers if Path(f"/proc/{w}").exists() and _state(w) != "Z"] == [], "workers outlived export"


def test_an_interrupt_wrapped_in_a_library_error_stays_an_interrupt():
    """SIGTERM raises ExportInterrupted in whatever code runs; code that wraps it in its own error (torch.export's
    serializer did, failing a run of the test above) still leaves interruptible() as ExportInterrupted, and an
    error with no signal behind it stays itself."""
    from onegraph.export.staging import ExportInterrupted, interruptible
    with pytest.raises(ExportInterrupted) as got:
        with interruptible():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except ExportInterrupted as e:
                raise RuntimeError("Failed serializing node") from e
    assert got.value.signum == signal.SIGTERM and got.value.__cause__ is None
    with pytest.raises(RuntimeError, match="no signal"):
        with interruptible():
            raise RuntimeError("no signal")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _spawned_children(pid: int) -> list[int]:
    """The exporter's multiprocessing children (its lowering workers), from /proc."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        f = task / "children"
        if f.exists():
            kids += [int(k) for k in f.read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# ---------------------------------------------------------------- concurrency and reuse

def test_concurrent_exports_and_a_byte_identical_reuse(tmp_path, tiny_artifact, aoti_cache):
    """Two exports at once into one cache both succeed: one compiling its 2 graphs in 2 worker processes, one
    in-process taking 2 of the session artifact's graphs from that cache (decode_b1 and prefill_t16 at
    conftest.TINY_EXPORT's max_seq_len: a second compiling export would add two compiles for the same check). A
    third export of the first one's model and options compiles nothing and its graphs are the cached bytes."""
    cache = aoti_cache
    before = set(cache.glob("*/*/graph.pt2"))
    shared = ["--batch-sizes", "1", "--prefill-chunks", "16", "--max-seq-len", "256"]     # in conftest.TINY_EXPORT
    runs = {name: subprocess.Popen(cli("export", "tiny", "--out", tmp_path / name, *opts, "--cache-dir", cache,
                                       "--jobs", jobs), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=ENV)
            for name, opts, jobs in (("a", SMALL, 2), ("b", shared, 1))}
    outs = {}
    for name, p in runs.items():
        outs[name], err = p.communicate(timeout=900)
        assert p.returncode == 0, f"export {name}: {err[-3000:]}"
        assert "FutureWarning" not in err, err                     # the CLI hides the known torch warnings
        load_manifest(tmp_path / name)
    assert "2 graphs: 0 lowered, 2 reused from the cache" in outs["b"], outs["b"]
    entries = sorted(set(cache.glob("*/*/graph.pt2")) - before)
    assert len(entries) == 2                                      # export a's; b compiled nothing

    r = subprocess.run(cli("export", "tiny", "--out", tmp_path / "c", *SMALL, "--cache-dir", cache, "--quiet"),
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 graphs: 0 lowered, 2 reused from the cache" in r.stdout, r.stdout      # nothing compiled
    cached = {e.read_bytes() for e in entries}
    m = {n: json.loads((tmp_path / n / "manifest.json").read_text()) for n in "ac"}
    for rel in m["c"]["files"]:
        got = (tmp_path / "c" / rel).read_bytes()
        if rel.startswith("graphs/"):
            assert got in cached, f"{rel}: not the cached package"
        else:                                   # weights, fixture, tokenizer: the same bytes as export a
            assert got == (tmp_path / "a" / rel).read_bytes(), rel
    from onegraph.runtime.executor import GraphExecutor
    ex = GraphExecutor.from_artifact(tmp_path / "c", max_slots=1)      # replays the eager fixture
    assert ex.fixture_report["max_logit_diff"] <= 1e-4
