"""The builtin model's trainer (scripts/train_tiny.py): its training forward is the inference path's math,
the MTP head reads only what it may, a few steps on a small slice lower the loss, and the checkpoint it
writes is the hub layout the loader reads back.
"""
import math

import pytest
import torch

from onegraph.custom_ops.sample import Sampling
from onegraph.models.qwen3_5.model import new_state
from onegraph.scripts import train_tiny as tt


@pytest.fixture(scope="module")
def perturbed():
    """tiny's shape with the trainer's init plus noise, so norms and gates are not at their identity."""
    cfg, model = tt.build(0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return cfg, model


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 264, (2, 72), generator=torch.Generator().manual_seed(2))     # [B, T+2]


def test_training_forward_is_the_prefill_path(perturbed, tokens, one_thread):
    """Position t of the batched training forward (the ops' references under autograd) == the logits
    the model's own prefill (registered ops, per sequence) gives after tokens 0..t. 70 tokens cross a
    GDN chunk (64). Measured: <= 2e-6."""
    cfg, model = perturbed
    with torch.no_grad():
        logits, _, _ = tt.forward(model, tokens)
        for b in range(tokens.shape[0]):
            for T in (70, 33, 1):
                state = new_state(cfg, 1, 128, torch.float32)
                _, ref = model.prefill(tokens[b, :T], torch.tensor([0]), torch.tensor([0]), torch.tensor([T]),
                                       *Sampling().tensors(1, "cpu"), *state)
                torch.testing.assert_close(logits[b, T - 1], ref[0], atol=1e-4, rtol=0)


def test_mtp_reads_up_to_the_next_token_only(perturbed, tokens, one_thread):
    """The MTP logits at position t (predicting x_{t+2}) depend on x_0..x_{t+1} and on nothing after:
    changing x_{t+2} leaves positions <= t unchanged and moves position t+1; the main logits at t depend
    on x_0..x_t only."""
    _, model = perturbed
    t = 40
    changed = tokens.clone()
    changed[:, t + 2] = (changed[:, t + 2] + 1) % 256
    with torch.no_grad():
        main_a, mtp_a, _ = tt.forward(model, tokens)
        main_b, mtp_b, _ = tt.forward(model, changed)
    torch.testing.assert_close(mtp_a[:, : t + 1], mtp_b[:, : t + 1], atol=0, rtol=0)
    assert (mtp_a[:, t + 1] - mtp_b[:, t + 1]).abs().max() > 1e-3
    torch.testing.assert_close(main_a[:, : t + 2], main_b[:, : t + 2], atol=0, rtol=0)
    assert (main_a[:, t + 2] - main_b[:, t + 2]).abs().max() > 1e-3


def test_heldout_files_exist_and_are_not_trained_on():
    root = tt.stdlib_root()
    held = tt.heldout_files()
    assert len(held) >= 10 and all((root / f).is_file() for f in held)
    train = tt.corpus_files(root)
    assert not set(held) & (set(train) - set(held)) and len(train) > 20 * len(held)
    assert all(not any(p in tt.EXCLUDED_DIRS for p in f.split("/")[:-1]) for f in train)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("train") / "ck"
    res = tt.train(out, steps=12, batch=4, seq_len=64, lr=3e-3, seed=0, warmup=3, eval_every=4, max_files=6,
                   command="test", log=lambda *a: None)
    return out, res


def test_a_few_steps_lower_the_loss(trained):
    """12 steps on 6 files: the held-out loss (16 fixed windows) falls from about ln(264) = 5.6 nats by
    more than a nat, and so does the MTP head's."""
    _, res = trained
    first, last = res["held_out"][0], res["held_out"][-1]
    assert len(res["held_out"]) == 3 and len(res["curve"]) == 12
    assert res["curve"][0]["loss"] > math.log(264) - 0.2
    assert last["held_out_loss"] < res["curve"][0]["loss"] - 1.0
    assert last["held_out_loss"] < first["held_out_loss"]
    assert last["held_out_mtp_loss"] < res["curve"][0]["mtp_loss"] - 1.0


def assert_mtp_loaded(model, sd, cfg):
    """Every `mtp.*` tensor of the checkpoint `sd` equals the parameter it loaded into (per-expert keys
    into the fused [E, 2I, H] / [E, H, I] tensors)."""
    params = dict(model.named_parameters())
    mtp_keys = [k for k in sd if k.startswith("mtp.")]
    assert len(mtp_keys) > 20
    for k in mtp_keys:
        if ".experts." in k:                     # mtp.layers.0.mlp.experts.{e}.{part}.weight -> fused [E, ...]
            prefix, e, part = k[: k.index(".experts.")], int(k.split(".")[-3]), k.split(".")[-2]
            I = cfg.moe_intermediate
            gate_up, down = params[f"{prefix}.experts.gate_up_proj"], params[f"{prefix}.experts.down_proj"]
            got = {"gate_proj": gate_up[e, :I], "up_proj": gate_up[e, I:], "down_proj": down[e]}[part]
        else:
            got = params[k]
        assert torch.equal(got, sd[k]), k


def test_checkpoint_is_the_hub_layout(trained):
    """Per-expert keys under `model.`, the MTP head under `mtp.` (fc [H, 2H], one layer with the MoE),
    and the whole of it loads with the head attached, each tensor equal to the checkpoint's."""
    from safetensors.torch import load_file
    from onegraph.checkpoint.load import load_model
    out, _ = trained
    sd = load_file(str(out / "model.safetensors"))
    cfg, model, _ = load_model(out, mtp=True)
    H = cfg.hidden_size
    assert sd["mtp.fc.weight"].shape == (H, 2 * H)
    for k in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
              "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.gate.weight",
              f"mtp.layers.0.mlp.experts.{cfg.num_experts - 1}.down_proj.weight",
              "mtp.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.mlp.experts.0.gate_proj.weight",
              "model.embed_tokens.weight", "lm_head.weight"):
        assert k in sd, k
    assert_mtp_loaded(model, sd, cfg)


def test_shipped_mtp_head_loads_and_predicts_two_ahead(one_thread):
    """The shipped checkpoint's `mtp.*` keys load into load_model(..., mtp=True) unchanged, and the head
    predicts token t+2 of held-out text (4 windows of 128 bytes): measured 1.415 bits/byte (the main
    head on t+1: 1.392); random weights give ~8."""
    from safetensors.torch import load_file
    from onegraph.checkpoint.load import load_model
    from onegraph.models.qwen3_5.tiny import TINY_WEIGHTS
    from onegraph.commands.eval import HELDOUT_TEXT
    cfg, model, _ = load_model("tiny", mtp=True, fuse=False)
    assert_mtp_loaded(model, load_file(str(TINY_WEIGHTS)), cfg)
    tokens = torch.tensor(list(HELDOUT_TEXT.read_bytes()[: 4 * 130])).view(4, 130)
    with torch.no_grad():
        main, mtp, _ = tt.losses(model, tokens)
    assert float(main) / math.log(2) < 1.45 and float(mtp) / math.log(2) < 1.5, (float(main), float(mtp))
