"""Tensor parallel (models/qwen3_5/tp.py + Qwen35Model(cfg, tp, group)), eager, CPU gloo.

- shard_state_dict then unshard round-trips the TP-1 weights bit for bit (tp 2 and 4; tied and
  untied lm_head);
- TP-2 and TP-4 fp32 `tiny` (TP-4 replicates the 2 KV heads and the 2 GDN key heads) in spawned
  gloo processes: greedy ids == TP-1 for 32 tokens, logits within 1e-4 (every rank gathers the full
  logits; rank 0 writes them); each rank's state has its own head count;
- a TP degree that cannot split the model raises ValueError naming the dimension and its size;
- bf16 TP-2 with fp32_reduce gives TP-1's (fp32_reduce) greedy ids up to an exact top-2 tie; without
  it TP-2 leaves TP-1 within a few tokens;
- a TP-2 fp32 `tiny` artifact (one export shared by the module) replayed by `torchrun -m onegraph
  generate`: greedy ids == TP-1 eager for 32 tokens (a GIL-holding runner deadlocked 1 run in 6);
  served by `torchrun -m onegraph serve` (rank 0 serves, rank 1 follows): two concurrent requests get
  TP-1's ids and SIGTERM ends both ranks without a traceback; launched as two torchrun "nodes" of one
  rank each (the multi-node form, on one host) it gives TP-1's ids; `torchrun -m onegraph bench` times it;
- bf16 TP-4 and TP-1 artifacts exported with --fp32-reduce give the same ids for 64 tokens (up to a
  near-tie), TP-4 replicating the KV and GDN key heads through the compiled graphs;
- a follower replays, step after step, the one of a captured bucket's two CUDA graphs that the
  leader replays (CPU stand-ins for the graphs; the real stage/replay/decode_step/follow);
- a rank that exits or hangs mid-replay makes rank 0 fail with an error (at once, or after the
  collective timeout) instead of hanging.
"""
import contextlib
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from onegraph.models.qwen3_5.config import ModelConfig
from onegraph.custom_ops.sample import Sampling
from onegraph.graphs.eager import generate_eager
from onegraph.checkpoint.load import load_model
from onegraph.models.qwen3_5.tiny import TINY_HF_CONFIG
from onegraph.models.qwen3_5.tp import check_divisible, local_dims, shard_state_dict, unshard
from tp_helpers import first_diff, free_port, torchrun, tp_generate, tp_serve_completions

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 5, 200, 17]
STEPS = 32
LOGIT_TOL = 1e-4
SEEDED = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def tiny():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    # the TP-1 model as sharding sees it: projections not yet concatenated (models/qwen3_5/fuse.py runs per rank after)
    cfg, model, _ = load_model("tiny", "float32", fuse=False)
    yield cfg, model
    torch.set_num_threads(n)


def full_sd(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_unshard_roundtrip(tiny, tp):
    cfg, model = tiny
    sd = full_sd(model)
    shards = [shard_state_dict(sd, cfg, r, tp) for r in range(tp)]
    d = local_dims(cfg, tp)
    assert shards[0]["lm_head.weight"].shape[0] == d.vocab
    # rank 1 of tp 2 holds attention q heads 2, 3 (query ‖ gate rows of each) and KV head 1
    if tp == 2:
        D = cfg.head_dim
        assert torch.equal(shards[1]["layers.3.self_attn.q_proj.weight"], sd["layers.3.self_attn.q_proj.weight"][4 * D:])
        assert torch.equal(shards[1]["layers.3.self_attn.k_proj.weight"], sd["layers.3.self_attn.k_proj.weight"][D:])
    if tp == 4:   # KV heads replicated: ranks 0, 1 keep KV head 0; ranks 2, 3 KV head 1
        k = "layers.3.self_attn.k_proj.weight"
        assert torch.equal(shards[1][k], shards[0][k]) and torch.equal(shards[2][k], sd[k][cfg.head_dim:])
    back = unshard(shards, cfg)
    assert back.keys() == sd.keys()
    for name, t in sd.items():
        assert back[name].shape == t.shape and torch.equal(back[name], t), name


def test_shard_unshard_tied_odd_vocab(tiny):
    """Tied embeddings get a vocab-sharded lm_head (zero-padded to a multiple of tp); unshard drops it."""
    cfg, model = tiny
    cfg = dataclasses.replace(cfg, tie_word_embeddings=True, vocab_size=cfg.vocab_size - 1)
    sd = {n: t for n, t in full_sd(model).items() if n != "lm_head.weight"}
    sd["embed_tokens.weight"] = sd["embed_tokens.weight"][:-1]
    shards = [shard_state_dict(sd, cfg, r, 2) for r in range(2)]
    assert shards[1]["lm_head.weight"].shape[0] == 132 and not shards[1]["lm_head.weight"][-1].any()
    back = unshard(shards, cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[n], sd[n]) for n in sd)


@pytest.mark.parametrize("tp, dims", [(3, ["num_attention_heads=4", "linear_num_value_heads=4",
                                           f"moe_intermediate_size={TINY_HF_CONFIG['moe_intermediate_size']}"]),
                                      (8, ["num_attention_heads=4"])])
def test_indivisible_tp_names_dimension(tp, dims):
    cfg = ModelConfig.from_hf(TINY_HF_CONFIG)
    with pytest.raises(ValueError) as e:
        check_divisible(cfg, tp)
    for d in dims:
        assert d in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        load_model("tiny", tp=tp)


def test_kv_heads_not_multiple():
    """tp 4 with 3 KV heads neither splits nor replicates them evenly."""
    cfg = dataclasses.replace(ModelConfig.from_hf(TINY_HF_CONFIG), num_heads=12, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        check_divisible(cfg, 4)


def _join_gloo(rank, tp, port, timeout_s: float | None = None):
    import torch.distributed as dist
    torch.set_num_threads(1)
    kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp, **kw)


@contextlib.contextmanager
def _gloo_rank(rank, tp, port):
    """A spawned worker's gloo group: joined, then, after the body, a barrier (every collective done
    before the group goes away), the group destroyed and the process ended without interpreter
    finalisation: a gloo worker thread that drops a Python-owned tensor then must take the GIL, and
    during finalisation that aborts the process ("terminate called without an active exception", seen
    once in CI on rank 1 after its work was done). Workers save their results inside the body."""
    import torch.distributed as dist
    _join_gloo(rank, tp, port)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


def _worker(rank, tp, port, out_path):
    with _gloo_rank(rank, tp, port):
        cfg, model, _ = load_model("tiny", "float32", tp=tp, rank=rank)
        state_heads = [tuple(s.shape) for s in model.state_spec(1, 64, torch.float32)]
        r = generate_eager(model, PROMPT, STEPS, max_seq_len=64, prefill_chunk=7)
        seeded = generate_eager(model, PROMPT, STEPS, SEEDED, max_seq_len=64)
        if rank == 0:
            torch.save({"ids": r.token_ids, "logits": torch.stack(r.logits), "state": state_heads,
                        "seeded": seeded.token_ids}, out_path)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_eager_matches_tp1(tiny, tp, tmp_path):
    cfg, model = tiny
    ref = generate_eager(model, PROMPT, STEPS, max_seq_len=64, prefill_chunk=7)
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(tp, free_port(), str(out)), nprocs=tp, join=True)
    got = torch.load(out)
    ids, logits = got["ids"], got["logits"]
    first = next((i for i, (a, b) in enumerate(zip(ids, ref.token_ids)) if a != b), None)
    assert ids == ref.token_ids, f"TP-{tp} first differing token at step {first}: {ids[first]} vs {ref.token_ids[first]}"
    # seeded top-k/top-p sampling over the all-gathered logits draws TP-1's ids (and is not greedy here)
    seeded = generate_eager(model, PROMPT, STEPS, SEEDED, max_seq_len=64).token_ids
    assert got["seeded"] == seeded and seeded != ref.token_ids, (got["seeded"], seeded)
    diff = (logits - torch.stack(ref.logits)).abs().max().item()
    assert diff <= LOGIT_TOL, f"TP-{tp} logits differ by {diff}"
    d = local_dims(cfg, tp)
    assert got["state"][0] == (2, d.conv_dim, cfg.conv_kernel - 1)          # layer 0: GDN conv, rank's channels
    assert got["state"][1] == (2, d.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim)
    assert got["state"][6] == (2, d.num_kv_heads, 64, cfg.head_dim)        # layer 3: attention k cache


def _fixture_worker(rank, tp, port, root, out_path):
    """TP-N bf16 eager (this rank's shard, gloo) against the TP-1 fixture, with and without its router
    margins; both ranks check in lockstep (their all-gathered logits are the same)."""
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from onegraph.runtime.artifact import ArtifactError
    from onegraph.runtime.executor import GraphExecutor
    from onegraph.runtime.fixture import check_fixture
    with _gloo_rank(rank, tp, port):
        _, model, _ = load_model("tiny", "bfloat16", tp=tp, rank=rank)
        ex = GraphExecutor.from_model(model, {"decode": [1], "prefill": [64]}, max_slots=1, max_seq_len=64)
        report = check_fixture(ex, f"{root}/fixture.safetensors", "bfloat16")
        fx = load_file(f"{root}/fixture.safetensors")
        if rank == 0:
            save_file({k: v for k, v in fx.items() if not k.startswith("router_margin")}, f"{root}/strict.safetensors")
        dist.barrier()
        try:
            check_fixture(ex, f"{root}/strict.safetensors", "bfloat16")
            strict = "passed"
        except ArtifactError as e:
            strict = str(e)
        if rank == 0:
            torch.save({"report": report, "strict": strict}, out_path)


def test_tp2_bf16_passes_tp1_fixture_through_router_near_ties(tmp_path):
    """bf16 TP-2 sums each row-parallel output in another order than TP-1, and the tiny MoE router has
    near-ties: on 2xH200 the TP-2 bf16 artifact was refused at load (fixture prompt 0, step 2, logits 4.6
    apart) although every rank's graphs matched that rank's eager shard. The same happens here in eager
    TP-2 on gloo: the check without the fixture's router margins refuses it; with them it passes and
    names the flip."""
    from onegraph.export.pipeline import fixture
    from safetensors.torch import save_file
    _, model, _ = load_model("tiny", "bfloat16")
    save_file(fixture(model, 64), str(tmp_path / "fixture.safetensors"))
    out = tmp_path / "report.pt"
    mp.spawn(_fixture_worker, args=(2, free_port(), str(tmp_path), str(out)), nprocs=2, join=True)
    got = torch.load(out)
    assert got["report"]["routing_flips"], got
    assert "parity fixture" in got["strict"], got


INVARIANCE_PROMPTS = [PROMPT, list(b"Colours of the rainbow: red, orange,"), [1, 2, 3], list(range(40, 60))]


def _bf16_worker(rank, tp, port, out_path):
    with _gloo_rank(rank, tp, port):
        res = {}
        for f in (False, True):
            _, model, _ = load_model("tiny", "bfloat16", tp=tp, rank=rank, fp32_reduce=f)
            res[f] = [generate_eager(model, p, 64, max_seq_len=128) for p in INVARIANCE_PROMPTS]
            res[f] = [(r.token_ids, torch.stack(r.logits).float()) for r in res[f]]
        if rank == 0:
            torch.save(res, out_path)


def test_tp2_bf16_fp32_reduce_gives_tp1_ids(tmp_path):
    """bf16 `tiny`, 4 prompts x 64 greedy tokens, TP-2 vs TP-1 of the same option.
    Default: each rank rounds its partial sums to bf16 and the all-reduce adds bf16, so TP-2's logits
    differ from TP-1's from the first step on every prompt, and its ids leave TP-1's early (at steps 0,
    10, 2, 30 when written: the tiny model's top two logits are often 1-2 bf16 steps apart).
    fp32_reduce: fp32 partials, fp32 all-reduce, one rounding; what is left is the fp32 summation order,
    so the logits are bit-identical on most prompts (3 of 4 at step 0, 2 of 4 for all 64 steps when
    written) and the ids agree for 235 of 256 steps, leaving TP-1 only at a near-tie (top two logits
    within two bf16 steps; when written, an exact tie at step 43)."""
    out = tmp_path / "rank0.pt"
    mp.spawn(_bf16_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    got = torch.load(out)
    agreed, step0_same = {}, {}
    for f in (False, True):
        _, model, _ = load_model("tiny", "bfloat16", fp32_reduce=f)
        agreed[f], step0_same[f] = 0, 0
        for p, (ids, logits) in zip(INVARIANCE_PROMPTS, got[f]):
            ref = generate_eager(model, p, 64, max_seq_len=128)
            step0_same[f] += torch.equal(logits[0], ref.logits[0].float())
            i = first_diff(ids, ref.token_ids)
            agreed[f] += len(ids) if i is None else i
            if f and i is not None:
                top2 = ref.logits[i].float().topk(2).values
                assert float(top2[0] - top2[1]) <= 1 / 32, \
                    f"fp32_reduce TP-2 left TP-1 at step {i} of prompt {p[:4]}, top-2 gap {float(top2[0] - top2[1]):.3g}"
    assert step0_same[False] == 0 and step0_same[True] >= 1, step0_same
    assert agreed[True] > agreed[False], agreed


# ---- the exported TP-2 artifact, replayed under torchrun ----

@pytest.fixture(scope="module")
def tp2_artifact(tmp_path_factory):
    """TP-2 fp32 `tiny`: 2 ranks x (decode bucket 1, prefill chunk 16) = 4 AOTInductor compiles, about
    90 s on 2 cores, so every test below shares it. PROMPT (17 tokens) prefills in two chunks."""
    from onegraph.export.pipeline import ExportOptions, export
    out = tmp_path_factory.mktemp("tp2") / "tiny_tp2"
    export("tiny", out, ExportOptions(tp=2, batch_sizes=(1,), prefill_chunks=(16,), max_seq_len=64),
           progress=False)
    return out


def _replay_matches_tp1(model, art, nproc: int, timeout: int, sampling=None):
    """`torchrun generate` of a TP-N artifact gives TP-1 eager's ids (greedy, or seeded `sampling`);
    rank 0's load-time fixture check vs TP-1 eager is within LOGIT_TOL."""
    ref = generate_eager(model, PROMPT, STEPS, sampling, max_seq_len=64).token_ids
    extra = [] if sampling is None else ["--temperature", sampling.temperature, "--top-k", sampling.top_k,
                                         "--top-p", sampling.top_p, "--seed", sampling.seed]
    got = tp_generate(art, PROMPT, STEPS, *extra, nproc=nproc, timeout=timeout)
    ids, i = got["token_ids"], first_diff(got["token_ids"], ref)
    assert ids == ref, f"TP-{nproc} replay first differing token at step {i}: {ids[i]} vs TP-1 {ref[i]}"
    assert got["fixture"]["max_logit_diff"] <= LOGIT_TOL


def test_tp2_weights_made_by_the_recipe_are_the_exported_shards(tp2_artifact):
    """export --weights reference at tp 2: what the runtime makes for each rank from the checkpoint by the
    recorded recipe (checkpoint/recipe.py) is that rank's weights file of a copying export, tensor for tensor."""
    from safetensors.torch import load_file
    from onegraph.checkpoint.recipe import graph_weights, recipe_of, tensors_sha256
    recipe = recipe_of("float32", "none", False, False, False, 2)          # tp2_artifact's options
    for r in range(2):
        want = load_file(str(tp2_artifact / f"weights_rank{r}.safetensors"))
        assert tensors_sha256(graph_weights("tiny", recipe, r)) == tensors_sha256(want), f"rank {r}"


def test_tp2_artifact_replay_matches_tp1(tiny, tp2_artifact):
    _replay_matches_tp1(tiny[1], tp2_artifact, 2, 240)
    _replay_matches_tp1(tiny[1], tp2_artifact, 2, 240, SEEDED)


def test_tp2_bench_under_torchrun(tp2_artifact, tmp_path):
    """`torchrun -m onegraph bench --artifact TP2`: rank 0 times replay (the other rank follows), both run
    their eager shards, rank 0 times the engine and writes the JSON; no artifact -> a clear error."""
    out = tmp_path / "bench.json"
    common = ["--preset", "tiny", "--batch-sizes", "1", "--steps", "5", "--max-seq-len", "64", "--prefill-chunk", "16",
              "--no-transformers", "--quiet"]
    r = subprocess.run(torchrun("bench", "--artifact", tp2_artifact, "--out", out, *common),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["tp"] == 2 and res["command"].startswith("torchrun --nproc-per-node 2 -m onegraph bench"), res["command"]
    row = res["decode"][0]
    assert row["batch"] == 1 and row["replay_ms_per_step"] > 0 and row["eager_ms_per_step"] > 0, row
    assert res["engine"]["host_us_per_step"] > 0 and res["prefill_ms"]["16"] > 0
    r = subprocess.run(torchrun("bench", *common), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "under torchrun, bench replays an exported tensor-parallel artifact" in r.stderr
    assert "]: Traceback" not in r.stderr, r.stderr[-3000:]


def test_tp4_bf16_fp32_reduce_artifact_gives_tp1_artifact_ids(tmp_path, tiny_bf16_artifact):
    """Exported with --fp32-reduce, the bf16 TP-4 artifact (torchrun generate on 4 CPU processes; tiny's 2 KV heads
    and 2 GDN key heads are replicated across the 4 ranks) gives the bf16 TP-1 artifact's ids (both load-time
    fixtures pass against eager with the option), up to a near-tie of the TP-1 graphs' top two logits. The TP-2
    form of this check, when written: 64 of 64 tokens identical, and identical fixture reports; the default bf16
    TP-2 artifact differs at the first token for this prompt (TP-1's prefill router margin is 0.0021). One test
    for both: TP-4 runs the replicated-head shards through the compiled graphs, which the TP-2 artifact
    (tp2_artifact, fp32) does not. The TP-4 export compiles rank 0's 2 graphs and the other 3 ranks run copies of
    them (docs/design.md "Export: one compile serves every TP rank"): this test is also what shows that a rank
    holding one GDN head runs a package compiled for another rank's weights."""
    from onegraph.export.pipeline import ExportOptions, export
    from onegraph.runtime.artifact import load_manifest
    from onegraph.runtime.executor import GraphExecutor
    opts = load_manifest(tiny_bf16_artifact)["options"]                          # conftest: bf16, fp32_reduce
    assert opts["fp32_reduce"] and opts["dtype"] == "bfloat16" and opts["tp"] == 1
    s = export("tiny", tmp_path / "tp4", ExportOptions(**dict(opts, tp=4)), progress=False)
    assert s["same_as"] == {f"rank{r}/{g}": f"rank0/{g}" for r in (1, 2, 3) for g in ("decode_b1", "prefill_t16")}
    assert sorted(s["compile_s"]) == ["rank0/decode_b1", "rank0/prefill_t16"]   # 2 compiles, not 8
    tp1 = GraphExecutor.from_artifact(tiny_bf16_artifact, max_slots=1)          # fixture checked vs eager
    ref, logits = tp1.generate(PROMPT, 64)
    got = tp_generate(tmp_path / "tp4", PROMPT, 64, nproc=4)
    assert got["fixture"]["max_logit_diff"] <= 0.25, got["fixture"]
    i = first_diff(got["token_ids"], ref)
    gap = None if i is None else float(logits[i].float().topk(2).values.diff().abs())
    assert i is None or gap <= 1 / 32, f"TP-4 left TP-1 at step {i} ({got['token_ids'][i]} vs {ref[i]}), top-2 gap {gap}"


def test_tp2_lockstep_every_rank_matches_its_eager_shard(tp2_artifact, tmp_path):
    """scripts/lockstep.py under torchrun: each rank's graphs vs an eager model of its own weight shard,
    teacher-forced, every state tensor compared per step (the rung that localised a 2xH200
    failure to TP-2 eager rounding rather than the graphs)."""
    out = tmp_path / "lockstep{rank}.json"
    r = subprocess.run(torchrun(tp2_artifact, "--steps", 6, "--out", out, module="onegraph.scripts.lockstep"),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ref = None
    for rank in range(2):
        rep = json.loads(Path(str(out).format(rank=rank)).read_text())
        assert rep["rank"] == rank and rep["path"].endswith("+tp2") and rep["first_diff"] is None, rep
        assert len(rep["rows"]) == 7
        ids = [row["ids"] for row in rep["rows"]]
        assert ref is None or ids == ref          # every rank samples from the same all-gathered logits
        ref = ids


def test_tp2_two_nodes_one_rank_each(tiny, tp2_artifact):
    """The multi-node launch (`torchrun --nnodes 2 --node-rank R --master-addr ...`), as two nodes of one
    rank each on this host: rank 0 (node 0) prints TP-1's ids; node 1 follows and exits cleanly."""
    ref = generate_eager(tiny[1], PROMPT, 16, max_seq_len=64).token_ids
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "onegraph", "generate", str(tp2_artifact), "--prompt-ids", ",".join(map(str, PROMPT)),
                               "--max-new-tokens", "16", "--ignore-eos", "--json", "--temperature", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    assert json.loads(outs[0][0].strip().splitlines()[-1])["token_ids"] == ref
    assert outs[1][0].strip() == ""                   # only rank 0 prints


def test_tp2_fixture_failure_releases_followers(tp2_artifact, tmp_path):
    """Rank 0 refusing the artifact at its load-time fixture check (here: a fixture whose logits were
    altered) exits with the reason and releases rank 1 at once; rank 1 used to wait out the collective
    timeout (torchrun killed it on 2xH200)."""
    import shutil
    from safetensors.torch import load_file, save_file

    from onegraph.runtime.artifact import write_manifest
    art = tmp_path / "bad"
    shutil.copytree(tp2_artifact, art)
    fx = load_file(str(art / "fixture.safetensors"))
    fx["logits0"][1] += 1.0
    save_file(fx, str(art / "fixture.safetensors"))
    m = json.loads((art / "manifest.json").read_text())      # re-signed: the hashes are not what is tested
    write_manifest(art, {k: v for k, v in m.items() if k not in ("files", "manifest_sha256")})
    r = subprocess.run(torchrun("generate", art, "--prompt-ids", "1,2,3", "--max-new-tokens", 4, "--tp-timeout", 900),
                       capture_output=True, text=True, timeout=200)
    assert r.returncode != 0 and "parity fixture: prompt 0 step 1" in r.stderr, r.stderr[-3000:]
    assert "]: Traceback" not in r.stderr, r.stderr[-3000:]
    # rank 1 was released, not left to fail on a dead peer (gloo: at once; NCCL: at the collective timeout)
    assert "tensor-parallel rank 1" not in r.stderr, r.stderr[-3000:]


def test_tp2_serve_under_torchrun(tiny, tp2_artifact):
    ref = generate_eager(tiny[1], PROMPT, 16, max_seq_len=64).token_ids
    assert tp_serve_completions(tp2_artifact, PROMPT, 16, 2) == [ref, ref]


def _fault_worker(rank, port, art, fault, timeout_s, out_path):
    """Rank 1 replays 3 graph calls, then exits or hangs (never reaching the 4th call's collectives);
    rank 0 records how its generate() ended."""
    from onegraph.runtime.executor import GraphExecutor
    _join_gloo(rank, 2, port, timeout_s)
    ex = GraphExecutor.from_artifact(art, max_slots=1, check_parity=False)
    if rank == 1:
        calls = []

        def run(name, inputs):
            calls.append(name)
            if len(calls) == 4:
                if fault == "exit":
                    os._exit(3)
                time.sleep(3600)                  # hung: the test kills it
            ex.graphs[name](list(inputs) + ex.state)
        ex.link.follow(run)
        return
    t0 = time.time()
    try:
        ex.generate(PROMPT, STEPS)
        error = None
    except RuntimeError as e:
        error = str(e)
    torch.save({"error": error, "seconds": time.time() - t0}, out_path)
    os._exit(0)                                   # no process-group teardown with a dead or hung peer


@pytest.mark.parametrize("fault", ["exit", "hang"])
def test_tp_rank_fault_fails_not_hangs(tp2_artifact, fault, tmp_path):
    timeout_s = 10
    out = tmp_path / "rank0.pt"
    ctx = mp.spawn(_fault_worker, args=(free_port(), str(tp2_artifact), fault, timeout_s, str(out)), nprocs=2,
                   join=False)
    rank0, rank1 = ctx.processes
    try:
        rank0.join(120)
        assert rank0.exitcode == 0, f"rank 0 did not finish (exit code {rank0.exitcode})"
    finally:
        for proc in ctx.processes:                # rank 1 hangs by design; rank 0 only on a regression
            proc.kill()
            proc.join(10)
    got = torch.load(out)
    assert got["error"] is not None, "rank 0 generated 32 tokens without its peer"
    if fault == "hang":                           # no answer: the collective timeout ends it
        assert "Timed out" in got["error"] and timeout_s - 1 < got["seconds"] < timeout_s + 15, got
    else:                                         # the peer's connection closed: at once
        assert got["seconds"] < timeout_s, got


def test_tp_follower_replays_the_leaders_captured_graph():
    """Each captured decode bucket holds two CUDA graphs that the leader alternates (stage() flips);
    every graph holds its own NCCL collectives, so a follower must replay the graph the leader
    replays, step after step. The real CapturedDecode.stage/replay and GraphExecutor.decode_step/
    follow run here over recording stand-ins for the two CUDA graphs (CPU), the broadcast replaced
    by a queue. (Followers replayed graph 0 only; TP-2 generate stalled on 2xH200.)"""
    from onegraph.runtime.cuda_graphs import CapturedDecode, Staging
    from onegraph.runtime.executor import GraphExecutor, Sampling

    B, sent = 2, []

    class Graph:                                   # stands in for torch.cuda.CUDAGraph
        def __init__(self, log, k):
            self.log, self.k = log, k

        def replay(self):
            self.log.append(self.k)

    class Link:                                    # stands in for StepBroadcast: leader -> queue -> follower
        def lead(self, name, inputs):
            sent.append((name, [t.clone() for t in inputs]))
            return inputs

        def follow(self, run):
            for name, inputs in sent:
                run(name, inputs)
            return len(sent)

    def rank(r):
        meta = {f"decode_b{B}": {"kind": "decode", "bucket": B, "inputs": []},
                "prefill_t16": {"kind": "prefill", "bucket": 16, "inputs": []}}
        ex = GraphExecutor({}, meta, [], max_slots=2, max_seq_len=64, vocab_size=8, device=torch.device("cpu"))
        cap, log = object.__new__(CapturedDecode), []
        cap.B, cap.copy_in, cap.flip = B, False, 0
        cap.host = [Staging(B, ex.scratch, pin=False) for _ in range(2)]
        cap.dev = torch.zeros_like(cap.host[0].bytes)
        cap.graphs = [Graph(log, k) for k in range(2)]
        cap.outs = [(torch.zeros(B, dtype=torch.int64), torch.zeros(B, 8))] * 2
        cap.host_ids, cap.events = [torch.zeros(B, dtype=torch.int64)] * 2, [None, None]
        ex.captured, ex.rank, ex.link = {B: cap}, r, Link()
        return ex, log

    (leader, led), (follower, followed) = rank(0), rank(1)
    for step in range(5):
        n = 1 + step % 2
        leader.decode_step([0, 1][:n], [10 + step, 3][:n], [Sampling()] * n)
    assert follower.follow() == 5
    assert led == [1, 0, 1, 0, 1]                  # the leader alternates its two graphs
    assert followed == led                         # and the follower replays the same one each step
    assert torch.equal(follower.captured[B].dev, leader.captured[B].host[led[-1]].bytes)   # with its bytes
