"""tools/plot.py reads both bench JSON shapes (`onegraph bench` "decode" rows, bench_big "batches" rows) and
plots ms per token = ms per step / batch; bad usage exits 2 with a message."""
import subprocess
import sys

from onegraph.tools.plot import series


def test_series_from_both_json_shapes():
    big = {"batches": [{"batch": 1, "replay_ms_per_step": 4.0, "eager_ms_per_step": 80.0, "bandwidth_limit_ms": 1.5},
                       {"batch": 64, "replay_ms_per_step": 32.0, "eager_ms_per_step": 640.0,
                        "bandwidth_limit_ms": 16.0}]}
    s = series(big)
    assert s["onegraph replay"] == [(1, 4.0), (64, 0.5)]
    assert s["onegraph eager"] == [(1, 80.0), (64, 10.0)]
    assert s["bandwidth limit"] == [(1, 1.5), (64, 0.25)]
    small = {"decode": [{"batch": 4, "replay_ms_per_step": 2.0, "eager_ms_per_step": 8.0}]}
    assert series(small) == {"onegraph replay": [(4, 0.5)], "onegraph eager": [(4, 2.0)]}


def test_plot_usage_error():
    r = subprocess.run([sys.executable, "-m", "onegraph.tools.plot"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


def test_big_preset_user_errors(tmp_path):
    """`onegraph bench --preset qwen3.5-35b-a3b`: no --out, or no CUDA device -> one line, exit 2."""
    import torch
    base = [sys.executable, "-m", "onegraph", "bench", "--preset", "qwen3.5-35b-a3b"]
    r = subprocess.run(base, capture_output=True, text=True)
    assert r.returncode == 2 and "--out is required" in r.stderr
    if not torch.cuda.is_available():
        r = subprocess.run(base + ["--out", str(tmp_path / "x.json")], capture_output=True, text=True)
        assert r.returncode == 2 and "needs a CUDA device" in r.stderr and "Traceback" not in r.stderr
