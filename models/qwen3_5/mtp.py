"""The multi-token-prediction (MTP) head of Qwen3.5/3.6: a draft model that predicts token t+2.

Hub layout (checkpoint keys `mtp.*`; embeddings and lm_head are the main model's, not repeated):
    mtp.pre_fc_norm_embedding.weight [H]     zero-centred RMSNorm of embed(x_{t+1})
    mtp.pre_fc_norm_hidden.weight    [H]     zero-centred RMSNorm of h_t, the main model's final-normed hidden
    mtp.fc.weight                    [H, 2H] over [norm_e(embed(x_{t+1})) ‖ norm_h(h_t)], no bias
    mtp.layers.{i}.*                          full-attention decoder layers (gated attention + the MoE MLP),
                                              per-expert keys as the main layers
    mtp.norm.weight                  [H]     the final norm before the shared lm_head
The config field `mtp_num_hidden_layers` (Qwen3.5; Qwen3-Next calls it `num_nextn_predict_layers`) counts
the layers. Verified against vLLM's qwen3_5_mtp.py / qwen3_next_mtp.py (Qwen3_5MultiTokenPredictor):
the same module names (`fc` 2H -> H without bias, `layers` of full_attention decoder layers, `norm`,
`pre_fc_norm_hidden`, `pre_fc_norm_embedding`, all Gemma-style (1 + w) RMSNorms), the concatenation order
(embedding first, then hidden), and its loader mapping `mtp.` onto the predictor while `embed_tokens` and
`lm_head` come from the main model's keys. Position t of the head reads x_{t+1} and h_t at rotary
position t, and its logits predict x_{t+2}.

Not part of an ordinary model (nor of tensor-parallel sharding): `attach_mtp` adds the head as `model.mtp`
only when asked (load_model(..., mtp=True); `onegraph export --speculative-tokens K` asks, and its prefill
and spec graphs run the head, graphs/spec_graphs.py), so an ordinary model, its exports and its TP shards
are unchanged.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from onegraph.models.qwen3_5.config import ModelConfig
from onegraph.models.qwen3_5.model import DecoderLayer, RMSNorm
from onegraph.models.qwen3_5.tp import local_dims


class MtpHead(nn.Module):
    def __init__(self, cfg: ModelConfig, num_layers: int = 1):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"config field 'mtp_num_hidden_layers': the MTP head needs >= 1 layer (got {num_layers})")
        H, d = cfg.hidden_size, local_dims(cfg, 1)
        self.pre_fc_norm_embedding = RMSNorm(H)
        self.pre_fc_norm_hidden = RMSNorm(H)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, "full_attention", d, False) for _ in range(num_layers))
        self.norm = RMSNorm(H)


def mtp_num_layers(path: str | Path) -> int:
    """`mtp_num_hidden_layers` of an HF config.json (the nested text_config of a multimodal one); 0 if absent."""
    hf = json.loads((Path(path) / "config.json").read_text())
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    return int(text.get("mtp_num_hidden_layers", hf.get("mtp_num_hidden_layers", 0)) or 0)


def attach_mtp(model: nn.Module, path: str | Path, tp: int = 1) -> MtpHead:
    """Adds an uninitialised MTP head with the checkpoint's `mtp_num_hidden_layers` to `model` as
    `model.mtp`, on the default device (under `torch.device("meta")` as load_model builds the model, so
    the loader fills it with the rest). The head is not sharded: tp must be 1."""
    if tp != 1:
        raise ValueError(f"the MTP head is not sharded for tensor parallel: load it at tp=1 (got tp={tp})")
    n = mtp_num_layers(path)
    if n < 1:
        raise ValueError(f"config field 'mtp_num_hidden_layers': {path}/config.json declares no MTP layers")
    with torch.device("meta"):
        model.mtp = MtpHead(model.cfg, n)
    return model.mtp
