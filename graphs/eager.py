"""Eager generation over the traced entry points (the reference every graph is compared with).

The same `prefill` / `decode` functions that export traces run here op by op, so eager and replay
differ only in how they are executed, never in what they compute.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from onegraph.custom_ops.sample import Sampling

from onegraph.models.qwen3_5.model import Qwen35Model, SparseMoe, new_state


@dataclasses.dataclass
class EagerResult:
    token_ids: list[int]
    logits: list[torch.Tensor]       # fp32 [vocab] for each generated token (the logits it came from)
    finish_reason: str


@contextlib.contextmanager
def router_margins(model: Qwen35Model):
    """While active, every MoE layer call appends its smallest top-k router margin (the k-th minus the
    (k+1)-th router logit, fp32, over the call's rows) to the yielded list. Near zero, a run whose sums
    round differently may pick another expert there and legitimately part from this one."""
    margins: list[float] = []

    def record(moe, args):
        top = torch.nn.functional.linear(args[0].float(), moe.router_weight[:-1].float()).topk(moe.top_k + 1, -1).values
        margins.append(float((top[:, -2] - top[:, -1]).min()))

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, SparseMoe)]
    try:
        yield margins
    finally:
        for h in hooks:
            h.remove()


def i64(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


@torch.no_grad()
def generate_eager(model: Qwen35Model, prompt_ids: list[int], max_new_tokens: int,
                   sampling: Sampling | None = None, stop_ids=(), max_seq_len: int | None = None,
                   prefill_chunk: int | None = None, state_dtype: torch.dtype | None = None) -> EagerResult:
    """Prefill the prompt (in chunks of `prefill_chunk`, default one shot) into slot 0, then decode.
    state_dtype: the state's float dtype (default the model's; graphs/fp32_compute.py runs it in fp32)."""
    sp = sampling or Sampling()
    dev = model.inv_freq.device
    dtype = state_dtype or model.embed_tokens.weight.dtype
    max_seq_len = max_seq_len or len(prompt_ids) + max_new_tokens
    state = new_state(model.cfg, 1, max_seq_len, dtype, dev, model.tp)   # tp > 1: this rank's heads
    slot = i64([0], dev)
    chunk = prefill_chunk or len(prompt_ids)
    for start in range(0, len(prompt_ids), chunk):
        part = prompt_ids[start:start + chunk]
        nxt, logits = model.prefill(i64(part, dev), slot, i64([start], dev), i64([len(part)], dev),
                                    *sp.tensors(1, dev), *state)
    out, all_logits = [int(nxt[0])], [logits[0]]
    pos = len(prompt_ids)
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        nxt, logits = model.decode(i64([out[-1]], dev), slot, i64([pos], dev), *sp.tensors(1, dev), *state)
        out.append(int(nxt[0]))
        all_logits.append(logits[0])
        pos += 1
    finish = "stop" if out[-1] in stop_ids else "length"
    return EagerResult(out[:max_new_tokens], all_logits[:max_new_tokens], finish)
