"""The traced entry points: wrapper modules around Qwen35Model.decode / prefill (and, in a speculative
artifact, graphs/spec_graphs.py's prefill and spec round), and the example inputs (names, shapes, dtypes)
that define each graph's static signature.

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


class SpecPrefillEntry(torch.nn.Module):
    """A speculative artifact's prefill: the plain prefill's outputs + the MTP head's catch-up."""

    def __init__(self, model: Qwen35Model):
        super().__init__()
        self.model = model

    def forward(self, *args):
        from onegraph.graphs import spec_graphs
        return spec_graphs.prefill(self.model, *args)


class SpecEntry(torch.nn.Module):
    """One speculative round of k drafts (graphs/spec_graphs.py step)."""

    def __init__(self, model: Qwen35Model, k: int):
        super().__init__()
        self.model, self.k = model, k

    def forward(self, *args):
        from onegraph.graphs import spec_graphs
        return spec_graphs.step(self.model, self.k, *args)


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    name: str            # decode_b4, prefill_t64, spec_b4
    kind: str            # decode | prefill | spec
    bucket: int          # B or T
    inputs: list         # [(name, shape, dtype)], state last, "S" for the dynamic slot dim
    k: int = 0           # speculative tokens: > 0 in a speculative artifact's prefill and spec graphs

    def manifest(self) -> dict:
        out = {"kind": self.kind, "bucket": self.bucket,
               "inputs": [{"name": n, "shape": list(s), "dtype": str(d).removeprefix("torch.")}
                          for n, s, d in self.inputs],
               "outputs": (["next_ids", "n_accepted", "targets", "drafts"] if self.kind == "spec"
                           else ["next_ids", "logits"])}
        if self.k:
            out["speculative_tokens"] = self.k
        return out


def state_inputs(model: Qwen35Model, max_seq_len: int, dtype: torch.dtype, k: int = 0) -> list:
    """[(name, shape, dtype)] of the state a graph takes (slot dim "S"): the model's, then with k > 0 the
    speculative state (graphs/spec_graphs.py spec_state_spec: the head's KV, spec.y, spec.pos)."""
    spec = model.state_spec(1, max_seq_len, dtype)
    if k:
        from onegraph.graphs.spec_graphs import spec_state_spec
        spec = spec + spec_state_spec(model, 1, max_seq_len, dtype)
    return [(t.name, ("S",) + t.shape[1:], t.dtype) for t in spec]


def graph_spec(model: Qwen35Model, kind: str, bucket: int, max_seq_len: int, dtype: torch.dtype,
               k: int = 0) -> GraphSpec:
    """k > 0 (a speculative artifact): prefill also takes next_tokens [T] and the speculative state; kind
    "spec" is the round of k drafts; decode graphs are the plain ones either way."""
    if kind == "decode":
        head = [("tokens", (bucket,), torch.int64), ("slots", (bucket,), torch.int64),
                ("positions", (bucket,), torch.int64)] + [(n, (bucket,), d) for n, d in SAMPLING]
    elif kind == "spec":
        if not k:
            raise ValueError("a spec graph needs k >= 1 speculative tokens")
        head = [("tokens", (bucket,), torch.int64), ("slots", (bucket,), torch.int64)] + \
               [(n, (bucket,), d) for n, d in SAMPLING]
    else:
        head = [("tokens", (bucket,), torch.int64), ("slot", (1,), torch.int64), ("start_pos", (1,), torch.int64),
                ("n_valid", (1,), torch.int64)] + [(n, (1,), d) for n, d in SAMPLING]
        if k:
            head.append(("next_tokens", (bucket,), torch.int64))
    k = 0 if kind == "decode" else k
    state = state_inputs(model, max_seq_len, dtype, k)
    return GraphSpec(f"{kind}_{'t' if kind == 'prefill' else 'b'}{bucket}", kind, bucket, head + state, k)


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


def entry_module(model: Qwen35Model, kind: str, k: int = 0) -> torch.nn.Module:
    if kind == "spec":
        return SpecEntry(model, k)
    if kind == "prefill":
        return SpecPrefillEntry(model) if k else PrefillEntry(model)
    return DecodeEntry(model)
