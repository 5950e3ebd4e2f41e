"""Tensor parallel (graphs/tp.py + Qwen35Model(cfg, tp, group)), eager, CPU gloo.

- shard_state_dict then unshard round-trips the TP-1 weights bit for bit (tp 2 and 4; tied and
  untied lm_head);
- TP-2 and TP-4 fp32 `tiny` (TP-4 replicates the 2 KV heads and the 2 GDN key heads) in spawned
  gloo processes: greedy ids == TP-1 for 32 tokens, logits within 1e-4 (every rank gathers the full
  logits; rank 0 writes them); each rank's state has its own head count;
- a TP degree that cannot split the model raises ValueError naming the dimension and its size.
"""
import dataclasses
import socket

import pytest
import torch
import torch.multiprocessing as mp

from onegraph.graphs.config import ModelConfig
from onegraph.graphs.eager import generate_eager
from onegraph.graphs.load import load_model
from onegraph.graphs.tiny import TINY_HF_CONFIG
from onegraph.graphs.tp import check_divisible, local_dims, shard_state_dict, unshard

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 5, 200, 17]
STEPS = 32
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg, model, _ = load_model("tiny", "float32")
    yield cfg, model
    torch.set_num_threads(n)


def full_sd(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_unshard_roundtrip(tiny, tp):
    cfg, model = tiny
    sd = full_sd(model)
    shards = [shard_state_dict(sd, cfg, r, tp) for r in range(tp)]
    d = local_dims(cfg, tp)
    assert shards[0]["lm_head.weight"].shape[0] == d.vocab
    # rank 1 of tp 2 holds attention q heads 2, 3 (query ‖ gate rows of each) and KV head 1
    if tp == 2:
        D = cfg.head_dim
        assert torch.equal(shards[1]["layers.3.self_attn.q_proj.weight"], sd["layers.3.self_attn.q_proj.weight"][4 * D:])
        assert torch.equal(shards[1]["layers.3.self_attn.k_proj.weight"], sd["layers.3.self_attn.k_proj.weight"][D:])
    if tp == 4:   # KV heads replicated: ranks 0, 1 keep KV head 0; ranks 2, 3 KV head 1
        k = "layers.3.self_attn.k_proj.weight"
        assert torch.equal(shards[1][k], shards[0][k]) and torch.equal(shards[2][k], sd[k][cfg.head_dim:])
    back = unshard(shards, cfg)
    assert back.keys() == sd.keys()
    for name, t in sd.items():
        assert back[name].shape == t.shape and torch.equal(back[name], t), name


def test_shard_unshard_tied_odd_vocab(tiny):
    """Tied embeddings get a vocab-sharded lm_head (zero-padded to a multiple of tp); unshard drops it."""
    cfg, model = tiny
    cfg = dataclasses.replace(cfg, tie_word_embeddings=True, vocab_size=cfg.vocab_size - 1)
    sd = {n: t for n, t in full_sd(model).items() if n != "lm_head.weight"}
    sd["embed_tokens.weight"] = sd["embed_tokens.weight"][:-1]
    shards = [shard_state_dict(sd, cfg, r, 2) for r in range(2)]
    assert shards[1]["lm_head.weight"].shape[0] == 132 and not shards[1]["lm_head.weight"][-1].any()
    back = unshard(shards, cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[n], sd[n]) for n in sd)


@pytest.mark.parametrize("tp, dims", [(3, ["num_attention_heads=4", "linear_num_value_heads=4",
                                           "moe_intermediate_size=32"]),
                                      (8, ["num_attention_heads=4"])])
def test_indivisible_tp_names_dimension(tp, dims):
    cfg = ModelConfig.from_hf(TINY_HF_CONFIG)
    with pytest.raises(ValueError) as e:
        check_divisible(cfg, tp)
    for d in dims:
        assert d in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        load_model("tiny", tp=tp)


def test_kv_heads_not_multiple():
    """tp 4 with 3 KV heads neither splits nor replicates them evenly."""
    cfg = dataclasses.replace(ModelConfig.from_hf(TINY_HF_CONFIG), num_heads=12, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        check_divisible(cfg, 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, tp, port, out_path):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        cfg, model, _ = load_model("tiny", "float32", tp=tp, rank=rank)
        state_heads = [tuple(s.shape) for s in model.state_spec(1, 64, torch.float32)]
        r = generate_eager(model, PROMPT, STEPS, max_seq_len=64, prefill_chunk=7)
        if rank == 0:
            torch.save({"ids": r.token_ids, "logits": torch.stack(r.logits), "state": state_heads}, out_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_eager_matches_tp1(tiny, tp, tmp_path):
    cfg, model = tiny
    ref = generate_eager(model, PROMPT, STEPS, max_seq_len=64, prefill_chunk=7)
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(tp, _free_port(), str(out)), nprocs=tp, join=True)
    got = torch.load(out)
    ids, logits = got["ids"], got["logits"]
    first = next((i for i, (a, b) in enumerate(zip(ids, ref.token_ids)) if a != b), None)
    assert ids == ref.token_ids, f"TP-{tp} first differing token at step {first}: {ids[first]} vs {ref.token_ids[first]}"
    diff = (logits - torch.stack(ref.logits)).abs().max().item()
    assert diff <= LOGIT_TOL, f"TP-{tp} logits differ by {diff}"
    d = local_dims(cfg, tp)
    assert got["state"][0] == (2, d.conv_dim, cfg.conv_kernel - 1)          # layer 0: GDN conv, rank's channels
    assert got["state"][1] == (2, d.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim)
    assert got["state"][6] == (2, d.num_kv_heads, 64, cfg.head_dim)        # layer 3: attention k cache
