"""The loader refuses checkpoints it does not understand (checkpoint/weights.py), instead of running them wrong.

Every broken checkpoint here is the builtin tiny checkpoint rewritten into a layout the loader must
not take: the hub FP8 layout (e4m3 weights + 128x128 block `weight_scale_inv`) without its
quantization_config or with a block size the loader does not read (with the official config it loads,
tests/test_quant_fp8.py), an AWQ layout (int32 `qweight`/`qzeros` + `scales`), a stray tensor, a float8
tensor under a plain name. The reference for "still loads" is the tiny checkpoint's own parameters.
"""
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file

from onegraph.checkpoint.load import check_checkpoint, load_model
from onegraph.models.qwen3_5.tiny import TINY_HF_CONFIG, write_tiny
from onegraph.checkpoint.weights import LoadError, census

pytestmark = pytest.mark.usefixtures("one_thread")

FP8_QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
AWQ_QCFG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def quantized(key: str, t: torch.Tensor) -> bool:
    """The projections the hub's quantized checkpoints quantize (embeddings, router, norms, conv stay float)."""
    return t.dim() == 2 and re.search(r"_proj(_qkv|_z)?\.weight$", key) is not None


def fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[O, I] float -> (e4m3 [O, I], weight_scale_inv [ceil(O/128), ceil(I/128)] fp32), as the hub's -FP8."""
    O, I = w.shape
    scale = torch.empty((O + block - 1) // block, (I + block - 1) // block)
    q = torch.empty(O, I, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def awq(w: torch.Tensor, group: int = 32) -> dict[str, torch.Tensor]:
    """[O, I] -> the AWQ GEMM tensor names and dtypes (qweight [I, O/8] int32, qzeros [I/g, O/8] int32,
    scales [I/g, O] fp16); the packed values do not matter, only that the loader refuses them."""
    O, I = w.shape
    return {"qweight": torch.randint(-2**31, 2**31 - 1, (I, O // 8), dtype=torch.int32),
            "qzeros": torch.randint(-2**31, 2**31 - 1, (I // group, O // 8), dtype=torch.int32),
            "scales": torch.rand(I // group, O).half()}


def write_ckpt(dst, tensors, config):
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The builtin checkpoint without its MTP head (`mtp.*`): a text-only checkpoint, so the skipped
    counts below are those of the keys each test adds."""
    d = write_tiny(tmp_path_factory.mktemp("tiny"))
    t = {k: v for k, v in load_file(str(d / "model.safetensors")).items() if not k.startswith("mtp.")}
    save_file(t, str(d / "model.safetensors"))
    return d, t


@pytest.fixture(scope="module")
def reference(tiny):
    _, model, _ = load_model(tiny[0])
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def ckpts(tiny, tmp_path_factory):
    """Every layout under test, written once."""
    root, (_, t) = tmp_path_factory.mktemp("ckpts"), tiny
    fp8 = {}
    for k, v in t.items():
        if quantized(k, v):
            fp8[k], fp8[k + "_scale_inv"] = fp8_block(v)
        else:
            fp8[k] = v
    aw = {}
    for k, v in t.items():
        if quantized(k, v):
            aw.update({k.removesuffix("weight") + n: x for n, x in awq(v).items()})
        else:
            aw[k] = v
    e4m3 = dict(t, **{"model.layers.1.linear_attn.out_proj.weight":
                      t["model.layers.1.linear_attn.out_proj.weight"].to(torch.float8_e4m3fn)})
    int8 = dict(t, **{"model.layers.0.mlp.shared_expert.up_proj.weight":
                      t["model.layers.0.mlp.shared_expert.up_proj.weight"].to(torch.int8)})
    skips = dict(t, **{"model.visual.blocks.0.attn.qkv.weight": torch.randn(96, 32),
                       "visual.merger.mlp.0.weight": torch.randn(7, 3),
                       "mtp.layers.0.mlp.gate.weight": torch.randn(8, 64), "mtp.fc.weight": torch.randn(64, 128)})
    # the text_config layout (ConditionalGeneration) with its quantization_config nested there
    text = {k: v for k, v in TINY_HF_CONFIG.items() if k not in ("model_type", "architectures")}
    nested = {"model_type": "qwen3_5_moe", "text_config": dict(text, quantization_config=FP8_QCFG)}
    garbage = root / "fp8_unreadable"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"not a safetensors file")
    (garbage / "config.json").write_text(json.dumps(dict(TINY_HF_CONFIG, quantization_config=dict(
        FP8_QCFG, weight_block_size=[64, 64]))))
    return {
        "fp8": write_ckpt(root / "fp8", fp8, dict(TINY_HF_CONFIG, quantization_config=FP8_QCFG)),
        "fp8_noconfig": write_ckpt(root / "fp8_noconfig", fp8, TINY_HF_CONFIG),
        "fp8_nested": write_ckpt(root / "fp8_nested", fp8, nested),
        "fp8_unreadable": garbage,
        "awq": write_ckpt(root / "awq", aw, dict(TINY_HF_CONFIG, quantization_config=AWQ_QCFG)),
        "awq_noconfig": write_ckpt(root / "awq_noconfig", aw, TINY_HF_CONFIG),
        "stray": write_ckpt(root / "stray", dict(t, **{"model.layers.0.foo": torch.randn(3)}), TINY_HF_CONFIG),
        "e4m3": write_ckpt(root / "e4m3", e4m3, TINY_HF_CONFIG),
        "int8": write_ckpt(root / "int8", int8, TINY_HF_CONFIG),
        "skips": write_ckpt(root / "skips", skips, TINY_HF_CONFIG),
    }


def assert_same_params(model, ref):
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert torch.equal(got[k].detach(), ref[k]), f"parameter {k} differs"


# ---------------------------------------------------------------- quantized checkpoints

def test_fp8_layout_is_what_the_hub_ships(ckpts, tiny):
    """The test checkpoint really is the -FP8 layout: e4m3 weights whose block scales restore them."""
    t = load_file(str(ckpts["fp8"] / "model.safetensors"))
    k = "model.layers.0.linear_attn.in_proj_qkv.weight"
    blocks = tuple((n + 127) // 128 for n in t[k].shape)                # one scale per 128 x 128 block
    assert t[k].dtype == torch.float8_e4m3fn and t[k + "_scale_inv"].shape == blocks
    O, I = t[k].shape
    deq = t[k].float() * t[k + "_scale_inv"].repeat_interleave(128, 0)[:O].repeat_interleave(128, 1)[:, :I]
    ref = tiny[1][k]
    assert (deq - ref).abs().max() <= 0.07 * ref.abs().max()     # e4m3: 3 mantissa bits
    assert not torch.equal(t[k].float(), ref)                    # a plain cast is not the weight


@pytest.mark.parametrize("name,method,where", [("awq", "awq", "config.json has")])
def test_quantization_config_is_refused(ckpts, name, method, where):
    for allow in (False, True):
        with pytest.raises(LoadError) as e:
            load_model(ckpts[name], allow_unused=allow)
        msg = str(e.value)
        assert msg.startswith(where) and f"quant_method={method!r}" in msg, msg
        assert "supported: quant_method one of ['fp8', 'compressed-tensors']" in msg, msg


def test_fp8_config_it_cannot_read_is_refused_before_any_weight(ckpts):
    """weight_block_size [64, 64] (and a safetensors file that is not one: never opened)."""
    with pytest.raises(LoadError, match=r"^config.json quantization_config weight_block_size=\[64, 64\]: supported "
                                        r"\[128, 128\]"):
        load_model(ckpts["fp8_unreadable"])


@pytest.mark.parametrize("name", ["fp8", "fp8_nested"])
def test_fp8_layout_with_its_config_loads(ckpts, name):
    _, model, _ = load_model(ckpts[name])
    assert model.layers[3].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn


def test_fp8_weights_without_config_are_refused_by_dtype(ckpts):
    for allow in (False, True):
        with pytest.raises(LoadError) as e:
            load_model(ckpts["fp8_noconfig"], allow_unused=allow)
        msg = str(e.value)
        assert msg.startswith("tensor 'model.layers.0.linear_attn.in_proj_qkv.weight' has dtype float8_e4m3fn"), msg
        assert "no dequantization rule" in msg, msg


def test_awq_tensors_without_config_are_refused(ckpts):
    with pytest.raises(LoadError, match=r"checkpoint tensors the model does not consume") as e:
        load_model(ckpts["awq_noconfig"])
    assert "qweight" in str(e.value) or "qzeros" in str(e.value) or "scales" in str(e.value), str(e.value)
    # letting them through still cannot load: the float weight they replace is missing
    with pytest.raises(LoadError, match="missing tensor"):
        load_model(ckpts["awq_noconfig"], allow_unused=True)


@pytest.mark.parametrize("name,key,dtype", [
    ("e4m3", "model.layers.1.linear_attn.out_proj.weight", "float8_e4m3fn"),
    ("int8", "model.layers.0.mlp.shared_expert.up_proj.weight", "int8")])
def test_non_float_tensor_under_a_normal_name_is_refused(ckpts, name, key, dtype):
    for allow in (False, True):
        with pytest.raises(LoadError) as e:
            load_model(ckpts[name], allow_unused=allow)
        assert f"tensor {key!r} has dtype {dtype}" in str(e.value), str(e.value)


# ---------------------------------------------------------------- unexpected tensors

def test_stray_tensor_is_refused_then_allowed(ckpts, reference, caplog):
    with pytest.raises(LoadError) as e:
        load_model(ckpts["stray"])
    msg = str(e.value)
    assert msg.startswith("1 checkpoint tensors the model does not consume") and "'model.layers.0.foo'" in msg, msg
    assert "--allow-unused-weights" in msg
    with caplog.at_level(logging.INFO, logger="onegraph.weights"):
        _, model, _ = load_model(ckpts["stray"], allow_unused=True)
    assert_same_params(model, reference)
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and "ignored 1 unexpected tensors" in warn[0] and "model.layers.0.foo" in warn[0], warn


def test_vision_and_mtp_are_skipped_and_counted(ckpts, reference, caplog):
    with caplog.at_level(logging.INFO, logger="onegraph.weights"):
        _, model, _ = load_model(ckpts["skips"])
    assert_same_params(model, reference)
    msgs = [r.getMessage() for r in caplog.records if r.name == "onegraph.weights"]
    assert msgs == ["skipped 4 vision/MTP tensors"], msgs
    _, c = check_checkpoint(ckpts["skips"])
    assert {k: len(v) for k, v in c.skipped.items()} == {"vision": 2, "MTP": 2} and not c.unused


def test_a_skip_family_loads_when_the_model_has_its_parameters(ckpts, reference):
    """Skipping is decided against the model's parameters: a model with an `mtp.*` head consumes those keys."""
    params = dict(reference, **{"mtp.fc.weight": torch.nn.Parameter(torch.zeros(64, 128)),
                                "mtp.layers.0.mlp.gate.weight": torch.nn.Parameter(torch.zeros(8, 64))})
    c = census(ckpts["skips"], params, tied_lm_head=False)
    assert c.consumed["mtp.fc.weight"] == "mtp.fc.weight" and "mtp.layers.0.mlp.gate.weight" in c.consumed
    assert {k: len(v) for k, v in c.skipped.items()} == {"vision": 2}


def test_normal_checkpoint_loads_with_no_new_output(tiny, reference, caplog, capsys):
    with caplog.at_level(logging.DEBUG):
        _, model, _ = load_model(tiny[0])
    assert_same_params(model, reference)
    assert [r for r in caplog.records if r.name.startswith("onegraph")] == []
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_export_refuses_before_touching_the_output(ckpts, tmp_path):
    from onegraph.export.pipeline import ExportOptions, export
    out = tmp_path / "art"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    for name, needle in (("awq", "quant_method='awq'"), ("stray", "model.layers.0.foo")):
        with pytest.raises(LoadError, match=needle):
            export(str(ckpts[name]), out, ExportOptions(), progress=False)
        assert (out / "manifest.json").read_text() == "{}", f"{name}: the existing artifact was removed"
    assert dataclasses.asdict(ExportOptions())["allow_unused_weights"] is False    # recorded in the manifest


def test_cli_threads_allow_unused_weights_into_export_options(ckpts, tmp_path, monkeypatch):
    import onegraph.export.pipeline as pipeline
    from onegraph import cli
    seen = {}

    def fake_export(model, out, opts, progress, **kwargs):
        seen["opts"] = opts
        return {"out": str(out), "graphs": {}, "weights_bytes": 0, "seconds": 0, "timings_s": {}, "cached": [],
                "workers": 0, "total_s": 0}
    monkeypatch.setattr(pipeline, "export", fake_export)
    assert cli.main(["export", str(ckpts["stray"]), "--out", str(tmp_path / "a"), "--allow-unused-weights"]) == 0
    assert seen["opts"].allow_unused_weights is True
    assert cli.main(["export", str(ckpts["stray"]), "--out", str(tmp_path / "a")]) == 0
    # quant auto: the checkpoint's own scheme, which export resolves and records
    assert seen["opts"].allow_unused_weights is False and seen["opts"].quant == "auto"
    assert cli.main(["export", str(ckpts["stray"]), "--out", str(tmp_path / "a"), "--quant", "fp8"]) == 0
    assert seen["opts"].quant == "fp8"


# ---------------------------------------------------------------- the command line

@pytest.fixture(scope="module")
def cli_runs(ckpts):
    def onegraph(*args):
        return subprocess.run([sys.executable, "-m", "onegraph", *map(str, args)], capture_output=True, text=True,
                              timeout=120, env=ENV)
    gen = ["--eager", "--prompt-ids", "1,2,3", "--max-new-tokens", 4, "--json", "--temperature", 0]
    jobs = {"awq": ["generate", ckpts["awq"], *gen],
            "stray": ["generate", ckpts["stray"], *gen],
            "stray_allowed": ["generate", ckpts["stray"], *gen, "--allow-unused-weights"],
            "inspect_fp8": ["inspect", ckpts["fp8_noconfig"]], "inspect_fp8_loads": ["inspect", ckpts["fp8"]]}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {n: pool.submit(onegraph, *a) for n, a in jobs.items()}
        return {n: f.result() for n, f in futures.items()}


@pytest.mark.parametrize("name,needle", [("awq", "quant_method='awq'"), ("stray", "model.layers.0.foo"),
                                         ("inspect_fp8", "has dtype float8_e4m3fn")])
def test_cli_refusal_is_one_line_exit_2(cli_runs, name, needle):
    p = cli_runs[name]
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert "Traceback" not in p.stderr and len(lines) == 1 and needle in lines[0], lines


def test_cli_inspect_prints_the_census(cli_runs):
    out = cli_runs["inspect_fp8"].stdout
    assert "quantization_config: None" in out, out
    assert "float8_e4m3fn×" in out and "loads: refused" in out, out
    out = cli_runs["inspect_fp8_loads"].stdout
    assert "quantization_config: {'quant_method': 'fp8'" in out and "loads: yes" in out, out


def test_cli_allow_unused_weights_generates(cli_runs, reference):
    from onegraph.graphs.eager import generate_eager
    p = cli_runs["stray_allowed"]
    assert p.returncode == 0, p.stderr
    assert "ignored 1 unexpected tensors" in p.stderr
    _, model, _ = load_model("tiny")
    assert_same_params(model, reference)
    want = generate_eager(model, [1, 2, 3], 4).token_ids
    assert json.loads(p.stdout.strip().splitlines()[-1])["token_ids"] == want
