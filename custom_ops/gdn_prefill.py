"""gdn_prefill: the chunked gated delta rule (chunk 64) over T tokens of one slot.

Inputs: x [T, C] (post-conv, post-SiLU q ‖ k ‖ v), g [T, HV] fp32 log-decay, beta [T, HV] fp32,
rec_state [S, HV, K, V] fp32, slot [1] int64, num_k_heads, chunk_size.
Returns (out [T, HV, V] in x.dtype, new_rec_row [1, HV, K, V] fp32) — the same numbers (up to fp32
rounding) as T repeated `gdn_decode_step` recurrences. A token with g = 0 and beta = 0 leaves the
state untouched, which is how the model pads a chunk bucket.

Within a chunk the delta-rule updates are condensed with the UT transform: (I + L) U = beta*V
with L strictly lower, L_ij = beta_i (k_i . k_j) exp(G_i - G_j). (I + L)^-1 is built by recursive
block inversion (2x2 blocks, 6 levels for 64): exact, stable, a few dozen batched matmuls, and
traceable without `linalg.solve_triangular` (which has no AOTInductor C shim on every device).
"""
import torch

from ._registry import check_shape, define_op
from .gdn_decode_step import split_qkv

SCHEMA = ("(Tensor x, Tensor g, Tensor beta, Tensor rec_state, Tensor slot, int num_k_heads, "
          "int chunk_size) -> (Tensor, Tensor)")


def _validate(x, g, beta, rec_state, slot, num_k_heads, chunk_size):
    if rec_state.dim() != 4 or x.dim() != 2:
        raise ValueError(f"gdn_prefill: expected x [T, C] and rec_state [S, HV, K, V], got "
                         f"{list(x.shape)} and {list(rec_state.shape)}")
    T, C = x.shape
    S, HV, K, V = rec_state.shape
    if HV % num_k_heads or C != 2 * num_k_heads * K + HV * V:
        raise ValueError(f"gdn_prefill: x channels {C} != 2*{num_k_heads}*{K} + {HV}*{V}")
    check_shape(rec_state, (S, HV, K, V), "gdn_prefill rec_state", torch.float32)
    check_shape(g, (T, HV), "gdn_prefill g", torch.float32)
    check_shape(beta, (T, HV), "gdn_prefill beta", torch.float32)
    check_shape(slot, (1,), "gdn_prefill slot", torch.int64)
    if chunk_size <= 0 or chunk_size & (chunk_size - 1):
        raise ValueError(f"gdn_prefill chunk_size: expected a power of two, got {chunk_size}")


def unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for L [..., n, n] strictly lower triangular, n a power of two.

    blocks [..., m, s, s] hold the inverses of the m diagonal s×s blocks; each level merges pairs:
    inv([[A, 0], [B, D]]) = [[A^-1, 0], [-D^-1 B A^-1, D^-1]].
    """
    n = L.shape[-1]
    lead = L.shape[:-2]
    blocks = torch.ones(lead + (n, 1, 1), dtype=L.dtype, device=L.device)
    s = 1
    while s < n:
        m = n // (2 * s)
        # diagonal 2s-blocks of L: [..., m, 2s, m, 2s] -> [..., m, 2s, 2s]
        diag = L.reshape(lead + (m, 2 * s, m, 2 * s)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
        lower = diag[..., s:, :s]                                           # [..., m, s, s]
        inv_a, inv_d = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        off = -(inv_d @ lower @ inv_a)
        top = torch.cat([inv_a, torch.zeros_like(inv_a)], dim=-1)
        bottom = torch.cat([off, inv_d], dim=-1)
        blocks = torch.cat([top, bottom], dim=-2)                           # [..., m, 2s, 2s]
        s *= 2
    return blocks[..., 0, :, :]


def reference_gdn_prefill(x, g, beta, rec_state, slot, num_k_heads, chunk_size):
    T = x.shape[0]
    _, HV, K, V = rec_state.shape
    q, k, v = split_qkv(x, num_k_heads, K, HV, V)                           # [T, HV, K|V] fp32
    c = chunk_size
    pad = (-T) % c
    n = (T + pad) // c
    # [HV, n, c, *]; padded tokens have g = 0, beta = 0, k = q = v = 0: they change nothing
    def chunks(t):
        t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) if t.dim() == 3 else \
            torch.nn.functional.pad(t, (0, 0, 0, pad))
        return t.reshape((n, c) + tuple(t.shape[1:])).movedim(2, 0)
    q, k, v = chunks(q), chunks(k), chunks(v)                               # [HV, n, c, K|V]
    g, beta = chunks(g), chunks(beta)                                       # [HV, n, c]
    G = g.cumsum(-1)                                                        # log decay from chunk start
    causal = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [HV,n,c,c]
    kb = k * beta[..., None]
    L = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    inv = unit_lower_inverse(L)                                             # [HV, n, c, c]
    u = inv @ (v * beta[..., None])                                         # pseudo-values
    w = inv @ (kb * G.exp()[..., None])                                     # decayed keys reading the state
    attn = (q @ k.transpose(-1, -2)) * decay                                # intra-chunk, causal
    q_dec = q * G.exp()[..., None]
    k_dec = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()                                          # [HV, n]
    state = rec_state.index_select(0, slot)[0]                              # [HV, K, V]
    outs = []
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state                                   # [HV, c, V]
        outs.append(q_dec[:, i] @ state + attn[:, i] @ v_new)
        state = state * chunk_decay[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=1).reshape(HV, n * c, V)[:, :T].transpose(0, 1)
    return out.to(x.dtype).contiguous(), state[None]


def _fake(x, g, beta, rec_state, slot, num_k_heads, chunk_size):
    _, HV, K, V = rec_state.shape
    return x.new_empty((x.shape[0], HV, V)), rec_state.new_empty((1, HV, K, V))


gdn_prefill = define_op("gdn_prefill", version=1, schema=SCHEMA, reference=reference_gdn_prefill,
                        validate=_validate, fake=_fake)
