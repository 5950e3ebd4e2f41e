"""HF checkpoint loading (checkpoint/weights.py, checkpoint/load.py) and config validation (models/qwen3_5/config.py).

The reference is always the builtin tiny checkpoint as written by `write_tiny` (per-expert keys,
one file): every other layout of the same tensors must load to identical parameters, and every
broken layout must fail with an error naming what is wrong.
"""
import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from onegraph.models.qwen3_5.config import ModelConfig
from onegraph.graphs.eager import generate_eager
from onegraph.checkpoint.load import load_model
from onegraph.models.qwen3_5.tiny import TINY_HF_CONFIG, write_tiny
from onegraph.checkpoint.weights import LoadError


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_tensors(tiny_dir):
    return load_file(str(tiny_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tiny_dir):
    _, model, _ = load_model(tiny_dir, "float32")
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def write_ckpt(dst, tensors, config=None):
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config or TINY_HF_CONFIG))
    return dst


def params(path, dtype="float32"):
    _, model, _ = load_model(path, dtype)
    return {k: v.detach() for k, v in model.named_parameters()}


def assert_same_params(got, ref):
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), f"parameter {k} differs"


# ---------------------------------------------------------------- broken checkpoints

@pytest.mark.parametrize("key", ["model.layers.0.linear_attn.A_log", "model.layers.3.self_attn.q_norm.weight",
                                 "lm_head.weight", "model.layers.2.mlp.experts.3.up_proj.weight"])
def test_missing_tensor_names_the_key(tmp_path, tiny_tensors, key):
    t = dict(tiny_tensors)
    del t[key]
    write_ckpt(tmp_path, t)
    with pytest.raises(LoadError) as e:
        load_model(tmp_path)
    name = key.removeprefix("model.")
    assert name in str(e.value), f"error does not name {name!r}: {e.value}"
    assert "missing" in str(e.value)


@pytest.mark.parametrize("key,bad_shape", [("model.layers.1.linear_attn.in_proj_z.weight", (64, 48)),
                                           ("model.embed_tokens.weight", (200, 64)),
                                           ("model.layers.3.self_attn.k_proj.weight", (64,))])
def test_wrong_shape_names_key_and_both_shapes(tmp_path, tiny_tensors, key, bad_shape):
    t = dict(tiny_tensors)
    want = list(t[key].shape)
    t[key] = torch.zeros(bad_shape)
    write_ckpt(tmp_path, t)
    with pytest.raises(LoadError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    assert key.removeprefix("model.") in msg, msg
    assert str(list(bad_shape)) in msg and str(want) in msg, f"both shapes not named: {msg}"


def test_wrong_shape_per_expert_tensor_names_key(tmp_path, tiny_tensors):
    t = dict(tiny_tensors)
    I, H = TINY_HF_CONFIG["moe_intermediate_size"], TINY_HF_CONFIG["hidden_size"]
    t["model.layers.1.mlp.experts.5.gate_proj.weight"] = torch.zeros(I - 1, H)     # [I, H] expected
    write_ckpt(tmp_path, t)
    with pytest.raises(LoadError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    assert "experts.5.gate_proj" in msg and str([I - 1, H]) in msg and str([I, H]) in msg, msg


def test_unknown_model_type_names_model_type(tmp_path, tiny_tensors):
    cfg = dict(TINY_HF_CONFIG, model_type="llama")
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf(cfg)
    write_ckpt(tmp_path, tiny_tensors, cfg)
    with pytest.raises(ValueError, match="model_type") as e:
        load_model(tmp_path)
    assert "llama" in str(e.value)


def test_missing_weights_and_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    with pytest.raises(LoadError, match="safetensors"):
        load_model(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


# ---------------------------------------------------------------- other layouts, same parameters

def test_sharded_checkpoint_loads_identically(tmp_path, tiny_tensors, reference):
    keys = sorted(tiny_tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for fname, ks in shards.items():
        save_file({k: tiny_tensors[k] for k in ks}, str(tmp_path / fname))
        weight_map.update({k: fname for k in ks})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    assert not (tmp_path / "model.safetensors").exists()
    assert_same_params(params(tmp_path), reference)


def test_fused_expert_keys_load_identically(tmp_path, tiny_tensors, reference):
    cfg = ModelConfig.from_hf(TINY_HF_CONFIG)
    E = cfg.num_experts
    t = {k: v for k, v in tiny_tensors.items() if ".mlp.experts." not in k}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}.mlp.experts"
        t[f"{p}.gate_up_proj"] = torch.stack([torch.cat([tiny_tensors[f"{p}.{e}.gate_proj.weight"],
                                                         tiny_tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(E)])
        t[f"{p}.down_proj"] = torch.stack([tiny_tensors[f"{p}.{e}.down_proj.weight"] for e in range(E)])
        assert t[f"{p}.gate_up_proj"].shape == (E, 2 * cfg.moe_intermediate, cfg.hidden_size)
        assert t[f"{p}.down_proj"].shape == (E, cfg.hidden_size, cfg.moe_intermediate)
    write_ckpt(tmp_path, t)
    got = params(tmp_path)
    assert_same_params(got, reference)
    # and independently of the loader: expert 5 of layer 2 holds exactly its hub tensors
    gu = got["layers.2.mlp.experts.gate_up_proj"][5]
    assert torch.equal(gu[: cfg.moe_intermediate], tiny_tensors["model.layers.2.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(gu[cfg.moe_intermediate:], tiny_tensors["model.layers.2.mlp.experts.5.up_proj.weight"])


def test_vision_and_mtp_keys_are_skipped(tmp_path, tiny_tensors, reference):
    t = dict(tiny_tensors)
    t["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(96, 32)
    t["model.visual.merger.mlp.0.weight"] = torch.randn(7, 3)
    t["mtp.layers.0.mlp.gate.weight"] = torch.randn(8, 64)
    t["mtp.fc.weight"] = torch.randn(64, 128)
    write_ckpt(tmp_path, t)
    assert_same_params(params(tmp_path), reference)


def test_conditional_generation_layout_loads_identically(tmp_path, tiny_tensors, reference):
    """The hub's ConditionalGeneration layout: nested text_config, `model.language_model.` prefix."""
    t = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
         for k, v in tiny_tensors.items()}
    t["model.visual.patch_embed.proj.weight"] = torch.randn(32, 3, 1, 4, 4)
    text = {k: v for k, v in TINY_HF_CONFIG.items() if k not in ("model_type", "architectures", "eos_token_id")}
    cfg = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
           "text_config": text, "vision_config": {"depth": 1}, "eos_token_id": TINY_HF_CONFIG["eos_token_id"]}
    write_ckpt(tmp_path, t, cfg)
    assert ModelConfig.from_file(tmp_path) == ModelConfig.from_hf(TINY_HF_CONFIG)
    assert_same_params(params(tmp_path), reference)


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_dtypes_load_and_run(tiny_dir, reference, dtype, torch_dtype):
    _, model, _ = load_model(tiny_dir, dtype)
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(reference)
    for k, p in got.items():
        assert p.dtype == torch_dtype, f"{k} has dtype {p.dtype}"
        assert torch.equal(p.detach(), reference[k].to(torch_dtype)), f"{k} is not the fp32 value cast to {dtype}"
    assert model.inv_freq.dtype == torch.float32        # rope frequencies stay fp32
    # it runs, and the prefill logits stay near fp32 (bf16 has 8 mantissa bits: 5% of the logit range)
    _, m32, _ = load_model(tiny_dir, "float32")
    ids = list(range(40, 60))
    a = generate_eager(model, ids, 1).logits[0]
    b = generate_eager(m32, ids, 1).logits[0]
    assert torch.isfinite(a).all()
    assert (a - b).abs().max() <= 0.05 * b.abs().max(), f"{dtype} logits far from fp32"


def test_checkpoint_dtype_is_cast_to_requested(tmp_path, tiny_tensors, reference):
    t = {k: v.to(torch.bfloat16) for k, v in tiny_tensors.items()}
    write_ckpt(tmp_path, t)
    got = params(tmp_path, "float32")
    for k, p in got.items():
        assert p.dtype == torch.float32
        assert torch.equal(p, reference[k].to(torch.bfloat16).float()), k


# ---------------------------------------------------------------- config validation

def hf_cfg(**over):
    c = copy.deepcopy(TINY_HF_CONFIG)
    c.update(over)
    return c




@pytest.mark.parametrize("over,field", [
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=4), "linear_num_value_heads"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(num_hidden_layers=5), "layer_types"),
    (dict(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]), "layer_types"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(linear_conv_kernel_dim=1), "conv_kernel"),
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.0}), "rotary_dim"),
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 2.0}), "rotary_dim"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(model_type="qwen3_5_moe"), "text_config"),
    (dict(layer_types=None, num_hidden_layers=4, full_attention_interval=0), "full_attention_interval"),
])
def test_config_validation_names_the_field(over, field):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(hf_cfg(**over))
    assert repr(field) in str(e.value) or field in str(e.value), f"{field!r} not named in: {e.value}"


def test_dense_config_validation():
    dense = {k: v for k, v in hf_cfg(model_type="qwen3_5_text").items() if not k.startswith(("num_experts", "moe_"))}
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf(dense)
    cfg = ModelConfig.from_hf(dict(dense, intermediate_size=96))
    assert not cfg.is_moe and cfg.intermediate_size == 96 and cfg.num_experts == 0


def test_config_derived_fields():
    cfg = ModelConfig.from_hf(TINY_HF_CONFIG)
    assert cfg.gdn_layers == [0, 1, 2] and cfg.attn_layers == [3]
    assert cfg.rotary_dim == 8                                   # 32 * 0.25
    hf = TINY_HF_CONFIG                                          # q and k per key head, v per value head
    assert cfg.conv_dim == (2 * hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
                            + hf["linear_num_value_heads"] * hf["linear_value_head_dim"])
    assert cfg.eos_token_ids == tuple(TINY_HF_CONFIG["eos_token_id"])
    # full_attention_interval in place of explicit layer_types
    c2 = ModelConfig.from_hf(hf_cfg(layer_types=None, num_hidden_layers=6, full_attention_interval=3))
    assert c2.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("drop,over,field", [("hidden_size", {}, "hidden_size"),
                                             (None, dict(num_attention_heads=0), "num_attention_heads|num_heads")])
def test_config_without_head_dim_names_the_field(drop, over, field):
    c = {k: v for k, v in hf_cfg(**over).items() if k not in ("head_dim", drop)}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(c)


def test_write_tiny_is_deterministic(tmp_path, tiny_dir):
    write_tiny(tmp_path / "again")
    a = load_file(str(tiny_dir / "model.safetensors"))
    b = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    shutil.rmtree(tmp_path / "again")
