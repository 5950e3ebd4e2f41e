"""The GDN chunked prefill at the Qwen3.5-35B-A3B layer shape: onegraph's three kernels (`gdn_prefill_triton`:
_wy, _state, _out) beside flash-linear-attention's `chunk_gated_delta_rule` on the same inputs, per prompt length.

    python -m onegraph.scripts.bench_gdn_prefill --tokens 512,2048,8192 --out benchmarks/h200_gdn_prefill_fla.json

Both get one layer's post-conv q ‖ k ‖ v rows (bf16, [T, 2 HK K + HV V]), the log decay g and beta (fp32,
[T, HV]) and a nonzero initial state (fp32 [HV, K, V]); both L2-norm q, k and scale q by K^-0.5 themselves. The
figure is each call's device time, the sum of its kernels under the torch profiler (host time apart, so FLA's
Python launch path does not count against it), the median over --reps calls. The JSON also carries each side's
kernels by name and the largest output difference between them (fla's chunk products take tf32 or bf16 inputs,
ours fp32-accurate ones: a check that both computed the same thing, not a parity bound).
fla-core is a test-only oracle (pyproject.toml): carry its wheel to the GPU host.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from onegraph.scripts.bench_ops import GDN


def inputs(T: int, dev, seed: int = 0):
    """x [T, C] bf16, g, beta [T, HV] fp32 (decays from fast to slow across heads), state [1, HV, K, V] fp32."""
    HK, HV, K, V = (GDN[k] for k in ("HK", "HV", "K", "V"))
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, 2 * HK * K + HV * V, generator=gen, device=dev).to(torch.bfloat16)
    rate = torch.linspace(-5.0, 0.5, HV, device=dev).exp()
    g = -rate * torch.nn.functional.softplus(torch.randn(T, HV, generator=gen, device=dev))
    beta = torch.randn(T, HV, generator=gen, device=dev).sigmoid()
    state = torch.randn(1, HV, K, V, generator=gen, device=dev) * 0.5
    return x, g, beta, state


def ours(x, g, beta, state):
    import onegraph.custom_ops.triton  # noqa: F401  (registers the Triton lowerings)
    slot = torch.zeros(1, dtype=torch.int64, device=x.device)
    return lambda: torch.ops.onegraph.gdn_prefill_triton(x, g, beta, state, slot, GDN["HK"], 64)


def fla(x, g, beta, state):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    HK, HV, K, V = (GDN[k] for k in ("HK", "HV", "K", "V"))
    T = x.shape[0]
    q, k, v = x.split([HK * K, HK * K, HV * V], dim=-1)
    q, k, v = q.reshape(1, T, HK, K), k.reshape(1, T, HK, K), v.reshape(1, T, HV, V)
    return lambda: chunk_gated_delta_rule(q, k, v, g[None], beta[None], scale=K ** -0.5, initial_state=state,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)


def device_time(fn, reps: int) -> tuple[float, dict]:
    """Median device µs per call (its kernels' sum) and µs per call by kernel name."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per_call, by_name = [], {}
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        per_call.append(sum(e.device_time for e in events))
        for e in events:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time / reps
    top = dict(sorted(((n[:80], round(us, 1)) for n, us in by_name.items()), key=lambda kv: -kv[1])[:8])
    return round(statistics.median(per_call), 1), top


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=lambda v: [int(t) for t in v.split(",")], default=[512, 2048, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gdn_prefill: needs a CUDA device", file=sys.stderr)
        return 2
    try:
        import fla  # noqa: F401
    except ImportError:
        print("bench_gdn_prefill: needs flash-linear-attention (fla-core, a test-only oracle: carry its wheel)",
              file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    args = sys.argv[1:] if argv is None else argv
    res = {"command": "python -m onegraph.scripts.bench_gdn_prefill " + " ".join(args),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "fla": fla.__version__, "shape": GDN,
           "rows": []}
    for T in a.tokens:
        x, g, beta, state = inputs(T, dev)
        ours_fn, fla_fn = ours(x, g, beta, state), fla(x, g, beta, state)
        (o1, s1), (o2, s2) = ours_fn(), fla_fn()
        row = {"tokens": T}
        row["ours_us"], row["ours_kernels_us"] = device_time(ours_fn, a.reps)
        row["fla_us"], row["fla_kernels_us"] = device_time(fla_fn, a.reps)
        row["ours_over_fla"] = round(row["ours_us"] / row["fla_us"], 3)
        row["max_out_diff"] = round((o1.float() - o2[0].float()).abs().max().item(), 5)
        row["max_state_diff"] = round((s1.float() - s2.float()).abs().max().item(), 5)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
