"""graphs/fp32_compute.py: eager in fp32 over a bf16 model's own weights (the parity fixture's fp32 gap).
It must be the very computation an fp32 copy of the model runs (same values, upcast per op), leave
quantized weights (int8, float8) and other dtypes as they are, and refuse a write into a bf16 tensor
(the write would land in a temporary)."""
import copy

import pytest
import torch

from onegraph.graphs.eager import generate_eager
from onegraph.graphs.fp32_compute import Fp32Compute, generate_eager_fp32

PROMPT, STEPS = [5, 17, 42, 99, 3, 250, 7], 8


def _fp32_twin(model):
    """A genuine fp32 copy of `model`'s float weights (bf16 -> fp32), quantized weights and scales kept."""
    twin = copy.deepcopy(model)
    for t in list(twin.parameters()) + list(twin.buffers()):
        if t.dtype == torch.bfloat16:
            t.data = t.data.float()
    return twin


@pytest.fixture(scope="module")
def bf16_model():
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.models.qwen3_5.tiny import TINY_HF_CONFIG, random_model
    return random_model(ModelConfig.from_hf(TINY_HF_CONFIG), torch.bfloat16, "cpu", router="decisive")


def test_the_mode_is_the_fp32_copy_computation(bf16_model, one_thread):
    got = generate_eager_fp32(bf16_model, PROMPT, STEPS, max_seq_len=64)
    ref = generate_eager(_fp32_twin(bf16_model), PROMPT, STEPS, max_seq_len=64)
    low = generate_eager(bf16_model, PROMPT, STEPS, max_seq_len=64)
    assert got.token_ids == ref.token_ids
    assert all(a.dtype == torch.float32 for a in got.logits)
    assert max(float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits)) <= 1e-5
    # and it is not the bf16 run: the first step's logits already differ by bf16 roundings
    assert float((got.logits[0] - low.logits[0].float()).abs().max()) > 1e-3
    assert all(p.dtype == torch.bfloat16 for p in bf16_model.parameters())       # the model is untouched


@pytest.mark.parametrize("quant,qdtype", [("fp8", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_quantized_weights_stay_quantized(quant, qdtype, one_thread):
    from onegraph.checkpoint.load import load_model
    model = load_model("tiny", "bfloat16", quant=quant)[1]
    held = {n: p.dtype for n, p in model.named_parameters() if p.dtype == qdtype}
    assert held
    got = generate_eager_fp32(model, PROMPT, STEPS, max_seq_len=64)
    ref = generate_eager(_fp32_twin(model), PROMPT, STEPS, max_seq_len=64)
    assert got.token_ids == ref.token_ids
    assert max(float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits)) <= 1e-5
    assert {n: p.dtype for n, p in model.named_parameters() if n in held} == held


def test_the_casting_rule():
    bf, i8 = torch.ones(4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.int8)
    f8, f32 = torch.ones(4).to(torch.float8_e4m3fn), torch.ones(4)
    with Fp32Compute(torch.bfloat16):
        assert (bf + bf).dtype == torch.float32 and (bf * f32).dtype == torch.float32
        assert (i8 + i8).dtype == torch.int8 and f8.view(2, 2).dtype == torch.float8_e4m3fn
        assert torch.zeros(2, dtype=torch.bfloat16).dtype == torch.float32     # dtype= of the model's: fp32
        assert f32.to(torch.bfloat16).dtype == torch.float32                   # no rounding back to bf16
        assert torch.ones(2, dtype=torch.float16).dtype == torch.float16       # another low dtype: as is
        f32.add_(bf)                                                           # writes into fp32: fine
        with pytest.raises(RuntimeError, match="writes into a torch.bfloat16 tensor"):
            bf.add_(f32)
        with pytest.raises(RuntimeError, match="writes into a torch.bfloat16 tensor"):
            torch.add(f32, f32, out=bf)
    assert float(f32[0]) == 2.0 and float(bf[0]) == 1.0
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        Fp32Compute(torch.float32)
