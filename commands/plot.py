"""PNG of a bench JSON: ms/token vs batch size for each mode (replay, eager, the bandwidth limit); for a
bench-serve JSON, its latency percentiles.

    python -m onegraph.commands.plot benchmarks/h200_35b.json      # -> benchmarks/h200_35b.png

Reads both shapes of bench JSON: `onegraph bench` ("decode" rows) and bench_big ("batches" rows).
matplotlib is an optional extra (`pip install -e '.[bench]'`); without it this says so and exits 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def series(res: dict) -> dict[str, list[tuple[int, float]]]:
    """-> {mode: [(batch, ms per token)]}; ms per token = ms per step / batch."""
    rows = res.get("batches") or res.get("decode") or []
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        B = r["batch"]
        for key, mode in (("replay_ms_per_step", "onegraph replay"), ("eager_ms_per_step", "onegraph eager"),
                          ("bandwidth_limit_ms", "bandwidth limit")):
            if r.get(key) is not None:
                out.setdefault(mode, []).append((B, r[key] / B))
    return out


def plot_serve(res: dict, png: Path) -> Path:
    """A bench-serve JSON (commands/bench_serve.py): TTFT, TPOT, ITL and e2e latency at p50/p90/p99 (ms)."""
    import matplotlib.pyplot as plt
    keys = [k for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") if (res.get(k) or {}).get("p50") is not None]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(2.2 * max(1, len(keys)) + 1, 3.4))
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, k in zip(axes, keys):
        qs = ("p50", "p90", "p99")
        ax.bar(qs, [res[k][q] for q in qs], color=("tab:blue", "tab:orange", "tab:red"))
        ax.set_title(k.replace("_ms", "").upper() + " (ms)", fontsize=9)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"{res.get('model')}: {res.get('completed')} done, {res.get('failed')} failed, "
                 f"{res.get('output_tok_s', 0):.1f} output tok/s, {res.get('requests_s', 0):.2f} req/s, "
                 f"concurrency {res.get('concurrency')}, rate {res.get('request_rate')}", fontsize=8)
    fig.text(0.01, 0.01, res.get("command", "")[:140], fontsize=5)
    fig.tight_layout(rect=(0, 0.04, 1, 0.93))
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def plot(json_path: str | Path, png_path: str | Path | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = json.loads(Path(json_path).read_text())
    png = Path(png_path) if png_path else Path(json_path).with_suffix(".png")
    if "ttft_ms" in res:
        return plot_serve(res, png)
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, pts in series(res).items():
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per token")
    ax.set_title(f"{res.get('gpu') or res.get('device', '')} decode", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.text(0.01, 0.01, res.get("command", "")[:110], fontsize=5)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m onegraph.commands.plot BENCH.json [OUT.png]", file=sys.stderr)
        return 2
    try:
        print(plot(*args))
    except ImportError:
        print("plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
