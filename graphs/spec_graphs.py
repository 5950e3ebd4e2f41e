"""The speculative entry points an artifact exports (`onegraph export --speculative-tokens K`), batched over
slots: the eager round of graphs/spec.py (draft, verify, accept, commit) for B slots at once, as two graphs.

  prefill(tokens[T], slot[1], start_pos[1], n_valid[1], temperature[1], top_k[1], top_p[1], seed[1],
          next_tokens[T], *state, *spec_state) -> (next_id [1], last_logits [1, V])
      Qwen35Model.prefill (spec.prefill_hidden: the same ids and logits) plus the MTP head's catch-up over
      the chunk (spec.mtp_catch_up: head position t on (h_t, x_{t+1}), x_{t+1} = next_tokens[t], which the
      host fills from the prompt; -1 marks the prompt's last token, whose x_{t+1} is the id sampled here).
      Writes spec.y[slot] (the head's output at the chunk's last valid position) and spec.pos[slot].
      It does not depend on K, and it replaces the plain prefill graph in a speculative artifact: the main
      model's outputs are the plain prefill's, so speculation off runs on it unchanged.
  spec(tokens[B], slots[B], temperature[B], top_k[B], top_p[B], seed[B], *state, *spec_state)
      -> (next_ids [B], n_accepted [B], targets [B, K+1], drafts [B, K])
      One round per row, all on the device: draft K tokens with the head from spec.y (its first draft) and
      K-1 head decode steps; verify [last token, d1..dK] with the main model at positions p..p+K; accept
      the longest prefix d == target; commit the GDN state at the accepted length; catch the head up over
      the accepted positions; advance spec.pos by n_accepted + 1. next_ids (targets[n_accepted]) becomes the
      slot's next input (the executor's last_tok, as a decode step's ids do); the host reads n_accepted and
      targets one step late and emits targets[:n_accepted+1].

Why one graph per round (draft + verify together) and not a draft graph and a verify graph: the draft's
input (the head's output at the last accepted position) is known only once the verify has accepted, so
every round is draft -> verify -> catch-up; in one graph the main model's hidden states and the head's
output never leave it, and a round costs one graph call (one CUDA-graph replay), as a decode step does.
Why the positions live on the device (spec.pos): the next round starts at p + n_accepted + 1, which the host
learns one step late; a host-side position would force a device sync per round.

Why verify is a decode step over B*(K+1) rows (attention: GatedAttention.decode, the op decode runs) rather
than a prefill chunk: prefill attends one slot at a time, and a decode step writes every row's KV before
any row reads, with each row reading its slot's rows <= its own position, which is causal attention over
the K+1 tokens of each slot. GDN layers run gdn_decode_steps (the decode step per position over the B rows in
one op, reading the state once), keeping the state after each position (per-position snapshots: commit is a
gather, no recompute; graphs/spec.py _gdn_verify says why).

KV bound: a row at a position >= Tmax (the KV cache's length, max_seq_len) writes its KV to the scratch slot,
main model and head alike, so nothing is written past max_seq_len; such rows occur only in a request's
last rounds, and the host never emits their targets (a request's length is bounded by max_seq_len).
Rejected positions' KV rows (main model and head) are inert by position (graphs/spec.py verify / mtp_draft):
every later pass writes its rows before any query reads them, and a query reads rows <= its position.

State added to the artifact (`spec_state_spec`; S = slots + 1, the last slot scratch, as the main state):
  mtp{i}.k_cache, mtp{i}.v_cache [S, KVH, Tmax, D]   the head's KV cache (model dtype), per head layer
  spec.y   [S, H]   per slot: the head's final-normed output at position p-1, which predicts x_{p+1}
  spec.pos [S]      per slot: the committed length p (int64): last_tok[slot] is x_p, not yet fed
"""
from __future__ import annotations

import torch

from onegraph.models.qwen3_5.model import Qwen35Model
from onegraph.models.state import StateTensor
from onegraph.graphs.spec import (_head_in, _stack, check_k, draft_logits, mtp_catch_up, mtp_state_spec,
                                  prefill_hidden)

ops = torch.ops.onegraph


def spec_state_spec(model: Qwen35Model, slots: int, max_seq_len: int, dtype: torch.dtype) -> list[StateTensor]:
    """The speculative state after the main state: the head's KV, then spec.y and spec.pos."""
    S = slots + 1
    return mtp_state_spec(model.cfg, len(model.mtp.layers), slots, max_seq_len, dtype) + [
        StateTensor("spec.y", (S, model.cfg.hidden_size), dtype, "spec"),
        StateTensor("spec.pos", (S,), torch.int64, "spec")]


def _split_state(model: Qwen35Model, state):
    """Flat state -> (main state, head KV, spec.y, spec.pos)."""
    n_main, n_head = 2 * len(model.layers), 2 * len(model.mtp.layers)
    main, head = list(state[:n_main]), list(state[n_main:n_main + n_head])
    spec_y, spec_pos = state[n_main + n_head:]
    return main, head, spec_y, spec_pos


def prefill(model: Qwen35Model, tokens, slot, start_pos, n_valid, temperature, top_k, top_p, seed, next_tokens,
            *state):
    main, head, spec_y, spec_pos = _split_state(model, state)
    nxt, logits, hidden = prefill_hidden(model, tokens, slot, start_pos, n_valid, temperature, top_k, top_p, seed,
                                         *main)
    nt = torch.where(next_tokens < 0, nxt.expand(tokens.shape[0]), next_tokens)        # [T]: x_{t+1}
    y = mtp_catch_up(model, hidden, nt, slot, start_pos, n_valid, *head)               # [T, H]
    spec_y.index_copy_(0, slot, y.index_select(0, (n_valid - 1).clamp(min=0)))
    spec_pos.index_copy_(0, slot, start_pos + n_valid)
    return nxt, logits


def _gdn_verify_rows(attn, x, slots, B: int, T: int, conv, rec):
    """A GDN layer over T positions of B slots (x [B*T, H], row-major by slot), keeping the state after
    every position: -> (out [B*T, H], conv_after [T, B, C, W-1], rec_after [T, B, HV, K, V] fp32).
    One gdn_decode_steps op (T decode steps from the slots' rows, the state read once); the slots' conv / rec are
    not touched (committed after acceptance)."""
    qkv, z, b, a = (t.view(B, T, -1) for t in attn._in(x))
    core, convs, recs = ops.gdn_decode_steps(qkv, a, b, conv, rec, slots, attn.conv1d.weight[:, 0, :], attn.A_log,
                                             attn.dt_bias, attn.num_k_heads)                # core [B, T, HV, V]
    return attn._finish(core.reshape(B * T, *core.shape[2:]), z.reshape(B * T, -1)), convs, recs


def _head_step(model, y, tok, w_slots, pos, head):
    """One head decode step for B rows: head position pos on (y, tok) -> final-normed [B, H]."""
    def mixer(layer, x, st):
        return layer.self_attn.decode(x, w_slots, pos, model.inv_freq, *st)
    return _stack(model, model.mtp.layers, model.mtp.norm, _head_in(model, y, tok), head, mixer)


def step(model: Qwen35Model, k: int, tokens, slots, temperature, top_k, top_p, seed, *state):
    """One speculative round for B rows (module docstring). tokens [B] = x_p (last_tok[slots]); padding rows
    point at the scratch slot."""
    check_k(k)
    main, head, spec_y, spec_pos = _split_state(model, state)
    B, T, dev = tokens.shape[0], k + 1, tokens.device
    tmax = head[0].shape[2]
    scratch = spec_pos.shape[0] - 1
    sampling = (temperature, top_k, top_p, seed)                                  # each [B]
    pos = spec_pos.index_select(0, slots)                                         # [B] committed length p

    def inside(positions, rows):
        """rows' slots where positions < Tmax, else the scratch slot (inert writes past max_seq_len)."""
        return torch.where(positions < tmax, rows, torch.full_like(rows, scratch))

    # 1. draft: d1 from spec.y (head position p-1), d_i from head position p+i-2 on (y, d_{i-1});
    #    d_i is sampled with the noise of position p+i-1, where the target for the same token is sampled
    y = spec_y.index_select(0, slots)                                             # [B, H]
    drafts = [ops.sample(draft_logits(model, y), *sampling, pos)]
    for i in range(2, k + 1):
        hpos = pos + (i - 2)
        y = _head_step(model, y, drafts[-1], inside(hpos, slots), hpos, head)
        drafts.append(ops.sample(draft_logits(model, y), *sampling, pos + (i - 1)))
    drafts = torch.stack(drafts, 1)                                               # [B, k]

    # 2. verify: the main model over [x_p, d1..dk] at positions p..p+k, a decode step of B*T rows
    toks = torch.cat([tokens[:, None], drafts], 1).reshape(-1)                   # [N] = [B*T]
    positions = (pos[:, None] + torch.arange(T, device=dev)).reshape(-1)          # [N]
    row_slots = slots[:, None].expand(B, T).reshape(-1)                           # [N]
    w_slots = inside(positions, row_slots)
    snaps = []

    def mixer(layer, x, st):
        if layer.kind == "linear_attention":
            out, conv_after, rec_after = _gdn_verify_rows(layer.linear_attn, x, slots, B, T, *st)
            snaps.append((st, conv_after, rec_after))
            return out
        return layer.self_attn.decode(x, w_slots, positions, model.inv_freq, *st)

    hidden = model._layers(model.embed_tokens(toks), main, mixer)                 # [N, H]
    rep = [s[:, None].expand(B, T).reshape(-1) for s in sampling]
    targets = ops.sample(model._logits(hidden), *rep, positions).view(B, T)       # t_j predicts x_{p+j+1}

    # 3. accept and commit: the GDN state after position p + n_acc (KV rows of rejected positions are inert)
    n_acc = (drafts == targets[:, :k]).long().cumprod(1).sum(1)                  # [B] in 0..k
    rows = torch.arange(B, device=dev)
    for (conv, rec), conv_after, rec_after in snaps:
        conv.index_copy_(0, slots, conv_after[n_acc, rows])
        rec.index_copy_(0, slots, rec_after[n_acc, rows])

    # 4. the head catches up over the accepted positions p..p+n_acc on (h_t, x_{t+1} = target); the rows
    #    past the acceptance write the scratch slot; its output at p+n_acc drafts the next round's d1
    valid = (torch.arange(T, device=dev)[None, :] <= n_acc[:, None]).reshape(-1)  # [N]
    c_slots = torch.where(valid, w_slots, torch.full_like(w_slots, scratch))

    def head_mixer(layer, x, st):
        return layer.self_attn.decode(x, c_slots, positions, model.inv_freq, *st)

    y_all = _stack(model, model.mtp.layers, model.mtp.norm, _head_in(model, hidden, targets.reshape(-1)), head,
                   head_mixer).view(B, T, -1)
    spec_y.index_copy_(0, slots, y_all[rows, n_acc])
    new_pos = torch.where(slots == scratch, torch.zeros_like(pos), pos + n_acc + 1)
    spec_pos.index_copy_(0, slots, new_pos)
    return targets[rows, n_acc], n_acc, targets, drafts
