"""The state a model family declares: tensors with fixed addresses, one row per slot, passed to every graph
and mutated in place. `kind` says what the runtime may do with each: size it by context length ("kv"),
keep or drop it with a prefix ("conv", "recurrent"), or carry it between speculative rounds ("spec")."""
from __future__ import annotations

import dataclasses

import torch

# kv: attention KV cache [S, KVH, Tmax, D] (grows with max_seq_len); conv: GDN conv window [S, C, k-1];
# recurrent: GDN state [S, HV, K, V] (fp32); spec: a speculative round's carry (the head's hidden, positions)
STATE_KINDS = ("kv", "conv", "recurrent", "spec")


@dataclasses.dataclass(frozen=True)
class StateTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str

    def __post_init__(self):
        if self.kind not in STATE_KINDS:
            raise ValueError(f"state tensor {self.name}: kind {self.kind!r} is not one of {STATE_KINDS}")
