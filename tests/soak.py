"""Soak of `onegraph serve` on an artifact, driven by `onegraph bench-serve`, with the checks that the run
left nothing behind. Used by tests/test_bench_serve.py (200 requests in CI) and by hand (1,000 requests):

    python tests/soak.py ARTIFACT --num-requests 1000 --out benchmarks/cpu_tiny_soak.json

The server runs as its own process (`onegraph serve`), so its resident memory is its own. Steps: start it,
warm it up with one bench-serve run of --concurrency requests, read VmRSS, run the soak (mixed greedy and
seeded sampling, a share of clients hanging up mid-stream, every request's output ids recorded), read
VmRSS and /metrics, then replay every completed request alone through an in-process Engine on the same
artifact: greedy and seeded outputs must be the solo `generate` ids (the server passes the request's seed
to the engine). The report holds the bench JSON's summary plus `checks`; the caller asserts on them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tp_helpers import launch_serve

MODEL = "tiny"


def rss_kb(pid: int) -> int:
    m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m.group(1))


def metrics(url: str) -> dict[str, float]:
    """/metrics samples, name{labels} -> value (histogram buckets and _created left out)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or "_bucket{" in line or "_created" in line or not line.strip():
            continue
        k, v = line.rsplit(" ", 1)
        out[k] = float(v)
    return out


def bench(url: str, n: int, out: Path, concurrency: int, input_len: int, output_len: int, seed: int,
          sampled: float, disconnect: float) -> dict:
    from onegraph.cli import main
    argv = ["bench-serve", "--base-url", url, "--model", MODEL, "--num-requests", str(n),
            "--concurrency", str(concurrency), "--input-len", str(input_len), "--output-len", str(output_len),
            "--seed", str(seed), "--sampled-fraction", str(sampled), "--disconnect-fraction", str(disconnect),
            "--extra-body", '{"return_token_ids": true}', "--save-outputs", "--no-plot", "--quiet",
            "--out", str(out)]
    assert main(argv) == 0
    return json.loads(out.read_text())


def run_soak(artifact, out: Path, num_requests: int = 200, concurrency: int = 32, input_len: int = 32,
             output_len: int = 16, seed: int = 0, sampled: float = 0.5, disconnect: float = 0.1,
             max_slots: int = 8) -> dict:
    t_start = time.perf_counter()
    times = {}
    proc, url = launch_serve(artifact, "--max-slots", max_slots, "--max-queue", 64)
    try:
        times["serve_start"] = time.perf_counter() - t_start
        warm = bench(url, concurrency, out.with_name(out.stem + "_warmup.json"), concurrency, input_len,
                     output_len, seed + 1, sampled, 0.0)
        m0, rss0 = metrics(url), rss_kb(proc.pid)
        t = time.perf_counter()
        res = bench(url, num_requests, out, concurrency, input_len, output_len, seed, sampled, disconnect)
        times["soak"] = time.perf_counter() - t
        time.sleep(0.5)                              # cancelled slots are freed at the engine's next step
        m1, rss1 = metrics(url), rss_kb(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.with_name(out.stem + "_warmup.json").unlink(missing_ok=True)

    def delta(key):
        return m1.get(key, 0.0) - m0.get(key, 0.0)
    outs = res["outputs"]
    ok = [o for o in outs if o["status"] == "ok"]
    comp = 'onegraph_requests_total{endpoint="/v1/completions",status='
    checks = {
        "warmup_completed": warm["completed"],
        "errors": res["errors"], "completed": res["completed"], "disconnected": res["disconnected"],
        "active_slots": m1['onegraph_active_slots'], "queue_depth": m1["onegraph_queue_depth"],
        # every request the tool sent got a 200 (streams start before any token) and nothing else
        "http_200": delta(comp + '"200"}'),
        "http_other": sum(v for k, v in m1.items() if k.startswith(comp) and '"200"' not in k)
        - sum(v for k, v in m0.items() if k.startswith(comp) and '"200"' not in k),
        # a client that hung up before its stream's end is not counted as finished: finished "length"
        # lies in [completed, completed + disconnected], and so do its tokens
        "finished_length": delta('onegraph_request_finished_total{finish_reason="length"}'),
        "finished_other": sum(v for k, v in m1.items() if k.startswith("onegraph_request_finished_total")
                              and '"length"' not in k)
        - sum(v for k, v in m0.items() if k.startswith("onegraph_request_finished_total") and '"length"' not in k),
        "generation_tokens": delta("onegraph_generation_tokens_total"),
        "completed_tokens": sum(o["usage"]["completion_tokens"] for o in ok),
        "rss_kb_before": rss0, "rss_kb_after": rss1, "rss_growth": (rss1 - rss0) / rss0,
    }

    import torch
    from onegraph.runtime import Engine
    t, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(1)           # tiny shapes: intra-op threads only cost (tests/conftest.py one_thread)
    eng = Engine.from_artifact(artifact, max_slots=1, check_parity=False)
    try:
        diff = {"greedy": [], "sampled": []}
        n = {"greedy": 0, "sampled": 0}
        for o in ok:
            kind = "greedy" if o["temperature"] == 0 else "sampled"
            want = eng.generate(o["prompt_ids"], o["max_tokens"], temperature=o["temperature"], seed=o["seed"]).token_ids
            n[kind] += 1
            if o["token_ids"] != want:
                diff[kind].append(o["index"])
    finally:
        eng.close()
        torch.set_num_threads(threads)
    times["solo_replay"] = time.perf_counter() - t
    checks.update(greedy_checked=n["greedy"], greedy_differ=diff["greedy"], sampled_checked=n["sampled"],
                  sampled_differ=diff["sampled"], times_s=times)
    res["checks"] = checks
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    res = run_soak(a.artifact, Path(a.out), a.num_requests, a.concurrency)
    res.pop("outputs")
    res["soak_command"] = "python tests/soak.py " + " ".join(sys.argv[1:])
    res["artifact_options"] = json.loads((Path(a.artifact) / "manifest.json").read_text())["options"]
    res["load_average_1m"] = [load0, os.getloadavg()[0]]     # the machine is shared: at the start, at the end
    res["server"] = f"onegraph serve ARTIFACT --max-slots 8 --max-queue 64 (CPU threads: torch's default, "\
                    f"{os.cpu_count()} cores)"
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["checks"], indent=1))
