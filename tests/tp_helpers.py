"""Launching tensor-parallel artifacts under torchrun from tests (CPU gloo in test_tp.py, 2 GPUs in
test_cuda_tp.py): the command line, a free port, `generate --json`'s result, and a TP server that
answers concurrent requests and then stops on SIGTERM."""
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_serve(artifact, *args, model: str = "tiny") -> tuple[subprocess.Popen, str]:
    """`onegraph serve ARTIFACT --port P --served-model-name MODEL --log-level warning *args` on a free port,
    stdout and stderr piped; returns once /health answers 200 (asserting the process is alive, 120 s at most)
    -> (process, base url)."""
    import os
    import httpx
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "onegraph", "serve", str(artifact), "--port", str(port),
                             "--served-model-name", model, "--log-level", "warning", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    t0 = time.time()
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.time() - t0 < 120, "serve did not come up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)


def torchrun(*args, nproc: int = 2, module: str = "onegraph") -> list[str]:
    """`torchrun --standalone --nproc-per-node N -m MODULE ARGS` (a free rendezvous port each time)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", module, *map(str, args)]


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def tp_generate(art, prompt: list[int], n: int, *extra, nproc: int = 2, timeout: int = 300) -> dict:
    """`torchrun generate ART --json` -> its JSON line (token_ids, fixture report); asserts exit 0."""
    r = subprocess.run(torchrun("generate", art, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", n,
                                "--ignore-eos", "--json", "--temperature", 0, *extra, nproc=nproc),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def tp_serve_completions(art, prompt: list[int], max_tokens: int, requests: int, *extra,
                         start_timeout: float = 180) -> list[list[int]]:
    """`torchrun serve ART --max-slots 2`: `requests` greedy completions of `prompt`, two in flight at a
    time (slot ids reach the other ranks too), then SIGTERM (torchrun passes it to every rank; rank 0
    releases the others) -> each request's token ids. No rank may print a traceback."""
    import httpx
    port = free_port()
    proc = subprocess.Popen(torchrun("serve", art, "--port", port, "--max-slots", 2, "--served-model-name", "tiny",
                                     "--log-level", "warning", *extra),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            assert proc.poll() is None and time.time() - t0 < start_timeout, "the TP server did not start"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        with ThreadPoolExecutor(2) as pool:
            rs = list(pool.map(lambda _: httpx.post(f"{base}/v1/completions", json=body, timeout=120), range(requests)))
        for r in rs:
            assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=90)[0]
    assert "]: Traceback" not in out, out[-4000:]     # torchrun prefixes a rank's traceback with [rankN]
    return [r.json()["choices"][0]["token_ids"] for r in rs]
