"""A second model family through the family seam (models/__init__.py): the Qwen3.5 family with one difference,
its layer pattern, stated in its config.json as `attention_layers` (the indices of the full-attention layers)
under its own `model_type`. Registered, it loads, exports (ONNX: one decode bucket, one prefill chunk, 2 layers)
and replays on the CPU with its eager model's greedy ids; nothing in the loader, exporter or runtime names it."""
from __future__ import annotations

import dataclasses
import json

import pytest

from onegraph import models
from onegraph.models.qwen3_5 import FAMILY as QWEN

ALT_TYPE = "alt_hybrid_text"
PROMPT = [5, 17, 42, 99, 3, 250, 7]


@dataclasses.dataclass(frozen=True)
class AltConfig(QWEN.config):
    @classmethod
    def from_hf(cls, hf: dict) -> "AltConfig":
        """`attention_layers` [i, ...] -> the Qwen mapping's layer_types; everything else as Qwen3.5-MoE's."""
        n, attn = hf["num_hidden_layers"], set(hf["attention_layers"])
        kinds = ["full_attention" if i in attn else "linear_attention" for i in range(n)]
        qwen = {k: v for k, v in hf.items() if k != "attention_layers"}
        base = QWEN.config.from_hf(dict(qwen, model_type="qwen3_5_moe_text", layer_types=kinds))
        return cls(**dict(dataclasses.asdict(base), model_type=ALT_TYPE))


ALT = dataclasses.replace(QWEN, name="alt_hybrid", model_types=(ALT_TYPE,), config=AltConfig, attach_mtp=None)


@pytest.fixture(scope="module")
def alt_checkpoint(tmp_path_factory):
    """A 2-layer checkpoint whose attention layer comes first (Qwen3.5 puts it last in every group of 4)."""
    pytest.importorskip("transformers")
    import hf_models
    import transformers as tf
    cfg = dict(hf_models.BASE, **hf_models.MOE, num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
    model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**cfg))
    hf_models.randomise(model, 0)
    out = tmp_path_factory.mktemp("alt") / "ckpt"
    model.save_pretrained(out)
    hf = json.loads((out / "config.json").read_text())
    hf = {k: v for k, v in hf.items() if k not in ("layer_types", "full_attention_interval")}
    (out / "config.json").write_text(json.dumps(dict(hf, model_type=ALT_TYPE, attention_layers=[0])))
    models.register(ALT)
    yield out
    models._REGISTERED.pop(ALT.name)


def test_an_unknown_family_is_refused_by_name():
    with pytest.raises(ValueError, match="unsupported 'alt_hybrid_text'"):
        models.family_of(ALT_TYPE)
    with pytest.raises(ValueError, match="belong to another family"):
        models.register(dataclasses.replace(ALT, name="again", model_types=("qwen3_5_moe_text",)))


def test_a_family_that_differs_in_its_layer_pattern_exports_and_replays(alt_checkpoint, tmp_path):
    from onegraph.checkpoint.load import load_model
    from onegraph.custom_ops.sample import Sampling
    from onegraph.export.pipeline import ExportOptions, export
    from onegraph.graphs.eager import generate_eager
    from onegraph.runtime import Engine
    from onegraph.runtime.artifact import Artifact

    cfg, model, _ = load_model(str(alt_checkpoint))
    assert models.family_of(cfg.model_type) is ALT and cfg.layer_types == ("full_attention", "linear_attention")
    want = generate_eager(model, PROMPT, 6, Sampling(), max_seq_len=64).token_ids

    out = tmp_path / "art"
    export(str(alt_checkpoint), out, ExportOptions(backend="onnx", batch_sizes=(1,), prefill_chunks=(16,),
                                                   max_seq_len=64), progress=False)
    art = Artifact.load(out)
    assert art.model["model_type"] == ALT_TYPE
    assert [t.kind for t in art.state_tensors] == ["kv", "kv", "conv", "recurrent"]   # attention first
    engine = Engine.from_artifact(art, max_slots=1)               # the load-time parity fixture passes too
    try:
        assert engine.generate(PROMPT, 6).token_ids == want
    finally:
        engine.close()
