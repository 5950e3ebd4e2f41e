"""Tensor-parallel sharding plan for Qwen35Model: pure functions over state dicts, no process groups.

Rank r of `tp` holds (HF parameter names, TP-1 shapes in brackets):
- gated attention: q_proj [Hq*2D, H] / k_proj, v_proj [KVH*D, H] column-parallel by heads,
  o_proj [H, Hq*D] row-parallel (the caller all-reduces). When tp > KVH (tp a multiple of KVH), the
  KV heads are replicated as vLLM does: rank r keeps KV head r // (tp / KVH), the one its q heads read.
  q_norm / k_norm are per head dim (replicated). An o_proj bias sits on rank 0 only (zeros elsewhere),
  so the all-reduce adds it once.
- Gated DeltaNet: by value heads. in_proj_qkv [2*HK*K + HV*V, H] packs q ‖ k ‖ v; each segment is cut
  by heads (q, k by key heads, v by value heads) and conv1d [C, 1, W] the same channels. in_proj_z
  [HV*V, H], in_proj_a / in_proj_b [HV, H], A_log / dt_bias [HV] by value heads; value head h stays
  with key head h // (HV / HK). When tp > HK (tp a multiple of HK) key heads are replicated like KV
  heads. norm [V] replicated; out_proj [H, HV*V] row-parallel (all-reduce).
- MoE: router replicated; each expert's intermediate dim split (gate rows and up rows of
  gate_up_proj [E, 2I, H] sliced each, down_proj [E, H, I] columns); the shared expert column/row
  the same way; shared_expert_gate replicated. Routed and shared outputs are both partial sums,
  reduced by ONE all-reduce of the block output. Dense MLP: column/row.
- embed_tokens replicated; lm_head [V, H] by vocab rows, padded with zero rows to a multiple of tp
  (the caller gathers the logits and drops the padding). Tied embeddings get an lm_head shard at tp > 1.
- Norms: replicated.
Every rule is "index_select along one dim" (plus the two exceptions above), so unshard is the exact
inverse: shard_state_dict then unshard round-trips bit for bit.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from onegraph.models.qwen3_5.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LocalDims:
    """Per-rank module sizes: what Qwen35Model(cfg, tp) allocates on every rank."""
    tp: int
    num_heads: int
    num_kv_heads: int
    linear_k_heads: int
    linear_v_heads: int
    moe_intermediate: int
    shared_intermediate: int
    intermediate_size: int
    vocab: int                       # lm_head rows per rank (vocab padded up to a multiple of tp)
    linear_k_dim: int
    linear_v_dim: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError naming every dimension (HF config key, size) that tp cannot split."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    bad = []
    if cfg.attn_layers:
        if cfg.num_heads % tp:
            bad.append(f"num_attention_heads={cfg.num_heads} is not divisible by tp={tp}")
        if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            bad.append(f"num_key_value_heads={cfg.num_kv_heads} neither divides nor is divisible by tp={tp} "
                       f"(KV heads are split, or replicated when tp is a multiple of them)")
    if cfg.gdn_layers:
        if cfg.linear_v_heads % tp:
            bad.append(f"linear_num_value_heads={cfg.linear_v_heads} is not divisible by tp={tp}")
        if cfg.linear_k_heads % tp and tp % cfg.linear_k_heads:
            bad.append(f"linear_num_key_heads={cfg.linear_k_heads} neither divides nor is divisible by tp={tp}")
    if cfg.is_moe:
        if cfg.moe_intermediate % tp:
            bad.append(f"moe_intermediate_size={cfg.moe_intermediate} is not divisible by tp={tp}")
        if cfg.shared_intermediate % tp:
            bad.append(f"shared_expert_intermediate_size={cfg.shared_intermediate} is not divisible by tp={tp}")
    elif cfg.intermediate_size % tp:
        bad.append(f"intermediate_size={cfg.intermediate_size} is not divisible by tp={tp}")
    if bad:
        raise ValueError(f"tensor parallel tp={tp} cannot shard this model: " + "; ".join(bad))


def local_dims(cfg: ModelConfig, tp: int = 1) -> LocalDims:
    check_divisible(cfg, tp)
    return LocalDims(
        tp=tp, num_heads=cfg.num_heads // tp, num_kv_heads=max(1, cfg.num_kv_heads // tp),
        linear_k_heads=max(1, cfg.linear_k_heads // tp), linear_v_heads=cfg.linear_v_heads // tp,
        moe_intermediate=cfg.moe_intermediate // tp, shared_intermediate=cfg.shared_intermediate // tp,
        intermediate_size=cfg.intermediate_size // tp, vocab=-(-cfg.vocab_size // tp),
        linear_k_dim=cfg.linear_k_dim, linear_v_dim=cfg.linear_v_dim)


def group_heads(n: int, rank: int, tp: int) -> list[int]:
    """Heads of a group of n rank r keeps: a contiguous 1/tp of them, or (tp > n) the one replicated
    head r // (tp / n) that its query/value heads read."""
    if n % tp == 0:
        return list(range(rank * n // tp, (rank + 1) * n // tp))
    return [rank // (tp // n)]


def _blocks(heads: list[int], size: int, offset: int = 0) -> list[int]:
    return [offset + h * size + j for h in heads for j in range(size)]


@dataclasses.dataclass(frozen=True)
class _Rule:
    kind: str            # "index": index_select(dim, idx) | "rank0": full on rank 0, zeros elsewhere
    dim: int = 0
    idx: tuple = ()      # global indices along dim (may exceed the full size: zero padding)
    full: int = 0        # full size along dim (TP-1) where the indices overshoot it (lm_head padding); 0: their span


REPLICATED = _Rule("replicated")


def _rule(name: str, shape: tuple, cfg: ModelConfig, rank: int, tp: int) -> _Rule:
    d = local_dims(cfg, tp)
    D, K, V = cfg.head_dim, cfg.linear_k_dim, cfg.linear_v_dim
    r = rank

    def idx(dim, ids, full=None):
        return _Rule("index", dim, tuple(ids), full or 0)

    q_heads = list(range(r * d.num_heads, (r + 1) * d.num_heads))
    kv_heads = group_heads(cfg.num_kv_heads, r, tp)
    v_heads = list(range(r * d.linear_v_heads, (r + 1) * d.linear_v_heads))
    k_heads = group_heads(cfg.linear_k_heads, r, tp)

    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if re.fullmatch(r"self_attn\.q_proj\.(weight|bias)", leaf):
        return idx(0, _blocks(q_heads, 2 * D))
    if re.fullmatch(r"self_attn\.[kv]_proj\.(weight|bias)", leaf):
        return idx(0, _blocks(kv_heads, D))
    if leaf == "self_attn.o_proj.weight":
        return idx(1, _blocks(q_heads, D))
    if leaf == "self_attn.o_proj.bias":
        return _Rule("rank0")
    if leaf in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        kd = cfg.linear_k_heads * K
        return idx(0, _blocks(k_heads, K) + _blocks(k_heads, K, kd) + _blocks(v_heads, V, 2 * kd))
    if leaf == "linear_attn.in_proj_z.weight":
        return idx(0, _blocks(v_heads, V))
    if leaf in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.A_log",
                "linear_attn.dt_bias"):
        return idx(0, v_heads)
    if leaf == "linear_attn.out_proj.weight":
        return idx(1, _blocks(v_heads, V))
    if leaf == "mlp.experts.gate_up_proj":
        I, il = cfg.moe_intermediate, d.moe_intermediate
        own = list(range(r * il, (r + 1) * il))
        return idx(1, own + [I + i for i in own])
    if leaf == "mlp.experts.down_proj":
        return idx(2, range(r * d.moe_intermediate, (r + 1) * d.moe_intermediate))
    m = re.fullmatch(r"mlp\.(shared_expert\.)?(gate_proj|up_proj|down_proj)\.weight", leaf)
    if m:
        il = d.shared_intermediate if m.group(1) else d.intermediate_size
        own = range(r * il, (r + 1) * il)
        return idx(1 if m.group(2) == "down_proj" else 0, own)
    if name == "lm_head.weight":
        return idx(0, range(r * d.vocab, (r + 1) * d.vocab), cfg.vocab_size)
    if (leaf.endswith("norm.weight") or leaf in ("mlp.gate.weight", "mlp.shared_expert_gate.weight")
            or name == "embed_tokens.weight"):
        return REPLICATED
    raise ValueError(f"tensor parallel: no sharding rule for parameter {name!r} {list(shape)}")


def _with_lm_head(full_sd: dict, cfg: ModelConfig, tp: int) -> dict:
    sd = dict(full_sd)
    if tp > 1 and cfg.tie_word_embeddings and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]          # tied: the vocab-sharded head is a copy
    return sd


def shard_state_dict(full_sd: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The TP-1 state dict (Qwen35Model names) -> rank `rank`'s shard for Qwen35Model(cfg, tp)."""
    check_divisible(cfg, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in 0..{tp - 1}, got {rank}")
    if tp == 1:
        return dict(full_sd)
    out = {}
    for name, t in _with_lm_head(full_sd, cfg, tp).items():
        rule = _rule(name, tuple(t.shape), cfg, rank, tp)
        if rule.kind == "replicated":
            out[name] = t
        elif rule.kind == "rank0":
            out[name] = t if rank == 0 else torch.zeros_like(t)
        else:
            ids = torch.tensor(rule.idx, dtype=torch.int64, device=t.device)
            pad = int(ids.max()) + 1 - t.shape[rule.dim]
            if pad > 0:                                            # lm_head rows past the vocab: zeros
                t = torch.cat([t, t.new_zeros(t.shape[:rule.dim] + (pad,) + t.shape[rule.dim + 1:])], rule.dim)
            out[name] = t.index_select(rule.dim, ids).contiguous()
    return out


def unshard(shards: list[dict[str, torch.Tensor]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every rank's shard (in rank order) -> the TP-1 state dict; exact inverse of shard_state_dict.
    Replicated pieces must agree across ranks (ValueError naming the parameter otherwise)."""
    tp = len(shards)
    check_divisible(cfg, tp)
    if tp == 1:
        return dict(shards[0])
    out = {}
    for name, t0 in shards[0].items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue                                               # the TP-1 model reads embed_tokens
        full_shape = list(t0.shape)
        rules = []
        for r in range(tp):
            rule = _rule(name, tuple(shards[r][name].shape), cfg, r, tp)
            rules.append(rule)
        kind = rules[0].kind
        if kind in ("replicated", "rank0"):
            if kind == "replicated" and any(not torch.equal(s[name], t0) for s in shards[1:]):
                raise ValueError(f"unshard: replicated parameter {name!r} differs across ranks")
            out[name] = t0
            continue
        dim = rules[0].dim
        span = max(max(rl.idx) for rl in rules) + 1
        full_shape[dim] = span
        full = t0.new_zeros(full_shape)
        for r, rule in enumerate(rules):
            full.index_copy_(dim, torch.tensor(rule.idx, dtype=torch.int64, device=t0.device), shards[r][name])
        out[name] = full.narrow(dim, 0, rules[0].full or span).contiguous()
    return out
