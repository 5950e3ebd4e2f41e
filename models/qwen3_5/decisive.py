"""Decisive MoE routing for seeded random Qwen3.5-MoE weights (random_checkpoint --router decisive,
tiny.random_model(router="decisive")).

Why: a random router (rows N(0, H^-1/2), normed input x of rms 1) gives logits ~N(0, 1) per expert, so the
k-th and (k+1)-th logits are close: with 256 experts, top-8 and 40 layers the smallest margin over a prompt
is ~1e-4, below the ~1e-2 by which bf16 graph and eager router logits may differ, and every prompt flips a
routing choice somewhere (the parity fixture can then compare nothing). Trained routers are decisive; this
rule makes random ones decisive too, while every tensor stays random and the hub keys, shapes, dtypes and
config are unchanged.

How (H hidden, E experts, k = top_k, m = channels(E, k) = floor(log2(E / k)): 35B 5, tiny 2; n = m + 1
coordinates; l the layer):
- n constant channels in the residual stream, coordinates 0..m: embed_tokens [V, H] columns i < m :=
  +-c / sqrt(n) (the sign of the drawn value, so each token id has a random sign pattern s in {-1, 1}^m),
  column m := +c / sqrt(n) for every token; no layer writes them (rows :n := 0 of every residual writer: GDN
  out_proj [H, vd], attention o_proj [H, Hq*D], expert and shared-expert down_proj [H, I]) and nothing but
  the routers reads them (columns :n := 0 of every other matrix that reads an H-vector: q/k/v_proj,
  in_proj_qkv/z/a/b, expert and shared gate/up_proj, shared_expert_gate, lm_head). So h[:, :n] is the token's
  constant at every layer, the rest of the model computes as a random model on the other H - n coordinates,
  and the channels' only other effect is their share c^2 / H of the RMSNorms' mean square (at layer 0, where
  the stream is smallest, it scales the other normed coordinates by 1 / sqrt(1 + KAPPA^2) = 0.89; later ones
  by > 0.99).
- the MoE input x = RMSNorm(h) (post_attention_layernorm weight[:n] := 0: gain 1 there) has
  x[:, i] = s_i u, x[:, m] = u, u = c / (sqrt(n) rms(h)) > 0.
- each layer's router mlp.gate.weight [E, H]: the random rows times ROUTER_SCALE, columns :n := 0; a seeded
  permutation of the experts gives group g (0 <= g < 2^m) k experts, whose columns :m := beta_l * b_g (b_g =
  g's bits as +-1); column m := -beta_l * m for every expert. A token of pattern s gets from a group-g expert
  the logit beta_l u (b_g . s - m) + ROUTER_SCALE * N(0, 1): 0 (+ noise) from the k experts of its own
  pattern, at most -2 beta_l u from any other group's, -m beta_l u from an expert in no group. So every token
  goes to its pattern's k experts by a margin of about 2 beta_l u - ROUTER_SCALE * (the spread of ~E
  normals): 2 BOOST / m = 8 for the 35B (m = 5) where u meets its estimate, less the noise (~1.5) and less
  where a token's u falls short of it (measured, eager bf16, smallest over 3 prompts: 4.5 at the 35B's hidden
  size, 40 layers, 5 sign channels; random routers there: 2e-05; benchmarks/decisive_router.json). The
  chosen logits stay small (the offset cancels exactly for them, whatever u is), so bf16 rounds them as
  finely as a random router's, and BOOST only pushes the other experts further down. The set depends on the
  token id (2^m sets per layer, 35B: 32 covering all 256 experts, so a batch spreads over the experts as a
  trained router's would); the order and renormalised top-k weights within it on the token's context
  (ROUTER_SCALE * N(0, 1) logits).
- beta_l = BOOST / (m * u(l)), u falling as the other coordinates of the stream grow with depth. Measured on
  random models of both shapes (tiny; the 35B's hidden size with 40 layers): the rms r_l of the other
  coordinates at layer l's MoE input has r_l^2 ~ 1/H + LAYER0 + GROWTH * max(l - ONSET, 0) (the embedding's
  1/H, the first mixer's ~0.002, then ~0.2 per layer; tokens spread +-30 % around it), so u(l) ~
  c / sqrt(n (r_l^2 + c^2 / H)), with c = KAPPA * sqrt(H) * r_0: the margin 2 BOOST / m moves with it.
- the MTP head (mtp.*): fc [H, 2H] row i (< n) := one weight, at column i (the normed embedding's channel),
  scaled to |h_i| ~ 1 / sqrt(n); columns :n and H : H + n := 0 otherwise; its layer follows the rules above with
  u ~ 1 / sqrt(n (r^2 + 1 / H)), r ~ 1 (fc's output).
Tensor parallel shards heads, intermediate sizes and the vocabulary, never the hidden coordinates, and the routers are
replicated, so every rank holds the whole rule. Tied embeddings (lm_head = embed_tokens) would add the
channels' x . embed[v, :n] to vocab id v's logit: the rule wants untied ones (random_checkpoint's and both
shapes' are).
"""
from __future__ import annotations

import hashlib
import math
import re

import torch

ROUTERS = ("random", "decisive")
KAPPA = 0.5            # c / (sqrt(H) * r_0): the channels' share of layer 0's normed input
ROUTER_SCALE = 0.25    # random router rows' std, times H^-1/2
BOOST = 20.0           # m * beta_l * u: the margin to another group is 2 BOOST / m
GROWTH, ONSET, LAYER0 = 0.2, 0.6, 0.002   # the r_l^2 model (docstring)

WRITER = re.compile(r"\.(o_proj|out_proj|down_proj)(\.weight)?$")
ROUTER = re.compile(r"\.mlp\.gate\.weight$")
LAYER = re.compile(r"^(?:model\.)?(mtp\.)?layers\.(\d+)\.")


def check_router(router: str) -> str:
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {list(ROUTERS)}, got {router!r}")
    return router


def channels(E: int, k: int) -> int:
    """m: the most sign channels whose 2^m groups of k experts fit in E (at least 1)."""
    return max(1, int(math.floor(math.log2(E // k))) if E >= 2 * k else 1)


def constant(H: int) -> float:
    """c: the norm of a token's embedding over the n channels."""
    return KAPPA * math.sqrt(H) * math.sqrt(1.0 / H + LAYER0)


def boost_weight(H: int, m: int, layer: int, mtp: bool) -> float:
    """beta_l: the router weight of a group's experts on each sign channel (BOOST / (m * the expected u))."""
    n = m + 1
    if mtp:
        return BOOST * math.sqrt(n * (1.0 + 1.0 / H)) / m
    c = constant(H)
    r2 = 1.0 / H + LAYER0 + GROWTH * max(layer - ONSET, 0.0)
    return BOOST * math.sqrt(n * (r2 + c * c / H)) / (m * c)


def groups(seed: int, layer: int, mtp: bool, E: int, k: int) -> torch.Tensor:
    """The experts of each sign-pattern group of a layer (seeded by seed and layer): int64 [2^m, k]; a token
    of pattern s goes to row sum_i 2^i [s_i > 0] (channels(E, k) < 1 + log2(E / k): one group when E < 2k)."""
    m = channels(E, k)
    count = 2 ** m if E >= 2 * k else 1
    s = int.from_bytes(hashlib.sha256(f"{seed}:decisive:{'mtp.' if mtp else ''}{layer}".encode()).digest()[:8],
                       "little") & ((1 << 63) - 1)
    return torch.randperm(E, generator=torch.Generator().manual_seed(s))[: count * k].view(count, k)


def bits(m: int, count: int) -> torch.Tensor:
    """[count, m] +-1: group g's pattern (bit i of g set -> +1); one group: all +1."""
    g = torch.arange(count).unsqueeze(1)
    out = ((g >> torch.arange(m)) & 1).float() * 2 - 1
    return out if count > 1 else torch.ones(1, m)


def token_group(embed_channels: torch.Tensor) -> torch.Tensor:
    """[N, m] a token's embedding over the channels -> its group [N] (bits of its positive channels)."""
    m = embed_channels.shape[-1]
    return ((embed_channels > 0).long() << torch.arange(m, device=embed_channels.device)).sum(-1)


@torch.no_grad()
def apply_(name: str, t: torch.Tensor, H: int, E: int, k: int, seed: int) -> torch.Tensor:
    """Applies the rule to the random tensor `t` named `name` (hub names, `model.`-prefixed, or the model's
    own, fused experts included) of a model with H hidden, E experts, top-k k, in place -> t."""
    m = channels(E, k)
    n = m + 1
    match = LAYER.match(name)
    if name.endswith("embed_tokens.weight"):
        v = constant(H) / math.sqrt(n)
        t[:, :m] = torch.where(t[:, :m] >= 0, v, -v) if E >= 2 * k else v
        t[:, m] = v
    elif name.endswith("mtp.fc.weight"):                        # [H, 2H]: embedding half, then hidden half
        t[:n, :] = 0
        t[:, :n] = 0
        t[:, H:H + n] = 0
        c = constant(H)                                          # normed embedding channel: c sqrt(H / (n (1 + c^2)))
        i = torch.arange(n, device=t.device)
        t[i, i] = math.sqrt(1.0 + c * c) / (c * math.sqrt(H))
    elif ROUTER.search(name):
        if match is None:
            raise ValueError(f"{name}: a router outside a numbered layer")
        mtp, layer = match.group(1) is not None, int(match.group(2))
        if t.shape[0] != E:
            raise ValueError(f"{name}: router {list(t.shape)} for {E} experts")
        g = groups(seed, layer, mtp, E, k)
        beta = boost_weight(H, m, layer, mtp)
        t.mul_(ROUTER_SCALE)
        t[:, :m] = 0
        t[:, m] = -beta * m
        w = bits(m, g.shape[0]) * beta                                     # [groups, m]
        t[g.reshape(-1).to(t.device), :m] = w.repeat_interleave(k, 0).to(t.dtype).to(t.device)
    elif name.endswith(("post_attention_layernorm.weight", "pre_fc_norm_embedding.weight")):
        t[:n] = 0
    elif t.dim() >= 2 and WRITER.search(name):
        if t.shape[-2] != H:
            raise ValueError(f"{name}: a residual writer {list(t.shape)} whose rows are not the hidden size {H}")
        t[..., :n, :] = 0
    elif t.dim() >= 2 and t.shape[-1] == H:
        t[..., :n] = 0
    return t
