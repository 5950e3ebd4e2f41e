"""Train the builtin `tiny` model (and its MTP head) on the Python standard library's own source.

    python -m onegraph.scripts.train_tiny --out DIR [--steps N] [--batch B] [--seq-len T] [--seed S]

Corpus: every `*.py` file under `sysconfig.get_paths()["stdlib"]` outside EXCLUDED_DIRS (site-packages,
the test suites, the codec tables and pydoc's help text), as bytes — every machine with Python has it,
no download; PSF License. Split by file: the files named in models/qwen3_5/tiny_weights/heldout_files.txt are
held out (a fixed list), the others, sorted, are the training stream, each followed by <|endoftext|>.

Model: models/qwen3_5/tiny.py's config (byte-level vocabulary and chat tokens unchanged) plus one MTP layer
(models/qwen3_5/mtp.py). Loss: next-token cross-entropy + MTP_WEIGHT * the MTP head's cross-entropy on token t+2
+ AUX_WEIGHT * a load-balancing loss on every router (Switch-style: E * sum_e f_e * P_e, f_e the share
of top-k slots routed to expert e, P_e its mean router probability; 1.0 when perfectly balanced).

The training forward runs the model's own eager path: each `onegraph::*` op's pure-torch reference
(`reference_*`), called directly under autograd (the registered custom ops have no autograd formula, and
the inference path's in-place state writes have no place in a batched training step), on [B, T] token
windows: everything but the sequence mixers on B*T rows at once, the causal conv + chunked gated delta
rule per sequence from a zero state, attention over the window with a causal mask. tests/test_train_tiny.py
checks that it gives the inference path's prefill logits.

Plain torch: AdamW, fp32, eager, seeded, 2 threads. Writes DIR/ as an HF checkpoint (config.json,
model.safetensors with `model.*`, `lm_head.*` and `mtp.*` keys, per-expert, tokenizer files), the
bundled evaluation text DIR/heldout.txt (a slice of the held-out files) and DIR/train_log.json with the
loss curve (and DIR/train_log.png when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from onegraph.custom_ops.add_rms_norm import reference_add_rms_norm
from onegraph.custom_ops.attention_decode import masked_attention
from onegraph.custom_ops.causal_conv_prefill import reference_causal_conv_prefill
from onegraph.custom_ops.fused_moe import reference_fused_moe
from onegraph.custom_ops.gated_rms_norm import reference_gated_rms_norm
from onegraph.custom_ops.gdn_prefill import reference_gdn_prefill
from onegraph.custom_ops.rms_norm import reference_rms_norm
from onegraph.custom_ops.rope import reference_rope
from onegraph.models.qwen3_5.model import GDN_CHUNK
from onegraph.models.qwen3_5.tiny import TINY_WEIGHTS

MTP_WEIGHT = 0.3          # DeepSeek-V3's MTP loss weight early in training
AUX_WEIGHT = 0.01         # Switch Transformer's load-balancing coefficient
# site-packages is not the stdlib; the test suites, the codec tables (encodings/) and the help text held in
# one string (pydoc_data/) are mostly data, not code (the tables are 12 % of the bytes, aligned whitespace)
EXCLUDED_DIRS = ("site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data")
WEIGHTS_DIR = TINY_WEIGHTS.parent
HELDOUT_LIST = WEIGHTS_DIR / "heldout_files.txt"
HELDOUT_SLICE = 512       # bytes per held-out file in the bundled evaluation text


# ---- corpus ----
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[str]:
    """Every *.py under the stdlib outside EXCLUDED_DIRS, as sorted POSIX paths relative to it."""
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if not any(part in EXCLUDED_DIRS for part in rel.parts[:-1]) and p.is_file():
            out.append(rel.as_posix())
    return sorted(out)


def heldout_files() -> list[str]:
    return [ln for ln in HELDOUT_LIST.read_text().splitlines() if ln and not ln.startswith("#")]


def heldout_text(root: Path, files: list[str], size: int = HELDOUT_SLICE) -> str:
    """The bundled evaluation text (models/qwen3_5/tiny_weights/heldout.txt): from each held-out file, the whole
    lines within `size` bytes starting at the first line after the file's middle."""
    parts = []
    for f in files:
        data = (root / f).read_bytes()
        start = data.index(b"\n", len(data) // 2) + 1
        chunk = data[start:start + size]
        parts.append(chunk[: chunk.rindex(b"\n") + 1].decode("utf-8"))
    return "".join(parts)


def token_stream(root: Path, files: list[str]) -> torch.Tensor:
    """Bytes of the files, each followed by <|endoftext|> (256) -> int16 [n] (ids < 264)."""
    from onegraph.models.qwen3_5.tiny import EOS_IDS
    parts = []
    for f in files:
        data = (root / f).read_bytes()
        parts.append(torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int16)))
        parts.append(torch.tensor([EOS_IDS[0]], dtype=torch.int16))
    return torch.cat(parts)


def windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """n random windows of `length` tokens -> int64 [n, length]."""
    start = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return stream[start[:, None] + torch.arange(length)].long()


# ---- training forward: the ops' references under autograd ----
def _lin(mod, x):
    # the weights of a projection module, not its forward (which may call a custom op without autograd)
    return F.linear(x, mod.weight, mod.bias)


def _gdn(attn, x, B, T):
    """GatedDeltaNet.prefill for B whole sequences from a zero state. x [B*T, H] (normed) -> [B*T, H]."""
    cfg = attn.cfg
    qkv = _lin(attn.in_proj_qkv, x)                                                 # [B*T, C]
    g = -attn.A_log.float().exp() * F.softplus(_lin(attn.in_proj_a, x).float() + attn.dt_bias)   # [B*T, HV]
    beta = _lin(attn.in_proj_b, x).sigmoid().float()
    C, W = qkv.shape[1], cfg.conv_kernel
    HV = attn.A_log.shape[0]
    conv0 = x.new_zeros(1, C, W - 1)
    rec0 = x.new_zeros(1, HV, cfg.linear_k_dim, cfg.linear_v_dim, dtype=torch.float32)
    slot, n_valid = torch.zeros(1, dtype=torch.int64), torch.tensor([T])
    w = attn.conv1d.weight[:, 0, :]
    cores = []
    for b in range(B):
        rows = slice(b * T, (b + 1) * T)
        y, _ = reference_causal_conv_prefill(qkv[rows], conv0, slot, n_valid, w)
        core, _ = reference_gdn_prefill(y, g[rows], beta[rows], rec0, slot, attn.num_k_heads, GDN_CHUNK)
        cores.append(core)                                                          # [T, HV, V]
    core = torch.cat(cores)
    z = _lin(attn.in_proj_z, x).reshape(-1, cfg.linear_v_dim)
    y = reference_gated_rms_norm(core.reshape(-1, cfg.linear_v_dim), z, attn.norm.weight, cfg.rms_norm_eps)
    return _lin(attn.out_proj, y.reshape(x.shape[0], -1))


def _attention(attn, x, B, T, positions, inv_freq):
    """GatedAttention.prefill for B whole sequences. x [B*T, H] -> [B*T, H]."""
    cfg, N, D = attn.cfg, x.shape[0], attn.cfg.head_dim
    qg = _lin(attn.q_proj, x).view(N, attn.num_heads, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(N, -1)
    q = reference_rope(reference_rms_norm(q, attn.q_norm.weight, cfg.rms_norm_eps), positions, inv_freq)
    k = _lin(attn.k_proj, x).view(N, attn.num_kv_heads, D)
    k = reference_rope(reference_rms_norm(k, attn.k_norm.weight, cfg.rms_norm_eps), positions, inv_freq)
    v = _lin(attn.v_proj, x).view(N, attn.num_kv_heads, D)
    heads = lambda t: t.view(B, T, t.shape[1], D).transpose(1, 2)                  # noqa: E731 [B, heads, T, D]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    o = masked_attention(heads(q), heads(k), heads(v), causal, attn.scale)          # [B, Hq, T, D]
    return _lin(attn.o_proj, o.transpose(1, 2).reshape(N, -1) * torch.sigmoid(gate))


def _moe(moe, x):
    """onegraph::fused_moe's reference + the load-balancing loss. x [N, H] -> ([N, H], aux scalar)."""
    se = moe.shared_expert
    logits = F.linear(x, torch.cat([moe.gate.weight, moe.shared_expert_gate.weight]))   # [N, E + 1]
    y = reference_fused_moe(x, logits, moe.experts.gate_up_proj, moe.experts.down_proj,
                            se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight, moe.top_k)
    probs = torch.softmax(F.linear(x, moe.gate.weight), -1, dtype=torch.float32)   # [N, E]
    E = probs.shape[1]
    chosen = F.one_hot(probs.topk(moe.top_k, -1).indices, E).sum(1).float()        # [N, E]
    aux = E * (chosen.mean(0) / moe.top_k * probs.mean(0)).sum()
    return y, aux


def _stack(layers, final_norm_w, h, B, T, positions, inv_freq, eps):
    """Qwen35Model._layers over `layers`: h [B*T, H] residual stream -> (final-normed [B*T, H], aux)."""
    x = reference_rms_norm(h, layers[0].input_layernorm.weight, eps)
    aux = h.new_zeros(())
    for i, layer in enumerate(layers):
        if layer.kind == "linear_attention":
            mixed = _gdn(layer.linear_attn, x, B, T)
        else:
            mixed = _attention(layer.self_attn, x, B, T, positions, inv_freq)
        x, h = reference_add_rms_norm(mixed, h, layer.post_attention_layernorm.weight, eps)
        m, a = _moe(layer.mlp, x)
        aux = aux + a
        nxt = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else final_norm_w
        x, h = reference_add_rms_norm(m, h, nxt, eps)
    return x, aux


def forward(model, tokens: torch.Tensor):
    """tokens [B, T+2] -> (logits [B, T, V] predicting tokens[:, 1:T+1], mtp logits [B, T, V] predicting
    tokens[:, 2:T+2] (None without model.mtp), mean router aux loss)."""
    cfg, eps = model.cfg, model.cfg.rms_norm_eps
    B, T = tokens.shape[0], tokens.shape[1] - 2
    positions = torch.arange(T).repeat(B)                                           # [B*T]
    h = model.embed_tokens(tokens[:, :T]).reshape(B * T, -1)
    x, aux = _stack(model.layers, model.norm.weight, h, B, T, positions, model.inv_freq, eps)
    lm_head = model.lm_head_weight
    logits = F.linear(x, lm_head).float().view(B, T, -1)
    n_moe = len(model.layers)
    mtp_logits = None
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        # position t: [norm_e(embed(x_{t+1})) ‖ norm_h(h_t)] -> fc -> one full-attention layer -> x_{t+2}
        e = model.embed_tokens(tokens[:, 1:T + 1]).reshape(B * T, -1)
        fused = _lin(mtp.fc, torch.cat([reference_rms_norm(e, mtp.pre_fc_norm_embedding.weight, eps),
                                  reference_rms_norm(x, mtp.pre_fc_norm_hidden.weight, eps)], -1))
        y, mtp_aux = _stack(mtp.layers, mtp.norm.weight, fused, B, T, positions, model.inv_freq, eps)
        mtp_logits = F.linear(y, lm_head).float().view(B, T, -1)
        aux, n_moe = aux + mtp_aux, n_moe + len(mtp.layers)
    return logits, mtp_logits, aux / n_moe


def losses(model, tokens):
    """-> (main CE, MTP CE or None, aux), CE in nats per token."""
    logits, mtp_logits, aux = forward(model, tokens)
    T, V = logits.shape[1], logits.shape[2]
    main = F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:T + 1].reshape(-1))
    mtp = None if mtp_logits is None else F.cross_entropy(mtp_logits.reshape(-1, V), tokens[:, 2:].reshape(-1))
    return main, mtp, aux


# ---- model ----
def build(seed: int, hf_config: dict | None = None):
    """A Qwen35Model + MTP head of tiny's config, seeded init (GPT-2-style: matrices N(0, 0.02), the
    residual-stream writers scaled by (2 * layers)^-1/2; Qwen's (1 + w) norms at w = 0, the GDN
    output norm at 1; GDN decay A_log = log U(1, 16), dt_bias 1, as transformers initialises them)."""
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.models.qwen3_5.mtp import MtpHead
    from onegraph.models.qwen3_5.model import Qwen35Model
    from onegraph.models.qwen3_5.tiny import TINY_HF_CONFIG
    hf = hf_config or TINY_HF_CONFIG
    cfg = ModelConfig.from_hf(hf)
    model = Qwen35Model(cfg)
    model.mtp = MtpHead(cfg, int(hf.get("mtp_num_hidden_layers", 1)))
    gen = torch.Generator().manual_seed(seed)
    out_std = 0.02 / math.sqrt(2 * (cfg.num_layers + 1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            elif name.endswith("conv1d.weight"):        # nn.Conv1d's default: U(+-fan_in^-1/2), fan_in = W
                bound = p.shape[-1] ** -0.5
                p.uniform_(-bound, bound, generator=gen)
            else:
                writes_residual = name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight",
                                                 "experts.down_proj"))
                p.normal_(0.0, out_std if writes_residual else 0.02, generator=gen)
    return cfg, model


def hf_state(model) -> dict[str, torch.Tensor]:
    from onegraph.models.qwen3_5.tiny import hf_tensors
    return hf_tensors({n: p.detach() for n, p in model.named_parameters()})


# ---- loop ----
def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def held_out_loss(model, batch: torch.Tensor) -> tuple[float, float]:
    main, mtp, _ = losses(model, batch)
    return float(main), float(mtp) if mtp is not None else float("nan")


def train(out: Path, steps: int, batch: int, seq_len: int, lr: float, seed: int, warmup: int,
          eval_every: int, max_files: int | None = None, command: str = "", log=print) -> dict:
    torch.manual_seed(seed)
    root = stdlib_root()
    held = heldout_files()
    missing = [f for f in held if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"held-out files missing from this Python's stdlib {root}: {missing[:3]}")
    held_set = set(held)
    train_files = [f for f in corpus_files(root) if f not in held_set]
    if max_files:
        train_files = train_files[:max_files]
    stream, held_stream = token_stream(root, train_files), token_stream(root, held)
    gen = torch.Generator().manual_seed(seed)
    eval_batch = windows(held_stream, 16, seq_len + 2, torch.Generator().manual_seed(seed + 1))
    cfg, model = build(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"train_tiny: {len(train_files)} train files ({stream.numel() / 1e6:.1f} M bytes), {len(held)} held out "
        f"({held_stream.numel() / 1e6:.2f} M); {n_params / 1e6:.2f} M parameters; {steps} steps of "
        f"{batch} x {seq_len} tokens")
    curve, evals, t0 = [], [], time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        main, mtp, aux = losses(model, windows(stream, batch, seq_len + 2, gen))
        loss = main + MTP_WEIGHT * mtp + AUX_WEIGHT * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        main, mtp, aux = main.item(), mtp.item(), aux.item()
        curve.append({"step": step, "loss": round(main, 4), "mtp_loss": round(mtp, 4),
                      "aux": round(aux, 4), "grad_norm": round(gnorm, 3),
                      "seconds": round(time.perf_counter() - t0, 1)})
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            h_main, h_mtp = held_out_loss(model, eval_batch)
            evals.append({"step": step, "held_out_loss": round(h_main, 4),
                          "held_out_bpb": round(h_main / math.log(2), 4), "held_out_mtp_loss": round(h_mtp, 4)})
            log(f"step {step + 1}/{steps}: loss {main:.3f} mtp {mtp:.3f} aux {aux:.3f} | "
                f"held-out {h_main:.3f} nats ({h_main / math.log(2):.3f} bits/byte), mtp {h_mtp:.3f} | "
                f"{time.perf_counter() - t0:.0f} s")
    from onegraph.models.qwen3_5.tiny import TINY_HF_CONFIG, write_checkpoint
    write_checkpoint(out, hf_state(model))
    (out / "heldout.txt").write_text(heldout_text(root, held), encoding="utf-8")
    file_list = "\n".join(train_files).encode()
    result = {
        "command": command,
        "corpus": {"root": "sysconfig.get_paths()['stdlib']", "python": sys.version.split()[0],
                   "license": "PSF License Agreement", "excluded_dirs": list(EXCLUDED_DIRS),
                   "train_files": len(train_files), "train_bytes": int(stream.numel()) - len(train_files),
                   "train_files_sha256": hashlib.sha256(file_list).hexdigest(),
                   "heldout_files": len(held), "heldout_bytes": int(held_stream.numel()) - len(held)},
        "config": TINY_HF_CONFIG, "parameters": n_params,
        "hyper": {"steps": steps, "batch": batch, "seq_len": seq_len, "lr": lr, "warmup": warmup, "seed": seed,
                  "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0.1 on matrices)", "schedule": "cosine to 0.1",
                  "mtp_weight": MTP_WEIGHT, "aux_weight": AUX_WEIGHT, "grad_clip": 1.0,
                  "threads": torch.get_num_threads()},
        "seconds": round(time.perf_counter() - t0, 1), "tokens_seen": steps * batch * seq_len,
        "curve": curve, "held_out": evals,
    }
    (out / "train_log.json").write_text(json.dumps(result, indent=1) + "\n")
    try:
        plot_curve(result, out / "train_log.png")
    except ImportError:
        log("train_tiny: matplotlib is not installed (pip install -e '.[bench]'); no PNG")
    return result


def plot_curve(res: dict, png: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    c = res["curve"]
    ln2 = math.log(2)
    ax.plot([r["step"] for r in c], [r["loss"] / ln2 for r in c], lw=0.6, alpha=0.7, label="train (next token)")
    ax.plot([r["step"] for r in c], [r["mtp_loss"] / ln2 for r in c], lw=0.6, alpha=0.7, label="train MTP (t+2)")
    e = res["held_out"]
    ax.plot([r["step"] for r in e], [r["held_out_bpb"] for r in e], marker="o", ms=3, label="held-out (next token)")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_ylim(bottom=0)
    ax.set_title(f"tiny on the Python stdlib: {res['parameters'] / 1e6:.2f} M params, "
                 f"{res['tokens_seen'] / 1e6:.1f} M tokens, {res['seconds'] / 60:.0f} min", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.text(0.01, 0.01, res["command"][:110], fontsize=5)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onegraph.scripts.train_tiny", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--max-files", type=int, default=None, help="train on the first N training files only")
    ap.add_argument("--threads", type=int, default=2)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if min(args.steps, args.batch, args.seq_len, args.warmup, args.eval_every, args.threads) < 1:
        print("train_tiny: error: --steps, --batch, --seq-len, --warmup, --eval-every, --threads must be >= 1",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        train(Path(args.out), args.steps, args.batch, args.seq_len, args.lr, args.seed, args.warmup,
              args.eval_every, args.max_files, "python -m onegraph.scripts.train_tiny " + " ".join(argv))
    except FileNotFoundError as e:
        print(f"train_tiny: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
