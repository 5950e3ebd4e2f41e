"""The entry of every command that runs an artifact, alone or under torchrun (runtime/ranks.py has the
tensor-parallel protocol, runtime/executor.py the graphs): rank 0 gets the Artifact back, ranks > 0 follow.
Above executor.py and ranks.py, which it joins."""
from __future__ import annotations

import signal

from . import ranks
from .artifact import Artifact
from .executor import GraphExecutor


def lead_or_follow(path, max_slots: int, device: str | None = None, cuda_graphs: bool = True,
                   timeout_s: float = ranks.DEFAULT_TIMEOUT_S):
    """Load and verify the artifact at `path`. Under torchrun, join the process group first; ranks > 0
    then load their shard with the same slots as rank 0 (the slot ids it broadcasts index their state
    too) and replay rank 0's steps until it stops -> None (FollowerError if it vanishes). -> the
    Artifact on rank 0 and outside torchrun: the caller runs the engine on it."""
    art = Artifact.load(path, device, defer_sha256=True)     # every caller makes the weights next
    if not ranks.launched_by_torchrun():
        return art
    rank, _ = ranks.init_from_torchrun(art.device.type, timeout_s)
    if rank == 0:
        return art
    ex = GraphExecutor.from_artifact(art, max_slots=max_slots, cuda_graphs=cuda_graphs)
    # rank 0 owns the lifetime: the SIGTERM/SIGINT that torchrun or a terminal sends every rank makes
    # rank 0 shut down gracefully and release this rank (stop()); dying here first would fail rank 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        ex.follow()
    except RuntimeError as e:          # rank 0 exited or stopped answering
        raise ranks.FollowerError(f"tensor-parallel rank {rank}: {e}") from None
    finally:
        ranks.leave()
    return None
