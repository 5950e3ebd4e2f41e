"""Tensor-parallel replay: every rank replays its own graphs (its weight shard, collectives inside
the graph); rank 0 decides what runs and broadcasts each step to the others.

Protocol, per graph call on rank 0 (the leader): a header [graph index] (or [-1] = stop), then the
graph's non-state inputs (tokens, slots, positions, sampling), each broadcast from rank 0. Ranks
> 0 (followers) sit in `follow()`, allocate the inputs from the graph signature, receive them and
replay the same graph with their own state. Both sides then meet in the graph's own all-reduces.

Launched by torchrun (`torchrun --nproc-per-node N -m onegraph generate ARTIFACT ...`): the process
group comes from torchrun's environment; gloo on CPU, NCCL on CUDA. A collective timeout makes a rank
whose peer died exit with an error instead of hanging.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

TIMEOUT_S = 300


def launched_by_torchrun() -> bool:
    """True under torchrun (torch's own launcher check); the launch is the user's explicit choice."""
    return dist.is_torchelastic_launched()


def init_from_torchrun(device_type: str) -> tuple[int, int]:
    """Join torchrun's process group (once) -> (rank, world size); (0, 1) outside torchrun."""
    if not launched_by_torchrun():
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return dist.get_rank(), dist.get_world_size()


class StepBroadcast:
    """Rank 0 -> all: which graph runs next and its non-state inputs."""

    def __init__(self, graph_meta: dict, n_state: int, device: torch.device):
        from .executor import DTYPES
        self.names = sorted(graph_meta)
        self.device = device
        # Persistent buffers for the header and each graph's non-state inputs (all static shapes),
        # never freed: a tensor whose last reference a gloo worker thread drops would need the GIL
        # there (torch keeps a dead Python wrapper alive inside it), while this thread holds the GIL
        # inside the graph waiting on that worker's collective: a deadlock, seen with per-call tensors.
        self.header = torch.zeros(1, dtype=torch.int64, device=device)
        self.inputs = {n: [torch.zeros(i["shape"], dtype=DTYPES[i["dtype"]], device=device)
                           for i in graph_meta[n]["inputs"][:-n_state]] for n in self.names}
        self.rank = dist.get_rank()

    def _header(self, value: int) -> torch.Tensor:
        self.header.fill_(value)
        dist.broadcast(self.header, 0)
        return self.header

    def lead(self, name: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        self._header(self.names.index(name))
        bufs = self.inputs[name]
        for b, t in zip(bufs, inputs, strict=True):
            b.copy_(t)
            dist.broadcast(b, 0)
        return bufs

    def stop(self) -> None:
        """Rank 0: release the followers (they return from follow())."""
        self._header(-1)

    def follow(self, run) -> int:
        """Ranks > 0: replay what rank 0 broadcasts until it stops -> number of graph calls."""
        n = 0
        while True:
            idx = int(self._header(0)[0])
            if idx < 0:
                return n
            name = self.names[idx]
            inputs = self.inputs[name]
            for t in inputs:
                dist.broadcast(t, 0)
            run(name, inputs)
            n += 1


def artifact_rank(m: dict) -> int:
    """This process's rank for a tensor-parallel artifact; fails closed unless the process group
    matches what the graphs were exported for (size, and the group name baked into the collectives)."""
    from .artifact import ArtifactError
    tp = m["tp"]["size"]
    if not dist.is_initialized() or dist.get_world_size() != tp:
        have = dist.get_world_size() if dist.is_initialized() else 1
        raise ArtifactError(f"artifact is tensor-parallel (tp={tp}): launch it with `torchrun --nproc-per-node "
                            f"{tp} -m onegraph ...` (this process group has {have} rank(s))")
    name = dist.group.WORLD.group_name
    if name != m["tp"]["group_name"]:
        raise ArtifactError(f"artifact collectives were exported for process group {m['tp']['group_name']!r}, "
                            f"this default group is {name!r}")
    return dist.get_rank()
