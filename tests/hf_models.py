"""Tiny random transformers checkpoints (test-only oracle): build, randomise, save_pretrained."""
from __future__ import annotations

import torch

BASE = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=2048)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2)

# name -> (kind, config overrides). Several shapes: head counts, GQA ratios, GDN k/v head counts,
# top-1 and top-k > 1, full_attention_interval 2 and 4, odd vocab, tied embeddings.
CASES = {
    "moe_i4_top2": ("moe", dict(MOE, full_attention_interval=4)),
    "moe_i2_top1_gqa4_oddvocab": ("moe", dict(MOE, num_experts_per_tok=1, full_attention_interval=2, vocab_size=257,
                                              num_attention_heads=8, num_key_value_heads=2,
                                              linear_num_key_heads=2, linear_num_value_heads=2)),
    "moe_6layers_top3_kv1": ("moe", dict(MOE, num_hidden_layers=6, num_experts_per_tok=3, full_attention_interval=3,
                                         num_key_value_heads=1, linear_num_key_heads=1, linear_num_value_heads=4,
                                         linear_key_head_dim=16)),
    "dense_i2": ("dense", dict(intermediate_size=96, full_attention_interval=2)),
    "dense_tied": ("dense", dict(intermediate_size=80, full_attention_interval=4, tie_word_embeddings=True)),
    "cond_gen_moe": ("cond", dict(MOE, full_attention_interval=4)),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    """O(1)-scale random weights (HF's 0.02 init leaves near-tied logits that make greedy fragile)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def build(case: str, seed: int = 0):
    import transformers as tf
    kind, over = CASES[case]
    cfg = dict(BASE, **over)
    torch.manual_seed(seed)
    if kind == "moe":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**cfg))
    elif kind == "dense":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**cfg))
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=cfg["hidden_size"],
                      patch_size=4, temporal_patch_size=1, spatial_merge_size=1)
        model = tf.Qwen3_5MoeForConditionalGeneration(
            tf.Qwen3_5MoeConfig(text_config=cfg, vision_config=vision))
    randomise(model, seed)
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], steps: int):
    """Greedy ids and last-position logits per step, recomputing the whole sequence each step
    (the reference model's own chunked path; no cache to get wrong)."""
    ids, out, logits = list(prompt), [], []
    for _ in range(steps):
        lg = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        logits.append(lg)
        out.append(int(lg.argmax()))
        ids.append(out[-1])
    return out, logits
