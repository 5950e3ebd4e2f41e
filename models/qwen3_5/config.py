"""ModelConfig: one frozen dataclass for the Qwen3.5/3.6 family, built from an HF `config.json`.

Accepts `model_type` qwen3_5_moe (nested `text_config`), qwen3_5_moe_text, and the dense
qwen3_5 / qwen3_5_text. Derived fields (layer types, rotary dims) are computed once here; an
impossible value raises ValueError naming the field, so nothing downstream has to re-check.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
DENSE_TYPES = ("qwen3_5", "qwen3_5_text")
LAYER_KINDS = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str                 # the text model type: qwen3_5_moe_text or qwen3_5_text
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]    # per layer: "linear_attention" (GDN) or "full_attention"
    # gated full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int                 # partial rotary: rotated dims per head (head_dim * factor)
    attention_bias: bool
    # Gated DeltaNet
    conv_kernel: int
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    # MLP: MoE (num_experts > 0) or dense SwiGLU (intermediate_size)
    num_experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        def need(cond, field, why, value):
            # `field` is the name the user wrote (the HF config key where it differs from ours)
            if not cond:
                raise ValueError(f"config field {field!r}: {why} (got {value!r})")
        for f in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "conv_kernel",
                  "linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim"):
            v = getattr(self, f)
            need(isinstance(v, int) and v > 0, f, "must be a positive int", v)
        need(len(self.layer_types) > 0, "layer_types", "needs at least one layer", self.layer_types)
        need(all(t in LAYER_KINDS for t in self.layer_types), "layer_types", f"entries must be in {LAYER_KINDS}",
             self.layer_types)
        need(self.num_heads % self.num_kv_heads == 0, "num_key_value_heads", "must divide num_attention_heads",
             self.num_kv_heads)
        need(self.linear_v_heads % self.linear_k_heads == 0, "linear_num_value_heads",
             "must be a multiple of linear_num_key_heads", self.linear_v_heads)
        need(0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0, "rotary_dim",
             "partial rotary dims must be even and within head_dim", self.rotary_dim)
        need(self.conv_kernel >= 2, "conv_kernel", "causal conv kernel must be >= 2", self.conv_kernel)
        if self.num_experts:
            need(0 < self.top_k <= self.num_experts, "num_experts_per_tok", "must be in 1..num_experts", self.top_k)
            need(self.moe_intermediate > 0, "moe_intermediate_size", "must be positive", self.moe_intermediate)
        else:
            need(self.intermediate_size > 0, "intermediate_size", "dense MLP needs a positive size",
                 self.intermediate_size)
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive", self.rms_norm_eps)

    # ---- derived, cheap ----
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def conv_dim(self) -> int:
        # channels of the GDN causal conv: q ‖ k ‖ v
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Map an HF config dict (any accepted model_type) to ModelConfig."""
        mt = hf.get("model_type")
        if mt in ("qwen3_5_moe", "qwen3_5"):
            if not isinstance(hf.get("text_config"), dict):
                raise ValueError(f"config field 'text_config': model_type {mt!r} needs a nested text_config")
            text = dict(hf["text_config"])
            for k in ("tie_word_embeddings", "eos_token_id"):
                if k not in text and k in hf:
                    text[k] = hf[k]
            mt_text = mt + "_text"
        elif mt in ("qwen3_5_moe_text", "qwen3_5_text"):
            text, mt_text = hf, mt
        else:
            raise ValueError(f"config field 'model_type': unsupported {mt!r}; expected one of "
                             f"{MOE_TYPES + DENSE_TYPES}")
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config field 'hidden_act': only 'silu' is supported (got {act!r})")
        n_layers = int(text.get("num_hidden_layers", 0))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            if interval <= 0:
                raise ValueError(f"config field 'full_attention_interval': must be positive (got {interval})")
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
        if len(layer_types) != n_layers:
            raise ValueError(f"config field 'layer_types': {len(layer_types)} entries for "
                             f"num_hidden_layers={n_layers}")
        rope = text.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        n_heads = int(text.get("num_attention_heads", 16))
        if n_heads <= 0:
            raise ValueError(f"config field 'num_attention_heads': must be positive (got {n_heads})")
        if not text.get("head_dim") and "hidden_size" not in text:
            raise ValueError("config field 'hidden_size': needed to derive head_dim (neither is set)")
        head_dim = int(text.get("head_dim") or text["hidden_size"] // n_heads)
        eos = text.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        is_moe = mt_text == "qwen3_5_moe_text"
        return cls(
            model_type=mt_text,
            vocab_size=int(text.get("vocab_size", 248320)),
            hidden_size=int(text.get("hidden_size", 2048)),
            layer_types=tuple(layer_types),
            num_heads=n_heads,
            num_kv_heads=int(text.get("num_key_value_heads", 2)),
            head_dim=head_dim,
            rope_theta=theta,
            rotary_dim=int(head_dim * factor),
            attention_bias=bool(text.get("attention_bias", False)),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            linear_k_heads=int(text.get("linear_num_key_heads", 16)),
            linear_v_heads=int(text.get("linear_num_value_heads", 32)),
            linear_k_dim=int(text.get("linear_key_head_dim", 128)),
            linear_v_dim=int(text.get("linear_value_head_dim", 128)),
            num_experts=int(text.get("num_experts", 256)) if is_moe else 0,
            top_k=int(text.get("num_experts_per_tok", 8)) if is_moe else 0,
            moe_intermediate=int(text.get("moe_intermediate_size", 512)) if is_moe else 0,
            shared_intermediate=int(text.get("shared_expert_intermediate_size", 512)) if is_moe else 0,
            intermediate_size=0 if is_moe else int(text.get("intermediate_size", 0)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            eos_token_ids=eos,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_hf(json.loads(path.read_text()))
