"""Weights referenced from the checkpoint (`export --weights reference`): the artifact holds no weights file.

Its manifest's `weights_reference` names the checkpoint ("tiny": the builtin, written afresh from the
package's data; otherwise an absolute directory), every file the loader reads from it (size, sha256), the
recipe that turns them into the graph weights and the digest of those weights per rank (graphs/recipe.py):

    "weights_reference": {"checkpoint": "/abs/dir", "files": {"model-00001-of-00008.safetensors":
                          {"sha256": ..., "size": ...}, ...}, "recipe": {...}, "tensors_sha256": [...],
                          "bytes": [...]}

Artifact.load runs verify_files (every file present, of its size and sha256: the files hashed in parallel
threads); Artifact.load_weights runs rebuild (the recipe on those files, the result's digest compared with
the recorded one). Both fail closed with ArtifactError naming the file or the cause. This is load-time
code: graphs/ is imported here, never on the step path.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .artifact import ArtifactError, sha256_file


def checkpoint_dir(ref: dict) -> Path:
    """The referenced checkpoint directory (`tiny`: written now, byte-identical to the one exported from)."""
    if ref["checkpoint"] == "tiny":
        from onegraph.graphs.load import model_dir
        return model_dir("tiny")
    return Path(ref["checkpoint"])


def sha256_files(paths: list[Path]) -> list[str]:
    """sha256 of each file, several files at once (hashlib releases the GIL while it hashes a block)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(sha256_file, paths))


def verify_files(ref: dict) -> Path:
    """-> the checkpoint directory, after checking that the loader reads exactly the recorded files and that
    each has its recorded size and sha256."""
    from onegraph.graphs.recipe import checkpoint_files
    root = checkpoint_dir(ref)
    files = ref["files"]
    for rel, meta in files.items():
        f = root / rel
        if not f.is_file():
            raise ArtifactError(f"referenced checkpoint file {f} is missing (this artifact's weights are made "
                                f"from it at load: it was exported with --weights reference)")
        if f.stat().st_size != meta["size"]:
            raise ArtifactError(f"referenced checkpoint file {f}: {f.stat().st_size} bytes, the manifest expects "
                                f"{meta['size']} (modified since export)")
    try:
        now = checkpoint_files(root)
    except Exception as e:          # graphs/weights.py LoadError: no safetensors, unreadable index
        raise ArtifactError(f"referenced checkpoint {root}: {e}") from None
    if sorted(now) != sorted(files):
        raise ArtifactError(f"referenced checkpoint {root} now reads the files {sorted(now)}, the manifest records "
                            f"{sorted(files)}")
    rels = sorted(files)
    for rel, got in zip(rels, sha256_files([root / r for r in rels])):
        if got != files[rel]["sha256"]:
            raise ArtifactError(f"referenced checkpoint file {root / rel}: sha256 {got}, the manifest expects "
                                f"{files[rel]['sha256']} (modified since export)")
    return root


def rebuild(ref: dict, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s graph weights (CPU), made from the referenced checkpoint by the recorded recipe and
    checked against the digest recorded at export."""
    from onegraph.graphs.recipe import graph_weights, tensors_sha256
    root = checkpoint_dir(ref)
    try:
        w = graph_weights(root, ref["recipe"], rank)
    except (ValueError, OSError, KeyError) as e:       # LoadError is a ValueError
        raise ArtifactError(f"making the weights from the referenced checkpoint {root} failed: {e}") from None
    got, want = tensors_sha256(w), ref["tensors_sha256"][rank]
    if got != want:
        raise ArtifactError(f"the weights made from the referenced checkpoint {root} differ from the exported ones "
                            f"(sha256 {got}, the manifest expects {want}): the loading code or a checkpoint file "
                            f"changed since export; re-export")
    return w
