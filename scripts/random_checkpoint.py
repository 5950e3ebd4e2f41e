"""Write a Qwen3.5-MoE checkpoint of a given shape with seeded random weights: the hub's key names and
shapes (per-expert `mlp.experts.E.{gate,up,down}_proj.weight`, the `mtp.*` head), sharded safetensors with
`model.safetensors.index.json`, config.json, a byte-level tokenizer; bf16, or with --fp8 the official
Qwen -FP8 layout (checkpoint/quant.py). For running the real-scale path (export, load, serve) where the real
weights cannot be downloaded.

    python -m onegraph.scripts.random_checkpoint --shape 35b|tiny --out DIR [--fp8] [--seed S]
        [--device cpu|cuda] [--shard-gb 5] [--router random|decisive]

Shapes: `35b` is models/qwen3_5/tiny.py QWEN35_35B_A3B_HF_CONFIG (the Qwen3.5-35B-A3B text model) plus a one-layer MTP
head; `tiny` is the builtin tiny model's config. Key names and shapes come from the model itself
(models/qwen3_5/model.py Qwen35Model and models/qwen3_5/mtp.py MtpHead on the meta device, named as models/qwen3_5/tiny.py
hf_tensors names them), so the loader reads the result strictly.

Values (models/qwen3_5/tiny.py randomise_'s scales: O(1) activations, greedy ids not dominated by ties): A_log =
log U(1, 16), dt_bias U(-1, 1), other vectors (zero-centred norms: 1 + w) N(0, 0.1), matrices
N(0, fan_in^-1/2); drawn in fp32 from a generator seeded by (seed, key), so a tensor does not depend on the
order of writing, then rounded to bf16. The same --seed and --device give byte-identical files (CPU and CUDA
generators differ, so the device is recorded).

--router decisive (default `random`: the values above): random routers have top-k margins of ~1e-4 (35B:
256 experts, top-8, 40 layers), so bf16 rounding differences between an artifact's graphs and eager flip
routing choices in every prompt and its load-time parity fixture can compare nothing. models/qwen3_5/decisive.py's
rule then edits the drawn values (a few constant sign channels of the embedding that only the routers read;
each layer's router sends a token to the top_k experts seeded for its sign pattern, by a margin of several
logits; every tensor otherwise random, same keys, shapes, dtypes and config.json). The choice is recorded in
random_checkpoint.json.

--fp8: exactly what `--quant fp8` makes of the bf16 checkpoint of the same seed (checkpoint/quant.py `quantize` of
the bf16 values): e4m3 `X.weight` + fp32 `X.weight_scale_inv` per 128x128 block for the main layers' GDN
in_proj_qkv / in_proj_z / out_proj, attention q/k/v/o, routed experts and shared expert; kept bf16 (and named
in `modules_to_not_convert`): embeddings, lm_head, norms, the routers `mlp.gate` / `shared_expert_gate`, GDN
in_proj_a / in_proj_b, conv1d, A_log, dt_bias, and the MTP head (checkpoint/load.py runs it float: its e4m3
weights would be dequantized at load).

Streamed: one tensor at a time is generated (on --device), quantized, copied to host and appended to its
shard, which is written straight in the safetensors format (header first, from the plan), so memory holds a
few tensors, never the model (35B: 69 GB bf16, 35 GB FP8). Refuses a non-empty output directory and a disk
without room for the planned bytes. Records random_checkpoint.json (command, seed, shape, bytes, seconds).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import queue
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from onegraph.checkpoint import quant

SHAPES = ("35b", "tiny")
MTP_LAYERS = 1
# main-layer weights written e4m3 with --fp8 (hub names): what quant.quantize_model quantizes
FP8_KEY = re.compile(
    r"^model\.layers\.\d+\.(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|self_attn\.[qkvo]_proj"
    r"|mlp\.experts\.\d+\.(gate|up|down)_proj|mlp\.shared_expert\.(gate|up|down)_proj)\.weight$")
ST_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", quant.FP8: "F8_E4M3"}
EXTRA_FILES_BYTES = 64 << 20        # config, tokenizer (35B: a 248k-entry vocab, ~6 MB) and index, with room


class RandomCheckpointError(ValueError):
    pass


def hf_config(shape: str, fp8: bool) -> dict:
    """config.json: the shape's hub fields, an MTP head, bf16; with fp8 the official quantization_config."""
    from onegraph.models.qwen3_5.tiny import EOS_IDS, QWEN35_35B_A3B_HF_CONFIG, TINY_HF_CONFIG
    if shape not in SHAPES:
        raise RandomCheckpointError(f"--shape must be one of {list(SHAPES)}, got {shape!r}")
    cfg = dict(TINY_HF_CONFIG if shape == "tiny" else QWEN35_35B_A3B_HF_CONFIG)
    cfg.update(architectures=["Qwen3_5MoeForCausalLM"], mtp_num_hidden_layers=MTP_LAYERS, dtype="bfloat16",
               eos_token_id=EOS_IDS, tie_word_embeddings=False)
    if fp8:
        cfg["quantization_config"] = {"quant_method": quant.METHOD, "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [quant.BLOCK, quant.BLOCK],
                                      "modules_to_not_convert": not_converted(cfg)}
    return cfg


def not_converted(cfg: dict) -> list[str]:
    """The Linear-like modules kept bf16 (Qwen3-Next -FP8's list: per-layer names; the MTP head whole)."""
    from onegraph.models.qwen3_5.config import ModelConfig
    c = ModelConfig.from_hf(cfg)
    out = ["lm_head", "model.embed_tokens", "mtp"]
    for i, kind in enumerate(c.layer_types):
        if kind == "linear_attention":
            out += [f"model.layers.{i}.linear_attn.in_proj_a", f"model.layers.{i}.linear_attn.in_proj_b"]
        out += [f"model.layers.{i}.mlp.gate", f"model.layers.{i}.mlp.shared_expert_gate"]
    return out


def float_plan(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Hub key -> shape of every float tensor of the model + MTP head, in the model's order (meta tensors only)."""
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.checkpoint.load import meta_model
    from onegraph.models.qwen3_5.mtp import MtpHead
    from onegraph.models.qwen3_5.tiny import hf_tensors
    c = ModelConfig.from_hf(cfg)
    model = meta_model(c)
    with torch.device("meta"):
        head = MtpHead(c, int(cfg.get("mtp_num_hidden_layers", 0))) if cfg.get("mtp_num_hidden_layers") else None
    named = dict(model.named_parameters())
    if head is not None:
        named.update({f"mtp.{n}": p for n, p in head.named_parameters()})
    return {k: tuple(t.shape) for k, t in hf_tensors(named).items()}


def plan(cfg: dict, fp8: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Hub key -> (shape, dtype) of every tensor written; an e4m3 weight is followed by its weight_scale_inv."""
    out = {}
    for key, shape in float_plan(cfg).items():
        if fp8 and FP8_KEY.match(key):
            out[key] = (shape, quant.FP8)
            out[key[: -len("weight")] + quant.SCALE] = (quant.scale_shape(shape), torch.float32)
        else:
            out[key] = (shape, torch.bfloat16)
    return out


def nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def shards(p: dict, shard_bytes: int) -> list[list[str]]:
    """Keys in plan order cut into shards of at most shard_bytes (a bigger tensor alone in its shard); a weight
    and its scale share a shard."""
    out, cur, size = [], [], 0
    for key in p:
        n = nbytes(*p[key])
        if cur and size + n > shard_bytes and not key.endswith(quant.SCALE):
            out.append(cur)
            cur, size = [], 0
        cur.append(key)
        size += n
    if cur:
        out.append(cur)
    return out


def tensor_seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def random_tensor(key: str, shape, seed: int, device, decisive: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The bf16 value of `key` (models/qwen3_5/tiny.py randomise_'s rule by name), drawn in fp32 on `device`;
    decisive = (hidden_size, experts, top_k): then models/qwen3_5/decisive.py's rule on the fp32 values."""
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, key))
    t = torch.empty(shape, dtype=torch.float32, device=device)
    if key.endswith("A_log"):
        t = t.uniform_(1.0, 16.0, generator=gen).log_()
    elif key.endswith("dt_bias"):
        t.uniform_(-1.0, 1.0, generator=gen)
    elif len(shape) == 1:
        t.normal_(0.0, 0.1, generator=gen)
    else:
        t.normal_(0.0, shape[-1] ** -0.5, generator=gen)
    if decisive is not None:
        from onegraph.models.qwen3_5.decisive import apply_
        apply_(key, t, *decisive, seed)
    return t.to(torch.bfloat16)


def tensors_of(key: str, shape, seed: int, device, fp8: bool, decisive: tuple[int, int, int] | None = None):
    """-> [(hub key, host tensor)]: the bf16 tensor, or with fp8 (for FP8_KEY) e4m3 + its block scales."""
    t = random_tensor(key, shape, seed, device, decisive)
    if fp8 and FP8_KEY.match(key):
        q, s = quant.quantize(t)
        return [(key, q.cpu()), (key[: -len("weight")] + quant.SCALE, s.cpu())]
    return [(key, t.cpu())]


def header(p: dict, keys: list[str]) -> bytes:
    """The safetensors header of a shard holding `keys` in order (8-byte length, JSON padded to 8 bytes)."""
    meta, off = {"__metadata__": {"format": "pt"}}, 0
    for k in keys:
        shape, dtype = p[k]
        n = nbytes(shape, dtype)
        meta[k] = {"dtype": ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    js = json.dumps(meta, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return len(js).to_bytes(8, "little") + js


def tokenizer(vocab: int):
    """tiny's byte-level tokenizer (models/qwen3_5/tiny.py) with its vocabulary padded to `vocab` ids: ids 0..263 as
    tiny's, then `<extra_i>` entries that encoding never produces (no merges) and that decode as their text."""
    from onegraph.models.qwen3_5.tiny import VOCAB, tiny_tokenizer
    if vocab < VOCAB:
        raise RandomCheckpointError(f"vocab_size {vocab} is below the byte tokenizer's {VOCAB} ids")
    return tiny_tokenizer(extra=vocab - VOCAB)


def write_text_files(out: Path, cfg: dict) -> None:
    from onegraph.models.qwen3_5.tiny import CHAT_TEMPLATE
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tokenizer(cfg["vocab_size"]).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|pad|>", "bos_token": None,
        "model_max_length": cfg["max_position_embeddings"]}, indent=2))


def check_target(out: Path, need: int) -> None:
    """Refuse a non-empty directory and a filesystem without `need` bytes free (names both numbers)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RandomCheckpointError(f"--out {str(out)!r} exists and is not an empty directory: refusing to write "
                                    f"into it")
    probe = out if out.exists() else next(p for p in out.absolute().parents if p.exists())
    free = shutil.disk_usage(probe).free
    if free < need:
        raise RandomCheckpointError(f"not enough disk space at {str(probe)!r}: {free:,} bytes free "
                                    f"({free / 1e9:.2f} GB), the checkpoint needs {need:,} bytes "
                                    f"({need / 1e9:.2f} GB)")


def write(shape: str, out: str | Path, fp8: bool = False, seed: int = 0, device: str = "cpu",
          shard_gb: float = 5.0, command: str | None = None, router: str = "random") -> dict:
    """Write the checkpoint; -> the record also saved as random_checkpoint.json. router: "random" or
    "decisive" (the module docstring)."""
    from onegraph.models.qwen3_5.decisive import ROUTERS
    if router not in ROUTERS:
        raise RandomCheckpointError(f"--router must be one of {list(ROUTERS)}, got {router!r}")
    t0 = time.time()
    out, dev = Path(out), torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RandomCheckpointError("--device cuda but CUDA is not available")
    if shard_gb <= 0:
        raise RandomCheckpointError(f"--shard-gb must be positive, got {shard_gb}")
    cfg = hf_config(shape, fp8)
    p = plan(cfg, fp8)
    total = sum(nbytes(*v) for v in p.values())
    groups = shards(p, int(shard_gb * 1e9))
    heads = [header(p, g) for g in groups]
    check_target(out, total + sum(map(len, heads)) + EXTRA_FILES_BYTES)
    out.mkdir(parents=True, exist_ok=True)
    write_text_files(out, cfg)
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    decisive = ((cfg["hidden_size"], cfg["num_experts"], cfg["num_experts_per_tok"]) if router == "decisive"
                else None)
    written = _write_shards(out, p, groups, heads, names, seed, dev, fp8, decisive)
    weight_map = {k: names[i] for i, g in enumerate(groups) for k in g}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    params = {"all": sum(math.prod(s) for k, (s, _) in p.items() if not k.endswith(quant.SCALE))}
    params["mtp"] = sum(math.prod(s) for k, (s, _) in p.items() if k.startswith("mtp."))
    rec = {"command": command, "shape": shape, "fp8": fp8, "seed": seed, "router": router, "device": str(dev),
           "torch": torch.__version__, "tensors": len(p), "shards": len(groups), "weight_bytes": total,
           "bytes_written": written + sum(f.stat().st_size for f in out.iterdir() if not f.suffix == ".safetensors"),
           "params": params["all"], "params_excl_mtp": params["all"] - params["mtp"],
           "seconds": round(time.time() - t0, 2)}
    (out / "random_checkpoint.json").write_text(json.dumps(rec, indent=2) + "\n")
    return rec


def _write_shards(out: Path, p, groups, heads, names, seed, dev, fp8, decisive=None) -> int:
    """Generation (this thread) overlapped with file writes (a writer thread, a few tensors queued); each shard
    is written as NAME.partial and renamed when complete."""
    q: queue.Queue = queue.Queue(maxsize=4)
    err: list[BaseException] = []
    written = [0]

    def writer():
        f = None
        try:
            while (item := q.get()) is not None:
                kind, a, b = item
                if kind == "open":
                    f = open(out / (a + ".partial"), "wb")
                    f.write(b)
                    written[0] += len(b)
                elif kind == "close":
                    f.close()
                    (out / (a + ".partial")).rename(out / a)
                else:
                    data = b.contiguous().view(torch.uint8).numpy()
                    f.write(memoryview(data).cast("B"))
                    written[0] += data.nbytes
        except BaseException as e:          # surfaced in the generating thread
            err.append(e)
            while q.get() is not None:
                pass

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    try:
        for name, head, keys in zip(names, heads, groups):
            q.put(("open", name, head))
            for key in keys:
                if key.endswith(quant.SCALE):
                    continue                 # produced with its weight
                for k, t in tensors_of(key, p[key][0], seed, dev, fp8, decisive):
                    if tuple(t.shape) != p[k][0] or t.dtype != p[k][1]:
                        raise RuntimeError(f"{k}: made {t.dtype} {list(t.shape)}, planned {p[k][1]} {list(p[k][0])}")
                    q.put(("tensor", k, t))
                if err:
                    raise err[0]
            q.put(("close", name, None))
    finally:
        q.put(None)
        th.join()
    if err:
        raise err[0]
    return written[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=SHAPES)
    ap.add_argument("--out", required=True, help="a new or empty directory")
    ap.add_argument("--fp8", action="store_true", help="the official Qwen -FP8 format (block e4m3 + scales)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the values are drawn")
    ap.add_argument("--shard-gb", type=float, default=5.0, help="shard size in GB (1e9 bytes)")
    ap.add_argument("--router", default="random", choices=["random", "decisive"],
                    help="decisive: routers with wide top-k margins, so an exported artifact's parity fixture can "
                         "compare its prompts (models/qwen3_5/decisive.py)")
    a = ap.parse_args(argv)
    cmd = "python -m onegraph.scripts.random_checkpoint " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        rec = write(a.shape, a.out, a.fp8, a.seed, a.device, a.shard_gb, cmd, a.router)
    except RandomCheckpointError as e:
        print(f"random_checkpoint: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
