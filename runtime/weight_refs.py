"""Weights referenced from the checkpoint (`export --weights reference`): the artifact holds no weights file.

Its manifest's `weights_reference` names the checkpoint ("tiny": the builtin, written afresh from the
package's data; otherwise an absolute directory), every file the loader reads from it (size, sha256), the
recipe that turns them into the graph weights and the digest of those weights per rank (checkpoint/recipe.py):

    "weights_reference": {"checkpoint": "/abs/dir", "files": {"model-00001-of-00008.safetensors":
                          {"sha256": ..., "size": ...}, ...}, "recipe": {...}, "tensors_sha256": [...],
                          "bytes": [...]}

Artifact.load runs verify_files (every file present, of its size and sha256: the files hashed in parallel
threads); Artifact.load_weights runs rebuild (the recipe on those files, the result's digest compared with
the recorded one). A runtime that loads the artifact to make its weights (Artifact.load(defer_sha256=True):
the executor, the engine, every tensor-parallel rank) checks only the files' presence, sizes and list at
load, and rebuild hashes them in threads while the recipe reads the same files: each byte comes from the
disk once (the hash threads and the loader's memory maps share the page cache) and the hashing overlaps
the recipe's work, instead of a full read for the hashes followed by another for the weights. The hashes
are compared before the digest and before rebuild returns, so no weights made from a modified file are
used. Both fail closed with ArtifactError naming the file or the cause. This is load-time code: graphs/
is imported here, never on the step path.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .files import ArtifactError, sha256_file


def checkpoint_dir(ref: dict) -> Path:
    """The referenced checkpoint directory (`tiny`: written now, byte-identical to the one exported from)."""
    if ref["checkpoint"] == "tiny":
        from onegraph.checkpoint.load import model_dir
        return model_dir("tiny")
    return Path(ref["checkpoint"])


# files hashed at once while the recipe reads them, in the order it reads them (sorted). Few, so that on a disk
# slower than the hashing (the H200: 10 files, 37.4 GB, hashed at once in 28 s: 1.33 GB/s) the files the recipe
# reads first arrive first, instead of every file arriving together at the end; not one, so that a disk that
# reads faster with more requests in flight still gets several. 4 threads hash ~5 GB/s (sha_ni), more than the
# recipe consumes (37.4 GB in 21.7 s).
OVERLAP_HASH_THREADS = 4


def _workers(n: int, most: int | None = None) -> int:
    return max(1, min(n, os.cpu_count() or 1, most or n))


def sha256_files(paths: list[Path]) -> list[str]:
    """sha256 of each file, several files at once (hashlib releases the GIL while it hashes a block)."""
    with ThreadPoolExecutor(max_workers=_workers(len(paths))) as pool:
        return list(pool.map(sha256_file, paths))


def check_files(ref: dict) -> Path:
    """-> the checkpoint directory, after checking that the loader reads exactly the recorded files and that
    each has its recorded size (no file is read: their sha256 is verify_files' or rebuild's)."""
    from onegraph.checkpoint.recipe import checkpoint_files
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
    except Exception as e:          # checkpoint/weights.py LoadError: no safetensors, unreadable index
        raise ArtifactError(f"referenced checkpoint {root}: {e}") from None
    if sorted(now) != sorted(files):
        raise ArtifactError(f"referenced checkpoint {root} now reads the files {sorted(now)}, the manifest records "
                            f"{sorted(files)}")
    return root


def _check_sha256(root: Path, files: dict, got: dict[str, str]) -> None:
    for rel in sorted(files):
        if got[rel] != files[rel]["sha256"]:
            raise ArtifactError(f"referenced checkpoint file {root / rel}: sha256 {got[rel]}, the manifest expects "
                                f"{files[rel]['sha256']} (modified since export)")


def verify_files(ref: dict) -> Path:
    """-> the checkpoint directory, after check_files and checking each file's sha256."""
    root = check_files(ref)
    rels = sorted(ref["files"])
    _check_sha256(root, ref["files"], dict(zip(rels, sha256_files([root / r for r in rels]))))
    return root


def _make(root: Path, ref: dict, rank: int) -> dict[str, torch.Tensor]:
    from onegraph.checkpoint.recipe import graph_weights
    try:
        return graph_weights(root, ref["recipe"], rank)
    except (ValueError, OSError, KeyError) as e:       # LoadError is a ValueError
        raise ArtifactError(f"making the weights from the referenced checkpoint {root} failed: {e}") from None


def rebuild(ref: dict, rank: int, files_verified: bool = False,
            timings: dict | None = None) -> dict[str, torch.Tensor]:
    """Rank `rank`'s graph weights (CPU), made from the referenced checkpoint by the recorded recipe and
    checked against the digest recorded at export. files_verified=False (an Artifact loaded with
    defer_sha256): check_files, then every file hashed in threads while the recipe reads it, the hashes
    checked before the digest (and named instead of the recipe's own error when it failed on a modified
    file). `timings` (optional) gets the wall seconds of weights_make, sha256_wait (the hashing that
    outlasted the recipe), weights_digest, and checkpoint_sha256_overlapped (the hash threads' wall,
    concurrent with weights_make: not a stage of its own)."""
    from onegraph.checkpoint.recipe import tensors_sha256
    t = timings if timings is not None else {}
    t0 = time.perf_counter()
    if files_verified:
        root = checkpoint_dir(ref)
        w = _make(root, ref, rank)
        t["weights_make"] = time.perf_counter() - t0
    else:
        root = check_files(ref)
        rels, done = sorted(ref["files"]), []
        with ThreadPoolExecutor(max_workers=_workers(len(rels), OVERLAP_HASH_THREADS)) as pool:
            hashes = [pool.submit(sha256_file, root / r) for r in rels]        # started in this order
            for h in hashes:
                h.add_done_callback(lambda _: done.append(time.perf_counter()))
            try:
                w, failed = _make(root, ref, rank), None
            except Exception as e:
                w, failed = None, e
            t1 = time.perf_counter()
            got = {r: h.result() for r, h in zip(rels, hashes)}
        t["weights_make"], t["sha256_wait"] = t1 - t0, time.perf_counter() - t1
        t["checkpoint_sha256_overlapped"] = max(done, default=t0) - t0
        _check_sha256(root, ref["files"], got)     # first: a modified file is the cause, not what the recipe made of it
        if failed is not None:
            raise failed
    t2 = time.perf_counter()
    digest, want = tensors_sha256(w), ref["tensors_sha256"][rank]
    t["weights_digest"] = time.perf_counter() - t2
    if digest != want:
        raise ArtifactError(f"the weights made from the referenced checkpoint {root} differ from the exported ones "
                            f"(sha256 {digest}, the manifest expects {want}): the loading code or a checkpoint file "
                            f"changed since export; re-export")
    return w
