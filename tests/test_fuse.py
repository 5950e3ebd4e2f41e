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
