"""Qwen3.5/3.6 hybrid (Gated DeltaNet + gated full attention + MoE or dense MLP), written for tracing.

Contract (why state is an input mutated in place: docs/design.md):
- Parameters carry the HF names without the `model.` prefix (experts fused as gate_up_proj
  [E, 2I, H] and down_proj [E, H, I]), so weights.py is a key mapping and nothing more.
- State is a flat list of tensors owned by the caller and mutated in place by both entry points,
  laid out by `state_spec` (S = slots + 1; the last slot is scratch for padding rows):
    per full-attention layer: k_cache, v_cache [S, KVH, Tmax, D] (model dtype)
    per GDN layer:            conv [S, C, W-1] (model dtype), rec [S, HV, K, V] (fp32)
- decode(tokens[B], slots[B], positions[B], temperature[B], top_k[B], top_p[B], seed[B], *state)
    -> (next_ids [B] int64, logits [B, vocab] fp32)
- prefill(tokens[T], slot[1], start_pos[1], n_valid[1], temperature[1], top_k[1], top_p[1],
          seed[1], *state) -> (next_id [1] int64, last_logits [1, vocab] fp32)
  Tokens n_valid..T-1 are padding: their KV writes go to the scratch slot and their GDN gates are
  zeroed, so a padded chunk leaves the same state as an exact one.
- Tensor parallel (models/qwen3_5/tp.py has the plan): Qwen35Model(cfg, tp, group) holds one rank's shard;
  head counts, intermediate sizes and the state layout are the rank's (`state_spec(..., tp)`). The
  token-mixer and MLP outputs are all-reduced and the vocab-sharded logits all-gathered with torch
  functional collectives, which torch.export keeps as `_c10d_functional` graph nodes. tp=1 adds no op.
- fp32_reduce (an export option): the row-parallel projections (o_proj, GDN out_proj, MoE / MLP down)
  return their fp32 accumulation, all-reduced in fp32 and rounded to the model dtype once, so a bf16
  model's result does not depend on the TP degree (TP-N == TP-1 up to fp32 summation order). Off, each
  projection rounds to the model dtype as transformers' does (and each rank's partial rounds).
No Python control flow depends on tensor values; no env reads; no device branches.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from onegraph import custom_ops  # noqa: F401  (registers torch.ops.onegraph)

from onegraph.models.qwen3_5.config import ModelConfig
from onegraph.models.state import StateTensor
from onegraph.models.qwen3_5.fuse import ConcatProj, rows
from onegraph.models.qwen3_5.linear import Linear
from onegraph.models.qwen3_5.tp import LocalDims, local_dims

ops = torch.ops.onegraph
GDN_CHUNK = 64


def state_spec(cfg: ModelConfig, slots: int, max_seq_len: int, dtype: torch.dtype, tp: int = 1) -> list[StateTensor]:
    """The state layout for `slots` request slots (+1 scratch slot) of up to max_seq_len tokens
    (one rank's heads and channels at tp > 1)."""
    S, d = slots + 1, local_dims(cfg, tp)
    spec = []
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            kv = (S, d.num_kv_heads, max_seq_len, cfg.head_dim)
            spec += [StateTensor(f"layer{i}.k_cache", kv, dtype, "kv"), StateTensor(f"layer{i}.v_cache", kv, dtype, "kv")]
        else:
            spec += [StateTensor(f"layer{i}.conv", (S, d.conv_dim, cfg.conv_kernel - 1), dtype, "conv"),
                     StateTensor(f"layer{i}.rec", (S, d.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim),
                                 torch.float32, "recurrent")]
    return spec


def new_state(cfg: ModelConfig, slots: int, max_seq_len: int, dtype: torch.dtype, device="cpu",
              tp: int = 1) -> list[torch.Tensor]:
    # zeros, never empty: padding rows read the scratch slot and NaN garbage would leak
    return [torch.zeros(t.shape, dtype=t.dtype, device=device)
            for t in state_spec(cfg, slots, max_seq_len, dtype, tp)]


def _linear(n_in, n_out, bias=False):
    return Linear(n_in, n_out, bias=bias)


class RowLinear(Linear):
    """A row-parallel projection (its output is all-reduced under TP). fp32_out: returns the fp32
    accumulation unrounded (onegraph::linear_f32), for `fp32_reduce`. x [N, in] -> [N, out]."""

    def __init__(self, n_in, n_out, bias=False, fp32_out=False):
        super().__init__(n_in, n_out, bias=bias)
        self.fp32_out = fp32_out

    def forward(self, x):
        if not self.fp32_out or self.weight.dtype in (torch.float8_e4m3fn, torch.int8):  # Linear handles fp32_out
            return super().forward(x)
        y = ops.linear_f32(x, self.weight)
        return y if self.bias is None else y + self.bias.float()


def _split(mod, x, parts):
    """The outputs of `parts` (Linear attributes of mod) for input x: views of one concatenated
    projection once models/qwen3_5/fuse.py has fused them, else one projection each."""
    if mod.fused_sizes is None:
        return [getattr(mod, p)(x) for p in parts]
    proj = mod.fused_proj
    if not isinstance(proj, ConcatProj):              # one weight, or an FP8 run with its float tail (Fp8WithTail)
        return proj(x).split(mod.fused_sizes, dim=-1)
    # runs that could not concatenate (FP8 runs that straddle a block): each run's output split on its own; joining
    # them first (ConcatProj.forward) cost a copy kernel per part per step, ~1 us each at the 35B bs1 step
    out, sizes = [], iter(mod.fused_sizes)
    for run in proj.runs:
        mine, n = [], rows(run)
        while n > 0:
            mine.append(next(sizes))
            n -= mine[-1]
        if n:                                         # models/qwen3_5/fuse.py concatenates whole parts: never reached
            raise ValueError(f"fused projection: a run of {rows(run)} rows straddles the parts {mod.fused_sizes}")
        out += run(x).split(mine, dim=-1)
    return out


class RMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, d: LocalDims, fp32_reduce: bool = False):
        super().__init__()
        H, C = cfg.hidden_size, d.conv_dim
        vd = d.linear_v_heads * cfg.linear_v_dim
        self.cfg, self.num_k_heads = cfg, d.linear_k_heads
        self.in_proj_qkv = _linear(H, C)
        self.in_proj_z = _linear(H, vd)
        self.in_proj_b = _linear(H, d.linear_v_heads)
        self.in_proj_a = _linear(H, d.linear_v_heads)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(C, 1, cfg.conv_kernel))   # HF layout [C, 1, W]
        self.A_log = nn.Parameter(torch.zeros(d.linear_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(d.linear_v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(cfg.linear_v_dim))
        self.out_proj = RowLinear(vd, H, fp32_out=fp32_reduce)
        self.fused_sizes = None                      # models/qwen3_5/fuse.py: in_proj = [qkv; z; b; a]

    @property
    def fused_proj(self):
        return self.in_proj

    def _in(self, x):
        """x [N, H] (normed input) -> qkv [N, C], z [N, HV*V], b [N, HV], a [N, HV]."""
        return _split(self, x, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))

    def _finish(self, core, z):
        """core [N, HV, V], z [N, HV*V] -> [N, H]."""
        cfg = self.cfg
        y = ops.gated_rms_norm(core.reshape(-1, cfg.linear_v_dim), z.reshape(-1, cfg.linear_v_dim), self.norm.weight,
                               cfg.rms_norm_eps)
        return self.out_proj(y.reshape(z.shape[0], -1))

    def decode(self, x, slots, conv, rec):
        """x [B, H] -> [B, H]; writes this step's conv/rec rows of `slots`."""
        qkv, z, b, a = self._in(x)                   # views of the fused projection's output, no copies
        # the step and the output norm in one op; export may fold the two row writes into it (export/inplace.py)
        y, new_conv, new_rec = ops.gdn_decode_step_norm(
            qkv, a, b, z, conv, rec, slots, self.conv1d.weight[:, 0, :], self.A_log, self.dt_bias, self.norm.weight,
            self.num_k_heads, self.cfg.rms_norm_eps)                             # y [B, HV, V]
        conv.index_copy_(0, slots, new_conv)
        rec.index_copy_(0, slots, new_rec)
        return self.out_proj(y.reshape(x.shape[0], -1))

    def prefill(self, x, slot, start_pos, n_valid, conv, rec):
        """x [T, H] -> [T, H]; tokens >= n_valid are padding and leave the state untouched."""
        cfg = self.cfg
        # a prefill from position 0 starts the slot afresh: a branch-free reset (where, not multiply,
        # so even a NaN left behind in a slot cannot survive it)
        fresh = start_pos == 0
        conv.index_copy_(0, slot, torch.where(fresh, 0.0, conv.index_select(0, slot)).to(conv.dtype))
        rec.index_copy_(0, slot, torch.where(fresh, 0.0, rec.index_select(0, slot)))
        qkv, z, b, a = self._in(x)
        qkv, new_conv = ops.causal_conv_prefill(qkv, conv, slot, n_valid, self.conv1d.weight[:, 0, :])
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)   # [T, HV]
        beta = b.sigmoid().float()
        valid = (torch.arange(x.shape[0], device=x.device) < n_valid)[:, None]
        g, beta = g * valid, beta * valid
        core, new_rec = ops.gdn_prefill(qkv, g, beta, rec, slot, self.num_k_heads, GDN_CHUNK)
        conv.index_copy_(0, slot, new_conv)
        rec.index_copy_(0, slot, new_rec)
        return self._finish(core, z)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, d: LocalDims, fp32_reduce: bool = False):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.cfg, self.num_heads, self.num_kv_heads = cfg, d.num_heads, d.num_kv_heads
        self.q_proj = _linear(H, d.num_heads * D * 2, cfg.attention_bias)      # query ‖ gate per head
        self.k_proj = _linear(H, d.num_kv_heads * D, cfg.attention_bias)
        self.v_proj = _linear(H, d.num_kv_heads * D, cfg.attention_bias)
        self.o_proj = RowLinear(d.num_heads * D, H, cfg.attention_bias, fp32_out=fp32_reduce)
        self.q_norm = RMSNorm(D)
        self.k_norm = RMSNorm(D)
        self.scale = D ** -0.5
        self.fused_sizes = None                      # models/qwen3_5/fuse.py: qkv_proj = [q; k; v]

    @property
    def fused_proj(self):
        return self.qkv_proj

    def _qkv(self, x, positions, inv_freq):
        """x [N, H] -> q [N, Hq, D], gate [N, Hq, D] (a strided view of the projection), k, v [N, KVH, D]
        (q, k normed and rotated by one op: one kernel launch on CUDA, reading q and k in place)."""
        cfg, N, D = self.cfg, x.shape[0], self.cfg.head_dim
        qg, k, v = _split(self, x, ("q_proj", "k_proj", "v_proj"))
        qg = qg.view(N, self.num_heads, 2 * D)                  # query ‖ gate per head
        q, k = ops.qk_norm_rope(qg[..., :D], k.view(N, self.num_kv_heads, D), self.q_norm.weight,
                                self.k_norm.weight, positions, inv_freq, cfg.rms_norm_eps)
        return q, qg[..., D:], k, v.view(N, self.num_kv_heads, D)

    def _out(self, o, gate):
        """o, gate [N, Hq, D] -> o_proj(o * sigmoid(gate)) [N, H]."""
        N = o.shape[0]
        return self.o_proj(o.reshape(N, -1) * torch.sigmoid(gate.reshape(N, -1)))

    def decode(self, x, slots, positions, inv_freq, k_cache, v_cache):
        """x [B, H] -> [B, H]; writes this step's k/v at (slots, positions), positions past the cache
        clamped to its last row (never index past the cache)."""
        return self.decode_rows(x, slots, positions, positions.clamp(0, k_cache.shape[2] - 1), inv_freq, k_cache,
                                v_cache)

    def decode_rows(self, x, slots, positions, w_pos, inv_freq, k_cache, v_cache):
        """decode at w_pos, positions (>= 0) clamped into the cache (Qwen35Model.decode clamps once per step for
        every layer): rope and this step's k/v rows. The keys attended (j <= position) are the same for
        positions as for w_pos, so attention takes positions, a graph input: handed the clamp, a kernel got it
        recomputed by AOTInductor into a one-element buffer of its own (a launch per kernel and layer)."""
        q, gate, k, v = self._qkv(x, w_pos, inv_freq)
        k_cache[slots, :, w_pos] = k   # [B, KVH, D] at (slot, :, pos)
        v_cache[slots, :, w_pos] = v
        # the output gate is applied inside the op (the CUDA lowering's combine kernel)
        o = ops.attention_decode(q, k_cache, v_cache, slots, positions, self.scale, gate)    # [B, Hq, D]
        return self.o_proj(o.reshape(o.shape[0], -1))

    def prefill(self, x, slot, start_pos, n_valid, inv_freq, k_cache, v_cache):
        T = x.shape[0]
        i = torch.arange(T, device=x.device)
        positions = start_pos + i
        q, gate, k, v = self._qkv(x, positions, inv_freq)
        # padding tokens write into the scratch slot (last), at a clamped position
        scratch = k_cache.shape[0] - 1
        valid = i < n_valid
        w_slot = torch.where(valid, slot.expand(T), torch.full_like(slot.expand(T), scratch))
        w_pos = torch.where(valid, positions, positions.clamp(max=k_cache.shape[2] - 1))
        k_cache[w_slot, :, w_pos] = k
        v_cache[w_slot, :, w_pos] = v
        return self._out(ops.attention_prefill(q, k_cache, v_cache, slot, start_pos, self.scale), gate)


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig, d: LocalDims, fp32_reduce: bool = False):
        super().__init__()
        H, E, I, Is = cfg.hidden_size, cfg.num_experts, d.moe_intermediate, d.shared_intermediate
        self.top_k, self.fp32_out = cfg.top_k, fp32_reduce
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(E, H))
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.experts.down_proj = nn.Parameter(torch.zeros(E, H, I))
        self.shared_expert = DenseMlp(H, Is)
        self.shared_expert_gate = _linear(H, 1)
        self.fused_sizes = None                      # models/qwen3_5/fuse.py: router = [gate; shared_expert_gate]

    @property
    def router_weight(self):
        """[E + 1, H]: the router's rows, then the shared expert gate's (fused_moe's logits projection)."""
        if self.fused_sizes is None:
            return torch.cat([self.gate.weight, self.shared_expert_gate.weight])
        return self.router.weight

    def forward(self, x, logits):
        """x [N, H] (normed), logits [N, E + 1] = x @ router_weight.T -> [N, H]. Block-FP8 experts and shared
        expert (checkpoint/quant.py make_fp8_moe): the same through onegraph::fused_moe_fp8."""
        se, ex = self.shared_expert, self.experts
        if ex.gate_up_proj.dtype == torch.float8_e4m3fn:
            return ops.fused_moe_fp8(x, logits, ex.gate_up_proj, ex.gate_up_proj_scale_inv, ex.down_proj,
                                     ex.down_proj_scale_inv, se.gate_proj.weight, se.gate_proj.weight_scale_inv,
                                     se.up_proj.weight, se.up_proj.weight_scale_inv, se.down_proj.weight,
                                     se.down_proj.weight_scale_inv, self.top_k, self.fp32_out)
        return ops.fused_moe(x, logits, self.experts.gate_up_proj, self.experts.down_proj,
                             se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight, self.top_k, self.fp32_out)


class DenseMlp(nn.Module):
    def __init__(self, H, I, fp32_reduce: bool = False):
        super().__init__()
        self.gate_proj, self.up_proj = _linear(H, I), _linear(H, I)
        self.down_proj = RowLinear(I, H, fp32_out=fp32_reduce)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, d: LocalDims, fp32_reduce: bool):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, d, fp32_reduce)
        else:
            self.self_attn = GatedAttention(cfg, d, fp32_reduce)
        self.mlp = (SparseMoe(cfg, d, fp32_reduce) if cfg.is_moe
                    else DenseMlp(cfg.hidden_size, d.intermediate_size, fp32_reduce))
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def mlp_block(self, mixed, h, eps):
        """The post-attention residual add + RMSNorm, then the MLP. mixed, h [N, H] -> (MLP output [N, H]
        (a partial sum under TP), the new residual stream h [N, H]). MoE: the norm is folded into the router
        projection (add_rms_norm_linear), whose normed rows the experts read."""
        w = self.post_attention_layernorm.weight
        if isinstance(self.mlp, SparseMoe):
            logits, x, h = ops.add_rms_norm_linear(mixed, h, w, eps, self.mlp.router_weight)
            return self.mlp(x, logits), h
        x, h = ops.add_rms_norm(mixed, h, w, eps)
        return self.mlp(x), h


class Qwen35Model(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int = 1, group=None, fp32_reduce: bool = False):
        """tp > 1: this rank's shard (load it with models/qwen3_5/tp.py shard_state_dict); `group` is the
        tensor-parallel process group (None: the default group). fp32_reduce: see the module docstring."""
        super().__init__()
        self.cfg, self.tp, self.group, self.fp32_reduce = cfg, tp, group, fp32_reduce
        d = self.dims = local_dims(cfg, tp)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kind, d, fp32_reduce) for kind in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size)
        if not cfg.tie_word_embeddings or tp > 1:                       # tp > 1: a vocab shard, even if tied
            self.lm_head = _linear(cfg.hidden_size, d.vocab)
        self.register_buffer("inv_freq", self.rope_inv_freq(cfg), persistent=False)

    @staticmethod
    def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
        # computed exactly as the reference model does, in fp32: [rotary_dim / 2]
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float) / cfg.rotary_dim))

    @property
    def lm_head_weight(self):
        return self.lm_head.weight if hasattr(self, "lm_head") else self.embed_tokens.weight

    def untie_head(self) -> None:
        """A tied model (lm_head = embed_tokens) gets an `lm_head` of its own holding a copy of the table, so the
        head can take another weight format than the embedding (checkpoint/quant.py quantize_lm_head)."""
        if not hasattr(self, "lm_head"):
            w = self.embed_tokens.weight
            self.lm_head = _linear(w.shape[1], w.shape[0]).to(device=w.device, dtype=w.dtype)
            self.lm_head.weight.data.copy_(w.detach())

    def _group(self):
        import torch.distributed as dist
        return self.group if self.group is not None else dist.group.WORLD

    def _all_reduce(self, x, dtype):
        """Sum of the ranks' partial outputs (row-parallel projections), in the model dtype `dtype` (one
        rounding after the fp32 sum under fp32_reduce); at tp=1 only that rounding."""
        if self.tp > 1:
            from torch.distributed import _functional_collectives as funcol
            x = funcol.all_reduce(x, "sum", self._group())
        return x.to(dtype)

    def state_spec(self, slots: int, max_seq_len: int, dtype: torch.dtype) -> list[StateTensor]:
        return state_spec(self.cfg, slots, max_seq_len, dtype, self.tp)

    def _layers(self, h, state, mixer):
        """Runs every layer; mixer(layer, normed, layer_state) -> token-mixer output. h [N, H]."""
        eps, it = self.cfg.rms_norm_eps, iter(state)
        x = ops.rms_norm(h, self.layers[0].input_layernorm.weight, eps)
        for li, layer in enumerate(self.layers):
            mixed = self._all_reduce(mixer(layer, x, (next(it), next(it))), h.dtype)
            m, h = layer.mlp_block(mixed, h, eps)
            m = self._all_reduce(m, h.dtype)              # MoE: routed + gated shared, both partial: one reduce
            nxt = self.layers[li + 1].input_layernorm.weight if li + 1 < len(self.layers) else self.norm.weight
            x, h = ops.add_rms_norm(m, h, nxt, eps)
        return x                                                            # final-normed [N, H]

    def _logits(self, x):
        # [N, vocab / tp] fp32; the head module (float or block FP8) where the model has one, else the tied table
        logits = (self.lm_head(x) if hasattr(self, "lm_head") else ops.linear(x, self.embed_tokens.weight)).float()
        if self.tp == 1:
            return logits
        from torch.distributed import _functional_collectives as funcol
        N = x.shape[0]
        # all_gather_single (torch >= 2.12; all_gather_tensor, its old name, warns there): one graph node either way
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        parts = gather(logits, 0, self._group())                          # [tp * N, vocab / tp], rank-major
        full = parts.reshape(self.tp, N, -1).permute(1, 0, 2).reshape(N, -1)
        return full[:, : self.cfg.vocab_size]                              # drop the vocab padding rows

    def decode(self, tokens, slots, positions, temperature, top_k, top_p, seed, *state):
        kinds = self.cfg.layer_types
        # the KV write rows clamped once per step, not per layer: never index past the cache
        w_pos = (positions.clamp(0, state[2 * kinds.index("full_attention")].shape[2] - 1)
                 if "full_attention" in kinds else positions)

        def mixer(layer, x, st):
            if layer.kind == "linear_attention":
                return layer.linear_attn.decode(x, slots, *st)
            return layer.self_attn.decode_rows(x, slots, positions, w_pos, self.inv_freq, *st)

        logits = self._logits(self._layers(self.embed_tokens(tokens), state, mixer))
        return ops.sample(logits, temperature, top_k, top_p, seed, positions), logits

    def prefill(self, tokens, slot, start_pos, n_valid, temperature, top_k, top_p, seed, *state):
        def mixer(layer, x, st):
            if layer.kind == "linear_attention":
                return layer.linear_attn.prefill(x, slot, start_pos, n_valid, *st)
            return layer.self_attn.prefill(x, slot, start_pos, n_valid, self.inv_freq, *st)

        x = self._layers(self.embed_tokens(tokens), state, mixer)          # [T, H]
        logits = self._logits(x.index_select(0, (n_valid - 1).clamp(min=0)))  # [1, vocab]: last valid token
        return ops.sample(logits, temperature, top_k, top_p, seed, start_pos + n_valid - 1), logits
