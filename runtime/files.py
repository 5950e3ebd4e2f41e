"""What every reader of an artifact's files shares: the error a load fails with, and file digests.
Below artifact.py and weight_refs.py, which both raise and hash."""
from __future__ import annotations

import hashlib
from pathlib import Path


class ArtifactError(ValueError):
    """The artifact cannot be used here; the message names the cause."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
