"""W8A8 weights end to end on CPU: compressed-tensors checkpoints (FP8 and INT8 per-channel weights, dynamic
per-token activations) load (checkpoint/quant_ct.py, checkpoint/weights.py) with transformers' and compressed-tensors'
own dequantized values, `--quant int8` quantizes per channel, unsupported configs and bad tensors are refused
naming the field or tensor, the accuracy stays within stated bounds of the float model, and an int8 CPU
artifact replays its eager model.

The compressed-tensors checkpoints are `tiny` written by scripts/quant_checkpoint.py (llm-compressor's layout
and rule: scale = amax / 127.5 for int8, so the code -128 occurs; amax / 448 for e4m3; scales in the weight's
dtype). transformers 5.24 with compressed-tensors installed dequantizes such a checkpoint on CPU
(`CompressedTensorsConfig(dequantize=True)`) when its quantized modules are Linear modules; it refuses
quantized per-expert keys (its Qwen3.5-MoE experts are fused 3-D parameters), so the experts are checked
against compressed-tensors' own `dequantize` instead.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from onegraph.graphs.eager import generate_eager
from onegraph.checkpoint.load import load_model, model_dir
from onegraph.checkpoint.weights import LoadError
from onegraph.scripts import quant_checkpoint

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 11]


@pytest.fixture(scope="module")
def ct_dirs(tmp_path_factory):
    """scheme -> a compressed-tensors tiny; "int8-experts": int8 with the routed experts quantized too."""
    root = tmp_path_factory.mktemp("ct")
    return {"int8": quant_checkpoint.write("tiny", root / "int8", "int8"),
            "fp8-channel": quant_checkpoint.write("tiny", root / "fp8", "fp8-channel"),
            "int8-experts": quant_checkpoint.write("tiny", root / "int8e", "int8", experts=True)}


def _rewrite(src, dst, tensors=None, qconfig=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if qconfig is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = qconfig
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("scheme,qdtype", [("int8", torch.int8), ("fp8-channel", torch.float8_e4m3fn)])
def test_ct_checkpoint_loads_projections_quantized(ct_dirs, scheme, qdtype):
    """Projections keep the checkpoint's bytes and scales (concatenated per channel at any size), the kept-float
    GDN in_proj_a/b, routers and (unquantized) experts stay float."""
    model = load_model(ct_dirs[scheme], "float32")[1]
    src = load_file(str(ct_dirs[scheme] / "model.safetensors"))
    gdn, attn = model.layers[0].linear_attn, model.layers[3].self_attn
    run = gdn.in_proj.runs[0]                                     # [qkv; z] quantized, [b; a] float
    assert run.weight.dtype == qdtype and gdn.in_proj.runs[1].weight.dtype == torch.float32
    qkv = src["model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert torch.equal(run.weight[:qkv.shape[0]].view(torch.uint8), qkv.view(torch.uint8))
    assert torch.equal(run.weight_scale[:qkv.shape[0]], src["model.layers.0.linear_attn.in_proj_qkv.weight_scale"])
    assert attn.qkv_proj.weight.shape[0] == 384                   # [q; k; v] in one run: no 128-row constraint
    assert attn.o_proj.weight.dtype == qdtype and attn.o_proj.weight_scale.shape == (128, 1)
    assert model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32


# transformers warns that the checkpoint's own quantization_config wins over the dequantize=True config this
# test passes on purpose (its loading attributes still apply)
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning:transformers")
def test_dequantized_weights_equal_transformers(ct_dirs):
    """quant='none' dequantizes every weight: bit-equal to transformers' own compressed-tensors dequantization
    (the FP8 checkpoint; transformers 5.24 fails to load the int-quantized one on CPU, a conversion error
    concatenating the float experts, so INT8 is checked against compressed-tensors itself below)."""
    from transformers import CompressedTensorsConfig, Qwen3_5MoeForCausalLM
    scheme = "fp8-channel"
    hf = Qwen3_5MoeForCausalLM.from_pretrained(ct_dirs[scheme], dtype=torch.float32,
                                               quantization_config=CompressedTensorsConfig(dequantize=True))
    ref = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    ours = dict(load_model(ct_dirs[scheme], "float32", quant="none", fuse=False)[1].named_parameters())
    shared = [n for n in ours if n in ref]
    assert len(shared) > 40 and "layers.3.self_attn.q_proj.weight" in shared
    assert all(torch.equal(ours[n], ref[n]) for n in shared), [n for n in shared if not torch.equal(ours[n], ref[n])]


def test_dequantized_int8_weights_equal_compressed_tensors(ct_dirs):
    """quant='none' on the INT8 checkpoint with quantized routed experts: every quantized weight dequantized at
    load as compressed-tensors' own `dequantize` does (in bf16 both are one rounding of the exact product);
    with quant as the checkpoint the experts (the MoE kernel takes float) are dequantized the same way."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    src = load_file(str(ct_dirs["int8-experts"] / "model.safetensors"))
    ours = dict(load_model(ct_dirs["int8-experts"], "bfloat16", quant="none", fuse=False)[1].named_parameters())
    quantized = [k for k, v in src.items() if v.dtype == torch.int8]
    assert len(quantized) > 100
    for key in quantized:
        ref = dequantize(src[key], src[key[:-len("weight")] + "weight_scale"], args=args).to(torch.bfloat16)
        name = key.removeprefix("model.")
        if ".experts." in name:                   # per-expert keys land in the fused [E, 2I, H] / [E, H, I]
            layer, e, part = name.split(".mlp.experts.")[0], int(name.split(".")[4]), name.split(".")[5]
            fused = ours[f"{layer}.mlp.experts.{'down' if part == 'down_proj' else 'gate_up'}_proj"][e]
            got = fused if part == "down_proj" else fused.chunk(2)[part == "up_proj"]
        else:
            got = ours[name]
        assert torch.equal(got, ref), key
    model = load_model(ct_dirs["int8-experts"], "bfloat16")[1]
    assert torch.equal(model.layers[2].mlp.experts.down_proj[5], ours["layers.2.mlp.experts.down_proj"][5])
    assert model.layers[2].linear_attn.out_proj.weight.dtype == torch.int8


def test_export_time_int8_is_per_channel_amax_over_127(tiny_eager):
    """load_model(quant='int8'): each row's scale is its amax / 127 and the codes round w / scale to nearest."""
    model = load_model("tiny", "float32", quant="int8")[1]
    w = load_file(str(model_dir("tiny") / "model.safetensors"))["model.layers.3.self_attn.o_proj.weight"]
    scale = w.abs().amax(1, keepdim=True) / 127
    o = model.layers[3].self_attn.o_proj
    assert torch.equal(o.weight_scale, scale)
    assert torch.equal(o.weight, torch.round(w / scale).to(torch.int8))
    assert model.layers[0].linear_attn.in_proj.runs[1].weight.dtype == torch.float32       # [b; a] kept float


def test_inspect_names_the_checkpoint_scheme(ct_dirs):
    from onegraph.checkpoint.load import describe_checkpoint
    text, refusal = describe_checkpoint(ct_dirs["fp8-channel"])
    assert refusal is None and "quantization: fp8-channel: float8_e4m3fn weights, one fp32 scale per output " \
                               "channel, activations quantized to e4m3 per token (dynamic)" in text


# ---------------------------------------------------------------- refusals

def _group(**changes):
    cfg = quant_checkpoint.config("int8")
    g = cfg["config_groups"]["group_0"]
    for path, value in changes.items():
        part, field = path.split("__")
        if field:
            g[part][field] = value
        else:
            g[part] = value
    return cfg


BAD_CONFIGS = [
    ("format", dict(quant_checkpoint.config("int8"), format="pack-quantized"), r"format='pack-quantized'"),
    ("group strategy", _group(weights__strategy="group", weights__group_size=128), r"weights.strategy='group'"),
    ("block strategy", _group(weights__strategy="block"), r"weights.strategy='block'"),
    ("asymmetric", _group(weights__symmetric=False), r"weights.symmetric=False"),
    ("4-bit", _group(weights__num_bits=4), r"weights.num_bits=4"),
    ("static activations", _group(input_activations__dynamic=False), r"input_activations.dynamic=False"),
    ("per-tensor activations", _group(input_activations__strategy="tensor"), r"input_activations.strategy='tensor'"),
    ("weight-only", _group(input_activations__=None), r"input_activations=None"),
    ("type vs format", _group(weights__type="float"), r"weights.type='float': supported 'int'"),
    ("kv cache", dict(quant_checkpoint.config("int8"), kv_cache_scheme={"num_bits": 8}), r"kv_cache_scheme="),
]


@pytest.mark.parametrize("qconfig,message", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_unsupported_ct_config_is_refused_naming_the_field(ct_dirs, tmp_path, qconfig, message):
    d = _rewrite(ct_dirs["int8"], tmp_path / "bad", qconfig=qconfig)
    with pytest.raises(LoadError, match=message):
        load_model(d)


def test_scale_of_the_wrong_shape_is_refused_naming_the_tensor(ct_dirs, tmp_path):
    t = load_file(str(ct_dirs["int8"] / "model.safetensors"))
    t["model.layers.3.self_attn.q_proj.weight_scale"] = torch.ones(256)
    d = _rewrite(ct_dirs["int8"], tmp_path / "shape", tensors=t)
    with pytest.raises(LoadError, match=r"layers.3.self_attn.q_proj.weight_scale is float32 \[256\] but "
                                        r"layers.3.self_attn.q_proj.weight \[256, 128\] needs float32 \[256, 1\]"):
        load_model(d)


def test_zero_points_are_refused(ct_dirs, tmp_path):
    t = load_file(str(ct_dirs["int8"] / "model.safetensors"))
    t["model.layers.3.self_attn.q_proj.weight_zero_point"] = torch.zeros(256, 1, dtype=torch.int8)
    d = _rewrite(ct_dirs["int8"], tmp_path / "zp", tensors=t)
    with pytest.raises(LoadError, match=r"q_proj.weight_zero_point"):
        load_model(d)


def test_quant_of_another_scheme_is_refused(ct_dirs):
    with pytest.raises(LoadError, match=r"--quant fp8 on a checkpoint already quantized as 'int8'"):
        load_model(ct_dirs["int8"], quant="fp8")
    with pytest.raises(LoadError, match=r"--quant int8 on a checkpoint already quantized as 'fp8-channel'"):
        load_model(ct_dirs["fp8-channel"], quant="int8")


def test_quant_with_onnx_is_refused_before_anything_runs(ct_dirs, tmp_path):
    from onegraph.export.pipeline import ExportOptions, export
    with pytest.raises(ValueError, match=r"--quant int8 needs --backend aoti"):
        export("tiny", tmp_path / "a", ExportOptions(backend="onnx", quant="int8"), progress=False)
    with pytest.raises(ValueError, match=r"--quant int8 needs --backend aoti"):   # auto: the checkpoint's int8
        export(ct_dirs["int8"], tmp_path / "b", ExportOptions(backend="onnx"), progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------- accuracy

# bits/byte over the first 2048 held-out tokens, trained tiny, fp32 eager, compressed-tensors checkpoint minus
# float: measured int8 +0.0018, fp8-channel +0.0049 (bf16 over the whole text: benchmarks/quant_accuracy.json);
# the bounds leave about 3x.
BPB_BOUND = {"int8": 0.006, "fp8-channel": 0.015}


def test_accuracy_bounds_bits_per_byte(ct_dirs):
    from onegraph.commands.eval import evaluate
    base = evaluate("tiny", max_tokens=2048, dtype="float32", batch=16)["bits_per_byte"]
    for scheme, bound in BPB_BOUND.items():
        got = evaluate(ct_dirs[scheme], max_tokens=2048, dtype="float32", batch=16)["bits_per_byte"]
        assert 0 <= got - base + 0.002 and got - base <= bound, f"{scheme}: {got:.4f} vs float {base:.4f}"


# ---------------------------------------------------------------- artifact

@pytest.fixture(scope="module")
def int8_artifact(tmp_path_factory):
    from onegraph import cli
    out = tmp_path_factory.mktemp("int8") / "art"
    assert cli.main(["export", "tiny", "--out", str(out), "--batch-sizes", "1", "--prefill-chunks", "16",
                     "--max-seq-len", "64", "--quant", "int8", "--quiet", "--no-cache"]) == 0
    return out


def test_int8_artifact_records_the_scheme_and_equals_eager(int8_artifact, capsys):
    from safetensors import safe_open

    from onegraph import cli
    from onegraph.custom_ops import PYTHON_CALLS
    from onegraph.runtime.executor import GraphExecutor
    manifest = json.loads((int8_artifact / "manifest.json").read_text())
    assert manifest["options"]["quant"] == "int8"
    with safe_open(str(int8_artifact / "weights.safetensors"), "pt") as f:
        i8 = [k for k in f.keys() if f.get_slice(k).get_dtype() == "I8"]
    assert "model.layers.3.self_attn.o_proj.weight" in i8 and len(i8) == 3 * 2 + 2, i8
    capsys.readouterr()
    assert cli.main(["inspect", str(int8_artifact)]) == 0
    assert "quantization: int8 (W8A8)" in capsys.readouterr().out
    ex = GraphExecutor.from_artifact(int8_artifact, max_slots=1)
    # W8A8: an ulp of difference in a projection's input may flip one activation's 8-bit rounding (about 1e-2
    # on the logits: runtime/fixture.py W8A8_TOLERANCE); the ids must be eager's
    assert ex.fixture_report["tolerance"] == 0.05 and not ex.fixture_report["routing_flips"]
    PYTHON_CALLS.clear()
    ids, _ = ex.generate(PROMPT, 24)
    assert sum(PYTHON_CALLS.values()) == 0, PYTHON_CALLS
    assert ids == generate_eager(load_model("tiny", quant="int8")[1], PROMPT, 24, max_seq_len=64).token_ids


def test_ct_int8_checkpoint_exports_as_it_is(ct_dirs, int8_artifact):
    """--quant auto on a compressed-tensors int8 checkpoint: the scheme it resolves to is recorded."""
    from onegraph.export.pipeline import ExportOptions, resolve_quant
    assert resolve_quant(ct_dirs["int8"], ExportOptions()).quant == "int8"
    assert resolve_quant(ct_dirs["int8"], ExportOptions(quant="none")).quant == "none"
    assert resolve_quant("tiny", ExportOptions()).quant == "none"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["int8", "fp8-channel"])
def test_cuda_bf16_w8a8_artifact_matches_its_eager_model(tmp_path, scheme):
    """`--quant int8|fp8-channel` on CUDA: the Triton W8A8 kernels inside the AOTInductor graphs (GEMV at
    decode, tl.dot at the 16-token prefill) against the eager model (the ops' references), bf16, 64 tokens,
    with and without CUDA-graph capture; ids agree up to a near-tie as tests/test_cuda_e2e.py."""
    from test_cuda_e2e import PROMPTS, agrees_up_to_near_tie

    from onegraph.export.pipeline import ExportOptions, export
    from onegraph.runtime import Engine
    out = tmp_path / scheme
    export("tiny", out, ExportOptions(device="cuda", dtype="bfloat16", batch_sizes=(1, 4), prefill_chunks=(16,),
                                      max_seq_len=256, quant=scheme), progress=False)
    model = load_model("tiny", "bfloat16", "cuda", quant=scheme)[1]
    for cuda_graphs in (True, False):
        eng = Engine.from_artifact(out, max_slots=2, device="cuda", cuda_graphs=cuda_graphs)
        try:
            assert eng.ex.fixture_report["max_logit_diff"] <= 0.25
            for p in PROMPTS:
                agrees_up_to_near_tie(eng.generate(p, 64).token_ids, generate_eager(model, p, 64, max_seq_len=256),
                                      0.25, f"{scheme} bf16 cuda_graphs={cuda_graphs}")
        finally:
            eng.close()
