"""Engine: the thin serving loop over a GraphExecutor — fixed slots, continuous batching, sampling
on the device, and token output read one step late.

One engine thread owns the executor. Per step it: admits waiting requests into free slots, runs
prefill chunks up to a token budget (`prefill_budget`, default one largest chunk; at least one chunk per
step), oldest admitted request first — a prompt's last chunk samples its first token in-graph, and only
then does the request join the decode rows, so a long prompt holds its slot for several steps while the
running streams keep decoding between its chunks (the chunk boundaries are those of a whole-prompt
prefill, so outputs are unchanged) — then gathers every decoding slot's last token
*on the device* (`last_tok[slots]`, never through the host), replays the decode graph of the
smallest fitting bucket, scatters the sampled ids back into `last_tok`, queues a non-blocking copy
of them to the host, and only then reads the ids of the *previous* step (docs/design.md). Stop ids
therefore act one step late; the overrun token of a stopped request is dropped, and the slot it
dirtied is reset branch-free by the next prefill at position 0. Length limits are known on the
host and never overrun.

Callers: `generate()` (blocking), `stream()` (async iterator, many concurrent tasks), `cancel()`,
`stats()`, all on token ids; text in and out: `generate_text()`, `stream_text()` and `tokenizer`
(runtime/text.py). Bad input raises ValueError in the caller; it never reaches the engine thread.

Speculative decoding (an artifact exported with --speculative-tokens K; graphs/spec_graphs.py): one mode
per engine, on by default where the artifact has the graphs (`speculation=False` turns it off, True
demands it). Every decode step is then a round per active slot: the spec graph drafts K tokens with the
MTP head, verifies them, accepts and commits on the device, each slot with its own accepted count and
its own position (spec.pos, on the device); the host reads each row's [n_accepted, targets] one step late
and emits targets[:n_accepted + 1] through the same stop / length rules as decode's ids, so a request's
tokens are those of speculation off (greedy and seeded sampling alike). The host does not know a round's
length until it reads it: `produced` counts one token per round in flight, so a request may run one round
past its end, whose tokens are dropped as a stopped request's overrun token is.

Prefix cache (runtime/prefix_cache.py; `prefix_cache_bytes` of from_artifact, off by default here, on by
default in `serve`): a request's first prefill chunk first copies the longest cached whole-block prefix of its
prompt into its slot and its prefill goes on from there, with the chunk partition of an uncached prefill (the
outputs are bit-identical); each chunk that ends on a block boundary stores that block. A request reports
the prompt tokens it reused as `cached_tokens` (its last Event, Result).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import random
import threading
import time

import torch

from onegraph.custom_ops.sample import check_sampling

from . import text
from .artifact import Artifact
from .executor import GraphExecutor, Sampling, max_chunk  # noqa: F401  (Sampling re-exported)

log = logging.getLogger("onegraph.runtime")


class QueueFull(RuntimeError):
    """The bounded wait queue is full: the caller should retry later (HTTP 503)."""


@dataclasses.dataclass
class Event:
    """One step of a request's output: a token id, or (the last event) token_id None and a finish_reason."""
    token_id: int | None
    finish_reason: str | None = None     # None until the last event: stop | length | cancelled | error
    cached_tokens: int = 0               # prompt tokens the prefix cache supplied (every event of the request)


@dataclasses.dataclass
class Result:
    """generate()'s answer: the generated ids (prompt excluded), why it stopped, timings (docs/export.md: JSON output)."""
    token_ids: list[int]
    finish_reason: str
    timings: dict
    speculation: dict | None = None     # {tokens: K, accepted_mean, rounds} when the engine speculates
    cached_tokens: int = 0              # prompt tokens the prefix cache supplied (not prefilled)


@dataclasses.dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop_ids: frozenset
    emit: callable                      # emit(Event), called on the engine thread
    slot: int = -1
    pos: int = 0                        # position of the token that the next decode feeds
    prefilled: int = 0                  # prompt tokens prefilled so far (== len(prompt): decoding)
    produced: int = 0                   # tokens sampled (delivered or in flight)
    done: bool = False
    cancelled: bool = False
    t_submit: float = dataclasses.field(default_factory=time.perf_counter)
    t_first: float | None = None
    delivered: int = 0                  # tokens emitted to the caller
    rounds: int = 0                     # speculative rounds read while the request ran
    accepted: int = 0                   # drafts accepted over those rounds
    cached_tokens: int = -1             # prompt tokens the prefix cache supplied (-1: not looked up yet)
    cache_chain: list = dataclasses.field(default_factory=list)   # the prefix cache entries it pins


class Engine:
    """The replay loop over one artifact's graphs, in its own thread; thread-safe for callers.

        engine = Engine.from_artifact("artifacts/tiny")
        engine.generate_text("def fibonacci(n):")        # or generate(ids) for token ids
        engine.close()
    """

    def __init__(self, executor: GraphExecutor, max_queue: int = 64, speculation: bool | None = None,
                 prefill_budget: int | None = None, prefix_cache=None):
        """speculation: None uses the artifact's speculative graphs where it has them, False decodes one token
        per step, True requires them (ValueError naming the export option if the artifact has none).
        prefill_budget: prompt tokens prefilled per engine step between decode steps (default: the executor's
        largest chunk, GraphExecutor.set_max_chunk; at least one chunk runs per step whatever its size).
        prefix_cache: a runtime/prefix_cache.py PrefixCache over this executor's state, or None."""
        if prefill_budget is not None and prefill_budget < 1:
            raise ValueError(f"prefill_budget must be >= 1 prompt tokens per step, got {prefill_budget}")
        if prefix_cache is not None and prefix_cache.C != executor.max_chunk:
            raise ValueError(f"the prefix cache's blocks ({prefix_cache.C} tokens) are not the prefill chunk "
                             f"({executor.max_chunk})")
        self.prefill_budget = int(prefill_budget or executor.max_chunk)
        if speculation and not executor.speculative_tokens:
            raise ValueError("speculative decoding needs an artifact exported with --speculative-tokens K "
                             "(this one has no draft / verify graphs)")
        self.spec = executor.speculative_tokens if speculation is not False else 0
        self.cache = prefix_cache
        self.ex = executor
        self.max_queue = max_queue
        self.vocab = executor.vocab_size
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: dict[int, Request] = {}            # slot -> request (prefilling or decoding)
        self.prefilling: collections.deque[Request] = collections.deque()   # admitted, prompt not all fed yet
        self.free = list(range(executor.max_slots))
        self.ids = itertools.count()
        self.cv = threading.Condition()
        self.inflight: list = []                           # [(rows, host ids, cuda event, reusable)] launched, not read
        self.events: list = []                             # the engine's CUDA events already read, for reuse
        self.counters = collections.Counter()
        self.step_us = collections.defaultdict(float)      # summed µs per phase
        self.closed = False
        self.error: BaseException | None = None
        # the engine thread runs with the creator's intra-op thread count (OpenMP settings are per thread)
        self.threads = torch.get_num_threads()
        self.thread = threading.Thread(target=self._loop, name="onegraph-engine", daemon=True)
        self.thread.start()

    @classmethod
    def from_artifact(cls, path, max_slots: int = 4, max_queue: int = 64, device: str | None = None,
                      check_parity: bool = True, cuda_graphs: bool = True,
                      speculation: bool | None = None, prefill_budget: int | None = None,
                      free_memory: int | None = None, prefix_cache_bytes: int | None = 0,
                      prefill_chunk: int | None = None) -> "Engine":
        """An engine over an artifact: a directory (verified here, for `device`: default the artifact's) or an
        Artifact already loaded (on its own device). prefill_budget: see Engine. prefill_chunk: the largest
        chunk a prompt is fed in, one of the artifact's prefill chunks (default its largest;
        GraphExecutor.set_max_chunk says what it trades), checked before any graph loads. A max_slots that does
        not fit in the device's free memory (or `free_memory` bytes) is refused with a ValueError naming the
        memory needed and free (GraphExecutor.from_artifact). prefix_cache_bytes: the prefix cache's pool
        (0: no cache; None: runtime/prefix_cache.py's default fraction of the memory left free), checked
        before any graph loads (prefix_cache.budget)."""
        art = path if isinstance(path, Artifact) else Artifact.load(path, device, defer_sha256=True)
        if speculation and not art.speculative_tokens:     # refused before any graph loads
            raise ValueError(f"{art.path} has no draft / verify graphs: export it with --speculative-tokens K "
                             f"to decode speculatively")
        chunk = max_chunk(sorted(g["bucket"] for g in art.graphs.values() if g["kind"] == "prefill"), prefill_chunk)
        cache_bytes = 0
        if prefix_cache_bytes != 0:
            from . import prefix_cache
            cache_bytes = prefix_cache.budget(art, max_slots, prefix_cache_bytes, free_memory, chunk)
        ex = GraphExecutor.from_artifact(art, max_slots=max_slots, check_parity=check_parity,
                                         cuda_graphs=cuda_graphs, free_memory=free_memory)
        ex.set_max_chunk(chunk)
        cache = None
        if cache_bytes:
            from .prefix_cache import for_executor
            cache = for_executor(ex, cache_bytes)
        eng = cls(ex, max_queue, speculation, prefill_budget, cache)
        log.info("onegraph engine: %s, %d slots, decode buckets %s, prefill chunks %s (prompts fed in chunks of "
                 "up to %d), prefill budget %s tokens per step, speculative tokens %s", ex.path, max_slots,
                 ex.decode_buckets, ex.prefill_buckets, ex.max_chunk, eng.prefill_budget,
                 ex.speculative_tokens if speculation is not False else "off")
        log.info("onegraph load (wall s): %s", ", ".join(f"{k} {v:.2f}" for k, v in ex.load_timings_s.items()))
        if ex.fixture_report is not None:
            log.info("onegraph parity fixture: %s", ex.fixture_report)
        log.info("onegraph prefix cache: %s", "off" if cache is None else
                 f"{cache.capacity} blocks of {cache.C} tokens, {cache.block_bytes} bytes each")
        return eng

    @property
    def artifact(self) -> Artifact | None:
        """The artifact the engine runs (None over an eager executor)."""
        return self.ex.artifact

    @property
    def fixture_report(self) -> dict | None:
        """The load-time parity fixture's report (None when it did not run)."""
        return self.ex.fixture_report

    # ---------------- caller side ----------------
    @property
    def tokenizer(self):
        """The artifact's tokenizer (runtime/codec.py TextCodec: encode(str) -> ids, decode(ids) -> str)."""
        return text.tokenizer(self)

    def generate_text(self, prompt: str, max_new_tokens: int = 32, **sampling) -> str:
        """The continuation of `prompt` as a string. sampling: temperature, top_k, top_p, seed, stop_ids
        (default runtime/text.py DEFAULT_SAMPLING and the model's eos ids; temperature=0 is greedy)."""
        return text.generate_text(self, prompt, max_new_tokens, **sampling)

    def stream_text(self, prompt: str, max_new_tokens: int = 32, **sampling):
        """Iterator of text deltas of the continuation of `prompt` (blocking; closing it cancels the request).
        Arguments as generate_text()."""
        return text.stream_text(self, prompt, max_new_tokens, **sampling)

    def _validate(self, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed=None) -> list[int]:
        if isinstance(prompt_ids, (str, bytes)):
            raise ValueError("prompt_ids are token ids; for text use engine.generate_text(prompt) / "
                             "stream_text(prompt), or engine.tokenizer.encode(prompt)")
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise ValueError("prompt is empty: at least one token id is needed")
        bad = [i for i in ids if not 0 <= i < self.vocab]
        if bad:
            raise ValueError(f"prompt ids {bad[:5]} are outside the vocabulary [0, {self.vocab})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(ids) + max_new_tokens > self.ex.max_seq_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"artifact's max_seq_len {self.ex.max_seq_len}")
        check_sampling(temperature, top_k, top_p, seed)
        return ids

    def submit(self, prompt_ids, emit, max_new_tokens=16, temperature=0.0, top_k=0, top_p=1.0, seed=None,
               stop_ids=()) -> int:
        """Queue a request -> its id. `emit(Event)` is called on the engine thread for every token and once at
        the end. temperature 0 is greedy; top_k 0 keeps every token; seed None draws one; stop_ids end the
        request (the stop id is emitted). ValueError (bad input) or QueueFull raise here."""
        return self._submit(prompt_ids, emit, max_new_tokens, temperature, top_k, top_p, seed, stop_ids).id

    def _submit(self, prompt_ids, emit, max_new_tokens, temperature, top_k, top_p, seed, stop_ids) -> Request:
        ids = self._validate(prompt_ids, max_new_tokens, temperature, top_k, top_p, seed)
        seed = random.getrandbits(63) if seed is None else int(seed)
        req = Request(next(self.ids), ids, int(max_new_tokens), Sampling(float(temperature), int(top_k),
                      float(top_p), seed), frozenset(int(s) for s in stop_ids), emit)
        with self.cv:
            if self.closed or self.error:
                raise RuntimeError(f"engine is not running ({self.error or 'closed'})")
            # a request that a free slot will take at once never counts against the queue bound
            if len(self.waiting) >= self.max_queue + len(self.free):
                self.counters["rejected_queue_full"] += 1
                raise QueueFull(f"{len(self.waiting)} requests already waiting (max_queue={self.max_queue})")
            self.waiting.append(req)
            self.counters["submitted"] += 1
            self.cv.notify()
        return req

    def generate(self, prompt_ids, max_new_tokens=16, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                 stop_ids=(), timeout: float | None = None) -> Result:
        """Run one request on token ids to its end (blocking) -> Result. Arguments as submit(); text: generate_text()."""
        out, done, fin = [], threading.Event(), []

        def emit(ev: Event):
            if ev.token_id is not None:
                out.append(ev.token_id)
            if ev.finish_reason is not None:
                fin.append(ev.finish_reason)
                done.set()
        t0 = time.perf_counter()
        req = self._submit(prompt_ids, emit, max_new_tokens, temperature, top_k, top_p, seed, stop_ids)
        if not done.wait(timeout):
            raise TimeoutError("generation did not finish in time")
        spec = None
        if self.spec:
            with self.cv:
                spec = {"tokens": self.spec, "accepted_mean": req.accepted / max(1, req.rounds), "rounds": req.rounds}
        return Result(out, fin[0], self.timings((time.perf_counter() - t0) * 1e3), spec, max(0, req.cached_tokens))

    def timings(self, total_ms: float) -> dict:
        """Timing fields with their unit in the name (docs/export.md: JSON output): total_ms of the request,
        prefill_us summed over the engine's prefills so far, each decode phase in µs per decode step."""
        with self.cv:
            steps = self.counters["decode_steps"]
            per_step = {f"{k}_us_per_step": v / max(1, steps) for k, v in self.step_us.items() if k != "prefill"}
            return {"total_ms": total_ms, "prefill_us": self.step_us.get("prefill", 0.0), "decode_steps": steps,
                    **per_step}

    def stream(self, prompt_ids, max_new_tokens=16, temperature=0.0, top_k=0, top_p=1.0, seed=None,
               stop_ids=(), request_id: list | None = None):
        """Submit now (ValueError / QueueFull raise here, before any event) and return an async iterator
        of Events; the last one has token_id None and a finish_reason. Call from a running event loop.
        `request_id`, if given a list, receives the id (for cancel())."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rid = self.submit(prompt_ids, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev), max_new_tokens,
                          temperature, top_k, top_p, seed, stop_ids)
        if request_id is not None:
            request_id.append(rid)
        return self._events(q, rid)

    async def _events(self, q: asyncio.Queue, rid: int):
        try:
            while True:
                ev = await q.get()
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            self.cancel(rid)          # a consumer that stops early frees its slot

    def cancel(self, request_id: int) -> bool:
        """Stop a request (its slot frees at the next step; its last event says cancelled) -> whether it was running."""
        with self.cv:
            for r in list(self.waiting) + list(self.active.values()):
                if r.id == request_id and not r.done:
                    r.cancelled = True
                    self.cv.notify()
                    return True
        return False

    def stats(self) -> dict:
        """Slots, queue, counters, per-step µs and the speculation figures (the server's /metrics reads them)."""
        with self.cv:
            steps = max(1, self.counters["decode_steps"])
            return {"path": self.ex.path, "active_slots": len(self.active), "free_slots": len(self.free), "queue_depth": len(self.waiting),
                    "max_slots": self.ex.max_slots, "prefilling": len(self.prefilling),
                    "prefill_budget": self.prefill_budget, "counters": dict(self.counters),
                    "step_us": {k: v / steps for k, v in self.step_us.items()},
                    "speculation": self._spec_stats(), "error": repr(self.error) if self.error else None,
                    "prefix_cache": self.cache.stats() if self.cache is not None else None}

    def _spec_stats(self) -> dict | None:
        """Under self.cv. acceptance_rate: accepted drafts / drafted (rounds x K); mean_accepted_length:
        tokens a round yields, accepted drafts + the target's own (1..K+1)."""
        if not self.spec:
            return None
        rounds, acc = self.counters["spec_rounds"], self.counters["spec_accepted"]
        return {"tokens": self.spec, "rounds": rounds, "accepted_drafts": acc,
                "acceptance_rate": acc / max(1, rounds * self.spec), "mean_accepted_length": 1 + acc / max(1, rounds)}

    def close(self):
        """Stop the engine thread (requests in flight end) and release tensor-parallel followers."""
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join(timeout=30)
        if not self.thread.is_alive() and self.error is None:
            self.ex.stop_followers()          # tensor parallel: release ranks > 0 (no-op otherwise)

    # ---------------- engine thread ----------------
    def _finish(self, r: Request, reason: str):
        """Under self.cv: end a request, free its slot, send the last event."""
        if r.done:
            return
        r.done = True
        self.counters[f"finished_{reason}"] += 1
        if r.slot >= 0 and self.active.get(r.slot) is r:
            del self.active[r.slot]
            self.free.append(r.slot)
        r.emit(Event(None, reason, max(0, r.cached_tokens)))

    def _loop(self):
        torch.set_num_threads(self.threads)
        try:
            while self._iteration():
                pass
        except BaseException as e:  # an engine bug: fail every request loudly, never leave one hanging
            self.error = e
            with self.cv:
                for r in list(self.waiting) + list(self.active.values()):
                    if not r.done:
                        r.done = True
                        r.emit(Event(None, "error"))
                self.waiting.clear()
                self.active.clear()
                self.prefilling.clear()
            raise

    def _iteration(self) -> bool:
        with self.cv:
            while not (self.closed or self.waiting or self.active or self.inflight):
                self.cv.wait()
            if self.closed and not self.active and not self.inflight:
                for r in self.waiting:
                    r.done = True
                    r.emit(Event(None, "cancelled"))
                self.waiting.clear()
                return False
            for r in list(self.active.values()):
                if r.cancelled:
                    self._finish(r, "cancelled")
            while self.waiting and self.free and not self.closed:
                r = self.waiting.popleft()
                if r.cancelled:
                    r.done = True
                    r.emit(Event(None, "cancelled"))
                    continue
                r.slot = self.free.pop(0)
                self.active[r.slot] = r
                self.prefilling.append(r)
            if self.closed:
                for r in list(self.active.values()):
                    self._finish(r, "cancelled")
            # a request cancelled mid-prefill left with its slot (_finish above): its chunks stop here
            if self.cache is not None:
                for r in self.prefilling:
                    if r.done:
                        self.cache.release(r.cache_chain)
            self.prefilling = collections.deque(r for r in self.prefilling if not r.done)
            # requests whose prompt is all fed; one whose last chunk runs below decodes from the next step on
            rows = [r for r in self.active.values() if r.prefilled == len(r.prompt) and r.produced < r.max_new_tokens]
        previous, self.inflight = self.inflight, []
        chunks = self._prefill_chunks()
        if rows and self.prefilling:          # a prompt part-fed: its neighbours decode on between its chunks
            self.counters["decode_steps_between_chunks"] += 1
        self._decode(rows)
        # one step late: read what the previous iteration launched while this one runs
        self._read(previous)
        if not chunks and not rows:
            self._read(self.inflight)           # nothing new launched: flush
            self.inflight = []
        return True

    def _launch(self, rows: list[Request], ids_dev: torch.Tensor, host_ev: tuple | None = None, spec: bool = False):
        """Queue rows' sampled ids for reading one step late; `host_ev`: (pinned copy, event after it)
        that the step makes itself (captured decode), else a D2H copy and an event are launched here.
        spec: ids_dev is [n, 1 + K+1], each row [n_accepted, targets...] of a speculative round."""
        if host_ev is not None:
            self.inflight.append((rows, *host_ev, False, spec))
            return
        host = ids_dev.to("cpu", non_blocking=ids_dev.device.type == "cuda")
        ev = None
        if ids_dev.device.type == "cuda":
            ev = self.events.pop() if self.events else torch.cuda.Event()   # reused once read
            ev.record()
        self.inflight.append((rows, host, ev, True, spec))

    def _read(self, batches):
        t, wait = time.perf_counter(), 0.0
        for rows, host, ev, reusable, spec in batches:
            if ev is not None:                     # device time, not host time: counted apart
                w = time.perf_counter()
                ev.synchronize()
                wait += time.perf_counter() - w
                if reusable:
                    self.events.append(ev)
            for r, tok in zip(rows, host.tolist()):
                if spec:
                    self._deliver_round(r, tok[0], tok[1:tok[0] + 2])
                else:
                    self._deliver(r, tok)
        self.step_us["device_wait"] += wait * 1e6
        self.step_us["host_read"] += (time.perf_counter() - t - wait) * 1e6

    def _deliver(self, r: Request, tok: int):
        with self.cv:
            if r.done:
                self.counters["overrun_dropped"] += 1      # stopped one step late: drop
                return
            if r.cancelled:
                return self._finish(r, "cancelled")
            if tok in r.stop_ids:
                return self._finish(r, "stop")
            if r.t_first is None:
                r.t_first = time.perf_counter()
            r.delivered += 1
            self.counters["generated_tokens"] += 1
            r.emit(Event(tok, cached_tokens=r.cached_tokens))    # on every event: a server that stops a
            # request itself (a stop string) never reads its last one
            if r.delivered >= r.max_new_tokens:
                self._finish(r, "length")

    def _deliver_round(self, r: Request, accepted: int, tokens: list[int]):
        """A speculative round's tokens (accepted drafts + the target's next), each as a decode step's id."""
        with self.cv:
            if not r.done:
                r.rounds += 1
                r.accepted += accepted
                self.counters["spec_rounds"] += 1
                self.counters["spec_accepted"] += accepted
        r.produced += len(tokens) - 1             # the round's first token was counted when it was launched
        r.pos += len(tokens)
        for tok in tokens:
            self._deliver(r, tok)

    def _prefill_chunks(self) -> int:
        """This step's prefill: chunks of the oldest prefilling requests while their prompt tokens fit in
        prefill_budget (the first chunk always runs) -> chunks run. A prompt's last chunk launches its
        first token, read one step late as a decode step's ids are."""
        spent = chunks = 0
        while self.prefilling:
            r = self.prefilling[0]
            if r.cached_tokens < 0:       # its first chunk: resume after the longest cached whole-block prefix
                r.cached_tokens = r.prefilled = self.cache.lookup(r.prompt, r.slot, r.cache_chain) if self.cache else 0
            n = self.ex.chunk_tokens(len(r.prompt) - r.prefilled)
            if chunks and spent + n > self.prefill_budget:
                break
            t = time.perf_counter()
            ids, _ = self.ex.prefill_chunk(r.prompt, r.prefilled, r.slot, r.sampling)
            r.prefilled += n
            if self.cache is not None:    # a chunk ending on a block boundary stores that block
                self.cache.store(r.prompt, r.prefilled, r.slot, r.cache_chain)
            spent, chunks = spent + n, chunks + 1
            self.counters["prefill_tokens"] += n
            self.counters["prefill_chunks"] += 1
            self.step_us["prefill"] += (time.perf_counter() - t) * 1e6
            if r.prefilled == len(r.prompt):
                self.prefilling.popleft()
                if self.cache is not None:
                    self.cache.release(r.cache_chain)
                r.pos, r.produced = len(r.prompt), 1
                self._launch([r], ids)
        return chunks

    def _decode(self, rows: list[Request]):
        if not rows:
            return
        cap = (self.ex.spec_buckets if self.spec else self.ex.decode_buckets)[-1]
        for i in range(0, len(rows), cap):
            part = rows[i:i + cap]
            t0 = time.perf_counter()
            if self.spec:                          # one round per row: [n_accepted, targets] read one step late
                rnd = self.ex.spec_round([r.slot for r in part], [r.sampling for r in part])
                host_ev, t1 = rnd.host_rows, rnd.copied_at      # captured: the graph copied its rows out
                ids = None if host_ev else torch.cat([rnd.n_accepted[:, None], rnd.targets], 1)
            else:
                step = self.ex.step([r.slot for r in part], [r.pos for r in part], [r.sampling for r in part])
                ids, host_ev, t1 = step.ids, step.host_ids, step.copied_at
            t2 = time.perf_counter()
            for r in part:
                r.pos += 0 if self.spec else 1     # speculative: advanced when the round is read
                r.produced += 1
            self._launch(part, ids, host_ev, spec=bool(self.spec))
            self.step_us["copy_in"] += (t1 - t0) * 1e6
            self.step_us["replay"] += (t2 - t1) * 1e6
            self.step_us["bookkeeping"] += (time.perf_counter() - t2) * 1e6
            self.counters["decode_steps"] += 1
            self.counters["decode_rows"] += len(part)
