"""Graph signatures: the inputs and outputs of each traced entry point, as the model defines them.

Export traces and records them in the manifest; the runtime allocates state and feeds graphs by them.
Both read them from here, so neither defines the model's interface on its own.

Every graph takes its head inputs (tokens, slots, positions, sampling, ...) and then the state tensors,
last. A state input is one whose first dimension is the slot dimension "S" (dynamic: any number of
slots at load time; docs/design.md, "State is a graph input"); no head input has it. Everything else is
static: batch B for decode and spec rounds, chunk T for prefill, Tmax = max_seq_len for the KV cache.
"""
from __future__ import annotations

import dataclasses

import torch

from onegraph.custom_ops.sample import Sampling

OUTPUTS = ("next_ids", "logits")                                   # decode and prefill graphs
SPEC_OUTPUTS = ("next_ids", "n_accepted", "targets", "drafts")      # a speculative round
# A graph that cannot mutate its inputs (ONNX) returns each state tensor's new value after OUTPUTS, as
# the output named NEW_STATE_PREFIX + the state input's name, in the state's order.
NEW_STATE_PREFIX = "new."


def torch_dtype(name: str) -> torch.dtype:
    """A manifest dtype string ("bfloat16", "int64", ...) -> the torch dtype it names."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a graph signature")
    return dtype


def is_state(shape) -> bool:
    """A graph input [S, ...] (the slot dimension first) is state; head inputs never start with "S"."""
    return bool(shape) and shape[0] == "S"


def split_inputs(inputs: list[dict]) -> tuple[list[dict], list[dict]]:
    """A manifest graph's inputs ({name, shape, dtype}) -> (head inputs, state inputs), state last."""
    n_head = sum(not is_state(i["shape"]) for i in inputs)
    if any(not is_state(i["shape"]) for i in inputs[n_head:]):
        raise ValueError("graph inputs: the state (shape [S, ...]) must come last")
    return inputs[:n_head], inputs[n_head:]


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
               "outputs": list(SPEC_OUTPUTS if self.kind == "spec" else OUTPUTS)}
        if self.k:
            out["speculative_tokens"] = self.k
        return out


def _state_spec(model: torch.nn.Module, max_seq_len: int, dtype: torch.dtype, k: int = 0) -> list:
    """The StateTensors of one slot: the model's, then with k > 0 the speculative state
    (graphs/spec_graphs.py spec_state_spec: the head's KV, spec.y, spec.pos)."""
    spec = model.state_spec(1, max_seq_len, dtype)
    if k:
        from onegraph.graphs.spec_graphs import spec_state_spec
        spec = spec + spec_state_spec(model, 1, max_seq_len, dtype)
    return spec


def state_inputs(model: torch.nn.Module, max_seq_len: int, dtype: torch.dtype, k: int = 0) -> list:
    """[(name, shape, dtype)] of the state a graph takes (slot dim "S")."""
    return [(t.name, ("S",) + t.shape[1:], t.dtype) for t in _state_spec(model, max_seq_len, dtype, k)]


def state_manifest(model: torch.nn.Module, max_seq_len: int, dtype: torch.dtype, k: int = 0) -> list[dict]:
    """The state as the manifest records it ({name, shape, dtype, kind}, slot dim "S"): the union of what the
    graphs take (with k > 0 the spec graphs take the model's state and then the speculative state)."""
    spec = _state_spec(model, max_seq_len, dtype, k)
    rows = GraphSpec("state", "state", 0, state_inputs(model, max_seq_len, dtype, k)).manifest()["inputs"]
    return [dict(r, kind=t.kind) for r, t in zip(rows, spec)]


def graph_spec(model: torch.nn.Module, kind: str, bucket: int, max_seq_len: int, dtype: torch.dtype,
               k: int = 0) -> GraphSpec:
    """k > 0 (a speculative artifact): prefill also takes next_tokens [T] and the speculative state; kind
    "spec" is the round of k drafts; decode graphs are the plain ones either way."""
    if kind == "decode":
        head = [("tokens", (bucket,), torch.int64), ("slots", (bucket,), torch.int64),
                ("positions", (bucket,), torch.int64)] + [(n, (bucket,), d) for n, d in Sampling.INPUTS]
    elif kind == "spec":
        if not k:
            raise ValueError("a spec graph needs k >= 1 speculative tokens")
        head = [("tokens", (bucket,), torch.int64), ("slots", (bucket,), torch.int64)] + \
               [(n, (bucket,), d) for n, d in Sampling.INPUTS]
    else:
        head = [("tokens", (bucket,), torch.int64), ("slot", (1,), torch.int64), ("start_pos", (1,), torch.int64),
                ("n_valid", (1,), torch.int64)] + [(n, (1,), d) for n, d in Sampling.INPUTS]
        if k:
            head.append(("next_tokens", (bucket,), torch.int64))
    k = 0 if kind == "decode" else k
    state = state_inputs(model, max_seq_len, dtype, k)
    return GraphSpec(f"{kind}_{'t' if kind == 'prefill' else 'b'}{bucket}", kind, bucket, head + state, k)
