"""`onegraph export`: checkpoint -> artifact, readable as one list of stages.

    load -> shard (tensor parallel: one model per rank, models/qwen3_5/tp.py) -> trace -> lower -> package

Everything is written into a staging directory beside --out and renamed into place once the manifest
is written and verified (staging.py). Graphs are traced here one after another and lowered by worker
processes, several at once (workers.py); a graph compiled before from the same program, weights,
options and toolchain is copied from the cache instead (cache.py).

Tensor parallel (--tp N, AOTInductor): every rank's graphs are traced in this one process under a
fake N-rank process group (the collectives are graph nodes; nothing is communicated while tracing)
and written as graphs/rank{r}/<name>.pt2 with weights_rank{r}.safetensors; the manifest's "tp"
records the plan and the group name the collectives bind to at load (torchrun's default group).
The parity fixture is recorded from the TP-1 eager model: every TP-N load must reproduce TP-1.

Decode graphs: one per batch bucket. Prefill graphs: one per chunk bucket, not one dynamic-length
graph, because the chunked GDN scan unrolls over a static number of 64-token chunks; a prompt is
prefilled in bucket-sized chunks, the last one padded (padding is inert: see models/qwen3_5/model.py).
The slot dimension of the state is dynamic, so the runtime chooses how many slots to allocate.
"""
from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from onegraph.custom_ops import schema_versions
from onegraph.custom_ops.sample import Sampling
from onegraph.graphs.eager import generate_eager, router_margins
from onegraph.graphs.fp32_compute import LOW, generate_eager_fp32
from onegraph.checkpoint.draft_vocab import draft_ids, ids_sha256
from onegraph.checkpoint.load import check_checkpoint, family, model_dir, quant_method, resolve_dtype
from onegraph.checkpoint.quant import QUANT_CHOICES, SCHEMES, resolve
from onegraph.checkpoint.recipe import checkpoint_files, load_tp1, rank_model, recipe_of, state_tensors, tensors_sha256
from onegraph.graphs.signature import graph_spec, split_inputs, state_manifest
from onegraph.graphs.spec import prune_draft_vocab
from onegraph.runtime.artifact import (device_descriptor, load_manifest, manifest_unverified, tool_versions,
                                       write_manifest)
from onegraph.runtime.weight_refs import sha256_files

from .cache import DEFAULT_DIR as DEFAULT_CACHE_DIR
from .cache import GraphCache, graph_key, program_digest, warm_toolchain
from .program import save_without_weights, weights_of
from .staging import check_target, interruptible, publish, staging
from .trace import trace, trace_group
from .workers import Done, LoweringError, LoweringPool, auto_jobs

TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
FIXTURE_PROMPTS = ([1, 2, 3], [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100], list(range(10, 40)))
FIXTURE_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    device: str = "cpu"
    dtype: str = "float32"
    backend: str = "aoti"                      # aoti | onnx
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    prefill_chunks: tuple[int, ...] = (16, 64, 256)
    max_seq_len: int = 512
    tp: int = 1
    kernels: str = "auto"                      # auto: hand-written kernels where registered | reference
    eager_rounding: bool = True                # round intermediates where eager does (bf16/fp16 parity)
    fp32_reduce: bool = False                  # row-parallel outputs in fp32, all-reduced, rounded once (TP-invariant)
    allow_unused_weights: bool = False         # load even if the checkpoint holds tensors the model does not consume
    quant: str = "auto"                        # dense projections' weights (checkpoint/quant.py): auto (the checkpoint's;
                                               # resolved before export) | none (model dtype) | fp8 | int8 | fp8-channel
    speculative_tokens: int = 0                # > 0: MTP draft + verify graphs of k drafts (graphs/spec_graphs.py)
    draft_vocab: int = 0                       # > 0: the head drafts over that many ids (graphs/spec.py prune_draft_vocab)
    draft_vocab_file: str | None = None        # their ranking (checkpoint/draft_vocab.py); None: tiny's builtin one
    fp8_lm_head: bool = False                  # the output projection as block FP8 too (checkpoint/quant.py quantize_lm_head)
    weights: str = "copy"                      # copy: weights.safetensors in the artifact | reference: the checkpoint's
                                               # files by path + sha256, made into the weights at load (checkpoint/recipe.py)
    batch_invariant: bool = False              # decode graphs: each row's bits those it gets alone (the ops' one-row
                                               # plans for every batch; docs/design.md "Batch invariance")

    def validate(self, max_positions: int) -> None:
        if self.backend not in ("aoti", "onnx"):
            raise ValueError(f"--backend must be aoti or onnx, got {self.backend!r}")
        if self.backend == "onnx" and self.device != "cpu":
            raise ValueError("--backend onnx targets onnxruntime's CPU execution provider: use --device cpu")
        if self.backend == "onnx" and self.dtype != "float32":
            raise ValueError("--backend onnx supports --dtype float32 only (bf16/fp16 graphs are not verified)")
        if self.device not in ("cpu", "cuda", "xpu"):
            raise ValueError(f"--device must be cpu, cuda or xpu, got {self.device!r}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"--batch-sizes must be positive integers, got {self.batch_sizes}")
        if not self.prefill_chunks or min(self.prefill_chunks) < 1:
            raise ValueError(f"--prefill-chunks must be positive integers, got {self.prefill_chunks}")
        if not 1 <= self.max_seq_len <= max_positions:
            raise ValueError(f"--max-seq-len must be in 1..{max_positions} (max_position_embeddings)")
        if max(self.prefill_chunks) > self.max_seq_len:
            # a chunk's KV rows would land past the cache's last row (on CUDA: a device-side index assert)
            raise ValueError(f"--prefill-chunks {max(self.prefill_chunks)} exceeds --max-seq-len {self.max_seq_len}: "
                             f"a prefill chunk cannot be longer than the cache")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.weights not in ("copy", "reference"):
            raise ValueError(f"--weights must be copy or reference, got {self.weights!r}")
        if self.weights == "reference" and self.backend != "aoti":
            raise ValueError("--weights reference needs --backend aoti (an ONNX graph file points at the weights in the "
                             "artifact's weights.safetensors)")
        if self.fp32_reduce and self.backend != "aoti":
            raise ValueError("--fp32-reduce needs --backend aoti (the ONNX backend is fp32 only: its sums are fp32 already)")
        if self.tp > 1 and self.backend != "aoti":
            raise ValueError("--tp > 1 needs --backend aoti (the ONNX backend has no collectives)")
        if self.quant not in ("auto", *QUANT_CHOICES):
            raise ValueError(f"--quant must be one of {['auto', *QUANT_CHOICES]}, got {self.quant!r}")
        if self.quant not in ("auto", "none") and (self.backend != "aoti" or self.tp > 1):
            raise ValueError(f"--quant {self.quant} needs --backend aoti and --tp 1 (quantized weights are neither "
                             f"lowered to ONNX nor sharded yet; --quant none dequantizes a quantized checkpoint)")
        if self.fp8_lm_head and (self.backend != "aoti" or self.tp > 1):
            raise ValueError("--fp8-lm-head needs --backend aoti and --tp 1 (quantized weights are neither lowered to "
                             "ONNX nor sharded yet)")
        if self.speculative_tokens:
            from onegraph.graphs.spec import check_k
            check_k(self.speculative_tokens, "--speculative-tokens")
            if self.backend != "aoti" or self.tp > 1:
                raise ValueError("--speculative-tokens needs --backend aoti and --tp 1 (the MTP head is not sharded)")
        if (self.draft_vocab or self.draft_vocab_file) and not self.speculative_tokens:
            raise ValueError("--draft-vocab prunes the speculative draft head: it needs --speculative-tokens K")
        if self.draft_vocab_file and not self.draft_vocab:
            raise ValueError("--draft-vocab-file needs --draft-vocab N (how many of its ids the head drafts over)")
        if self.draft_vocab and self.weights != "copy":
            raise ValueError("--draft-vocab needs --weights copy (referenced weights are remade from the checkpoint "
                             "alone, which holds no draft vocabulary)")
        if self.batch_invariant:
            self.validate_batch_invariant()
        resolve_dtype(self.dtype)

    def validate_batch_invariant(self) -> None:
        """--batch-invariant covers the bf16 / fp16 / fp32 Triton decode graphs of one GPU; the rest is refused
        until it has invariant kernels of its own (docs/design.md, "Batch invariance")."""
        why = ("needs --device cuda or xpu (the CPU graphs are aten's, whose GEMMs pick their kernels from the batch)"
               if self.device == "cpu" else
               "needs --kernels auto (Inductor's kernels of the references pick their plans from the shapes)"
               if self.kernels != "auto" else
               "needs --quant none or fp8 (the W8A8 projections have no batch-invariant kernels yet)"
               if self.quant not in ("auto", "none", "fp8") else
               "cannot take --fp32-reduce (its fp32 projections are cuBLAS GEMMs, chosen by the batch)"
               if self.fp32_reduce else
               "needs --tp 1 (the all-reduce's chunks follow the batch's bytes)" if self.tp > 1 else None)
        if why:
            raise ValueError(f"--batch-invariant {why}")


def resolve_quant(model_spec, opts: ExportOptions) -> ExportOptions:
    """opts with `quant` the projections' actual scheme (recorded in the manifest): `auto` becomes the
    checkpoint's own (none for a float one); a checkpoint quantized otherwise than --quant asks is refused."""
    method = quant_method(model_dir(model_spec))
    scheme = resolve(method, None if opts.quant == "auto" else opts.quant)
    return dataclasses.replace(opts, quant=scheme or "none")


def shard(model, opts: ExportOptions) -> list:
    """One model per rank (models/qwen3_5/tp.py's plan; TP-1: the model itself), each with its same-input
    projections concatenated (models/qwen3_5/fuse.py) after sharding."""
    return [rank_model(model, r, opts.tp) for r in range(opts.tp)]


def fixture(model, max_seq_len: int) -> dict[str, torch.Tensor]:
    """Greedy ids and logits from eager for a few prompts: checked again at every load. Also, per step,
    the router's smallest top-k margin (k-th minus (k+1)-th router logit over every MoE layer and row,
    fp32): where it is near zero, a graph whose sums round differently (other kernels, a TP all-reduce)
    may route a row to another expert and legitimately diverge from that step on (runtime/fixture.py).
    And, for a bf16 / fp16 model, `gap{i}`, fp32 [steps]: per step the max |logits| difference of this run
    and the same eager computation in fp32 over the same weights (graphs/fp32_compute.py); NaN from the
    step after the two runs' ids first differ (fed different tokens, they are no longer the same
    computation). runtime/fixture.py widens the load-time tolerance to twice it where that exceeds the
    dtype's: a graph is another low-precision rounding of that fp32 computation, and a deep bf16 model
    strays from it by more than the fixed bound. An fp32 model records no gap (it is 0 by definition).
    """
    out = {}
    for i, p in enumerate(FIXTURE_PROMPTS):
        p = [t % model.cfg.vocab_size for t in p]
        n = min(FIXTURE_TOKENS, max_seq_len - len(p))
        with router_margins(model) as margins:
            r = generate_eager(model, p, n, Sampling(), max_seq_len=max_seq_len)
        out[f"prompt{i}"] = torch.tensor(p)
        out[f"ids{i}"] = torch.tensor(r.token_ids)
        out[f"logits{i}"] = torch.stack(r.logits).float().cpu()
        steps = len(r.token_ids)                # one forward per step (a one-shot prefill, then decodes)
        out[f"router_margin{i}"] = (torch.tensor(margins).view(steps, -1).amin(1) if margins
                                    else torch.full((steps,), float("inf")))      # a dense MLP: no router
        if model.embed_tokens.weight.dtype in LOW:
            out[f"gap{i}"] = fp32_gap(model, p, r, max_seq_len)
    return out


def fp32_gap(model, prompt: list[int], low, max_seq_len: int) -> torch.Tensor:
    """`low` (generate_eager's result for `prompt` on a bf16 / fp16 model) vs the same run computed in fp32
    over the same weights -> fp32 [steps] of per-step max |logit difference|, NaN after the first step
    whose ids differ."""
    steps = len(low.token_ids)
    ref = generate_eager_fp32(model, prompt, steps, Sampling(), max_seq_len=max_seq_len)
    gap = torch.full((steps,), float("nan"))
    for s, (a, b) in enumerate(zip(low.logits, ref.logits)):
        gap[s] = (a.float() - b.float()).abs().max().cpu()
        if low.token_ids[s] != ref.token_ids[s]:
            break                               # this step's logits are comparable, the next inputs differ
    return gap


def export(model_spec: str, out_dir: str | Path, opts: ExportOptions, progress: bool = True, *,
           force: bool = False, cache_dir: str | Path | None = None, jobs: int | None = None,
           on_lower_start: Callable[[str, int], None] | None = None) -> dict:
    """Run every stage into a staging directory beside out_dir, verify it, rename it into place
    (staging.py); returns a summary. force: replace an existing artifact. cache_dir: reuse compiled
    graphs (cache.py; the CLI passes DEFAULT_CACHE_DIR; None: compile every graph). jobs: lowering
    worker processes (None: as many as the cores and memory allow, workers.auto_jobs; 1: lower in this
    process). Workers are spawned: a script calling this with jobs != 1 needs the usual
    `if __name__ == "__main__":` guard. on_lower_start(tag, pid) is called as a graph is handed to a
    worker (a test hook)."""
    t0 = time.time()
    cfg, tensors = check_checkpoint(model_spec)         # quantized / unexpected / non-float tensors: refused
    tensors.check(opts.allow_unused_weights)            # here, before anything is written or removed
    opts = resolve_quant(model_spec, opts)
    opts.validate(cfg.max_position_embeddings)
    if opts.speculative_tokens and "MTP" not in tensors.skipped:
        raise ValueError(f"--speculative-tokens needs a checkpoint with an MTP head (mtp.* weights): "
                         f"{model_spec} has none")
    # the draft vocabulary's file and ids, checked before anything is loaded
    draft = draft_ids(model_spec, opts.draft_vocab, cfg.vocab_size, opts.draft_vocab_file) if opts.draft_vocab else None
    family(cfg).check_divisible(cfg, opts.tp)
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    out = Path(out_dir).absolute()                     # its name and parent name the staging directory
    check_target(out, force)                            # a foreign directory; an artifact without force
    with interruptible(), staging(out) as stage:
        s = _build(model_spec, stage, opts, progress, GraphCache(cache_dir) if cache_dir else None, jobs,
                   on_lower_start, draft)
        load_manifest(stage, opts.device)               # every file's hash, before it becomes --out
        publish(stage, out, force)
    return dict(s, out=str(out_dir), total_s=round(time.time() - t0, 1))


def lowering_order(specs: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Largest graphs first (prefill unrolls its scan over T/64 chunks), so the last to finish is small."""
    return sorted(specs, key=lambda s: (s[0] == "prefill", s[0] == "spec", s[1]), reverse=True)


def _build(model_spec, stage: Path, opts: ExportOptions, progress: bool, cache: GraphCache | None,
           jobs: int | None, on_lower_start, draft: torch.Tensor | None = None) -> dict:
    """draft: the pruned draft vocabulary's ids [N] (export() checked them), None: the whole vocabulary."""
    from safetensors.torch import save_file

    from .aoti import inductor_configs, lower_aoti
    dev = torch.device(opts.device)
    dtype = resolve_dtype(opts.dtype)
    specs_wanted = [("decode", b) for b in sorted(set(opts.batch_sizes))] + \
                   [("prefill", t) for t in sorted(set(opts.prefill_chunks))]
    k = opts.speculative_tokens                         # a round of k drafts per decode bucket
    specs_wanted += [("spec", b) for b in sorted(set(opts.batch_sizes))] if k else []
    tp = opts.tp
    n_graphs = len(specs_wanted) * tp
    bar = tqdm(total=n_graphs, desc="export", disable=not progress, unit="graph")
    bar.set_postfix_str("load")
    # the cache key's toolchain, and on CPU Inductor's vector-ISA probes, while the model loads and traces
    warm = warm_toolchain(dev.type) if opts.backend == "aoti" else None
    # the options that decide the weights: a referencing artifact records them and the runtime repeats this path
    recipe = recipe_of(opts.dtype, opts.quant, opts.fp32_reduce, opts.allow_unused_weights, k > 0, tp, opts.fp8_lm_head)
    cfg, model, src = load_tp1(model_spec, recipe, dev)
    if draft is not None:
        prune_draft_vocab(model, draft)
    ranks = shard(model, opts)
    family(cfg).fuse_projections(model)   # the TP-1 eager model records the fixture: the same projections

    entries, timings, compile_s, cached, dests, keys = {}, {}, {}, [], {}, {}
    # TP: a rank's graph whose traced program is rank 0's (weights aside) takes rank 0's package, compiled without
    # any weight value in it (aoti.RANK_INDEPENDENT): tag -> rank 0's tag, and per (kind, bucket) rank 0's digest
    same_as, first = {}, {}
    sub = "graphs/rank{rank}/" if tp > 1 else "graphs/"
    weights_file = "weights_rank{rank}.safetensors" if tp > 1 else "weights.safetensors"
    lowering = {"eager_rounding": opts.eager_rounding, "inductor": inductor_configs(tp)}
    device_desc = device_descriptor(dev)
    # graphs to compile: at TP each one once, its other ranks taking rank 0's package (same_as below)
    n_lower = len(specs_wanted) if tp > 1 else n_graphs
    n_jobs = 1 if opts.backend != "aoti" else jobs or auto_jobs(n_lower, dev)
    work = stage / ".work"                              # programs and worker logs, removed before the manifest
    work.mkdir()
    # the fixture before any lowering worker gets the weights: sending them moves their storage into shared
    # memory (page-aligned), and MKL's fp32 GEMM sums in an order that depends on its operands' alignment (a
    # misaligned copy of tiny's weights moves its fixture logits by 3.8e-6), so a fixture recorded after a
    # worker started would depend on when it started and a re-export would not reproduce it byte for byte
    bar.set_postfix_str("fixture")
    save_file(fixture(model, opts.max_seq_len), str(stage / "fixture.safetensors"))   # TP-1 eager: the truth
    pool, t_trace, digests, nbytes = None, {}, [], []

    def finished(done: list[Done]) -> None:
        for d in done:
            compile_s[d.tag] = round(d.seconds, 2)
            timings[d.tag] = round(t_trace[d.tag] + d.seconds, 2)
            if cache is not None:
                cache.store(keys[d.tag], dests[d.tag], d.seconds, dev.type)
            bar.update()

    try:
        if n_jobs > 1 and (cache is None or cache.empty()):
            # every graph will be compiled: the workers start now, their imports overlapping the tracing (with
            # a cache that may hold the graphs, at the first miss: a re-export then starts none)
            pool = LoweringPool(min(n_jobs, n_lower), dev, tp, work / "logs", on_lower_start)
        with trace_group(tp) as group_name:
            for r, rank_model in enumerate(ranks):
                # weights first: written once (--weights copy), and the cache key holds their digest, which
                # a referencing manifest records (the runtime checks the weights it makes against it)
                weights = state_tensors(rank_model)
                if opts.weights == "copy":
                    save_file(weights, str(stage / weights_file.format(rank=r)))
                weights_sha = tensors_sha256(weights) if cache is not None or opts.weights == "reference" else None
                digests.append(weights_sha)
                nbytes.append(sum(t.nbytes for t in weights.values()))
                shared = False
                for kind, bucket in lowering_order(specs_wanted):
                    spec = graph_spec(rank_model, kind, bucket, opts.max_seq_len, dtype, k)
                    tag = spec.name if tp == 1 else f"rank{r}/{spec.name}"
                    bar.set_postfix_str(f"trace {tag}")
                    t = time.time()
                    # prefill graphs run one request at a time: only decode and speculative rows share a launch
                    ep, hist = trace(rank_model, spec, dev, opts.kernels,
                                     batch_invariant=opts.batch_invariant and kind in ("decode", "spec"))
                    if warm is not None:
                        warm.join()             # before any key, worker or in-process lowering
                    rel = sub + f"{spec.name}.{'pt2' if opts.backend == 'aoti' else 'onnx'}"
                    entries[(r, kind, bucket)] = spec.name, dict(spec.manifest(), file=rel, ops=hist,
                                                                 node_count=sum(hist.values()))
                    dest = dests[tag] = stage / rel.format(rank=r)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    if opts.backend == "onnx":
                        from .onnx import lower_onnx
                        lower_onnx(rank_model, spec, ep, dest)
                        timings[tag] = round(time.time() - t, 2)
                        bar.update()
                        continue
                    program = work / f"{tag.replace('/', '.')}.program.pt2"
                    if cache is not None or n_jobs > 1 or tp > 1:
                        try:
                            save_without_weights(ep, program)
                        except Exception as e:      # e.g. an op torch.export cannot serialize
                            raise LoweringError(f"saving the traced program of {tag} failed ({type(e).__name__}: "
                                                f"{e}); `--jobs 1 --no-cache` lowers it in this process without "
                                                f"saving it") from e
                    t_trace[tag] = time.time() - t
                    digest = program_digest(program) if cache is not None or tp > 1 else None
                    if tp > 1:
                        if r == 0:
                            first[(kind, bucket)] = tag, digest
                        elif first[(kind, bucket)][1] == digest:
                            same_as[tag] = first[(kind, bucket)][0]       # copied in once rank 0's is lowered
                            timings[tag] = round(time.time() - t, 2)
                            bar.update()
                            continue
                    if cache is not None:
                        keys[tag] = graph_key(digest, weights_sha, dest.name, lowering, device_desc)
                        if cache.fetch(keys[tag], dest):
                            cached.append(tag)
                            timings[tag] = round(time.time() - t, 2)
                            bar.update()
                            continue
                    if n_jobs == 1:                 # in this process, from the program in memory
                        bar.set_postfix_str(f"lower {tag}")
                        t1 = time.time()
                        lower_aoti(ep, dest, opts.eager_rounding, tp)
                        finished([Done(tag, time.time() - t1)])
                        continue
                    if pool is None:
                        pool = LoweringPool(min(n_jobs, n_lower), dev, tp, work / "logs", on_lower_start)
                    if not shared:
                        pool.share(r, weights_of(ep))
                        shared = True
                    pool.submit(tag, r, program, dest, opts.eager_rounding)
                    finished(pool.poll(0))
        while pool is not None and pool.pending:
            bar.set_postfix_str("lower " + ", ".join(pool.running()))
            finished(pool.poll(1.0))
    finally:
        if pool is not None:
            pool.close()
    for tag, src_tag in same_as.items():
        shutil.copyfile(dests[src_tag], dests[tag])
    shutil.rmtree(work)
    bar.set_postfix_str("package")
    for name in TEXT_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, stage / name)
    graphs = {}
    for r in range(tp):                # each graph once, in bucket order (its file name holds {rank})
        for kind, bucket in specs_wanted:
            name, entry = entries[(r, kind, bucket)]
            graphs[name] = entry
    # every graph's state inputs are the model's; a spec round's add the head's KV, spec.y, spec.pos after them
    state = split_inputs(graphs[f"spec_b{min(opts.batch_sizes)}" if k else next(iter(graphs))]["inputs"])[1]
    kinds = {t["name"]: t["kind"] for t in state_manifest(model, opts.max_seq_len, dtype, k)}   # by name: any tp
    state = [dict(t, kind=kinds[t["name"]]) for t in state]
    manifest = {
        "backend": opts.backend, "model": cfg.to_dict(), "dtype": opts.dtype,
        "device": device_desc, "versions": tool_versions(opts.backend), "ops": schema_versions(),
        "options": dataclasses.asdict(opts), "max_seq_len": opts.max_seq_len, "graphs": graphs, "state": state,
        "weights": weights_file if opts.weights == "copy" else None,
        "weight_shapes": {n: list(t.shape) for n, t in weights.items()},
        "fixture": "fixture.safetensors", "timings_s": timings, "speculative_tokens": k,
    }
    if family(cfg).projection_groups is not None:     # rank 0's (every rank fuses the same parts)
        manifest["projection_groups"] = family(cfg).projection_groups(ranks[0])
    if draft is not None:                              # the ids are the weight model.mtp.draft_ids; this names them
        manifest["draft_vocab"] = {"size": len(draft), "sha256": ids_sha256(draft),
                                   "source": opts.draft_vocab_file or "builtin (tiny's training corpus)"}
    if opts.weights == "reference":
        manifest["weights_reference"] = reference(model_spec, src, recipe, digests, nbytes)
    if opts.backend == "aoti":
        manifest["lowering"] = lowering                # aoti.py's Inductor configs, as the graphs were compiled
    if tp > 1:
        manifest["tp"] = {"size": tp, "group_name": group_name, "plan": f"onegraph.models.{family(cfg).name}",
                          "collectives": "all_reduce after each token mixer and MLP block; all_gather of "
                                         "vocab-sharded logits before sampling"}
    write_manifest(stage, manifest)
    bar.close()
    gdir = stage / "graphs"
    sizes = {str(p.relative_to(gdir)): p.stat().st_size for p in sorted(gdir.rglob("*")) if p.is_file()}
    ref = manifest.get("weights_reference")
    return {"graphs": sizes, "weights_bytes": sum((stage / weights_file.format(rank=r)).stat().st_size
                                                  for r in range(tp)) if ref is None else 0,
            "weights_referenced": ref and {"checkpoint": ref["checkpoint"], "files": len(ref["files"]),
                                           "bytes": sum(f["size"] for f in ref["files"].values())},
            "timings_s": timings, "compile_s": compile_s, "cached": cached, "same_as": same_as,
            "workers": len(pool.workers) if pool is not None else 0}


def reference(model_spec, src: Path, recipe: dict, digests: list[str], nbytes: list[int]) -> dict:
    """The manifest's `weights_reference` (runtime/weight_refs.py): the checkpoint (`tiny`, which the runtime
    writes again, or the directory's absolute path), the size and sha256 of every file the loader read, the
    recipe, and per rank the digest and bytes of the weights it made."""
    rels = checkpoint_files(src)
    shas = sha256_files([src / r for r in rels])
    return {"checkpoint": "tiny" if str(model_spec) == "tiny" else str(src.resolve()),
            "files": {r: {"sha256": h, "size": (src / r).stat().st_size} for r, h in zip(rels, shas)},
            "recipe": recipe, "tensors_sha256": digests, "bytes": nbytes}


def summary_text(s: dict) -> str:
    """One line per graph (size, lowering seconds or reused), the weights, and a header with the totals."""
    n, reused, same = len(s["graphs"]), len(s["cached"]), s.get("same_as", {})
    lowered = n - reused - len(same)
    how = f" by {s['workers']} worker processes" if s["workers"] else " in this process" if lowered else ""
    ranks = f", {len(same)} copied from rank 0" if same else ""
    lines = [f"artifact {s['out']}: {n} graphs: {lowered} lowered{how}, {reused} reused from the cache{ranks}; "
             f"{s['total_s']} s in all"]
    for name, size in s["graphs"].items():
        tag = name.rsplit(".", 1)[0]
        what = "reused from the cache" if tag in s["cached"] else f"copy of {same[tag]}" if tag in same \
            else f"lowered in {s['compile_s'][tag]} s" if tag in s["compile_s"] else f"{s['timings_s'][tag]} s (onnx)"
        lines.append(f"  {name:<24} {size / 1e6:8.2f} MB  {what}")
    ref = s.get("weights_referenced")
    lines.append(f"  {'weights':<24} {s['weights_bytes'] / 1e6:8.2f} MB" if not ref else
                 f"  {'weights':<24} referenced: {ref['files']} files, {ref['bytes'] / 1e6:.2f} MB in "
                 f"{ref['checkpoint']} (not copied)")
    return "\n".join(lines)


def inspect(path: str | Path, manifest: dict | None = None) -> str:
    """An artifact's summary: `manifest` as runtime.artifact.verify returned it (default: read there with
    its format and self-hash checked, the files not hashed)."""
    from onegraph.runtime.artifact import verify
    m = manifest if manifest is not None else verify(path, files=False)
    lines = [f"{m['format']} v{m['format_version']}  backend={m['backend']}  dtype={m['dtype']}  "
             f"device={m['device']}  max_seq_len={m['max_seq_len']}",
             f"model: {m['model']['model_type']} layers={len(m['model']['layer_types'])} "
             f"hidden={m['model']['hidden_size']} vocab={m['model']['vocab_size']}",
             f"options: {m['options']}", f"versions: {m['versions']}", f"ops: {m['ops']}"]
    q = m["options"].get("quant", "none")
    lines.insert(2, f"quantization: {SCHEMES[q].describe if q in SCHEMES else q}"
                    + ("; lm_head block fp8" if m["options"].get("fp8_lm_head") else ""))
    lines.insert(3, "batch invariance: " + ("on: every decode row gets the bits it gets alone (one-row kernel plans "
                                            "at every bucket)" if m["options"].get("batch_invariant") else
                                            "off: a decode row's last bits may depend on the batch it runs in"))
    ref = m.get("weights_reference")
    if ref is None:
        lines.insert(4, f"weights: copied ({m['weights']})")
    else:
        root = ref["checkpoint"]
        lines.insert(4, f"weights: referenced, made at load from checkpoint {root} by {ref['recipe']['recipe']} "
                        f"(not copied; each file's sha256 verified at load):")
        for i, (rel, f) in enumerate(sorted(ref["files"].items())):
            lines.insert(5 + i, f"  {rel if root == 'tiny' else str(Path(root) / rel)}  {f['size']} bytes  "
                                f"sha256 {f['sha256']}")
    groups = m.get("projection_groups")                # absent from older manifests
    if groups:
        lines.append("projections (launches per layer, joined by +): " + "; ".join(
            f"{proj} {launches} x{n}" for proj, per in sorted(groups.items()) for launches, n in sorted(per.items())))
    for name, g in m["graphs"].items():
        top = sorted(g["ops"].items(), key=lambda kv: -kv[1])[:6]
        lines.append(f"  {name:<14} nodes={g['node_count']:<6} file={g['file']}  top ops: "
                     + ", ".join(f"{k}×{v}" for k, v in top))
    return "\n".join(lines)
