"""Making referenced weights (export --weights reference) with the checkpoint hashed first, then read again by the
recipe (the previous load: Artifact.load's verify_files, then load_weights' rebuild), against one pass (the hashes
computed in threads while the recipe reads the same files: Artifact.load(defer_sha256=True)).

    python -m onegraph.tools.bench_weights_load --out benchmarks/cpu_weights_reference_one_pass.json
        [--dir /tmp/onegraph-bench-ckpt] [--hidden 1024] [--experts 32] [--shards 4] [--repeats 5]

The checkpoint: tiny's config (graphs/tiny.py) widened to --hidden / --experts, seeded random bf16 weights in
--shards safetensors files with model.safetensors.index.json, the recipe bfloat16. Each run is timed cold (every
checkpoint file's pages dropped from the page cache with posix_fadvise DONTNEED: this process's own files, no
root, the rest of the page cache untouched) and warm; the runs alternate and the median is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def write(out: Path, hidden: int, experts: int, shards: int) -> Path:
    from safetensors.torch import save_file

    from onegraph.graphs.config import ModelConfig
    from onegraph.graphs.qwen3_5 import Qwen35Model
    from onegraph.graphs.tiny import TINY_HF_CONFIG, random_hf_weights, write_checkpoint
    cfg = dict(TINY_HF_CONFIG, hidden_size=hidden, num_experts=experts, moe_intermediate_size=hidden // 2,
               shared_expert_intermediate_size=hidden // 2, dtype="bfloat16")
    if (out / "config.json").is_file() and json.loads((out / "config.json").read_text()) == cfg:
        return out                                     # written by an earlier run with these options
    with torch.device("meta"):
        model = Qwen35Model(ModelConfig.from_hf(cfg))
    tensors = {k: v.to(torch.bfloat16) for k, v in random_hf_weights(model, 0).items()}
    write_checkpoint(out, {}, cfg)                     # config, tokenizer; the weights follow, sharded
    (out / "model.safetensors").unlink()
    keys, total = sorted(tensors), sum(t.nbytes for t in tensors.values())
    parts, acc = [[]], 0
    for k in keys:                                     # about total / shards bytes per file
        if acc >= total * len(parts) / shards and len(parts) < shards:
            parts.append([])
        parts[-1].append(k)
        acc += tensors[k].nbytes
    weight_map = {}
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    return out


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)                               # dirty pages (a file just written) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", default="/tmp/onegraph-bench-ckpt")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    from onegraph.export.pipeline import reference
    from onegraph.graphs.recipe import graph_weights, recipe_of, tensors_sha256
    from onegraph.runtime.artifact import sha256_file
    from onegraph.runtime.weight_refs import check_files, rebuild, verify_files
    root = write(Path(args.dir), args.hidden, args.experts, args.shards)
    recipe = recipe_of("bfloat16", "none", False, False, False, 1)
    w = graph_weights(root, recipe)
    ref = reference(root, root, recipe, [tensors_sha256(w)], [sum(t.nbytes for t in w.values())])
    files = [root / r for r in sorted(ref["files"])]
    ckpt_bytes = sum(f.stat().st_size for f in files)
    del w

    def previous(t):
        t0 = time.perf_counter()
        verify_files(ref)
        t["verify_files"] = time.perf_counter() - t0
        rebuild(ref, 0, files_verified=True, timings=t)

    def one_pass(t):
        check_files(ref)
        rebuild(ref, 0, files_verified=False, timings=t)

    def hash_only(t):
        for f in files:
            sha256_file(f)

    runs: dict = {}
    for _ in range(args.repeats):
        for cold in (True, False):
            for name, fn in (("previous", previous), ("one_pass", one_pass), ("sha256_only_1_thread", hash_only)):
                if cold:
                    drop_cache(files)
                t: dict = {}
                t0 = time.perf_counter()
                fn(t)
                t["total"] = time.perf_counter() - t0
                runs.setdefault(f"{name}_{'cold' if cold else 'warm'}", []).append(t)
    med = {k: {s: round(statistics.median(r[s] for r in v), 3) for s in v[0]} for k, v in runs.items()}
    res = {"command": "python -m onegraph.tools.bench_weights_load " + " ".join(sys.argv[1:] if argv is None else argv),
           "checkpoint": {"files": len(files), "bytes": ckpt_bytes, "hidden": args.hidden, "experts": args.experts,
                          "dtype": "bfloat16"},
           "cores": os.cpu_count(), "load_average_after": os.getloadavg()[0], "torch": torch.__version__,
           "repeats": args.repeats, "median_s": med,
           "note": "previous = verify_files (sha256 of every file, threads) then rebuild(files_verified=True); "
                   "one_pass = check_files then rebuild(files_verified=False): the files hashed in threads while "
                   "the recipe reads them; cold: the checkpoint's pages dropped from the page cache first"}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["median_s"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
