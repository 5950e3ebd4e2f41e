"""commands/plot.py reads both bench JSON shapes (`onegraph bench` "decode" rows, bench_big "batches" rows) and
plots ms per token = ms per step / batch; bad usage exits 2 with a message; bench_big's
--identical-experts really makes the MoE output independent of which experts the router picks."""
import subprocess
import sys

from onegraph.commands.plot import series


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
    r = subprocess.run([sys.executable, "-m", "onegraph.commands.plot"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


def test_big_preset_user_errors(tmp_path):
    """`onegraph bench --preset qwen3.5-35b-a3b`: no --out, or no CUDA device; bench_big given a prefill longer
    than the cache, --fp8-lm-head without --quant fp8, or --batch-invariant where the export refuses it; the GDN
    prefill bench without a GPU -> one line, exit 2 (before any lowering)."""
    import torch
    base = [sys.executable, "-m", "onegraph", "bench", "--preset", "qwen3.5-35b-a3b"]
    r = subprocess.run(base, capture_output=True, text=True)
    assert r.returncode == 2 and "--out is required" in r.stderr
    if not torch.cuda.is_available():
        r = subprocess.run(base + ["--out", str(tmp_path / "x.json")], capture_output=True, text=True)
        assert r.returncode == 2 and "needs a CUDA device" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "onegraph.scripts.bench_big", "--prefill", "512,8192", "--out",
                        str(tmp_path / "x.json")], capture_output=True, text=True)
    assert r.returncode == 2 and "--prefill 8192 exceeds --max-seq-len 4096" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "onegraph.scripts.bench_big", "--fp8-lm-head", "--out",
                        str(tmp_path / "x.json")], capture_output=True, text=True)
    assert r.returncode == 2 and "--fp8-lm-head needs --quant fp8" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "onegraph.scripts.bench_big", "--batch-invariant", "--quant", "int8",
                        "--out", str(tmp_path / "x.json")], capture_output=True, text=True)
    assert r.returncode == 2 and "--batch-invariant needs --quant none or fp8" in r.stderr, r.stderr
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, "-m", "onegraph.scripts.bench_gdn_prefill", "--out",
                            str(tmp_path / "g.json")], capture_output=True, text=True)
        assert r.returncode == 2 and "needs a CUDA device" in r.stderr and "Traceback" not in r.stderr


def test_bench_flags_user_errors(tmp_path):
    """`onegraph bench` given a count that is not a positive integer (a batch list with a 0 or a word, --steps 0, a
    negative --threads): argparse's usage error naming the flag, exit 2, no traceback (--steps 0 divided by zero)."""
    for flags, needle in ((["--batch-sizes", "1,0"], "--batch-sizes: must be comma-separated positive integers"),
                          (["--batch-sizes", "x"], "--batch-sizes: must be comma-separated positive integers"),
                          (["--steps", "0"], "--steps: must be a positive integer"),
                          (["--threads", "-1"], "--threads: must be a positive integer")):
        r = subprocess.run([sys.executable, "-m", "onegraph", "bench", *flags, "--out", str(tmp_path / "b.json")],
                           capture_output=True, text=True)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, (flags, r.stderr)


def test_identical_experts_make_the_moe_blind_to_routing():
    """bench_big --identical-experts rests on this: once every expert is expert 0, another router (here a
    random one, which picks other experts) leaves the MoE output unchanged up to rounding, while with the
    model's own distinct experts the same change moves it (fp32, tiny)."""
    import torch

    from onegraph.checkpoint.load import load_model
    from onegraph.models.qwen3_5.model import SparseMoe, ops
    from onegraph.scripts.bench_big import identical_experts_
    _, model, _ = load_model("tiny", "float32")
    moe = next(m for m in model.modules() if isinstance(m, SparseMoe))
    own = moe.router_weight                                                # [E + 1, H]: router ‖ shared gate
    x = torch.randn(8, own.shape[1])
    other = torch.cat([torch.randn_like(own[:-1]), own[-1:]])             # another router, the same shared gate
    se = moe.shared_expert

    def out(router):
        return ops.fused_moe(x, x @ router.T, moe.experts.gate_up_proj, moe.experts.down_proj, se.gate_proj.weight,
                             se.up_proj.weight, se.down_proj.weight, moe.top_k, False)

    picks = lambda r: torch.softmax(x @ r[:-1].T, -1).topk(moe.top_k).indices.sort().values   # noqa: E731
    assert not torch.equal(picks(own), picks(other))                      # the two routers differ
    assert (out(own) - out(other)).abs().max() > 1e-3
    identical_experts_(model)
    assert (out(own) - out(other)).abs().max() < 1e-5


def test_bench_big_layers_and_speculative_round_on_cpu(tmp_path):
    """bench_big --layers / --speculative-tokens on the tiny shape (CPU, fp32, the traced graphs run
    uncaptured): the JSON names the layer counts and its projection method, the decode step and the
    speculative round each equal their eager run, the round reports its cost and ms/token at assumed
    acceptance lengths, and no acceptance is measured (random weights)."""
    import json

    from onegraph.scripts.bench_big import main
    out = tmp_path / "spec.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--lower", "export", "--layers", "2",
                 "--speculative-tokens", "1", "--batch", "1", "--steps", "2", "--eager-steps", "1",
                 "--max-seq-len", "64", "--position", "8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["layers"], res["layers_full"]) == (2, 4) and "projection" in res["method"]
    dec = res["batches"][0]
    assert dec["parity_vs_eager"]["ids_equal"] and dec["parity_vs_eager"]["max_logit_diff"] < 1e-4
    (row,) = res["speculative"]
    assert (row["K"], row["layers"]) == (1, 2) and row["parity_vs_eager"]["exact"], row["parity_vs_eager"]
    assert row["round_ms"] > 0 and row["round_over_decode_step"] > 0 and row["decode_ms"] > 0
    assert set(row["ms_per_token_at"]) == {"2.0"}                 # acceptance lengths up to K + 1
    # tiny's first 2 layers are GDN: conv [conv_dim, W-1] and recurrent [HV, K, V] fp32 rows, read and written
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.models.qwen3_5.tiny import TINY_HF_CONFIG
    c = ModelConfig.from_hf(TINY_HF_CONFIG)
    assert tuple(c.layer_types[:2]) == ("linear_attention",) * 2
    conv_dim = 2 * c.linear_k_heads * c.linear_k_dim + c.linear_v_heads * c.linear_v_dim
    per_layer = 2 * 4 * (conv_dim * (c.conv_kernel - 1) + c.linear_v_heads * c.linear_k_dim * c.linear_v_dim)
    assert dec["state_bytes_per_step"] == 2 * per_layer
    if dec["bandwidth_limit_ms"]:
        assert dec["bandwidth_limit_with_state_ms"] > dec["bandwidth_limit_ms"]
    # the round reads more weights than a decode step (K+1 rows' experts, the head, lm_head K more times)
    assert row["round_weight_bytes"] > dec["weight_bytes_per_step"]
    assert "meaningless" in res["acceptance"]
    assert not any("accepted" in key or "acceptance_length" in key for key in row)


def test_bench_big_round_split():
    """split_round cuts a round's time-ordered device events at its sample calls: k drafts, then the verify's
    targets, then the commit up to the catch-up's first GEMM; a round with another count of sample calls
    is refused; verify_kernels sums the verify part's kernels by name. decode_layers_us: a step's layers span from its first Triton kernel's end to lm_head's start."""
    import pytest

    from onegraph.scripts.bench_big_spec import decode_layers_us, split_round, verify_kernels
    ev = [("index_select", 0, 1), ("_gemv_kernel", 1, 3), ("_scan_kernel", 3, 4), ("_pick_kernel", 4, 5),   # draft 1
          ("_rms_norm_kernel", 5, 6), ("_gemv_kernel", 6, 7), ("_scan_kernel", 7, 8), ("_pick_kernel", 8, 9),  # draft 2
          ("_gdn_decode_kernel", 9, 12), ("_gemv_kernel", 12, 20), ("_scan_kernel", 20, 21),   # verify
          ("_pick_kernel", 21, 22), ("triton_poi_fused_index_copy_0", 23, 25),                  # commit
          ("_gemv_kernel", 26, 27), ("_attn_split_kernel", 27, 30)]                             # catch-up
    s = split_round(ev, 2)
    assert (s["draft_us"], s["verify_us"], s["commit_us"], s["catch_up_us"]) == (9, 13, 3, 5)
    assert (s["verify_lm_head_us"], s["verify_fixed_us"], s["kernels"]) == (8, 10, 15)
    with pytest.raises(ValueError, match="sample calls"):
        split_round(ev, 1)
    assert verify_kernels(ev, 2) == {"_gdn_decode_kernel": 3, "_gemv_kernel": 8, "_scan_kernel": 1, "_pick_kernel": 1}
    # a decode step: runtime copies and token gather, embedding, two layers, final norm, lm_head, sample
    step = [("Memcpy HtoD (Pinned -> Device)", 0, 1), ("void at::native::indexSelectSmallIndex", 1, 2),
            ("triton_poi_fused_embedding_0", 3, 4), ("_rms_norm_kernel", 5, 6), ("_gemv_kernel", 6, 9),
            ("_rms_norm_kernel", 10, 11), ("_gemv_kernel", 11, 14), ("_rms_norm_kernel", 15, 16),
            ("_gemv_kernel", 17, 40), ("_scan_kernel", 41, 42), ("_pick_kernel", 42, 43)]
    assert decode_layers_us(step) == 17 - 4
    with pytest.raises(ValueError, match="lm_head"):
        decode_layers_us(step[:2])


def test_bench_interleave_chunked_vs_whole(tiny_artifact, tmp_path):
    """tools/bench_interleave on the tiny artifact: with the default budget (one 16-token chunk per step) the
    running streams decode between the 80-token prompt's 5 chunks; with the whole prompt in one step they do
    not, and the JSON carries both runs' gap percentiles."""
    import json

    from onegraph.scripts.bench_interleave import main
    out = tmp_path / "interleave.json"
    assert main(["--artifact", str(tiny_artifact), "--streams", "2", "--prompt-len", "80", "--warmup", "2",
                 "--out", str(out)]) == 0
    runs = {r["budget"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["chunk"]["prefill_budget"] == 16 and runs["whole"]["prefill_budget"] == 80
    assert runs["chunk"]["decode_steps_between_chunks"] >= 4 and runs["whole"]["decode_steps_between_chunks"] == 0
    assert runs["chunk"]["itl_during_prefill_ms"]["n"] > 0 and runs["chunk"]["long_ttft_ms"] > 0


def test_bench_engine_on_the_tiny_artifact(tiny_artifact, tmp_path):
    """tools/bench_engine: the load stages (and, --profile-load, its profile), the fixture's report (it runs by
    default), the first request, bs1 and 3 concurrent requests each streaming exactly --output-len tokens;
    input past max_seq_len exits 2."""
    import json

    import pytest

    from onegraph.scripts.bench_engine import main
    out = tmp_path / "engine.json"
    assert main(["--artifact", str(tiny_artifact), "--concurrency", "3", "--input-len", "20", "--output-len", "5",
                 "--profile-load", "5", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert {"graph_packages", "fixture"} <= set(r["load_timings_s"]) and r["load_s"] > 0
    prof = r["load_profile"]           # the load's most expensive functions, the Engine's own entry among them
    cum = [f["cumulative_s"] for f in prof]
    assert len(prof) == 5 and cum == sorted(cum, reverse=True) and cum[0] <= r["load_s"] + 0.01   # load_s: 2 decimals
    assert any("from_artifact" in f["function"] for f in prof)
    assert r["fixture"]["prompts"] >= 1
    assert r["bs1"]["decode_ms_per_token"] > 0 and r["first_request"]["ttft_ms"] > 0
    c = r["concurrency"]
    assert c["requests"] == 3 and c["output_tokens"] == 15 and c["ttft_ms"]["n"] == 3 and c["itl_ms"]["n"] == 12
    assert c["output_tok_s"] > 0 and c["input_tok_s"] == pytest.approx(c["output_tok_s"] * 60 / 15, rel=1e-2)
    assert main(["--artifact", str(tiny_artifact), "--concurrency", "1", "--input-len", "250", "--output-len", "10",
                 "--no-parity-check"]) == 2


def test_profile_regions_name_each_kernel_family():
    """Kernel names as the H200 profiles show them -> their region: the grouped MoE path (bs >= 64) is MoE, not
    'other', and attention's combine kernel is not the MoE's."""
    from onegraph.commands.bench_common import REGIONS

    def region(name):
        return next((r for r, pats in REGIONS if any(p in name.lower() for p in pats)), "other")
    assert {n: region(n) for n in ("_grouped_swiglu_kernel", "_grouped_down_fp8_kernel", "_pair_table_kernel",
                                   "_route_kernel", "_combine_kernel", "_moe_swiglu_kernel")} == dict.fromkeys(
        ("_grouped_swiglu_kernel", "_grouped_down_fp8_kernel", "_pair_table_kernel", "_route_kernel",
         "_combine_kernel", "_moe_swiglu_kernel"), "moe")
    assert region("_attn_combine_kernel") == region("_attn_split_kernel") == "attention"
    assert region("_gdn_decode_kernel") == "gdn" and region("_gated_rms_norm_kernel") == "norms"
    assert region("nvjet_sm90_tst_64x64") == region("_gemv_kernel") == "gemm"


def test_bench_big_prefill_and_interleave_on_cpu(tmp_path):
    """bench_big --prefill / --interleave on the tiny shape (CPU, fp32, the traced graphs run uncaptured): the
    prefill row equals eager and names its weight bytes (every expert: 24 tokens over 8 experts top-2); the
    interleave runs 2 streams through an Engine over the in-memory graphs while a 40-token prompt is admitted
    in 8- and in 16-token chunks, each with the default budget (decode steps between its chunks) and whole
    (none): the chunk's trade-off curve."""
    import json

    from onegraph.scripts.bench_big import main
    out = tmp_path / "inter.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--lower", "export", "--batch", "2",
                 "--prefill", "24", "--steps", "2", "--eager-steps", "1", "--max-seq-len", "96", "--interleave", "2",
                 "--interleave-prompt", "40", "--interleave-chunk", "16,8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (pre,) = res["prefill"]
    assert pre["prompt_tokens"] == 24 and pre["parity_vs_eager"]["ids_equal"], pre
    assert pre["parity_vs_eager"]["max_logit_diff"] < 1e-4
    from onegraph.checkpoint.load import load_model
    model = load_model("tiny")[1]
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n and not n.startswith("mtp."))
    assert pre["weight_bytes"] > experts * 0.99           # 1 - (3/4)^24 of them, expected
    inter = res["interleave"]
    assert (inter["streams"], inter["decode_bucket"], inter["prefill_chunks"]) == (2, 2, [8, 16])
    runs = {(r["prefill_chunk"], r["budget"]): r for r in inter["runs"]}
    assert sorted(runs) == [(8, "chunk"), (8, "whole"), (16, "chunk"), (16, "whole")]
    assert runs[8, "chunk"]["prefill_budget"] == 8 and runs[16, "chunk"]["prefill_budget"] == 16
    assert runs[8, "chunk"]["decode_steps_between_chunks"] >= 4, runs         # 5 chunks
    assert runs[16, "chunk"]["decode_steps_between_chunks"] >= 2, runs        # 3 chunks
    assert all(runs[c, "whole"]["decode_steps_between_chunks"] == 0 for c in (8, 16)), runs
    assert runs[8, "chunk"]["itl_during_prefill_ms"]["n"] > 0 and set(inter["chunked_prefill_tok_s"]) == {"8", "16"}


def test_bench_big_lower_all_keys_by_kind_bucket_and_drafts(monkeypatch):
    """lower_all traces every wanted (kind, bucket, k) and returns the lowered package of each under that key (the
    pool and the tracing faked: what is checked is the bookkeeping a 35B run depends on after ~5 min of lowering)."""
    from types import SimpleNamespace

    from onegraph.export import program, workers
    from onegraph.scripts import bench_big

    class Pool:
        def __init__(self, *a):
            self.q = []

        def share(self, *a):
            pass

        def submit(self, tag, *a):
            self.q.append(tag)

        @property
        def pending(self):
            return len(self.q)

        def poll(self, _):
            done, self.q = [SimpleNamespace(tag=t, seconds=1.0) for t in self.q], []
            return done

        def close(self):
            pass

    monkeypatch.setattr(workers, "LoweringPool", Pool)
    monkeypatch.setattr(program, "save_without_weights", lambda ep, path: None)
    monkeypatch.setattr(program, "weights_of", lambda ep: {})
    monkeypatch.setattr(bench_big, "_trace", lambda model, kind, bucket, args, dev, r, k: r.update(trace_s=0.1))
    wanted = [("spec", 1, 2), ("spec", 1, 3), ("decode", 1, 0), ("prefill", 64, 0)]
    got = bench_big.lower_all(SimpleNamespace(tp=1), wanted, SimpleNamespace(jobs=2, lower="aoti"), "cpu")
    assert sorted(got) == sorted(wanted)
    assert got[("spec", 1, 3)][0].name == "spec_1_k3.pt2" and got[("spec", 1, 3)][1]["lowered_in_parallel"] == 2
