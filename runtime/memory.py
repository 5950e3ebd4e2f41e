"""Memory sizing of an artifact's engine: what `max_slots` slots need, what the device has free, and a
refusal at load (before the weights or the state are allocated) of a slot count that does not fit — never
an out-of-memory error in the middle of a request.

    needed(S) = weights + (S + 1) x state_per_slot + workspace

state_per_slot: the manifest's state tensors without their slot dimension (KV cache [KVH, Tmax, D] per
full-attention layer, GDN conv [C, k-1] and recurrent [HV, K, V] fp32 per linear layer, the speculative
head's state where exported); S + 1: the scratch slot padding rows write. weights: this rank's weights file.
workspace: an estimate of the activations the graphs allocate while they run (below). Free memory:
torch.cuda.mem_get_info on CUDA, MemAvailable of /proc/meminfo on a CPU (or the OS page counts).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from onegraph.graphs.signature import torch_dtype

from .artifact import tp_size

MIB = 1 << 20
SLACK = 256 * MIB          # allocator fragmentation, runtime buffers (staging, last_tok, rings), CUDA graph pools


class DoesNotFit(ValueError):
    """The slot count does not fit in the device's free memory; the message names both numbers."""


def state_bytes_per_slot(state: list[dict]) -> int:
    """Bytes of one slot of the manifest's state ([{name, shape ["S", ...], dtype}])."""
    return sum(math.prod(t["shape"][1:]) * torch_dtype(t["dtype"]).itemsize for t in state)


def weight_bytes(path: Path, manifest: dict, rank: int = 0) -> int:
    """This rank's weights file, as loaded onto the device (safetensors: the bytes plus a small header);
    referenced weights (runtime/weight_refs.py): the bytes the export recorded of those it made."""
    if manifest.get("weights_reference") is not None:
        return manifest["weights_reference"]["bytes"][rank]
    f = Path(path) / manifest["weights"].format(rank=rank)
    return f.stat().st_size if f.is_file() else 0


def workspace_bytes(manifest: dict, device_type: str) -> int:
    """An upper-end estimate of the activations of the largest graph call, fp32 throughout:
    rows = the largest prefill chunk T (or decode bucket x (K + 1) of a speculative round), each with the
    logits [V], the MLP's intermediates (gate, up, act: 3 x top_k x I routed, or 3 x I dense) and router
    [E], and 16 hidden-sized buffers;
    on a CPU the reference attention also materialises scores and probabilities [H, rows, Tmax] (the CUDA
    kernels stream over the cache and keep no such tensor); on CUDA each captured decode bucket keeps its
    own memory pool (runtime/cuda_graphs.py), so each bucket's B rows are counted once more; plus SLACK."""
    cfg, graphs = manifest["model"], manifest["graphs"].values()
    k = manifest.get("speculative_tokens", 0)
    rows = max([g["bucket"] for g in graphs if g["kind"] == "prefill"]
               + [g["bucket"] * (k + 1) for g in graphs if g["kind"] in ("decode", "spec")])
    tp = tp_size(manifest)
    ffn = cfg.get("top_k", 0) * cfg.get("moe_intermediate", 0) + cfg.get("intermediate_size", 0)   # MoE or dense
    per_row = cfg["vocab_size"] + 16 * cfg["hidden_size"] + cfg.get("num_experts", 0) + 3 * ffn // tp
    act = 2 * rows * per_row * 4
    scores = 2 * (cfg["num_heads"] // tp) * rows * manifest["max_seq_len"] * 4 if device_type == "cpu" else 0
    pools = sum(2 * g["bucket"] * per_row * 4 for g in graphs if g["kind"] == "decode") if device_type == "cuda" else 0
    return act + scores + pools + SLACK


def needed_bytes(path: Path, manifest: dict, max_slots: int, device_type: str, rank: int = 0) -> dict:
    """{weights, state_per_slot, state, workspace, total} in bytes for max_slots slots."""
    per = state_bytes_per_slot(manifest["state"])
    w, ws = weight_bytes(path, manifest, rank), workspace_bytes(manifest, device_type)
    return {"weights": w, "state_per_slot": per, "state": (max_slots + 1) * per, "workspace": ws,
            "total": w + (max_slots + 1) * per + ws}


def free_bytes(device: torch.device) -> int:
    """Memory free for this engine on `device`: the CUDA allocator's free bytes, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def max_slots_fitting(path: Path, manifest: dict, free: int, device_type: str, rank: int = 0) -> int:
    """The largest slot count whose needed_bytes fits in `free` (0: not even one slot)."""
    fixed = needed_bytes(path, manifest, 0, device_type, rank)
    per = fixed["state_per_slot"]
    return max(0, (free - fixed["total"]) // per) if per else 0


def max_seq_len_fitting(path: Path, manifest: dict, free: int, device_type: str, max_slots: int,
                        rank: int = 0) -> int:
    """The largest --max-seq-len an export of this model could take for `max_slots` slots in `free` bytes (0:
    none): the KV caches ([S, KVH, Tmax, D] tensors, named *_cache) grow with it, the GDN state does not. The
    workspace is this artifact's (on a CPU its attention scores grow with Tmax too: there, an estimate); capped
    at the model's max_position_embeddings."""
    per_token = sum(math.prod(t["shape"][1:]) * torch_dtype(t["dtype"]).itemsize
                    for t in manifest["state"] if t["kind"] == "kv") // manifest["max_seq_len"]
    fixed = state_bytes_per_slot(manifest["state"]) - per_token * manifest["max_seq_len"]
    base = needed_bytes(path, manifest, 0, device_type, rank)
    room = (free - base["weights"] - base["workspace"]) // (max_slots + 1) - fixed
    cap = manifest["model"].get("max_position_embeddings", 1 << 30)
    return max(0, min(cap, room // per_token if per_token else cap))


def size(n: int) -> str:
    """Bytes for a message: GiB from 1 GiB up, else MiB (two decimals)."""
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / MIB:.2f} MiB"


def check_fits(path: Path, manifest: dict, max_slots: int, device: torch.device, free: int | None = None,
               rank: int = 0) -> dict:
    """Refuse (DoesNotFit) `max_slots` slots that do not fit in `free` bytes (default: free_bytes(device))
    -> needed_bytes(...) with the free bytes, when they fit."""
    need = needed_bytes(path, manifest, max_slots, device.type, rank)
    free = free_bytes(device) if free is None else free
    if need["total"] > free:
        fit = max_slots_fitting(path, manifest, free, device.type, rank)
        raise DoesNotFit(
            f"--max-slots {max_slots} at max_seq_len {manifest['max_seq_len']} needs {size(need['total'])} on "
            f"{device.type} (weights {size(need['weights'])} + {max_slots + 1} x {need['state_per_slot'] / MIB:.2f} "
            f"MiB state per slot, scratch slot included, + workspace {size(need['workspace'])}), but "
            f"{size(free)} is free: " + (f"at most --max-slots {fit} fits" if fit else
                                         "not even one slot fits: export a smaller --max-seq-len or use a larger device"))
    return dict(need, free=free)
