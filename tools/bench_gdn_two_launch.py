"""The GDN decode op at batch 1 in two launches instead of three, measured (H200:
benchmarks/h200_gdn_two_launch.json; not adopted).

    python -m onegraph.tools.bench_gdn_two_launch OUT.json

35B shape, in place, 30 layers' own inputs per CUDA graph: the split path (conv update, step, gated norm:
gdn_decode_step_norm's launcher) vs the step with the conv inside (its new conv rows to a scratch buffer, since
16 programs read a key head's conv rows and none may shift them in place) followed by a gated norm kernel that
also shifts the conv state rows in place (by then every read of them is done). Parity: one step from the same
state, outputs and both states compared."""
import json, sys
import torch
import triton
import triton.language as tl

from onegraph.custom_ops.triton import gdn_decode_step, norms
from onegraph.custom_ops.triton.gdn_decode_step_norm import _launch
from onegraph.custom_ops.triton._common import rnd, to_dt, next_pow2
from onegraph.tools.bench_common import replay_us


@triton.jit
def _gnorm_shift_kernel(x, z, w, y, sx_r, sz_r, N, eps, qkv, conv_state, slots, s_q_b, s_cs_s, s_cs_c, s_cs_w,
                        C, ZH: tl.constexpr, BN: tl.constexpr, CPB: tl.constexpr, W: tl.constexpr, BW: tl.constexpr):
    r = tl.program_id(0)
    b = r // ZH
    # conv state shift for channels [r % ZH * CPB, +CPB) of row slots[b] (loads first, a barrier, then stores)
    ch = (r % ZH) * CPB + tl.arange(0, CPB)
    mc = ch < C
    kk = tl.arange(0, BW)
    slot = tl.load(slots + b)
    row = conv_state + slot * s_cs_s
    nxt = tl.load(row + ch[:, None] * s_cs_c + (kk[None, :] + 1) * s_cs_w, mask=mc[:, None] & (kk[None, :] + 1 < W - 1),
                  other=0.0)
    xv = tl.load(qkv + b * s_q_b + ch, mask=mc, other=0.0)
    nxt = tl.where(kk[None, :] == W - 2, to_dt(xv.to(tl.float32), conv_state.dtype.element_ty)[:, None], nxt)
    offs = tl.arange(0, BN)
    m = offs < N
    xf = tl.load(x + r * sx_r + offs, mask=m, other=0.0).to(tl.float32)
    zf = tl.load(z + b * sz_r + ((r % ZH) * N + offs), mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + tl.cast(eps, tl.float32))
    yv = rnd(xf * inv, x.dtype.element_ty)
    yv = rnd(tl.load(w + offs, mask=m, other=0.0).to(tl.float32) * yv, x.dtype.element_ty)
    tl.store(y + r * N + offs, to_dt(yv * zf * tl.sigmoid(zf), y.dtype.element_ty), mask=m)
    tl.debug_barrier()
    tl.store(row + ch[:, None] * s_cs_c + kk[None, :] * s_cs_w, nxt, mask=mc[:, None] & (kk[None, :] < W - 1))


def two_launch(qkv, a, b, z, conv_state, rec_state, slots, conv_w, A_log, dt_bias, norm_w, HK, eps, y, scratch):
    B, C = qkv.shape
    _, HV, K, V = rec_state.shape
    out = torch.empty(y.shape, dtype=qkv.dtype, device=qkv.device)
    gdn_decode_step.run(qkv, a, b, conv_state, rec_state, slots, conv_w, A_log, dt_bias, HK, out, scratch, rec_state,
                        conv_in=False)
    _gnorm_shift_kernel[(B * HV,)](out, z, norm_w, y, V, z.stride(0), V, eps, qkv, conv_state, slots, qkv.stride(0),
                                   *conv_state.stride(), C, ZH=HV, BN=next_pow2(V), CPB=C // HV, W=4, BW=4,
                                   num_warps=4)


def rand(g, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype)


def cases(n, g, B=1):
    HK, HV, K, V, W, C = 16, 32, 128, 128, 4, 8192
    out = []
    for _ in range(n):
        proj = rand(g, B, C + HV * V + 2 * HV)
        qkv, z, bb, a = proj.split([C, HV * V, HV, HV], -1)
        out.append(dict(qkv=qkv, a=a, b=bb, z=z, conv_state=rand(g, B + 1, C, W - 1),
                        rec_state=rand(g, B + 1, HV, K, V, scale=0.1, dtype=torch.float32),
                        slots=torch.tensor([0], device="cuda"), conv_w=rand(g, C, W, scale=0.5),
                        A_log=rand(g, HV, scale=0.5), dt_bias=rand(g, HV), norm_w=rand(g, V),
                        y=torch.empty(B, HV, V, device="cuda", dtype=torch.bfloat16),
                        scratch=torch.empty(B, C, W - 1, device="cuda", dtype=torch.bfloat16)))
    return out


def run(cs, mode):
    for c in cs:
        args = (c["qkv"], c["a"], c["b"], c["z"], c["conv_state"], c["rec_state"], c["slots"], c["conv_w"], c["A_log"],
                c["dt_bias"], c["norm_w"], 16, 1e-6, c["y"])
        if mode == "three":
            _launch(*args, c["conv_state"], c["rec_state"])
        else:
            two_launch(*args, c["scratch"])


def time_mode(cs, mode):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(cs, mode)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(cs, mode)
    return replay_us(g, 5, 50) / len(cs)


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {}
    # parity: one step each from the same state
    c3 = cases(1, g)
    c2 = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in c3[0].items()}]
    run(c3, "three"); run(c2, "two"); torch.cuda.synchronize()
    res["y_max_diff"] = float((c3[0]["y"].float() - c2[0]["y"].float()).abs().max())
    res["conv_state_equal"] = bool(torch.equal(c3[0]["conv_state"], c2[0]["conv_state"]))
    res["rec_max_diff"] = float((c3[0]["rec_state"] - c2[0]["rec_state"]).abs().max())
    cs = cases(30, g)
    for rep in range(2):
        for mode in ("three", "two"):
            res[f"{mode}_us_{rep}"] = round(time_mode(cs, mode), 2)
    print(json.dumps(res))
    json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
