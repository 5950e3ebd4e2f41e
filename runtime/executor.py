"""GraphExecutor: owns the state for S slots and runs prefill chunks / decode buckets on graphs.

The same executor drives lowered graphs (from an artifact) or the eager model (for side-by-side
benchmarks and parity): both expose `call(name, inputs) -> (next_ids, logits)` over the same
signature, so everything above this file is backend-blind.

Slots 0..max_slots-1 belong to requests; slot max_slots is scratch: padding rows of a decode
bucket point at it with zero inputs.

A speculative artifact (export --speculative-tokens K) adds the MTP head's state (its KV cache, spec.y,
spec.pos) to the state, a `spec_b{B}` graph per decode bucket (spec_step: one round of K drafts, verified
and committed on the device) and a prefill that also catches the head up (it takes next_tokens, the
prompt shifted by one). Each graph is handed the state tensors its signature names: the decode graphs
take the model's state only (graphs/spec_graphs.py).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from onegraph.custom_ops.sample import Sampling  # noqa: F401  (re-exported: onegraph.runtime.Sampling)
from onegraph.graphs.signature import torch_dtype

from . import ranks
from .artifact import Artifact, ArtifactError


@dataclasses.dataclass
class DecodeStep:
    """One decode step: ids [n] and logits [n, V] on the device (views a later step may overwrite),
    perf_counter() when its inputs were in (the Engine's per-phase timings), and on the captured path
    (pinned host ids [n], the CUDA event recorded after the graph copied them there), else None."""
    ids: torch.Tensor
    logits: torch.Tensor
    copied_at: float
    host_ids: tuple | None = None


@dataclasses.dataclass
class SpecRound:
    """One speculative round: n_accepted [n] and targets [n, K+1] on the device, when its inputs were in, and
    on the captured path the pinned host copy the round's graph made of them."""
    n_accepted: torch.Tensor
    targets: torch.Tensor
    copied_at: float
    host_rows: tuple | None = None     # captured: (pinned [n, 1+K+1] rows [n_accepted, targets...], event)


def capability_mismatch(name: str, meta: dict, capability: tuple[int, int], device_name: str) -> str | None:
    """Why a package built for another GPU architecture cannot run here (its metadata's AOTI_COMPUTE_CAPABILITY,
    "90" for sm_90, against this device's (major, minor)), or None. A package without one (CPU) passes."""
    built, here = meta.get("AOTI_COMPUTE_CAPABILITY") or None, f"{capability[0]}{capability[1]}"
    if built is None or built == here:
        return None
    return f"graph {name} was compiled for compute capability {built}, this {device_name} has {here}: re-export on it"


def check_capability(path: Path, device: torch.device) -> None:
    """ArtifactError if the CUDA package at path was built for another compute capability than device's."""
    meta = torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(str(path), "model")
    why = capability_mismatch(path.name, meta, torch.cuda.get_device_capability(device),
                              torch.cuda.get_device_name(device))
    if why:
        raise ArtifactError(why)


class AotiGraph:
    """One AOTInductor package with the artifact's weights bound (no copy). `loader_cls`: a class with
    torch._C._aoti.AOTIModelPackageLoader's interface to load it with (tensor parallel passes
    runtime/ranks.py's native().Loader); default torch's own."""

    def __init__(self, path: Path, weights: dict[str, torch.Tensor], device: torch.device, loader_cls=None):
        from torch._inductor import aoti_load_package
        t0 = time.perf_counter()
        index = -1 if device.index is None else device.index
        try:
            if device.type == "cuda":
                check_capability(path, device)
            if device.type == "cuda" or loader_cls is not None:
                # the C++ loader itself, with the arguments aoti_load_package passes it (package, model name,
                # single-threaded, runners, index): torch's Python wrapper first compares the package's device
                # information with this machine's, which asks Inductor for the CPU's vector ISA: in a fresh process
                # a probe (a g++ build and a load check per ISA; 6.9 s on the H200 machine, part of a 35B load's
                # 45 s first package at most, docs/design.md). A CUDA package's compute capability is checked above instead (fail
                # closed, where torch only warns).
                self.loader = (loader_cls or torch._C._aoti.AOTIModelPackageLoader)(
                    str(path), "model", device.type == "cuda", 1, index)
            else:          # a CPU package: torch's ISA check stays (an AVX-512 package would die on an AVX2 CPU)
                self.loader = aoti_load_package(str(path), device_index=index).loader
        except ArtifactError:
            raise
        except Exception as e:
            raise ArtifactError(f"cannot load graph {path.name}: {e}") from None
        fqns = self.loader.get_constant_fqns()
        missing = [f for f in fqns if f not in weights]
        if missing:
            raise ArtifactError(f"graph {path.name} needs weights missing from the artifact: {missing[:3]}")
        t1 = time.perf_counter()
        self.loader.load_constants({f: weights[f] for f in fqns}, False, True, True)   # active, full, user-managed
        self.load_s, self.bind_s = t1 - t0, time.perf_counter() - t1     # wall seconds: package load, weights bound
        self.run = self.loader.run                 # list[Tensor] -> list[Tensor], no pytree overhead
        self.run_with_stream = self.loader.run     # (inputs, stream capsule): for CUDA-graph capture


def max_chunk(prefill_buckets: list[int], chunk: int | None) -> int:
    """`chunk` (None: the largest bucket) if it is one of the sorted prefill buckets, else a ValueError of one line."""
    if chunk is None:
        return prefill_buckets[-1]
    if chunk not in prefill_buckets:
        raise ValueError(f"a prefill chunk of {chunk} tokens: the artifact's prefill chunks are "
                         f"{', '.join(map(str, prefill_buckets))}")
    return chunk


class GraphExecutor:
    def __init__(self, graphs: dict, graph_meta: dict, state_meta: list, max_slots: int, max_seq_len: int,
                 vocab_size: int, device: torch.device):
        self.graphs, self.meta, self.device = graphs, graph_meta, device
        self.max_slots, self.max_seq_len, self.vocab_size = max_slots, max_seq_len, vocab_size
        self.scratch = max_slots
        self.state = [torch.zeros([max_slots + 1 if s == "S" else s for s in t["shape"]], dtype=torch_dtype(t["dtype"]),
                                  device=device) for t in state_meta]
        idx = {t["name"]: i for i, t in enumerate(state_meta)}
        self.graph_state = {n: [self.state[idx[i["name"]]] for i in g["inputs"] if i["name"] in idx]
                            for n, g in graph_meta.items()}      # graph -> the state tensors it takes, in order
        # speculative decoding: one round graph per decode bucket (0 / []: an artifact without them)
        self.spec_buckets = sorted(g["bucket"] for g in graph_meta.values() if g["kind"] == "spec")
        self.speculative_tokens = max((g.get("speculative_tokens", 0) for g in graph_meta.values()
                                       if g["kind"] == "spec"), default=0)
        # per slot: the token its next decode step feeds (the last sampled id). It stays on the device:
        # prefill writes it, every decode step gathers its rows' tokens from it and scatters the new ids back
        self.last_tok = torch.zeros(max_slots + 1, dtype=torch.int64, device=device)
        self.captured: dict = {}                   # decode bucket -> CapturedDecode (CUDA graphs)
        self.captured_spec: dict = {}              # spec bucket -> CapturedDecode(spec=True)
        self.staging: dict = {}                    # decode bucket -> Staging (uncaptured path)
        self.rank, self.link = 0, None             # tensor parallel: this rank, runtime/ranks.py StepBroadcast
        self.path = "eager"                        # reported at start-up and in stats()
        self.artifact: Artifact | None = None      # what from_artifact loaded (None: the eager backend)
        self.fixture_report: dict | None = None    # the load-time parity check's report, when it ran
        self.load_timings_s: dict = {}             # from_artifact's stages -> wall seconds (see there)
        self.decode_buckets = sorted(g["bucket"] for g in graph_meta.values() if g["kind"] == "decode")
        self.prefill_buckets = sorted(g["bucket"] for g in graph_meta.values() if g["kind"] == "prefill")
        if not self.decode_buckets or not self.prefill_buckets:
            raise ArtifactError("artifact needs at least one decode and one prefill graph")
        self.max_chunk = self.prefill_buckets[-1]   # the largest chunk a prompt is fed in (set_max_chunk)

    def set_max_chunk(self, chunk: int) -> None:
        """Feed prompts in chunks of at most `chunk` tokens, one of the prefill buckets (default the largest).
        A smaller chunk shortens the steps that prefill between running streams' decode steps (their
        inter-token gaps) at the cost of the prompt's own prefill time, since every chunk reads the weights;
        it also changes the chunk partition, and with it the prompt's rounding (the prefix cache's block
        is this chunk). ValueError of one line for a size the artifact has no prefill graph for."""
        self.max_chunk = max_chunk(self.prefill_buckets, chunk)

    # ---- construction ----
    @classmethod
    def from_artifact(cls, artifact: str | Path | Artifact, max_slots: int = 4, device: str | None = None,
                      check_parity: bool = True, cuda_graphs: bool = True,
                      free_memory: int | None = None) -> "GraphExecutor":
        """An executor over an artifact (a directory, verified here, or an Artifact already loaded, in
        which case `device` is its own); the parity fixture is replayed unless check_parity=False.
        On CUDA, each decode bucket is captured as a CUDA graph unless cuda_graphs=False. A max_slots whose
        weights + state + workspace exceed the device's free memory (or `free_memory` bytes, when given) is
        refused before anything is allocated (runtime/memory.py, ValueError naming both).

        `load_timings_s` of the executor: wall seconds per stage, in order: Artifact.load's (artifact_files,
        checkpoint_files: runtime/artifact.py), check_fits, the weights' (weights_read, or weights_make,
        sha256_wait, weights_digest, weights_to_device: Artifact.load_weights), graph_packages and
        graph_bind (AOTInductor packages loaded, weights bound; graph_package:NAME each package's load, inside
        graph_packages; graphs: the onnx backend's whole load),
        state, capture (CUDA graphs), link (tensor parallel), fixture. checkpoint_sha256_overlapped is
        the checkpoint hashing that ran during weights_make, not a stage of its own."""
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        # given a path, the checkpoint files a referencing artifact names are hashed as its weights are made
        art = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact, device, defer_sha256=True)
        timings = dict(art.load_timings_s)
        t = time.perf_counter()

        def stage(name: str) -> None:          # the wall seconds since the previous stage ended
            nonlocal t
            if dev.type == "cuda":             # the stage's kernels and copies count in it
                torch.cuda.synchronize(dev)
            now = time.perf_counter()
            timings[name], t = now - t, now
        dev = art.device
        if dev.type == "cuda" and dev.index is None:
            # an explicit index: the package loader given none (-1) ran rank 1's TP graphs against cuda:0
            # (illegal memory access on 2xH200; pytorch#152087), while an explicit index worked
            dev = torch.device("cuda", torch.cuda.current_device())
        if art.tp > 1:                             # this rank's graphs and weight shard
            art = art.for_rank(ranks.artifact_rank(art))
        from .memory import check_fits
        check_fits(art.path, art.manifest, max_slots, dev, free_memory, art.rank)
        stage("check_fits")
        graphs, loaded = cls._load_graphs(art, dev, timings)
        t = time.perf_counter()
        ex = cls(graphs, art.graphs, art.state, max_slots, art.max_seq_len, art.model["vocab_size"], dev)
        ex.artifact, ex.load_timings_s = art, timings
        ex.path = "aoti-cpu" if dev.type == "cpu" else f"{art.backend}-{dev.type}"
        stage("state")
        if cuda_graphs and dev.type == "cuda" and loaded:
            ex._capture(loaded, copy_in=art.tp == 1)
            stage("capture")
        if art.tp > 1:
            ex._link(art)
            check_parity = check_parity and ex.rank == 0   # rank 0 checks while the others follow()
            stage("link")
        if check_parity:
            from .fixture import check_fixture
            try:
                ex.fixture_report = check_fixture(ex, art.fixture, art.dtype, art.options.get("quant"))
            except Exception:
                ex.stop_followers()            # tensor parallel: release them now, not at the collective timeout
                raise
            stage("fixture")
        return ex

    @staticmethod
    def _load_graphs(art: Artifact, dev: torch.device, timings: dict) -> tuple[dict, dict]:
        """-> (name -> run(inputs), name -> AotiGraph: the AOTInductor graphs, which CUDA graphs capture);
        adds the wall seconds of its stages to `timings` (from_artifact's)."""
        if art.backend != "aoti":
            from .onnx_graph import onnx_graphs   # the onnxruntime backend
            t0 = time.perf_counter()
            graphs = onnx_graphs(art)
            timings["graphs"] = time.perf_counter() - t0
            return graphs, {}
        weights = art.load_weights(dev, timings)
        loader_cls = None
        if art.tp > 1:                             # graphs that wait on collectives must not hold the GIL
            loader_cls = ranks.native().Loader
        loaded = {name: AotiGraph(art.path / g["file"], weights, dev, loader_cls) for name, g in art.graphs.items()}
        timings["graph_packages"] = sum(g.load_s for g in loaded.values())
        timings.update({f"graph_package:{name}": g.load_s for name, g in loaded.items()})   # apart, for the slow one
        timings["graph_bind"] = sum(g.bind_s for g in loaded.values())
        return {name: g.run for name, g in loaded.items()}, loaded

    def _link(self, art: Artifact) -> None:
        """Tensor parallel: this rank, and the broadcast rank 0 leads and the others follow (runtime/ranks.py)."""
        self.rank, self.link = art.rank, ranks.link(self, art)
        self.path += f"+tp{art.tp}"

    def _capture(self, runs: dict, copy_in: bool) -> None:
        """Capture each decode bucket as CUDA graphs. Tensor parallel (copy_in=False): every rank captures
        its buckets in the same order (the warm-up and capture run the graph's NCCL collectives, which
        pair up across ranks), and replays the bytes rank 0 broadcast to a device buffer, so the graphs
        do not copy a host staging in."""
        from .cuda_graphs import CapturedDecode

        def capture(kind: str, **kw) -> dict:
            return {g["bucket"]: CapturedDecode(runs[name].run_with_stream, g["bucket"], self.graph_state[name],
                                                self.last_tok, self.scratch, self.device, **kw)
                    for name, g in self.meta.items() if g["kind"] == kind}
        self.captured = capture("decode", copy_in=copy_in)
        # speculative rounds run at tp=1 only (spec_round refuses a link): captured there alone
        self.captured_spec = capture("spec", spec=True) if copy_in else {}
        self.path += "+cudagraphs"

    @property
    def manifest(self) -> dict:
        """The loaded artifact's manifest.json (read only)."""
        return self.artifact.manifest

    @classmethod
    def from_model(cls, model, kinds: dict, max_slots: int, max_seq_len: int,
                   speculative_tokens: int = 0) -> "GraphExecutor":
        """Eager backend over the same entry points; `kinds` = {"decode": [B...], "prefill": [T...]} (and
        "spec": [B...] with speculative_tokens K > 0: a model with its MTP head, graphs/spec_graphs.py)."""
        from onegraph.graphs import spec_graphs
        from onegraph.graphs.signature import graph_spec, state_manifest
        dtype, k = model.embed_tokens.weight.dtype, speculative_tokens
        fns = {"decode": model.decode, "prefill": model.prefill if not k else
               (lambda *a: spec_graphs.prefill(model, *a)), "spec": lambda *a: spec_graphs.step(model, k, *a)}
        graphs, meta = {}, {}
        for kind, buckets in kinds.items():
            for b in buckets:
                spec = graph_spec(model, kind, b, max_seq_len, dtype, k)
                graphs[spec.name] = (lambda f: lambda inputs: f(*inputs))(fns[kind])
                meta[spec.name] = spec.manifest()
        state = state_manifest(model, max_seq_len, dtype, k)
        return cls(graphs, meta, state, max_slots, max_seq_len, model.cfg.vocab_size,
                   model.embed_tokens.weight.device)

    # ---- tensor parallel (runtime/ranks.py) ----
    def follow(self) -> int:
        """Ranks > 0: replay the graphs rank 0 calls, with this rank's state, until it stops."""
        def run(name, inputs):
            if name.startswith("captured_b"):             # captured_b{B}_{graph}: the leader's graph of bucket B
                B, k = map(int, name[len("captured_b"):].split("_"))
                self.captured[B].replay(inputs[0], 0, graph=k)
                return
            self._run(name, inputs)
        return self.link.follow(run)

    def stop_followers(self) -> None:
        if self.link is not None and self.rank == 0:
            self.link.stop()

    # ---- steps ----
    def _sampling(self, rows: list[Sampling], n: int) -> list[torch.Tensor]:
        return Sampling.rows(rows, n, self.device)

    def call(self, name: str, inputs: list[torch.Tensor]):
        if self.link is not None:                  # tensor parallel: rank 0 leads, the others replay it
            inputs = self.link.lead(name, inputs)
        out = self._run(name, inputs)
        return out[0], out[1]

    def _run(self, name: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run an uncaptured graph, then keep last_tok: the sampled ids become the next decode input of
        their slots (inputs[1]: prefill's slot [1], decode's rows [B]; padding rows write the scratch
        slot). Every tensor-parallel rank runs this, so each rank's last_tok, which its captured decode
        graphs read, is the leader's (kept on rank 0 alone, rank 1's first decode step after a prefill
        reads token 0)."""
        with torch.no_grad():
            out = self.graphs[name](list(inputs) + self.graph_state[name])
            ids, slots = out[0], inputs[1]
            self.last_tok.index_copy_(0, slots, ids[:slots.shape[0]])
        return out

    def prefill(self, prompt: list[int], slot: int, sampling: Sampling = Sampling(), start_pos: int = 0):
        """Prefill `prompt` into `slot` from start_pos in chunk buckets -> (next_id [1], logits [1, V])."""
        i = 0
        while i < len(prompt):
            ids, logits = self.prefill_chunk(prompt, i, slot, sampling, start_pos)
            i += self.chunk_tokens(len(prompt) - i)
        return ids, logits

    def chunk_tokens(self, rest: int) -> int:
        """Prompt tokens the next prefill chunk feeds when `rest` are left: all of them if they fit in
        max_chunk (the smallest bucket that holds them runs), else max_chunk's worth."""
        return min(rest, self.max_chunk)

    def prefill_chunk(self, prompt: list[int], i: int, slot: int, sampling: Sampling = Sampling(),
                      start_pos: int = 0):
        """One chunk of prefill(): prompt[i:i + chunk_tokens(len(prompt) - i)] into `slot` at position
        start_pos + i -> (next_id [1], logits [1, V]). Only the prompt's last chunk samples the request's
        first token; the id an earlier chunk writes to last_tok[slot] is overwritten by the next one.
        The Engine calls this chunk by chunk, between decode steps of other slots."""
        d, rest = self.device, self.chunk_tokens(len(prompt) - i)
        T = next(b for b in self.prefill_buckets if b >= rest)
        part = prompt[i:i + rest]
        toks = torch.zeros(T, dtype=torch.int64, device=d)
        toks[:len(part)] = torch.tensor(part, dtype=torch.int64)
        extra = []
        if any(x["name"] == "next_tokens" for x in self.meta[f"prefill_t{T}"]["inputs"]):
            # the MTP head's x_{t+1} per row: the prompt shifted by one; -1 at the prompt's last token,
            # whose next token the graph samples (graphs/spec_graphs.py prefill); padding rows 0
            nxt = torch.zeros(T, dtype=torch.int64)
            nxt[:len(part)] = torch.tensor(prompt[i + 1:i + 1 + len(part)] + [-1] * (i + len(part) == len(prompt)),
                                           dtype=torch.int64)
            extra = [nxt.to(d)]
        return self.call(f"prefill_t{T}", [toks, torch.tensor([slot], device=d), torch.tensor([start_pos + i], device=d),
                                           torch.tensor([len(part)], device=d)] + self._sampling([sampling], 1) + extra)

    def decode_bucket(self, n: int) -> int:
        b = next((b for b in self.decode_buckets if b >= n), None)
        if b is None:
            raise ValueError(f"{n} rows exceed the largest decode bucket {self.decode_buckets[-1]}")
        return b

    def decode(self, tokens: list[int], slots: list[int], positions: list[int], sampling: list[Sampling]):
        """One decode step feeding `tokens` to `slots` -> (next_ids [n], logits [n, V]). Tensor parallel
        runs decode_step: tokens set here would reach rank 0's last_tok only."""
        if self.link is not None:
            raise RuntimeError("tensor parallel: decode() sets rank 0's tokens only; use decode_step(), which "
                               "feeds every rank the ids its graphs sampled")
        self.last_tok[torch.tensor(slots, dtype=torch.int64)] = torch.tensor(tokens, dtype=torch.int64).to(self.device)
        return self.decode_step(slots, positions, sampling)

    def decode_step(self, slots: list[int], positions: list[int], sampling: list[Sampling]):
        """One decode step of len(slots) rows, padded to a bucket: each row feeds last_tok[slot], and its
        sampled id replaces it -> (next_ids [n], logits [n, V]) (views a later step may overwrite)."""
        step = self.step(slots, positions, sampling)
        return step.ids, step.logits

    def step(self, slots: list[int], positions: list[int], sampling: list[Sampling]) -> DecodeStep:
        """decode_step's step, with when its inputs were in and (captured) the host copy of its ids."""
        n = len(slots)
        B = self.decode_bucket(n)
        if B in self.captured:
            cap = self.captured[B]
            staged = cap.stage(slots, positions, sampling)
            if self.link is not None:              # tensor parallel: the followers replay the same bytes
                staged = self.link.lead(f"captured_b{B}_{cap.flip}", [staged])[0]
            ids, logits = cap.replay(staged, n)
            # the graph copies its ids to pinned memory and records an event itself
            return DecodeStep(ids, logits, cap.copied_at, cap.last_host_ids(n))
        if B not in self.staging:                  # the same host staging the captured path copies in
            from .cuda_graphs import Staging
            self.staging[B] = Staging(B, self.scratch, pin=False)
        st = self.staging[B]
        st.fill(slots, positions, sampling)
        (rows, pos, top_k, seed), (temperature, top_p) = st.ints.to(self.device), st.floats.to(self.device)
        inputs = [self.last_tok.index_select(0, rows), rows, pos, temperature, top_k, top_p, seed]
        copied_at = time.perf_counter()           # copy-in ends here
        ids, logits = self.call(f"decode_b{B}", inputs)
        return DecodeStep(ids[:n], logits[:n], copied_at)

    def spec_step(self, slots: list[int], sampling: list[Sampling]):
        """One speculative round for len(slots) rows, padded to a spec bucket (graphs/spec_graphs.py step):
        each row feeds last_tok[slot] at the slot's committed length (spec.pos, on the device) ->
        (n_accepted [n], targets [n, K+1]) on the device; last_tok[slots] already holds targets[n_accepted].
        The round emits targets[:n_accepted + 1] per row. Runs uncaptured on every device."""
        r = self.spec_round(slots, sampling)
        return r.n_accepted, r.targets

    def spec_round(self, slots: list[int], sampling: list[Sampling]) -> SpecRound:
        """spec_step's round, with when its inputs were in."""
        n = len(slots)
        B = next((b for b in self.spec_buckets if b >= n), None)
        if B is None:
            raise ValueError(f"{n} rows exceed the largest speculative bucket {self.spec_buckets[-1] if self.spec_buckets else None}")
        if self.link is not None:
            raise RuntimeError("speculative decoding runs at tp=1 (the MTP head is not sharded)")
        if B in self.captured_spec:                # one replay: staging in, [n_accepted, targets] out
            cap = self.captured_spec[B]
            n_acc, targets = cap.replay(cap.stage(slots, [0] * n, sampling), n)
            return SpecRound(n_acc, targets, cap.copied_at, cap.last_host_ids(n))
        pad = B - n
        rows = torch.tensor(list(slots) + [self.scratch] * pad, dtype=torch.int64).to(self.device)
        inputs = [self.last_tok.index_select(0, rows), rows] + self._sampling(sampling, B)
        copied_at = time.perf_counter()
        _, n_acc, targets, _ = self._run(f"spec_b{B}", inputs)
        self.last_tok[self.scratch] = 0            # padding rows keep feeding token 0
        return SpecRound(n_acc[:n], targets[:n], copied_at)

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(), slot: int = 0,
                 stop_ids=()):
        """A simple loop (the Engine adds batching and async output) -> (ids, logits per token)."""
        ids, logits = self.prefill(prompt, slot, sampling)
        # clone: decode outputs may be a captured graph's static buffers, rewritten by the next step
        out, lg = [int(ids[0])], [logits[0].clone()]
        pos = len(prompt)
        while len(out) < max_new_tokens and out[-1] not in stop_ids:
            ids, logits = self.decode_step([slot], [pos], [sampling])    # feeds last_tok[slot] == out[-1]
            out.append(int(ids[0]))
            lg.append(logits[0].clone())
            pos += 1
        return out, lg
