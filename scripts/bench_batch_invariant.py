"""What `export --batch-invariant` costs per op at the Qwen3.5-35B-A3B shape (bf16, one H200): each decode op's
default Triton lowering against its batch-invariant variant, at batches 1, 8 and 64, each timed as the mean of
CUDA-graph replays of CALLS calls (2 weight copies alternated, so the big weights are not all L2-resident), and
summed per decode step by how many times the 40-layer model calls it (30 GDN layers, 10 attention layers, 40 MoE
blocks, one lm_head; the sampler has one plan at every batch, so no variant). A sum of isolated kernels, not a
replayed step: the JSON says so.

    python -m onegraph.scripts.bench_batch_invariant --out OUT.json [--batches 1,8,64] [--quant fp8]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

CALLS, REPLAYS = 10, 20
BF = torch.bfloat16


def rand(*shape, scale=1.0, dtype=BF):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def cases(B: int, fp8: bool = False):
    """(name, calls per 35B decode step, default op, invariant op, make inputs -> args); fp8: the block-FP8 model's
    (--quant fp8 --fp8-lm-head) projections, experts and head in place of the bf16 ones."""
    ops = torch.ops.onegraph
    H, E, K_, I = 2048, 256, 8, 512
    Tmax, pos = 4096, 1024

    def lin(N, K):
        return lambda: (rand(B, K), rand(N, K, scale=K ** -0.5))

    def router():
        return (rand(B, H), rand(B, H), rand(H, scale=0.1), 1e-6, rand(E + 1, H, scale=H ** -0.5))

    def moe():
        return (rand(B, H), rand(B, E + 1), rand(E, 2 * I, H, scale=H ** -0.5), rand(E, H, I, scale=I ** -0.5),
                rand(I, H, scale=H ** -0.5), rand(I, H, scale=H ** -0.5), rand(H, I, scale=I ** -0.5), K_)

    def attn():
        S = B + 1
        return (rand(B, 16, 256), rand(S, 2, Tmax, 256), rand(S, 2, Tmax, 256),
                torch.arange(B, device="cuda"), torch.full((B,), pos, device="cuda"), 256 ** -0.5, rand(B, 16, 256))

    def gdn():
        HK, HV, K, V, W = 16, 32, 128, 128, 4
        C = 2 * HK * K + HV * V
        return (rand(B, C), rand(B, HV), rand(B, HV), rand(B, HV * V), rand(B + 1, C, W - 1),
                rand(B + 1, HV, K, V, scale=0.5, dtype=torch.float32), torch.arange(B, device="cuda"),
                rand(C, W, scale=0.5), rand(HV, scale=0.5), rand(HV), rand(V), HK, 1e-6)

    rest = [("router add_rms_norm_linear [257, 2048]", 40, ops.add_rms_norm_linear_triton,
             ops.add_rms_norm_linear_invariant_triton, router),
            ("gdn_decode_step_norm", 30, ops.gdn_decode_step_norm_triton, ops.gdn_decode_step_norm_invariant_triton,
             gdn),
            ("attention_decode at 1024 keys", 10, ops.attention_decode_triton, ops.attention_decode_invariant_triton,
             attn)]
    if fp8:
        return fp8_cases(B, ops) + rest
    return [("gdn_in_proj linear [12352, 2048]", 30, ops.linear_triton, ops.linear_invariant_triton, lin(12352, 2048)),
            ("attn_qkv linear [9216, 2048]", 10, ops.linear_triton, ops.linear_invariant_triton, lin(9216, 2048)),
            ("out/o_proj linear [2048, 4096]", 40, ops.linear_triton, ops.linear_invariant_triton, lin(2048, 4096)),
            ("fused_moe 256 experts top-8", 40, ops.fused_moe_triton, ops.fused_moe_invariant_triton, moe),
            ("lm_head linear [248320, 2048]", 1, ops.linear_triton, ops.linear_invariant_triton,
             lin(248320, 2048))] + rest


def fp8_cases(B, ops):
    """The block-FP8 model's projections (the GDN one with its float [b; a] tail), experts and lm_head."""
    from onegraph.checkpoint.quant import quantize
    H, E, K_, I = 2048, 256, 8, 512
    lin8, inv8 = ops.linear_fp8_triton, ops.linear_fp8_invariant_triton

    def lin(N, K, tail=0):
        def make():
            w, s = quantize(rand(N, K, scale=K ** -0.5))
            return (rand(B, K), w, s, rand(tail, K, scale=K ** -0.5) if tail else None)
        return make

    def moe():
        ws = [quantize(w) for w in (rand(E, 2 * I, H, scale=H ** -0.5), rand(E, H, I, scale=I ** -0.5),
                                    rand(I, H, scale=H ** -0.5), rand(I, H, scale=H ** -0.5), rand(H, I, scale=I ** -0.5))]
        return (rand(B, H), rand(B, E + 1), *[t for w in ws for t in w], K_)

    return [("gdn_in_proj linear_fp8 [12288, 2048] + tail 64", 30, lin8, inv8, lin(12288, 2048, 64)),
            ("attn_qkv linear_fp8 [9216, 2048]", 10, lin8, inv8, lin(9216, 2048)),
            ("out/o_proj linear_fp8 [2048, 4096]", 40, lin8, inv8, lin(2048, 4096)),
            ("fused_moe_fp8 256 experts top-8", 40, ops.fused_moe_fp8_triton, ops.fused_moe_fp8_invariant_triton, moe),
            ("lm_head linear_fp8 [248320, 2048]", 1, lin8, inv8, lin(248320, 2048))]


def time_us(op, inputs) -> float:
    """Mean µs per call: CALLS calls alternating two input sets in one CUDA graph, replayed REPLAYS times."""
    for args in inputs:
        op(*args)
    torch.cuda.synchronize()
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(s):
        op(*inputs[0])
        with torch.cuda.graph(g, stream=s):
            for i in range(CALLS):
                op(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quant", choices=("none", "fp8"), default="none",
                    help="fp8: the block-FP8 projections, experts and lm_head (--quant fp8 --fp8-lm-head)")
    a = ap.parse_args()
    import onegraph.custom_ops.triton  # noqa: F401  (registers the Triton ops)
    torch.manual_seed(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"command": f"python -m onegraph.scripts.bench_batch_invariant --batches {a.batches} --quant {a.quant} "
                      "--out OUT.json", "quant": a.quant,
           "gpu": torch.cuda.get_device_name(), "commit": commit, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "method": f"each op alone, {CALLS} calls per CUDA graph over 2 input copies, {REPLAYS} replays; the step sum "
                     "weights each op by its calls per 40-layer decode step. Isolated kernels, not a replayed step: "
                     "the batch-1 default also folds the layer-input norms into the projections (not counted here)",
           "batches": {}}
    for B in map(int, a.batches.split(",")):
        rows, tot = {}, {"default_us": 0.0, "invariant_us": 0.0}
        for name, n, dflt, inv, make in cases(B, a.quant == "fp8"):
            inputs = [make(), make()]
            d, i = time_us(dflt, inputs), time_us(inv, inputs)
            rows[name] = {"calls_per_step": n, "default_us": round(d, 2), "invariant_us": round(i, 2)}
            tot["default_us"] += n * d
            tot["invariant_us"] += n * i
            del inputs
            torch.cuda.empty_cache()
            print(f"B={B:<3} {name:<42} default {d:8.2f} us  invariant {i:8.2f} us", flush=True)
        tot = {k: round(v, 1) for k, v in tot.items()}
        tot["cost_pct"] = round(100 * (tot["invariant_us"] / tot["default_us"] - 1), 1)
        res["batches"][str(B)] = {"ops": rows, "step_sum": tot}
        print(f"B={B}: step sum default {tot['default_us']} us, invariant {tot['invariant_us']} us "
              f"({tot['cost_pct']:+} %)", flush=True)
        with open(a.out, "w") as f:                  # after each batch: a run cut short keeps what it measured
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
