"""FP8 weights end to end on CPU: the official block-FP8 checkpoint format loads (checkpoint/quant.py,
checkpoint/weights.py), runs through onegraph::linear_fp8 and (experts) fused_moe_fp8, matches transformers on the
same checkpoint dequantized, exports (`--quant fp8`) with the scheme in the manifest, and bad FP8 checkpoints are refused.

The FP8 checkpoint is `tiny` quantized here, independently of checkpoint/quant.py, in the official layout:
e4m3 `X.weight` + fp32 `X.weight_scale_inv` [ceil(N/128), ceil(K/128)] (amax / 448 per block) for the
projections, experts and shared expert; embeddings, lm_head, norms, the routers and the GDN in_proj_a/b
float (the official `modules_to_not_convert`). transformers 5.24 cannot load an FP8 checkpoint on CPU here
(its FineGrainedFP8 quantizer requires `accelerate`, not a dependency), so its own dequantization
(`Fp8Dequantize`) writes a float twin of the checkpoint, which transformers then runs: that is
transformers' dequantized model. In fp32 onegraph dequantizes to the same fp32 weights and multiplies in
fp32, so its logits meet transformers' within the HF-parity bound (1e-4) and the greedy ids are identical.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from onegraph.custom_ops.linear_fp8 import dequantize_blocks as dequantize
from onegraph.graphs.eager import generate_eager
from onegraph.checkpoint.load import load_model, model_dir
from onegraph.checkpoint.weights import LoadError

tf = pytest.importorskip("transformers")

QUANTIZED = re.compile(r"^model\.layers\.\d+\.(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|self_attn\.[qkvo]_proj"
                       r"|mlp\.experts\.\d+\.(gate|up|down)_proj|mlp\.shared_expert\.(gate|up|down)_proj)\.weight$")
QCONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
           "modules_to_not_convert": ["lm_head", "model.embed_tokens", "model.layers.0.linear_attn.in_proj_a"]}
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 11]
STEPS = 16


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], fp32 [ceil(N/128), ceil(K/128)]): zero-pad to whole blocks, amax / 448."""
    N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    padded = torch.nn.functional.pad(w.float(), (0, kb * 128 - K, 0, nb * 128 - N))
    blocks = padded.view(nb, 128, kb, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale[:, None, :, None]).view(nb * 128, kb * 128)[:N, :K].to(torch.float8_e4m3fn)
    return q, scale


def _write(dst, tensors, qconfig):
    shutil.copytree(model_dir("tiny"), dst)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if qconfig is not None:
        cfg["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def fp8_tensors():
    src = load_file(str(model_dir("tiny") / "model.safetensors"))
    out = {}
    for k, v in src.items():
        if QUANTIZED.match(k):
            out[k], out[k[: -len("weight")] + "weight_scale_inv"] = _quantize(v)
        else:
            out[k] = v
    assert sum(v.dtype == torch.float8_e4m3fn for v in out.values()) > 30
    return out


@pytest.fixture(scope="module")
def fp8_dir(fp8_tensors, tmp_path_factory):
    return _write(tmp_path_factory.mktemp("fp8") / "ckpt", fp8_tensors, QCONFIG)


def _hf_dequantized(tensors, dtype):
    """transformers' own FP8 dequantization of every (weight, weight_scale_inv) pair. (Imported here, not at
    collection: the module imports triton, which must not load before tests/triton_env.py sets the
    interpreter mode for the Triton tests collected after this file.)"""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    deq = Fp8Dequantize(None)
    out = {}
    for k, v in tensors.items():
        if k.endswith("weight_scale_inv"):
            continue
        scale = tensors.get(k[: -len("weight")] + "weight_scale_inv")
        out[k] = v if scale is None else deq._dequantize_one(v, scale, dtype)
    return out


@pytest.fixture(scope="module")
def dequantized_dir(fp8_tensors, tmp_path_factory):
    return _write(tmp_path_factory.mktemp("fp8") / "deq", _hf_dequantized(fp8_tensors, torch.float32), None)


@pytest.fixture(scope="module")
def fp8_model(fp8_dir):
    return load_model(fp8_dir, "float32")[1]


def test_fp8_checkpoint_loads_fp8_projections_and_experts(fp8_model, fp8_tensors):
    """Projections stay e4m3 + scales (concatenated by runs, the GDN's float [b; a] the tail of its e4m3 run); routed
    experts and the shared expert stay e4m3 (onegraph::fused_moe_fp8) with their block scales fused per layer, and
    dequantize to transformers' values."""
    from onegraph.custom_ops.fused_moe_fp8 import dequantize_gate_up
    gdn, attn = fp8_model.layers[0].linear_attn, fp8_model.layers[3].self_attn
    fp8 = {n for n, p in fp8_model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert "layers.0.linear_attn.in_proj.weight" in fp8               # [qkv; z] e4m3, [b; a] its float tail
    assert gdn.in_proj.tail.dtype == torch.float32
    assert attn.qkv_proj.runs[0].weight.shape[0] == 320               # [q; k]: q (256) is whole blocks, k (64) not
    assert "layers.3.self_attn.o_proj.weight" in fp8 and len(fp8) == 3 * 2 + 1 + 2 + 4 * 5   # + experts, shared
    ex, key = fp8_model.layers[0].mlp.experts, "model.layers.0.mlp.experts.5.{}_proj.weight{}"
    assert torch.equal(ex.gate_up_proj[5].view(torch.uint8), torch.cat(
        [fp8_tensors[key.format(p, "")] for p in ("gate", "up")]).view(torch.uint8))
    assert torch.equal(ex.gate_up_proj_scale_inv[5], torch.cat([fp8_tensors[key.format(p, "_scale_inv")]
                                                                for p in ("gate", "up")]))
    assert torch.equal(ex.down_proj_scale_inv[5], fp8_tensors[key.format("down", "_scale_inv")])
    hf = _hf_dequantized(fp8_tensors, torch.float32)
    gate_up = torch.cat([hf["model.layers.0.mlp.experts.5.gate_proj.weight"],
                         hf["model.layers.0.mlp.experts.5.up_proj.weight"]])
    assert torch.equal(dequantize_gate_up(ex.gate_up_proj[5], ex.gate_up_proj_scale_inv[5]), gate_up)
    sd = fp8_model.layers[0].mlp.shared_expert.down_proj
    assert torch.equal(dequantize(sd.weight, sd.weight_scale_inv),
                       hf["model.layers.0.mlp.shared_expert.down_proj.weight"])
    qkv = fp8_tensors["model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert torch.equal(gdn.in_proj.weight[:qkv.shape[0]].view(torch.uint8), qkv.view(torch.uint8))


def test_fp8_checkpoint_matches_transformers_dequantized_model(fp8_model, dequantized_dir):
    hf = tf.Qwen3_5MoeForCausalLM.from_pretrained(dequantized_dir, dtype=torch.float32).eval()
    import hf_models
    ref_ids, ref_logits = hf_models.hf_greedy(hf, PROMPT, STEPS)
    got = generate_eager(fp8_model, PROMPT, STEPS)
    for step, (a, b) in enumerate(zip(got.logits, ref_logits)):
        diff = (a - b).abs().max().item()
        assert diff <= 1e-4, f"logits differ from transformers' dequantized model by {diff:.3g} at step {step}"
    assert got.token_ids == ref_ids


def test_bf16_dequantizes_experts_exactly_as_transformers(fp8_dir, fp8_tensors):
    """quant='none' in bf16: experts are bf16(e4m3 * scale) per block, transformers' rule. By default a bf16 model
    keeps them e4m3 as the fp32 one does."""
    model = load_model(fp8_dir, "bfloat16", quant="none")[1]
    hf = _hf_dequantized(fp8_tensors, torch.bfloat16)
    assert torch.equal(model.layers[2].mlp.experts.down_proj[7], hf["model.layers.2.mlp.experts.7.down_proj.weight"])
    model = load_model(fp8_dir, "bfloat16")[1]
    assert model.layers[2].linear_attn.out_proj.weight.dtype == torch.float8_e4m3fn
    assert model.layers[2].mlp.experts.down_proj.dtype == model.layers[2].mlp.shared_expert.up_proj.weight.dtype \
        == torch.float8_e4m3fn


def test_quant_none_dequantizes_everything(fp8_dir, dequantized_dir):
    """Every weight bit-equal to transformers' fp32 dequantization (then the same model as the float twin)."""
    a = dict(load_model(fp8_dir, "float32", quant="none")[1].named_parameters())
    b = dict(load_model(dequantized_dir, "float32")[1].named_parameters())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]


def test_export_time_quantization_is_the_official_format(tiny_eager):
    """load_model(quant='fp8') on a float checkpoint: the projections' bytes and scales are what the
    test's independent quantizer makes of the same weights, the routed experts' gate and up rows quantized
    apart (as a checkpoint holds them) and the shared expert too; in_proj_a/b and the routers stay float."""
    model = load_model("tiny", "float32", quant="fp8")[1]
    src = load_file(str(model_dir("tiny") / "model.safetensors"))
    q, s = _quantize(src["model.layers.3.self_attn.o_proj.weight"])
    o = model.layers[3].self_attn.o_proj
    assert torch.equal(o.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(o.weight_scale_inv, s)
    assert model.layers[0].linear_attn.in_proj.tail.dtype == torch.float32               # [b; a]
    ex, key = model.layers[0].mlp.experts, "model.layers.0.mlp.experts.3.{}_proj.weight"
    (gq, gs), (uq, us) = _quantize(src[key.format("gate")]), _quantize(src[key.format("up")])
    assert torch.equal(ex.gate_up_proj[3].view(torch.uint8), torch.cat([gq, uq]).view(torch.uint8))
    assert torch.equal(ex.gate_up_proj_scale_inv[3], torch.cat([gs, us]))
    q, s = _quantize(src["model.layers.0.mlp.shared_expert.down_proj.weight"])
    sd = model.layers[0].mlp.shared_expert.down_proj
    assert torch.equal(sd.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sd.weight_scale_inv, s)
    assert model.layers[0].mlp.router.weight.dtype == torch.float32                      # [gate; shared_expert_gate]


def test_fp8_lm_head_is_the_block_quantized_head():
    """load_model(fp8_lm_head=True) on tiny (tied embeddings): the head holds the test's own block quantization of
    the table, the embedding lookup keeps the float table, and the logits are x times the dequantized head."""
    model = load_model("tiny", "float32", fp8_lm_head=True)[1]
    src = load_file(str(model_dir("tiny") / "model.safetensors"))
    table = src["model.embed_tokens.weight"]
    q, s = _quantize(src.get("lm_head.weight", table))
    head = model.lm_head
    assert torch.equal(head.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(head.weight_scale_inv, s)
    assert torch.equal(model.embed_tokens.weight, table)
    x = torch.randn(3, table.shape[1], generator=torch.Generator().manual_seed(0))
    want = x.double() @ (q.double() * s.double().repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(128, 1)
                         [:, :q.shape[1]]).T
    assert torch.allclose(model._logits(x).double(), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_fp8_lm_head_is_refused_where_it_does_not_apply():
    from onegraph.export.pipeline import ExportOptions
    with pytest.raises(ValueError, match=r"quantized weights \(fp8 lm_head\) with tp > 1"):
        load_model("tiny", tp=2, fp8_lm_head=True)
    with pytest.raises(ValueError, match="--fp8-lm-head needs --backend aoti and --tp 1"):
        ExportOptions(backend="onnx", fp8_lm_head=True).validate(4096)


@pytest.fixture(scope="module")
def bad_dir(fp8_tensors, tmp_path_factory):
    return tmp_path_factory.mktemp("bad")


def test_scale_of_the_wrong_shape_is_refused(fp8_tensors, bad_dir):
    t = dict(fp8_tensors)
    key = "model.layers.3.self_attn.q_proj.weight_scale_inv"
    t[key] = torch.ones(1, 1)                                   # q_proj is [256, 128]: needs [2, 1]
    d = _write(bad_dir / "shape", t, QCONFIG)
    with pytest.raises(LoadError, match=r"q_proj.weight_scale_inv is float32 \[1, 1\] but "
                                        r"layers.3.self_attn.q_proj.weight \[256, 128\] needs float32 \[2, 1\]"):
        load_model(d)


def test_missing_scale_is_refused(fp8_tensors, bad_dir):
    t = dict(fp8_tensors)
    del t["model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"]
    d = _write(bad_dir / "noscale", t, QCONFIG)
    with pytest.raises(LoadError, match=r"experts.3.up_proj.weight' is float8_e4m3fn but the checkpoint has no "
                                        r"model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"):
        load_model(d)


@pytest.mark.parametrize("field,value", [("weight_block_size", [64, 64]), ("fmt", "e5m2"),
                                         ("activation_scheme", "static")])
def test_fp8_config_the_loader_does_not_read_exactly_is_refused(fp8_tensors, bad_dir, field, value):
    d = _write(bad_dir / field, fp8_tensors, dict(QCONFIG, **{field: value}))
    with pytest.raises(LoadError, match=f"{field}="):
        load_model(d)


def test_fp8_with_tensor_parallel_is_refused(fp8_dir):
    with pytest.raises(ValueError, match=r"quantized weights \(fp8\) with tp > 1 are not supported"):
        load_model(fp8_dir, tp=2)


def test_cli_export_quant_fp8_records_the_scheme_and_replays_its_eager_model(tmp_path, capsys):
    """`onegraph export tiny --quant fp8 --fp8-lm-head`: FP8 weights (the head's too) in the artifact, the scheme
    and the head option in the manifest's options and in `onegraph inspect`, as are the projection groups (the GDN
    in_proj one launch with its float tail), the load-time fixture (recorded from the FP8 eager model) passes, and
    the graphs call no Python op. (The float head of a `--quant fp8` export is the
    float model's head, covered by every other artifact test, and on the GPU by the test below.)"""
    from safetensors import safe_open

    from onegraph import cli
    from onegraph.custom_ops import PYTHON_CALLS
    from onegraph.runtime.executor import GraphExecutor
    out = tmp_path / "art"
    assert cli.main(["export", "tiny", "--out", str(out), "--batch-sizes", "1", "--prefill-chunks", "16",
                     "--max-seq-len", "64", "--quant", "fp8", "--fp8-lm-head", "--quiet", "--no-cache"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["quant"] == "fp8" and manifest["options"]["fp8_lm_head"] is True
    groups = manifest["projection_groups"]                # the GDN [b; a] rides in its e4m3 run's launch
    assert groups["linear_attn.in_proj"] == {"e4m3 384 with float32 tail 8": 3}, groups
    assert groups["self_attn.qkv_proj"] == {"e4m3 320 + e4m3 64": 1}, groups      # [q; k] + [v]: k is half a block
    with safe_open(str(out / "weights.safetensors"), "pt") as f:
        fp8 = [k for k in f.keys() if f.get_slice(k).get_dtype() == "F8_E4M3"]
    assert "model.layers.3.self_attn.o_proj.weight" in fp8 and "model.lm_head.weight" in fp8
    assert len(fp8) == 9 + 4 * 5 + 1, fp8                                                  # + experts, shared, head
    capsys.readouterr()
    assert cli.main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "'quant': 'fp8'" in printed and "lm_head block fp8" in printed
    assert "linear_attn.in_proj e4m3 384 with float32 tail 8 x3" in printed
    ex = GraphExecutor.from_artifact(out, max_slots=1)
    assert ex.fixture_report["max_logit_diff"] <= 1e-4 and not ex.fixture_report["routing_flips"]
    PYTHON_CALLS.clear()
    ids, _ = ex.generate(PROMPT, 8)
    assert sum(PYTHON_CALLS.values()) == 0, PYTHON_CALLS
    assert ids == generate_eager(load_model("tiny", quant="fp8", fp8_lm_head=True)[1], PROMPT, 8,
                                 max_seq_len=64).token_ids


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_fp8_artifact_matches_its_eager_model(tmp_path):
    """`--quant fp8` on CUDA: the Triton linear_fp8 kernel inside the AOTInductor graphs (GEMV at decode,
    tl.dot at the 16-token prefill) against the FP8 eager model (the op's reference), bf16, 64 tokens,
    with and without CUDA-graph capture; ids agree up to a near-tie as tests/test_cuda_e2e.py."""
    from test_cuda_e2e import PROMPTS, agrees_up_to_near_tie

    from onegraph.export.pipeline import ExportOptions, export
    from onegraph.runtime import Engine
    out = tmp_path / "fp8"
    export("tiny", out, ExportOptions(device="cuda", dtype="bfloat16", batch_sizes=(1, 4), prefill_chunks=(16,),
                                      max_seq_len=256, quant="fp8"), progress=False)
    model = load_model("tiny", "bfloat16", "cuda", quant="fp8")[1]
    for cuda_graphs in (True, False):
        eng = Engine.from_artifact(out, max_slots=2, device="cuda", cuda_graphs=cuda_graphs)
        try:
            assert eng.ex.fixture_report["max_logit_diff"] <= 0.25
            for p in PROMPTS:
                agrees_up_to_near_tie(eng.generate(p, 64).token_ids, generate_eager(model, p, 64, max_seq_len=256),
                                      0.25, f"fp8 bf16 cuda_graphs={cuda_graphs}")
        finally:
            eng.close()
