"""The builtin `tiny` model: a 4-layer Qwen3.5-MoE (3 GDN + 1 attention, 8 experts top-2 + a shared
expert, hidden 128) with an MTP head, trained on the Python standard library's own source
(scripts/train_tiny.py; PSF License corpus), and a byte-level tokenizer — no download, ever.

The trained weights ship inside the package (tiny_weights/model.safetensors, 6.2 MB fp32, hub names,
per-expert keys, `mtp.*`); `write_tiny(dir)` writes them as an HF-format checkpoint with config.json,
tokenizer.json and tokenizer_config.json (chat template). `random_hf_weights` gives seeded random
weights of any Qwen35Model shape for tests.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
VOCAB = 256 + len(SPECIAL) + len(ADDED)      # 264: bytes, then special and added tokens
EOS_IDS = [256, 258]                          # <|endoftext|>, <|im_end|>
# scripts/train_tiny.py's output, shipped as package data (pyproject.toml)
TINY_WEIGHTS = Path(__file__).resolve().parent / "tiny_weights" / "model.safetensors"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_HF_CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "mtp_num_hidden_layers": 1,                 # the MTP head (models/qwen3_5/mtp.py), `mtp.*` keys
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    # the 35B shape's limit, not the context tiny was trained on: long-context artifacts (--max-seq-len
    # 131072) export and size on a CPU with it
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "eos_token_id": EOS_IDS,
    "dtype": "float32",
}


def hf_tensors(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model-side parameter names -> HF hub names: a `model.` prefix (not on `lm_head.*` nor `mtp.*`,
    which the hub keeps at the top level) and fused experts split into per-expert keys."""
    out = {}
    for name, t in named.items():
        hub = name if name.startswith(("lm_head.", "mtp.")) else f"model.{name}"
        if name.endswith("experts.gate_up_proj"):
            prefix, I = hub[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :I].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, I:].contiguous()
        elif name.endswith("experts.down_proj"):
            prefix = hub[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[hub] = t.contiguous()
    return out


def random_hf_weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random values for every parameter of a Qwen35Model, under HF hub names
    (`model.` prefix, per-expert keys). Scales keep activations O(1) so greedy ids are not
    dominated by ties."""
    gen = torch.Generator().manual_seed(seed)
    named = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            t = torch.empty(shape).uniform_(-1.0, 1.0, generator=gen)
        elif p.dim() == 1:  # norm weights
            t = torch.randn(shape, generator=gen) * 0.1
        else:
            fan_in = shape[-1]
            t = torch.randn(shape, generator=gen) * (fan_in ** -0.5)
        named[name] = t
    return hf_tensors(named)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte <-> printable-char map, which the ByteLevel pre-tokenizer uses
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiny_tokenizer(extra: int = 0):
    """Byte-level tokenizer: byte b is id b; special and added tokens follow from 256. extra > 0 pads the
    vocabulary with `<extra_i>` ids after them (VOCAB .. VOCAB + extra - 1), which encoding never produces
    (no merges) and which decode as their text: a larger model's vocab_size (scripts/random_checkpoint.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import AddedToken
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    if extra:
        vocab.update({t: 256 + i for i, t in enumerate(SPECIAL + ADDED)})     # the ids add_*_tokens would give
        vocab.update({f"<extra_{i}>": i for i in range(VOCAB, VOCAB + extra)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False) for t in ADDED])
    return tok


def write_checkpoint(out_dir: str | Path, tensors: dict[str, torch.Tensor],
                     hf_config: dict | None = None) -> Path:
    """An HF-format checkpoint of tiny's shape: config.json, model.safetensors (`tensors`, hub names),
    tokenizer.json and tokenizer_config.json with the chat template."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config or TINY_HF_CONFIG, indent=2))
    tiny_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
        "bos_token": None, "model_max_length": TINY_HF_CONFIG["max_position_embeddings"]}, indent=2))
    return out


def write_tiny(out_dir: str | Path) -> Path:
    """The builtin tiny checkpoint (the shipped trained weights) as an HF-format directory."""
    from safetensors.torch import load_file
    return write_checkpoint(out_dir, load_file(str(TINY_WEIGHTS)))


# The Qwen3.5-35B-A3B text shape (transformers Qwen3_5MoeTextConfig defaults), for benchmarks
# with seeded random weights built on the device — never shipped, never downloaded.
QWEN35_35B_A3B_HF_CONFIG = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}


@torch.no_grad()
def randomise_(model: torch.nn.Module, device, seed: int = 0, router: str = "random") -> None:
    """Seeded O(1)-scale weights by parameter name (ours or transformers' Qwen3.5 names): GDN decay
    A_log = log U(1, 16), dt_bias U(-1, 1), other vectors N(0, 0.1), matrices N(0, fan_in^-1/2).
    router="decisive": then models/qwen3_5/decisive.py's rule (per layer, a seeded top-k set for each token's sign
    pattern, chosen by wide router margins)."""
    from onegraph.models.qwen3_5 import decisive
    decisive.check_router(router)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device=device).uniform_(1.0, 16.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.uniform_(-1.0, 1.0, generator=gen)
        elif p.dim() == 1:
            p.normal_(0.0, 0.1, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        if router == "decisive":                         # a Qwen35Model (its cfg gives H and top_k)
            decisive.apply_(name, p, model.cfg.hidden_size, model.cfg.num_experts, model.cfg.top_k, seed)


@torch.no_grad()
def random_model(cfg, dtype: torch.dtype, device, seed: int = 0, fp32_reduce: bool = False,
                 router: str = "random"):
    """A Qwen35Model built on `device` (meta -> to_empty -> seeded init), same scales as the tiny
    weights; for benchmarking shapes whose weights cannot be shipped. router: see randomise_."""
    from onegraph.models.qwen3_5.model import Qwen35Model
    with torch.device("meta"):
        model = Qwen35Model(cfg, fp32_reduce=fp32_reduce).to(dtype)   # allocated in the target dtype (35B: 69 GB)
    model.to_empty(device=device)
    randomise_(model, device, seed, router)
    model.inv_freq = Qwen35Model.rope_inv_freq(cfg).to(device)   # the rope table stays fp32
    return model.eval()
