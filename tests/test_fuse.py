"""models/qwen3_5/fuse.py: concatenating the same-input projections changes the parameters, not the model."""
from __future__ import annotations

import torch

from onegraph.custom_ops.sample import Sampling
from onegraph.graphs.eager import generate_eager
from onegraph.models.qwen3_5.fuse import fuse_projections
from onegraph.checkpoint.load import load_model


def test_fused_model_generates_what_the_separate_projections_do():
    _, sep, _ = load_model("tiny", fuse=False)
    _, fused, _ = load_model("tiny")
    names = {n for n, _ in fused.named_parameters()}
    assert "layers.0.linear_attn.in_proj.weight" in names and "layers.3.self_attn.qkv_proj.weight" in names
    leaves = {n.split(".")[-2] for n in names}
    assert not leaves & {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "q_proj", "k_proj", "v_proj"}
    w = fused.layers[0].linear_attn.in_proj.weight
    assert torch.equal(w[: sep.layers[0].linear_attn.in_proj_qkv.weight.shape[0]],
                       sep.layers[0].linear_attn.in_proj_qkv.weight)
    assert torch.equal(w[-1], sep.layers[0].linear_attn.in_proj_a.weight[-1])
    prompt = [72, 101, 108, 108, 111, 44, 32]
    a = generate_eager(sep, prompt, 12, Sampling())
    b = generate_eager(fused, prompt, 12, Sampling())
    assert a.token_ids == b.token_ids
    diff = max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))
    assert diff <= 1e-5, f"fp32 logits moved by {diff} (only the GEMM's summation order may differ)"


def test_fuse_is_idempotent_and_keeps_the_parameter_count():
    _, m, _ = load_model("tiny")
    before = {n: p.data_ptr() for n, p in m.named_parameters()}
    n_params = sum(p.numel() for p in m.parameters())
    fuse_projections(m)
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == before
    _, sep, _ = load_model("tiny", fuse=False)
    assert sum(p.numel() for p in sep.parameters()) == n_params


def test_fp8_gdn_in_proj_is_one_projection_with_its_float_tail():
    """FP8 tiny (`--quant fp8`): the e4m3 [qkv; z] run and the float [b; a] run are one Fp8WithTail (one linear_fp8
    call with its tail); attention's [q; k] + [v] stays two runs (k is half a block); the model generates what the
    separate projections do (fp32: only the GEMM's summation order may differ)."""
    from onegraph.models.qwen3_5.fuse import ConcatProj, Fp8WithTail, projection_groups
    _, sep, _ = load_model("tiny", quant="fp8", fuse=False)
    _, fused, _ = load_model("tiny", quant="fp8")
    gdn, sgdn = fused.layers[0].linear_attn, sep.layers[0].linear_attn
    assert isinstance(gdn.in_proj, Fp8WithTail) and isinstance(fused.layers[3].self_attn.qkv_proj, ConcatProj)
    assert torch.equal(gdn.in_proj.tail, torch.cat([sgdn.in_proj_b.weight, sgdn.in_proj_a.weight]))
    assert torch.equal(gdn.in_proj.weight_scale_inv, torch.cat([sgdn.in_proj_qkv.weight_scale_inv,
                                                                sgdn.in_proj_z.weight_scale_inv]))
    assert {n for n, _ in fused.named_parameters() if n.startswith("layers.0.linear_attn.in_proj")} == {
        f"layers.0.linear_attn.in_proj.{p}" for p in ("weight", "weight_scale_inv", "tail")}
    assert projection_groups(fused)["linear_attn.in_proj"] == {"e4m3 384 with float32 tail 8": 3}
    x = torch.randn(3, fused.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for a, b in zip(gdn._in(x), sgdn._in(x)):
        assert torch.allclose(a, b, rtol=0, atol=1e-5 * b.abs().max().item())
    prompt = [72, 101, 108, 108, 111, 44, 32]
    a = generate_eager(sep, prompt, 12, Sampling())
    b = generate_eager(fused, prompt, 12, Sampling())
    assert a.token_ids == b.token_ids
    diff = max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))
    assert diff <= 1e-5, f"fp32 logits moved by {diff} (only the GEMM's summation order may differ)"
