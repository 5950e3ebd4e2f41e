"""The traced entry points: wrapper modules around Qwen35Model.decode / prefill, and the example
inputs (names, shapes, dtypes) that define each graph's static signature.

Every graph takes the state tensors last, with the slot dimension S dynamic (any number of
slots at load time) and everything else static: batch B for decode, chunk T for prefill,
Tmax = max_seq_len for the KV cache.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.export import Dim

from onegraph.graphs.qwen3_5 import Qwen35Model, state_spec

EXPORT_SLOTS = 2          # slots in the example state (S = 3 with scratch); S is dynamic anyway
SAMPLING = [("temperature", torch.float32), ("top_k", torch.int64), ("top_p", torch.float32), ("seed", torch.int64)]


class DecodeEntry(torch.nn.Module):
    def __init__(self, model: Qwen35Model):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model.decode(*args)


class PrefillEntry(torch.nn.Module):
    def __init__(self, model: Qwen35Model):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model.prefill(*args)


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    name: str            # decode_b4, prefill_t64
    kind: str            # decode | prefill
    bucket: int          # B or T
    inputs: list         # [(name, shape, dtype)], state last, "S" for the dynamic slot dim

    def manifest(self) -> dict:
        return {"kind": self.kind, "bucket": self.bucket,
                "inputs": [{"name": n, "shape": list(s), "dtype": str(d).removeprefix("torch.")}
                           for n, s, d in self.inputs],
                "outputs": ["next_ids", "logits"]}


def graph_spec(model: Qwen35Model, kind: str, bucket: int, max_seq_len: int, dtype: torch.dtype) -> GraphSpec:
    if kind == "decode":
        head = [("tokens", (bucket,), torch.int64), ("slots", (bucket,), torch.int64),
                ("positions", (bucket,), torch.int64)] + [(n, (bucket,), d) for n, d in SAMPLING]
    else:
        head = [("tokens", (bucket,), torch.int64), ("slot", (1,), torch.int64), ("start_pos", (1,), torch.int64),
                ("n_valid", (1,), torch.int64)] + [(n, (1,), d) for n, d in SAMPLING]
    state = [(t.name, ("S",) + t.shape[1:], t.dtype) for t in model.state_spec(1, max_seq_len, dtype)]
    return GraphSpec(f"{kind}_{'b' if kind == 'decode' else 't'}{bucket}", kind, bucket, head + state)


def example_inputs(spec: GraphSpec, device) -> tuple:
    """Zero-filled example inputs (S = EXPORT_SLOTS + 1); n_valid = T so prefill traces the full chunk."""
    out = []
    for name, shape, dtype in spec.inputs:
        shape = tuple(EXPORT_SLOTS + 1 if s == "S" else s for s in shape)
        t = torch.zeros(shape, dtype=dtype, device=device)
        if name == "n_valid":
            t.fill_(spec.bucket)
        out.append(t)
    return tuple(out)


def dynamic_shapes(spec: GraphSpec):
    S = Dim("S", min=2, max=1 << 16)
    return (tuple({0: S} if s and s[0] == "S" else None for _, s, _ in spec.inputs),)


def entry_module(model: Qwen35Model, kind: str) -> torch.nn.Module:
    return DecodeEntry(model) if kind == "decode" else PrefillEntry(model)
