"""Lower traced graphs in worker processes, several at once (decode buckets, prefill chunks, TP ranks).

What crosses the process boundary:
- each graph: its program saved by program.save_without_weights (graph, signature, example inputs;
  a few MB for `tiny`) to a file in the staging directory;
- each rank's weights: once per worker, through torch.multiprocessing (CPU: shared memory; CUDA: IPC
  handles), so N workers add no copy of the weights (a 35B model could not be copied per worker).
A worker loads the program, binds the shared weights back by name and calls the same lower_aoti as
the in-process path. Workers record the warnings they raise and send them back; the exporting process
re-issues them, so its warning filters (the CLI's) decide what shows.

Failures: a worker that raises sends its traceback; a worker that dies (a signal, e.g. SIGKILL from
the out-of-memory killer, or an exit) is seen through its process sentinel. Either way LoweringError
names the graph, the cause and the last lines of the worker's log, and every worker is stopped.
Workers run in their own process group: Ctrl-C in a terminal reaches only the exporting process,
which stops the workers (and their compiler children) itself.
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Callable

import torch

WORKER_RAM = 2 << 30          # host bytes per worker: Inductor peaked at 0.5 GiB lowering a `tiny` graph
WORKER_DEVICE_MEM = 2 << 30   # device bytes per worker (its CUDA context, autotuning buffers)
LOG_TAIL = 15                 # lines of a failed worker's log quoted in the error


class LoweringError(RuntimeError):
    """A graph could not be lowered; the message names it, the cause, and the worker's log."""


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def auto_jobs(n_graphs: int, device: torch.device) -> int:
    """Workers for n_graphs: one per core, as many as the free memory holds (weights are shared)."""
    n = min(n_graphs, usable_cores(), _mem_available() // WORKER_RAM)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        n = min(n, free // WORKER_DEVICE_MEM)
    return max(1, n)


@dataclasses.dataclass
class Done:
    tag: str
    seconds: float


@dataclasses.dataclass
class _Worker:
    proc: object
    conn: object
    log: Path
    ready: bool = False
    task: tuple | None = None        # (tag, rank, program, out, eager_rounding)
    ranks: set = dataclasses.field(default_factory=set)
    started: float = 0.0


def _signal_text(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (the out-of-memory killer sends SIGKILL)" if -code == signal.SIGKILL else ""
        return f"was killed by {name} (signal {-code}){hint}"
    return f"exited with code {code}"


class LoweringPool:
    """n spawned workers; submit() graphs, poll() for the finished ones, close() always."""

    def __init__(self, n: int, device: torch.device, tp: int, log_dir: Path,
                 on_start: Callable[[str, int], None] | None = None):
        import torch.multiprocessing as tmp          # registers the tensor-sharing reductions
        ctx = tmp.get_context("spawn")
        self.on_start = on_start                     # test hook: (graph tag, worker pid) at dispatch
        self.queue: collections.deque = collections.deque()
        self.weights: dict[int, dict] = {}
        self.warn_registry: dict = {}
        self.workers: list[_Worker] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        threads = max(1, usable_cores() // n)        # Inductor's own compile threads, per worker
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                log = log_dir / f"worker{i}.log"
                p = ctx.Process(target=_worker_main, args=(child, str(log), str(device), tp, threads),
                                name=f"onegraph-lower-{i}")
                p.start()
                child.close()
                self.workers.append(_Worker(p, parent, log))
        except BaseException:
            self.close()
            raise

    @property
    def pending(self) -> int:
        return len(self.queue) + sum(w.task is not None for w in self.workers)

    def running(self) -> list[str]:
        return [w.task[0] for w in self.workers if w.task is not None]

    def share(self, rank: int, weights: dict[str, torch.Tensor]) -> None:
        self.weights[rank] = weights

    def submit(self, tag: str, rank: int, program: Path, out: Path, eager_rounding: bool) -> None:
        self.queue.append((tag, rank, str(program), str(out), eager_rounding))
        self._dispatch()

    def _dispatch(self) -> None:
        for w in self.workers:
            if not self.queue:
                return
            if w.ready and w.task is None:
                task = self.queue.popleft()
                if task[1] not in w.ranks:
                    w.conn.send(("weights", task[1], self.weights[task[1]]))
                    w.ranks.add(task[1])
                w.task, w.started = task, time.perf_counter()
                w.conn.send(("lower",) + task)
                if self.on_start is not None:
                    self.on_start(task[0], w.proc.pid)

    def poll(self, timeout: float | None) -> list[Done]:
        """Wait up to timeout for events -> the graphs finished meanwhile; raises LoweringError."""
        for w in self.workers:
            if w.proc.exitcode is not None:   # died since the last poll (workers exit only when stopped): a
                self._died(w)                 # dead worker left out of the wait below was never reported
        live = self.workers
        ready = mp_wait([w.conn for w in live] + [w.proc.sentinel for w in live], timeout)
        done = []
        for w in live:
            if w.conn in ready:
                try:
                    while w.conn.poll():
                        done += self._handle(w, w.conn.recv())
                except (EOFError, OSError):       # the pipe closed: the worker is exiting
                    w.proc.join(5)
            if w.proc.sentinel in ready or not w.proc.is_alive():
                w.proc.join(5)
                self._died(w)
        self._dispatch()
        return done

    def _handle(self, w: _Worker, msg) -> list[Done]:
        kind = msg[0]
        if kind == "ready":
            w.ready = True
            return []
        tag = w.task[0]
        if kind == "error":
            raise LoweringError(self._describe(w, tag, f"raised {msg[1].strip().splitlines()[-1]}", msg[1]))
        _, seconds, caught = msg
        for text, category, filename, lineno, module in caught:
            warnings.warn_explicit(text, category, filename, lineno, module=module, registry=self.warn_registry)
        w.task = None
        return [Done(tag, seconds)]

    def _died(self, w: _Worker) -> None:
        code = w.proc.exitcode
        cause = _signal_text(code) if code is not None else "closed its pipe and did not exit"
        raise LoweringError(self._describe(w, w.task[0] if w.task else None, cause))

    def _describe(self, w: _Worker, tag: str | None, cause: str, tb: str | None = None) -> str:
        keep = Path(tempfile.gettempdir()) / f"onegraph-lower-{(tag or 'worker').replace('/', '_')}-{w.proc.pid}.log"
        try:
            shutil.copyfile(w.log, keep)           # the staging directory (and the log in it) is removed
            lines = keep.read_text(errors="replace").splitlines()
        except OSError:
            keep, lines = w.log, []
        if tb:
            lines += tb.strip().splitlines()
        tail = "\n".join("  " + ln for ln in lines[-LOG_TAIL:]) or "  (empty)"
        head = f"lowering {tag} failed" if tag else "a lowering worker failed before taking a graph"
        return f"{head}: worker pid {w.proc.pid} {cause}; last lines of its log ({keep}):\n{tail}"

    def close(self) -> None:
        """Stop every worker (and its compiler children: the worker leads its own process group)."""
        for w in self.workers:
            if w.proc.exitcode is None:
                try:
                    w.conn.send(("stop",))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 2
        for w in self.workers:
            if w.task is None:
                w.proc.join(max(0.0, deadline - time.monotonic()))
            if w.proc.exitcode is None:
                try:
                    os.killpg(w.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    w.proc.kill()
                w.proc.join(5)
            w.conn.close()


def _module_names() -> dict[str, str]:
    return {getattr(m, "__file__", None): name for name, m in list(sys.modules.items()) if getattr(m, "__file__", None)}


def _worker_main(conn, log_path: str, device: str, tp: int, compile_threads: int) -> None:
    os.setpgrp()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)
    import torch._inductor.config as inductor_config

    import onegraph.custom_ops  # noqa: F401  (registers the onegraph ops a program may name)
    from onegraph.export.aoti import lower_aoti
    from onegraph.export.program import load_with_weights
    from onegraph.export.trace import trace_group
    if torch.device(device).type != "cpu":
        import onegraph.custom_ops.triton  # noqa: F401  (the Triton ops of CUDA programs)
    inductor_config.compile_threads = compile_threads
    weights: dict[int, dict] = {}
    with trace_group(tp):                 # TP programs name the collectives' group: the same fake group
        print(f"onegraph lowering worker {os.getpid()}: ready (torch {torch.__version__}, {device}, "
              f"{compile_threads} compile threads)", flush=True)
        conn.send(("ready",))
        while True:
            try:
                msg = conn.recv()
            except EOFError:              # the exporting process is gone
                return
            if msg[0] == "stop":
                # CUDA: a weight received over IPC tells its producer it is released only when it is freed
                # here; a worker exiting with them alive left the exporting process to warn at its exit
                # ("Producer process has been terminated before all shared CUDA tensors released"). lower_aoti
                # drops torch's own hold on the last trace (export/aoti.py release_last_trace), so this frees them
                weights.clear()
                gc.collect()
                return
            if msg[0] == "weights":
                weights[msg[1]] = msg[2]
                continue
            _, tag, rank, program, out, eager_rounding = msg
            print(f"lowering {tag}", flush=True)
            t = time.perf_counter()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    lower_aoti(load_with_weights(Path(program), weights[rank]), Path(out), eager_rounding, tp)
            except Exception:
                conn.send(("error", traceback.format_exc()))
                continue
            names, seen, keep = _module_names(), set(), []
            for m in caught:
                k = (str(m.message), m.category, m.filename, m.lineno)
                if k not in seen:
                    seen.add(k)
                    keep.append(k + (names.get(m.filename),))
            conn.send(("done", time.perf_counter() - t, keep))
