"""What the bench tools share (commands/bench.py and the scripts/ that measure), so none
imports another for it: a result printed and written as JSON, a device sync for timers, a captured graph's
replay time, the weight and state bytes a decode step moves, the kernel-name regions of a profiled decode step, transformers' decode time, and a random
model of a known shape (bench_symbolic_batch.py, bench_lower_set.py)."""
from __future__ import annotations

import json
import time

import torch

# kernel-name patterns -> region of the decode step (first match wins). Hand-written Triton kernels carry
# their op's name (sampling: _scan_kernel, _pick_kernel); cuBLAS GEMMs are the projections (lm_head is told
# apart as the largest one per step; the MoE router's GEMM is one of them); Inductor's generated kernels are
# named after the aten ops they fuse. The router's torch.topk runs as aten's gatherTopK + bitonicSortKV, a region
# of its own: the sampling patterns name the sample op's two kernels exactly, so no sort is counted as sampling.
# The MoE's kernels: the decode pair (_moe_*), and where B * top_k > E the grouped path's routing, pair table,
# grouped GEMMs and combine (custom_ops/triton/fused_moe_prefill.py).
REGIONS = (("attention", ("_attn", "attention")),          # first: the MoE's "_combine_kernel" is in "_attn_combine_kernel"
           ("moe", ("_moe_", "_grouped_", "_pair_table_kernel", "_route_kernel", "_combine_kernel")),
           ("moe_router_topk", ("topk", "bitonicsort")), ("gdn", ("_gdn_",)), ("norms", ("_rms", "norm")),
           ("sampling", ("_scan_kernel", "_pick_kernel")),
           ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "xmma", "splitk", "_fp8_kernel", "_w8a8_kernel")),
           ("inductor_other", ("triton_",)))


def bytes_per_step(model, B: int) -> int:
    """Weights read by one decode step: all dense weights, one embedding row per token, and the
    experts the batch touches (expected distinct experts under uniform routing)."""
    cfg = model.cfg
    total = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.startswith("mtp."):
            continue
        if name.endswith("embed_tokens.weight"):
            nbytes = B * p.shape[1] * p.element_size()
        elif ".experts." in name:
            touched = cfg.num_experts * (1 - (1 - cfg.top_k / cfg.num_experts) ** B)
            nbytes = int(nbytes * touched / cfg.num_experts)
        total += nbytes
    return total


def state_bytes_per_step(model, B: int, position: int) -> int:
    """State bytes a decode step of B rows at `position` moves: each GDN layer's conv and recurrent state rows
    read and written whole, each attention layer's K and V rows read up to the position and one row written."""
    from onegraph.models.qwen3_5.model import state_spec
    dtype = model.embed_tokens.weight.dtype
    total = 0
    for t in state_spec(model.cfg, 1, position + 1, dtype, model.tp):     # one slot, position + 1 rows of KV
        row = t.dtype.itemsize
        for n in t.shape[1:]:
            row *= n
        total += row if t.name.endswith("_cache") else 2 * row
    return B * total


def emit(res: dict, out: str | None) -> None:
    """Print a result as indented JSON and, when `out` is given, write the same text there (folders made)."""
    from pathlib import Path
    text = json.dumps(res, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text)


def sync(device) -> None:
    """Wait for the device (CUDA) before reading a timer; a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def replay_us(graph, warmup: int, iters: int) -> float:
    """µs per replay of a captured torch.cuda.CUDAGraph: `warmup` replays, then CUDA events around `iters`."""
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def hf_decode_ms(model, B: int, steps: int, device, prompt_len: int = 3) -> float:
    """ms per greedy decode step of a transformers model at batch B, after a prompt_len-token prefill."""
    ids = torch.arange(1, prompt_len + 1, device=device).repeat(B, 1)                # [B, prompt_len]
    out = model(input_ids=ids, use_cache=True)
    cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    for _ in range(3):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    sync(device)
    return (time.perf_counter() - t) / steps * 1e3


# --shape -> models/qwen3_5/tiny.py config (bench_big names the 35B shape in full)
SHAPES = {"35b": "QWEN35_35B_A3B_HF_CONFIG", "qwen3.5-35b-a3b": "QWEN35_35B_A3B_HF_CONFIG", "tiny": "TINY_HF_CONFIG"}


def shape_config(shape: str, layers: int) -> tuple[dict, int]:
    """A known shape's HF config -> (config, its full layer count). layers > 0 keeps the first `layers` decoder
    layers (the config's layer pattern; 4 = one 3 GDN + 1 attention unit of the 35B model); ValueError else."""
    from onegraph.models.qwen3_5 import tiny
    hf = dict(getattr(tiny, SHAPES[shape]))
    full = hf["num_hidden_layers"]
    if not 0 <= layers <= full:
        raise ValueError(f"--layers must be in 1..{full} for the {shape} shape, got {layers}")
    if layers:
        hf["num_hidden_layers"] = layers
        if "layer_types" in hf:
            hf["layer_types"] = hf["layer_types"][:layers]
    return hf, full


def random_shape_model(shape: str, layers: int, dtype: torch.dtype, device):
    """A seeded random model of a known shape (35b: Qwen3.5-35B-A3B, 69 GB in bf16; tiny), its projections
    fused as export fuses them -> (model, layers_full); layers: see shape_config."""
    from onegraph.models.qwen3_5 import tiny
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.models.qwen3_5.fuse import fuse_projections
    hf, full = shape_config(shape, layers)
    model = tiny.random_model(ModelConfig.from_hf(hf), dtype, device)
    return fuse_projections(model), full
