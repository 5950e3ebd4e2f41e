"""sample: next-token choice inside the graph — greedy, or temperature / top-k / top-p sampling
driven by a counter-based RNG, branch-free per row.

logits [B, V]; temperature [B] fp32 (<= 0 means greedy); top_k [B] int64 (<= 0 means all);
top_p [B] fp32 (1 means all); seed [B] int64; position [B] int64 (the position of the token
being fed: the sample for a given (seed, position) never depends on batch neighbours or on
replay count). -> ids [B] int64.

Sampling is Gumbel-max over the kept set: argmax(logits/T + gumbel(u)), u = hash(seed, position,
token id) — a 32-bit integer hash (lowbias32) computed in int64 arithmetic, identical on every
device and backend.
"""
import dataclasses
from typing import ClassVar

import torch

from ._registry import check_shape, define_op

SCHEMA = ("(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, Tensor position)"
          " -> Tensor")
MASK32 = 0xFFFFFFFF


@dataclasses.dataclass
class Sampling:
    """One request's sampling parameters (the host-side form of this op's per-row inputs)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # the graph inputs they become, in the graphs' order (graphs/signature.py): one [rows] tensor each
    INPUTS: ClassVar[tuple] = (("temperature", torch.float32), ("top_k", torch.int64), ("top_p", torch.float32),
                               ("seed", torch.int64))

    def tensors(self, n: int, device) -> list[torch.Tensor]:
        """-> [temperature, top_k, top_p, seed], each [n], as the graphs take them."""
        return Sampling.rows([self] * n, n, device)

    @staticmethod
    def rows(rows: list["Sampling"], n: int, device) -> list[torch.Tensor]:
        """Per-row parameters, padded to n rows with greedy ones -> [temperature, top_k, top_p, seed], each [n]."""
        rows = list(rows) + [Sampling()] * (n - len(rows))
        return [torch.tensor([getattr(r, name) for r in rows], dtype=dtype, device=device)
                for name, dtype in Sampling.INPUTS]


def check_sampling(temperature: float, top_k: int, top_p: float, seed: int | None = None) -> None:
    """The one check of a request's sampling parameters (the engine, the CLI and the server call it); ValueError
    names the rule. `not (x >= 0)` also rejects NaN."""
    if not (temperature >= 0 and 0 <= top_k < 2**31 and 0 < top_p <= 1):
        raise ValueError("need temperature >= 0, 0 <= top_k < 2^31 and 0 < top_p <= 1")
    if seed is not None and not -2**63 <= int(seed) < 2**63:
        raise ValueError(f"seed must fit in int64, got {seed}")


def _validate(logits, temperature, top_k, top_p, seed, position):
    if logits.dim() != 2:
        raise ValueError(f"sample logits: expected shape [B, V], got {list(logits.shape)}")
    B = logits.shape[0]
    check_shape(temperature, (B,), "sample temperature", torch.float32)
    check_shape(top_k, (B,), "sample top_k", torch.int64)
    check_shape(top_p, (B,), "sample top_p", torch.float32)
    check_shape(seed, (B,), "sample seed", torch.int64)
    check_shape(position, (B,), "sample position", torch.int64)


def _mix32(x):
    """lowbias32 on values in [0, 2^32), kept exact in int64 (products wrap; low 32 bits survive)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniform(seed, position, vocab: int, device):
    """[B] x [B] -> u [B, V] in (0, 1), a pure function of (seed, position, token id)."""
    s = _mix32(seed & MASK32) ^ _mix32((seed >> 32) & MASK32 ^ 0x9E3779B9)
    h = _mix32(s ^ _mix32(position & MASK32))[:, None]                      # [B, 1]
    tok = torch.arange(vocab, device=device, dtype=torch.int64)[None, :]
    r = _mix32(h ^ _mix32(tok + 0x632BE5AB & MASK32))
    return (r.double() + 0.5) / 4294967296.0


def _cumsum_blocked(p, block: int = 512):
    """cumsum over the last dim of [B, V] as two short scans (within blocks of `block`, then over the
    block totals): Inductor lowers one scan over a 248k vocab at B=1 to a split-scan kernel that
    cannot fuse with the reductions around it (NotImplementedError at compile, seen on the H200)."""
    B, V = p.shape
    nb = -(-V // block)
    x = torch.nn.functional.pad(p, (0, nb * block - V)).view(B, nb, block)   # [B, nb, block]
    inner = x.cumsum(-1)
    offs = inner[:, :, -1].cumsum(-1) - inner[:, :, -1]                      # [B, nb] mass of earlier blocks
    return (inner + offs[:, :, None]).view(B, nb * block)[:, :V]


def reference_sample(logits, temperature, top_k, top_p, seed, position):
    B, V = logits.shape
    logits = logits.float()
    greedy = logits.argmax(-1)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / t[:, None]
    srt, order = torch.sort(scaled, dim=-1, descending=True)               # [B, V]
    probs = torch.softmax(srt, dim=-1)
    before = _cumsum_blocked(probs) - probs                                # mass ranked above
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))[:, None]
    keep = (rank < k) & (before < top_p[:, None]) | (rank == 0)
    u = uniform(seed, position, V, logits.device).gather(1, order)          # noise of each ranked token
    gumbel = -torch.log(-torch.log(u)).float()
    choice = torch.where(keep, srt + gumbel, torch.full_like(srt, float("-inf"))).argmax(-1)
    sampled = order.gather(1, choice[:, None])[:, 0]
    return torch.where(temperature > 0, sampled, greedy)


sample = define_op("sample", version=2, schema=SCHEMA, reference=reference_sample, validate=_validate,
                   fake=lambda logits, *r: logits.new_empty((logits.shape[0],), dtype=torch.int64))
