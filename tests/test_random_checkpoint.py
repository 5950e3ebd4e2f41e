"""scripts/random_checkpoint.py: a seeded random Qwen3.5-MoE checkpoint of tiny's shape (bf16 and the official
FP8 layout) loads strictly (every tensor consumed, none missing), its FP8 weights are exactly `--quant fp8` of
the bf16 one, it generates, transformers loads the bf16 one, same seed -> identical files; the 35B plan has
bench_big's parameter count and fits the H200 machine's disk as FP8; bad targets are refused."""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections import namedtuple

import pytest
import torch
from safetensors import safe_open

from onegraph.graphs.eager import generate_eager
from onegraph.checkpoint.load import check_checkpoint, load_model
from onegraph.scripts import random_checkpoint as rc

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rc") / "bf16"
    rc.write("tiny", d, fp8=False, seed=0, shard_gb=0.002)        # 3.1 MB -> 2 shards
    return d


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rc") / "fp8"
    rc.write("tiny", d, fp8=True, seed=0)
    return d


def _tensors(d):
    idx = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for f in sorted(set(idx.values())):
        with safe_open(str(d / f), framework="pt") as sf:
            for k in sf.keys():
                assert idx[k] == f
                out[k] = sf.get_tensor(k)
    assert out.keys() == idx.keys()
    return out


def _hashes(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())
            if f.name != "random_checkpoint.json"}


@pytest.mark.parametrize("which", ["bf16", "fp8"])
def test_loads_strictly_with_its_mtp_head_and_generates(which, bf16_dir, fp8_dir):
    d = bf16_dir if which == "bf16" else fp8_dir
    rec = json.loads((d / "random_checkpoint.json").read_text())
    assert rec["shards"] == (2 if which == "bf16" else 1) and rec["seed"] == 0 and rec["fp8"] == (which == "fp8")
    assert rec["weight_bytes"] == sum(f.stat().st_size for f in d.glob("model-*.safetensors")) - \
        sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in d.glob("model-*.safetensors"))
    _, c = check_checkpoint(d)
    c.check()                                            # no unused tensor, no bad dtype, no scale missing
    assert set(c.skipped) == {"MTP"} and len(c.consumed) + len(c.skipped["MTP"]) == len(c.dtypes)
    cfg, model, _ = load_model(d, "float32", mtp=True)   # strict: a missing tensor raises
    assert model.mtp.fc.weight.dtype == torch.float32
    ids = generate_eager(model, [5, 17, 42, 99, 3], 8).token_ids
    assert len(ids) == 8 and all(0 <= i < cfg.vocab_size for i in ids)
    t = _tensors(d)
    assert torch.equal(model.embed_tokens.weight, t["model.embed_tokens.weight"].float())
    assert torch.equal(model.mtp.norm.weight, t["mtp.norm.weight"].float())


@pytest.fixture(scope="module")
def decisive_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rc") / "decisive"
    rc.write("tiny", d, fp8=True, seed=0, router="decisive")
    return d


def _routing(model, prompts=((5, 17, 42, 99, 3, 250, 7, 11), (100, 101, 102, 103), (9, 8, 7, 6, 5, 4, 3, 2, 1)),
             seed=None):
    """bf16 eager generation of a few prompts -> (smallest top-k router margin, {layer: top-k sets seen}); seed
    given (a decisive model's): every row's top-k set must be the seeded group of its channels' sign pattern."""
    from onegraph.models.qwen3_5 import decisive
    from onegraph.graphs.eager import router_margins
    from onegraph.models.qwen3_5.model import SparseMoe
    sets, cfg = {}, model.cfg

    def hook(i):
        def record(moe, args):
            x = args[0].float()
            top = torch.nn.functional.linear(x, moe.router_weight[:-1].float()).topk(moe.top_k).indices.sort(-1).values
            sets.setdefault(i, set()).update(tuple(r) for r in top.tolist())
            if seed is not None:
                g = decisive.groups(seed, i, False, cfg.num_experts, cfg.top_k).sort(-1).values
                m = decisive.channels(cfg.num_experts, cfg.top_k)
                assert torch.equal(top, g[decisive.token_group(x[:, :m])]), (i, top)
        return record

    hooks = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(
        m for m in model.modules() if isinstance(m, SparseMoe))]
    try:
        with router_margins(model) as margins:
            for p in prompts:
                logits = generate_eager(model, list(p), 6).logits
                assert all(torch.isfinite(lg).all() and lg.abs().max() < 30 for lg in logits)
                assert max(float(lg.topk(2).values.diff().abs()) for lg in logits) > 0
    finally:
        for h in hooks:
            h.remove()
    return min(margins), sets


def test_decisive_router_same_layout_loads_strictly_and_routes_by_wide_margins(decisive_dir, fp8_dir):
    """--router decisive: the default's keys, dtypes, shapes and config; loads strictly; every token goes to the
    seeded top-k set of its sign pattern (tiny: 2 sign channels, 4 sets per layer, all seen) by a router margin
    above 16x the parity fixture's bf16 near-tie (0.0625), where the default's random routers have margins
    below that near-tie."""
    from onegraph.runtime.fixture import ROUTER_NEAR_TIE
    a, b = _tensors(decisive_dir), _tensors(fp8_dir)
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}
    assert (decisive_dir / "config.json").read_text() == (fp8_dir / "config.json").read_text()
    rec = json.loads((decisive_dir / "random_checkpoint.json").read_text())
    assert rec["router"] == "decisive"
    assert json.loads((fp8_dir / "random_checkpoint.json").read_text())["router"] == "random"
    _, c = check_checkpoint(decisive_dir)
    c.check()
    _, model, _ = load_model(decisive_dir, "bfloat16")               # strict
    margin, sets = _routing(model, seed=0)
    assert margin > 16 * ROUTER_NEAR_TIE["bfloat16"], margin
    assert sorted(sets) == [0, 1, 2, 3] and all(len(s) == 4 for s in sets.values()), sets
    default_margin, default_sets = _routing(load_model(fp8_dir, "bfloat16")[1])
    assert default_margin < ROUTER_NEAR_TIE["bfloat16"] and all(len(s) > 4 for s in default_sets.values())


def test_decisive_rule_keeps_the_values_outside_its_channels(decisive_dir, fp8_dir):
    """Only the 3 channels' rows / columns (tiny: 2 sign channels + 1 constant), the routers and two norm
    entries differ from the default's values."""
    a, b = _tensors(decisive_dir), _tensors(fp8_dir)
    k = "model.layers.0.linear_attn.in_proj_a.weight"                 # a bf16 reader [HV, H]
    assert torch.equal(a[k][:, 3:], b[k][:, 3:]) and not a[k][:, :3].any() and b[k][:, :3].all()
    e = "model.embed_tokens.weight"                                   # +-c / sqrt(3): the drawn value's sign, then +
    assert torch.equal(a[e][:, 3:], b[e][:, 3:]) and a[e][:, :3].abs().unique().numel() == 1
    assert torch.equal(a[e][:, :2].sign(), b[e][:, :2].sign()) and (a[e][:, 2] > 0).all()
    g = "model.layers.2.mlp.gate.weight"                              # [E, H]: scaled random rows + the groups' bits
    assert torch.allclose(a[g][:, 3:].float(), 0.25 * b[g][:, 3:].float(), rtol=1e-2)
    beta = a[g][0, :2].abs().unique()
    assert beta.numel() == 1 and torch.unique(a[g][:, :2].sign(), dim=0).shape == (4, 2)
    assert torch.equal(a[g][:, 2].unique(), (-2 * beta).to(torch.bfloat16))   # the offset: -m beta
    assert not a["model.layers.1.mlp.experts.3.down_proj.weight"][:3].float().any()   # a writer's rows (e4m3)
    assert not a["model.layers.1.post_attention_layernorm.weight"][:3].any()


def test_decisive_random_model_and_bad_router(tmp_path):
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.models.qwen3_5.tiny import TINY_HF_CONFIG, random_model
    cfg = ModelConfig.from_hf(TINY_HF_CONFIG)
    margin, _ = _routing(random_model(cfg, torch.bfloat16, "cpu", seed=3, router="decisive"),
                         prompts=((5, 17, 42, 99, 3),), seed=3)
    assert margin > 1.0
    with pytest.raises(ValueError, match="router must be one of"):
        random_model(cfg, torch.bfloat16, "cpu", router="sharp")
    with pytest.raises(rc.RandomCheckpointError, match="--router must be one of"):
        rc.write("tiny", tmp_path / "x", router="sharp")


def test_fp8_layout_is_the_official_format(fp8_dir):
    t = _tensors(fp8_dir)
    q = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128] and q["activation_scheme"] == "dynamic"
    e4m3 = {k for k, v in t.items() if v.dtype == FP8}
    assert e4m3 == {k for k in t if rc.FP8_KEY.match(k)} and len(e4m3) == 3 * 3 + 4 + 4 * (8 * 3 + 3)
    for k in e4m3:
        s = t[k[: -len("weight")] + "weight_scale_inv"]
        assert s.dtype == torch.float32 and tuple(s.shape) == tuple(-(-n // 128) for n in t[k].shape)
    float_names = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "shared_expert_gate", "in_proj_a", "in_proj_b",
                   "conv1d", "A_log", "dt_bias", "mtp.")
    assert all(v.dtype in (torch.bfloat16, torch.float32) for k, v in t.items() if any(n in k for n in float_names))
    for m in ("model.layers.0.linear_attn.in_proj_a", "model.layers.3.mlp.shared_expert_gate", "lm_head", "mtp"):
        assert m in q["modules_to_not_convert"]
    model = load_model(fp8_dir, "bfloat16")[1]
    fp8 = {n for n, p in model.named_parameters() if p.dtype == FP8}
    assert len(fp8) == 3 * 2 + 1 + 2 + 4 * 5                # fused projections + experts and shared expert per layer
    assert model.layers[1].mlp.experts.gate_up_proj.dtype == FP8 and model.embed_tokens.weight.dtype == torch.bfloat16


def test_fp8_checkpoint_is_quant_fp8_of_the_bf16_one(bf16_dir, fp8_dir):
    """Same seed: the FP8 checkpoint holds exactly what `--quant fp8` makes of the bf16 checkpoint's values."""
    a = dict(load_model(bf16_dir, "bfloat16", quant="fp8", fuse=False)[1].named_parameters())
    b = dict(load_model(fp8_dir, "bfloat16", fuse=False)[1].named_parameters())
    assert a.keys() == b.keys()
    view = (lambda p: p.view(torch.uint8) if p.dtype == FP8 else p)
    diff = [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(view(a[n]), view(b[n]))]
    assert not diff, diff[:5]
    assert sum(p.dtype == FP8 for p in a.values()) == 3 * 3 + 4 + 4 * 5


def test_same_seed_same_files_other_seed_other_weights(fp8_dir, bf16_dir, tmp_path):
    rc.write("tiny", tmp_path / "again", fp8=True, seed=0)
    assert _hashes(tmp_path / "again") == _hashes(fp8_dir)
    rc.write("tiny", tmp_path / "seed1", fp8=False, seed=1, shard_gb=0.002)
    a, b = _hashes(tmp_path / "seed1"), _hashes(bf16_dir)
    assert a.keys() == b.keys() and a["config.json"] == b["config.json"]
    assert all(a[f] != b[f] for f in a if f.endswith(".safetensors"))


def test_transformers_loads_the_bf16_checkpoint(bf16_dir):
    tf = pytest.importorskip("transformers")
    hf, info = tf.Qwen3_5MoeForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    t = _tensors(bf16_dir)
    key = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert torch.equal(hf.model.layers[0].linear_attn.in_proj_qkv.weight, t[key].float())
    assert torch.equal(hf.lm_head.weight, t["lm_head.weight"].float())


def test_padded_tokenizer_keeps_tiny_ids_and_decodes_every_id():
    from onegraph.models.qwen3_5.tiny import tiny_tokenizer
    tok, tiny = rc.tokenizer(1000), tiny_tokenizer()
    text = "<|im_start|>user\nhé <think>x</think><|im_end|>"
    assert tok.encode(text).ids == tiny.encode(text).ids
    assert tok.get_vocab_size() == 1000 and tok.decode([999]) == "<extra_999>" and tok.decode([104, 105]) == "hi"


def test_35b_plan_is_bench_bigs_model_and_fits_the_disk_as_fp8():
    cfg = rc.hf_config("35b", fp8=True)
    p = rc.plan(cfg, fp8=True)
    weights = {k: v for k, v in p.items() if not k.endswith("weight_scale_inv")}
    params = sum(math.prod(s) for s, _ in weights.values())
    mtp = sum(math.prod(s) for k, (s, _) in weights.items() if k.startswith("mtp."))
    assert round((params - mtp) / 1e9, 2) == 34.66           # bench_big's params_B (no MTP head)
    assert (params, mtp) == (35_505_251_456, 844_640_768)
    experts = [k for k in p if ".mlp.experts." in k and k.endswith("_proj.weight")]
    assert len(experts) == (40 + 1) * 256 * 3
    assert p["model.layers.7.mlp.experts.255.down_proj.weight_scale_inv"] == ((16, 4), torch.float32)
    assert p["model.layers.7.mlp.experts.255.down_proj.weight"] == ((2048, 512), FP8)
    assert p["mtp.layers.0.mlp.experts.0.up_proj.weight"] == ((512, 2048), torch.bfloat16)
    fp8_bytes = sum(rc.nbytes(*v) for v in p.values())
    assert fp8_bytes == 37_401_363_712 and 2 * params > 64 * 2**30 > fp8_bytes + 20 * 2**30   # bf16 does not fit
    groups = rc.shards(p, int(5e9))
    assert len(groups) == 8 and all(not g[0].endswith("weight_scale_inv") for g in groups)
    assert all(sum(rc.nbytes(*p[k]) for k in g) <= 5e9 for g in groups)


Usage = namedtuple("Usage", "total used free")


def test_refuses_non_empty_dir_and_too_little_disk(tmp_path, monkeypatch, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert rc.main(["--shape", "tiny", "--out", str(tmp_path / "full")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    monkeypatch.setattr(rc.shutil, "disk_usage", lambda p: Usage(10**12, 10**12 - 1000, 1000))
    assert rc.main(["--shape", "tiny", "--out", str(tmp_path / "new"), "--fp8"]) == 2
    err = capsys.readouterr().err
    assert "1,000 bytes free" in err and re.search(r"needs [\d,]{9,} bytes", err) and not (tmp_path / "new").exists()
