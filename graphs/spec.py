"""Speculative decoding with the model's own MTP head (models/qwen3_5/mtp.py): draft, verify, accept, commit.

The eager reference, one slot at a time (generate_spec), written as graphs trace (explicit state tensors
indexed by slot, static k, no Python control flow on tensor values). The exported graphs
(graphs/spec_graphs.py) batch the same round over slots and reuse prefill_hidden, mtp_catch_up, _head_in
and _stack from here; every layer loop, main model and head alike, is Qwen35Model._layers (_stack).

One round for one slot. The slot's committed length is p: positions 0..p-1 are in the main model's state
and x_p (the last accepted token) is known but not yet fed.
  draft   mtp_draft: the head catches up over the positions the previous round committed (their main-model
          hidden states and next tokens are now known), then drafts d1..dk autoregressively.
  verify  the main model runs over [x_p, d1..dk] at positions p..p+k (one prefill-like pass), samples the
          target t_j at every position j (t_j predicts x_{p+j+1}), keeping the GDN state after each position.
  accept  a = the longest prefix with d_{j+1} == t_j (0..k); the round emits t_0..t_a (a accepted drafts and
          the target's next token).
  commit  each GDN layer's conv / recurrent state of the slot <- its snapshot after position p+a. The KV
          cache is not touched: the rows of the rejected positions p+a+1..p+k are inert (see `verify`).
          The new committed length is p+a+1; x_{p+a+1} = t_a.

Sampling. The target at every position is ops.sample with the request's (seed, position) noise, exactly
as the non-speculative decode step draws it: the noise is keyed by the token's position, not by the step
count. So acceptance by equality (draft == target) emits the very tokens speculation-off emits, at
temperature 0 (argmax) and at temperature > 0 alike: the output is token-identical, not only identically
distributed, up to rounding: verify computes k+1 rows per matmul where decode computes one, so fp32 sums
may differ in the last bits (state <= 6e-6 in tests/test_spec_eager.py) and a logit near-tie could flip.
The drafts are sampled from the head's logits with the same (seed, position) noise, so at temperature > 0
head and target share their Gumbel noise and agree where their distributions are close.
This is not the residual-distribution rejection sampling of Leviathan et al.: its acceptance rate
(P[draft == target] under shared noise) can be lower than sum_x min(p, q), but it needs no residual draw
and keeps speculation-on equal to speculation-off token for token.

State layout. The head's attention layers keep their own KV cache, laid out like the main model's
(`mtp_state_spec`: per head layer k_cache, v_cache [S, KVH, Tmax, D], S = slots + 1, the last slot scratch).
Head position t reads (h_t, x_{t+1}) at rotary position t and predicts x_{t+2} (the training layout,
scripts/train_tiny.py), so its KV row t depends only on committed values once x_{t+1} is committed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from onegraph.custom_ops.sample import Sampling

from onegraph.models.qwen3_5.config import ModelConfig
from onegraph.graphs.eager import i64
from onegraph.models.qwen3_5.model import Qwen35Model, new_state, ops
from onegraph.models.state import StateTensor

MAX_SPECULATIVE_TOKENS = 4


def check_k(k: int, name: str = "speculative tokens") -> int:
    """The one rule for K, the draft tokens of a speculative round (export options, the CLI, the graphs);
    ValueError names the option as `name`."""
    if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"{name} must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
    return k


def mtp_state_spec(cfg: ModelConfig, num_layers: int, slots: int, max_seq_len: int,
                   dtype: torch.dtype) -> list[StateTensor]:
    """The MTP head's state for `slots` slots (+1 scratch): per head layer k_cache, v_cache [S, KVH, Tmax, D]."""
    kv = (slots + 1, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
    spec = []
    for i in range(num_layers):
        spec += [StateTensor(f"mtp{i}.k_cache", kv, dtype, "kv"), StateTensor(f"mtp{i}.v_cache", kv, dtype, "kv")]
    return spec


def new_mtp_state(model: Qwen35Model, slots: int, max_seq_len: int, device="cpu") -> list[torch.Tensor]:
    dtype = model.embed_tokens.weight.dtype
    return [torch.zeros(t.shape, dtype=t.dtype, device=device)
            for t in mtp_state_spec(model.cfg, len(model.mtp.layers), slots, max_seq_len, dtype)]


class _Stack:
    """The model seen with another layer stack: `layers` and `norm` replaced, every other attribute the
    model's own. So Qwen35Model._layers (the decoder loop: norms, residual adds, MLPs) runs the MTP head's
    layers too, and a change to that loop reaches the head without a copy of it here."""

    def __init__(self, model, layers, norm):
        self._model, self.layers, self.norm = model, layers, norm

    def __getattr__(self, name):
        return getattr(self._model, name)


def _stack(model, layers, final_norm, h, state, mixer):
    """Qwen35Model._layers over `layers` (the main model's, or the head's with its final norm):
    h [N, H] residual stream -> final-normed [N, H]; mixer(layer, normed, layer_state) -> token-mixer output."""
    if layers is model.layers:
        return model._layers(h, state, mixer)
    return type(model)._layers(_Stack(model, layers, final_norm), h, state, mixer)


def prune_draft_vocab(model: Qwen35Model, ids: torch.Tensor) -> None:
    """The MTP head drafts over `ids` [N] int64 only (a pruned draft vocabulary, FR-Spec's idea; the ids a corpus
    uses most, commands/draft_vocab.py): model.mtp.draft_head [N, H] holds the head's rows at those ids in the
    model dtype (a block-FP8 head's rows dequantized: its 128-row blocks do not survive the gather) and
    model.mtp.draft_ids the ids. At 35B a draft token then reads N x 2048 of the head instead of 248,320 x 2048
    (1.02 GB in bf16). The verify still decides every token over the whole vocabulary, so the output is what
    speculation off emits; only acceptance can fall (a target outside the N ids is never drafted)."""
    dtype = model.embed_tokens.weight.dtype
    w = model.lm_head_weight
    rows = w.index_select(0, ids.to(w.device))                                    # [N, H]
    if w.dtype == torch.float8_e4m3fn:
        from onegraph.custom_ops.linear_fp8 import BLOCK
        scale = model.lm_head.weight_scale_inv.index_select(0, ids.to(w.device) // BLOCK)   # [N, ceil(H/128)]
        rows = rows.float() * scale.repeat_interleave(BLOCK, 1)[:, : rows.shape[1]]
    ids = ids.to(device=w.device, dtype=torch.int64)
    model.mtp.register_buffer("draft_ids", ids)
    # draft_logits' gather map: vocabulary id -> its column in the pruned logits, N (a -inf column) elsewhere
    inverse = torch.full((model.cfg.vocab_size,), len(ids), dtype=torch.int64, device=w.device)
    model.mtp.register_buffer("draft_inverse", inverse.index_copy(0, ids, torch.arange(len(ids), device=w.device)))
    model.mtp.draft_head = torch.nn.Parameter(rows.to(dtype).contiguous(), requires_grad=False)


def draft_logits(model: Qwen35Model, y):
    """The head's logits to draft from, y [N, H] final-normed -> [N, V] fp32: the full head's, or with a pruned
    draft vocabulary its N rows' logits at their ids and -inf at every other id, so the sampler draws each id
    with the same (seed, position) noise as over the full head (ops.sample: a -inf logit is never chosen)."""
    if not hasattr(model.mtp, "draft_ids"):
        return model._logits(y)
    part = ops.linear(y, model.mtp.draft_head).float()                           # [N, n_draft]
    # one gather (no scatter into a filled [N, V]): column draft_inverse[v] of [part | -inf]
    part = torch.cat([part, part.new_full((part.shape[0], 1), float("-inf"))], 1)  # [N, n_draft + 1]
    return part.index_select(1, model.mtp.draft_inverse)                          # [N, V]


def _sample(logits, sampling, positions):
    """logits [N, V] fp32, sampling = (temperature, top_k, top_p, seed) each [1], positions [N] -> ids [N]."""
    n = logits.shape[0]
    return ops.sample(logits, *(s.expand(n) for s in sampling), positions)


def prefill_hidden(model: Qwen35Model, tokens, slot, start_pos, n_valid, temperature, top_k, top_p, seed,
                   *state):
    """Qwen35Model.prefill (the same ops on the same values: next_id and logits are identical) that also
    returns every position's final-normed hidden state: -> (next_id [1], last_logits [1, V], hidden [T, H]).
    The prompt's hidden states feed the head's first catch-up."""
    def mixer(layer, x, st):
        if layer.kind == "linear_attention":
            return layer.linear_attn.prefill(x, slot, start_pos, n_valid, *st)
        return layer.self_attn.prefill(x, slot, start_pos, n_valid, model.inv_freq, *st)

    x = _stack(model, model.layers, model.norm, model.embed_tokens(tokens), state, mixer)   # [T, H]
    logits = model._logits(x.index_select(0, (n_valid - 1).clamp(min=0)))
    nxt = _sample(logits, (temperature, top_k, top_p, seed), start_pos + n_valid - 1)
    return nxt, logits, x


def _head_in(model, hidden, tokens):
    """hidden [N, H] (h_t, final-normed), tokens [N] (x_{t+1}) -> the head layers' input [N, H]:
    fc([norm_e(embed(x_{t+1})) ‖ norm_h(h_t)]) (embedding first, as the checkpoint's fc is laid out)."""
    head, eps = model.mtp, model.cfg.rms_norm_eps
    e = ops.rms_norm(model.embed_tokens(tokens), head.pre_fc_norm_embedding.weight, eps)
    h = ops.rms_norm(hidden, head.pre_fc_norm_hidden.weight, eps)
    return ops.linear(torch.cat([e, h], -1), head.fc.weight)


def mtp_catch_up(model: Qwen35Model, hidden, next_tokens, slot, start_pos, n_valid, *mtp_state):
    """The head over committed positions start_pos..start_pos+T-1 of one slot (one prefill-like pass):
    hidden [T, H] (h_t), next_tokens [T] (x_{t+1}), rows >= n_valid padding (their KV goes to the scratch
    slot). Writes the head's KV rows of those positions. -> the head's final-normed output [T, H], whose
    logits (model._logits) predict x_{t+2}: the training forward's MTP logits (scripts/train_tiny.py)."""
    def mixer(layer, x, st):
        return layer.self_attn.prefill(x, slot, start_pos, n_valid, model.inv_freq, *st)

    head = model.mtp
    return _stack(model, head.layers, head.norm, _head_in(model, hidden, next_tokens), mtp_state, mixer)


def mtp_draft(model: Qwen35Model, k: int, hidden, next_tokens, slot, start_pos, n_valid,
              temperature, top_k, top_p, seed, *mtp_state):
    """The MTP head drafts k tokens for one slot. -> drafts [k] int64.

    hidden [T, H]: the main model's final-normed hidden states h_t at positions start_pos..start_pos+T-1
    (the verify pass's output, or the prompt's from prefill_hidden); next_tokens [T]: x_{t+1} for each of
    them (the verify targets, of which the first n_valid are committed; the prompt shifted by one and the
    prefill's sampled token); rows >= n_valid are padding. mtp_state: the head's KV (mtp_state_spec).

    How the head's position and KV advance:
      1. catch-up: head positions start_pos..start_pos+n_valid-1 run as one prefill-like pass over
         (h_t, x_{t+1}); their KV rows are written from committed values only. Padding rows write the
         scratch slot. q0 = start_pos + n_valid - 1, the last committed position, is the last one caught up;
         its output predicts d1 = x_{q0+2}.
      2. autoregression: draft step i = 2..k runs head position q0+i-1 on (y, d_{i-1}), y the head's own
         final-normed output at the step before (the head stands in for the main model's hidden state
         there), writing KV row q0+i-1 from a drafted input.
    How a rejection rolls it back: by the positions alone, nothing is copied. After a round that accepts a
    drafts at verify position p, the next catch-up runs positions p..p+a (its n_valid = a+1) and rewrites
    their rows from committed values; rows beyond p+a written by draft steps are rewritten by a later
    catch-up or draft step before any query reads them, because attention at position t reads rows <= t
    only and every pass writes its rows before it reads. So the committed KV rows are always the ones a
    non-speculative head run over the accepted tokens would hold.
    Draft token d_i is sampled with the noise of position q0+i, the position the target samples x_{q0+i+1}
    at (see the module docstring); at temperature 0 it is the head's argmax.
    """
    head = model.mtp
    sampling = (temperature, top_k, top_p, seed)
    y = mtp_catch_up(model, hidden, next_tokens, slot, start_pos, n_valid, *mtp_state)
    q0 = start_pos + n_valid - 1                                              # [1]
    y = y.index_select(0, (n_valid - 1).clamp(min=0))                         # [1, H]
    drafts = [_sample(draft_logits(model, y), sampling, q0 + 1)]
    for i in range(2, k + 1):
        pos = q0 + i - 1

        def step(layer, x, st, pos=pos):
            return layer.self_attn.decode(x, slot, pos, model.inv_freq, *st)

        y = _stack(model, head.layers, head.norm, _head_in(model, y, drafts[-1]), mtp_state, step)
        drafts.append(_sample(draft_logits(model, y), sampling, q0 + i))
    return torch.cat(drafts)


def _gdn_verify(attn, x, slot, conv, rec):
    """A GDN layer over the T verify tokens of one slot, keeping the state after every position.
    x [T, H] -> (out [T, H], conv_after [T, C, W-1], rec_after [T, HV, K, V] fp32); conv / rec untouched.

    Per-position snapshots rather than recompute: committing is then one gather of row a per layer,
    with no second pass, and recomputing the accepted prefix would re-read every weight of the model, the
    memory-bound cost speculation exists to share between tokens. Each position runs gdn_decode_step,
    the op the decode step runs, so every snapshot is exactly the state non-speculative decode would reach
    from the same inputs (a chunked gdn_prefill would return the last state only, in another summation
    order). Cost: T sequential state updates per layer, and T snapshots per GDN layer live until the
    acceptance is known (tiny: 5 x 4 KiB; the 35B shape: 5 x 2 MiB per layer per slot), dropped after."""
    qkv, z, b, a = attn._in(x)
    conv_j, rec_j = conv.index_select(0, slot), rec.index_select(0, slot)   # [1, C, W-1], [1, HV, K, V]
    row0 = torch.zeros_like(slot)                                             # the one row of conv_j / rec_j
    cores, convs, recs = [], [], []
    for j in range(x.shape[0]):
        core, conv_j, rec_j = ops.gdn_decode_step(qkv[j:j + 1], a[j:j + 1], b[j:j + 1], conv_j, rec_j, row0,
                                                  attn.conv1d.weight[:, 0, :], attn.A_log, attn.dt_bias,
                                                  attn.num_k_heads)
        cores.append(core)
        convs.append(conv_j)
        recs.append(rec_j)
    return attn._finish(torch.cat(cores), z), torch.cat(convs), torch.cat(recs)


def kv_len(model: Qwen35Model, state) -> int:
    """Tmax, the KV cache's length (max_seq_len), from the first full-attention layer's k_cache."""
    return state[2 * model.cfg.layer_types.index("full_attention")].shape[2]


def accept(drafts, targets):
    """drafts [k], targets [k+1] -> n_accepted [1] int64: the longest prefix with drafts[j] == targets[j]."""
    k = drafts.shape[0]
    return (drafts == targets[:k]).long().cumprod(0).sum(0, keepdim=True)


def verify(model: Qwen35Model, last_token, drafts, slot, start_pos, temperature, top_k, top_p, seed, *state):
    """The main model over [last_token, d1..dk] of one slot at positions start_pos..start_pos+k, then accept
    and commit. -> (targets [k+1] int64, n_accepted [1] int64, hidden [k+1, H], logits [k+1, V] fp32).
    The round emits targets[:n_accepted+1]; the slot's committed length becomes start_pos+n_accepted+1.
    Caller: start_pos >= 1 (the prompt is prefilled first). KV bound: rows at positions >= the KV cache's
    Tmax are inert, as prefill padding is: their KV writes go to the scratch slot (n_valid below), so no
    position past max_seq_len is ever written; their targets are not usable, and a caller that keeps a
    request within max_seq_len never emits one (the last target it needs is at position max_seq_len - 2).

    GDN layers: per-position snapshots (_gdn_verify), the slot's conv / rec set to the snapshot after
    position start_pos+n_accepted once the targets are known. Attention layers write KV rows
    start_pos..start_pos+k as a prefill chunk does. The rows of rejected positions are inert: the next
    round's verify (or decode step) starts at the new committed length p' <= the first rejected position
    and writes every row from p' on before it reads it, and attention at position t reads rows <= t only,
    so no query ever reads a row written from a rejected token."""
    tokens = torch.cat([last_token, drafts])                                  # [T] = [k+1]
    T = tokens.shape[0]
    n_valid = (kv_len(model, state) - start_pos).clamp(0, T)                  # rows inside the KV cache
    snaps = []

    def mixer(layer, x, st):
        if layer.kind == "linear_attention":
            out, conv_after, rec_after = _gdn_verify(layer.linear_attn, x, slot, *st)
            snaps.append((st, conv_after, rec_after))
            return out
        return layer.self_attn.prefill(x, slot, start_pos, n_valid, model.inv_freq, *st)

    hidden = _stack(model, model.layers, model.norm, model.embed_tokens(tokens), state, mixer)  # [T, H]
    logits = model._logits(hidden)                                            # [T, V]
    positions = start_pos + torch.arange(T, device=tokens.device)
    targets = _sample(logits, (temperature, top_k, top_p, seed), positions)
    n_acc = accept(drafts, targets)
    for (conv, rec), conv_after, rec_after in snaps:                          # commit at the accepted length
        conv.index_copy_(0, slot, conv_after.index_select(0, n_acc))
        rec.index_copy_(0, slot, rec_after.index_select(0, n_acc))
    return targets, n_acc, hidden, logits


@dataclasses.dataclass
class SpecResult:
    token_ids: list[int]
    finish_reason: str
    accepted: list[int]          # drafts accepted per verify (0..k), one entry per round
    drafts: list[list[int]]      # each round's k drafts

    @property
    def accepted_mean(self) -> float:
        return sum(self.accepted) / max(1, len(self.accepted))

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify: accepted drafts + the target's own token (1..k+1)."""
        return self.accepted_mean + 1.0


DraftFn = Callable[[int, int], list[int]]


@torch.no_grad()
def generate_spec(model: Qwen35Model, prompt_ids: list[int], max_new_tokens: int, k: int,
                  sampling: Sampling | None = None, stop_ids=(), draft_fn: DraftFn | None = None,
                  state_hook: Callable | None = None) -> SpecResult:
    """generate_eager with speculation: prefill the prompt (one pass) into slot 0, then draft / verify
    rounds of k drafts. Emits the tokens generate_eager emits (see the module docstring).
    draft_fn (tests): draft_fn(p, k) -> k token ids drafted for positions p+1..p+k instead of the head's
    (the model then needs no head). state_hook (tests): called after every round with
    (committed length, main state list, head state list)."""
    check_k(k)
    sp = sampling or Sampling()
    if draft_fn is None and getattr(model, "mtp", None) is None:
        raise ValueError("speculative decoding needs the model's MTP head: load it with load_model(..., mtp=True)")
    if model.tp != 1:
        raise ValueError(f"speculative decoding runs at tp=1 (the MTP head is not sharded), got tp={model.tp}")
    dev = model.inv_freq.device
    P = len(prompt_ids)
    max_seq_len = P + max_new_tokens + k + 1                       # the last verify writes up to p + k
    state = new_state(model.cfg, 1, max_seq_len, model.embed_tokens.weight.dtype, dev)
    mtp_state = new_mtp_state(model, 1, max_seq_len, dev) if draft_fn is None else []
    slot, st = i64([0], dev), sp.tensors(1, dev)
    nxt, _, hidden = prefill_hidden(model, i64(prompt_ids, dev), slot, i64([0], dev), i64([P], dev), *st, *state)
    out, accepted, drafted = [int(nxt[0])], [], []
    catch = (hidden, torch.cat([i64(prompt_ids[1:], dev), nxt]), 0, P)     # head rows: (h_t, x_{t+1}), start, n
    p = P
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        if draft_fn is None:
            h, nt, start, n = catch
            drafts = mtp_draft(model, k, h, nt, slot, i64([start], dev), i64([n], dev), *st, *mtp_state)
        else:
            drafts = i64(draft_fn(p, k), dev)
        targets, n_acc, hidden, _ = verify(model, i64([out[-1]], dev), drafts, slot, i64([p], dev), *st, *state)
        a = int(n_acc[0])
        accepted.append(a)
        drafted.append(drafts.tolist())
        for t in targets[: a + 1].tolist():
            out.append(t)
            if t in stop_ids or len(out) >= max_new_tokens:
                break
        catch = (hidden, targets, p, a + 1)
        p += a + 1
        if state_hook is not None:
            state_hook(p, state, mtp_state)
    finish = "stop" if out[-1] in stop_ids else "length"
    return SpecResult(out[:max_new_tokens], finish, accepted, drafted)
