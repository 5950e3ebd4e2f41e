"""Reuse of compiled graphs across exports: a directory of .pt2 packages keyed by what they were made from.

The key is the sha256 of
- the traced program as torch.export.save writes it with the weights left out (graph, signature,
  shapes, strides, dtypes, example inputs, source locations), less each node's "from_node"
  provenance, which holds Python object ids and so differs between two traces of one graph; the
  rest is byte-stable across traces and processes (a test re-exports and expects every graph reused),
- the digest of the rank's weights (checkpoint/recipe.py tensors_sha256: every tensor's name, dtype, shape
  and bytes, what its weights file holds; the same whether the artifact copies them or references the
  checkpoint they are made from): Inductor bakes small constants into the code by value (0-d and 1-d
  tensors of up to 8 elements, e.g. `tiny`'s per-head A_log), so the weights are part of what a package
  was compiled from,
- the package's file name (the .pt2 archive names its contents after it),
- the lowering options (aoti.py's Inductor configs, eager rounding) and the device descriptor,
- the toolchain: torch, triton, the C++ compiler, CUDA, the CPU's vector ISA (-march=native).

An entry is a directory `<key[:2]>/<key>/` holding graph.pt2 and meta.json (its sha256, compile
seconds, toolchain); it is created under a temporary name and renamed into place, so concurrent
exports never see half an entry. A fetched entry whose bytes no longer match its sha256 is removed
and counted as a miss. Nothing is evicted: remove the directory to reclaim the space.

A package fetched from here is byte-identical to the one stored; two fresh compiles of the same
graph are not byte-identical to each other (the package embeds a time-based serialization id, and
Inductor appends its compile commands to the sources depending on the state of its own cache), so a
re-export is byte-identical to the export that filled the cache, not to a fresh compile.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import torch

from onegraph.runtime.artifact import sha256_file

DEFAULT_DIR = Path.home() / ".cache" / "onegraph" / "aoti"
# 2: lower_aoti inlines the in-place twins (export/inplace.py) before compiling; a package compiled
# from the same program without that pass calls the twin back through Python
KEY_VERSION = 2


@functools.lru_cache(maxsize=None)
def toolchain(device_type: str) -> dict:
    """What a compiled package depends on besides its graph."""
    from importlib import metadata
    v = {"torch": torch.__version__, "python": sys.version.split()[0], "machine": platform.machine()}
    try:
        v["triton"] = metadata.version("triton")
    except metadata.PackageNotFoundError:
        v["triton"] = None
    if device_type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        cxx = get_cpp_compiler()
        v["cxx"] = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        v["vec_isa"] = str(pick_vec_isa())
    else:
        v["cuda"] = torch.version.cuda
    return v


def warm_toolchain(device_type: str) -> threading.Thread:
    """toolchain(device_type) started in a thread, so it overlaps loading and tracing; join it before
    anything calls toolchain() or lowers. On CPU it asks Inductor for the vector ISA, which on a cold
    Inductor cache compiles and runs six probe programs (6 CPU-s on a 2-core machine); Inductor keeps the
    answers on disk, so lowering workers started after the join skip them."""
    t = threading.Thread(target=toolchain, args=(device_type,), name="onegraph-toolchain", daemon=True)
    t.start()
    return t


def _drop_provenance(o):
    if isinstance(o, dict):
        return {k: _drop_provenance(v) for k, v in o.items() if k != "from_node"}
    if isinstance(o, list):
        return [_drop_provenance(v) for v in o]
    return o


def program_digest(program: Path) -> str:
    """sha256 over the archive's members by name; the graph JSON without node provenance."""
    h = hashlib.sha256()
    with zipfile.ZipFile(program) as z:
        for info in sorted(z.infolist(), key=lambda i: i.filename):
            name = info.filename.split("/", 1)[-1]          # the archive's top folder is the file's stem
            if name == ".data/serialization_id":
                continue
            data = z.read(info)
            if name.startswith("models/") and name.endswith(".json"):
                data = json.dumps(_drop_provenance(json.loads(data)), sort_keys=True).encode()
            h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def graph_key(program_sha256: str, weights_sha256: str, file_name: str, lowering: dict, device: dict) -> str:
    """program_sha256: program_digest of the traced program saved without its weights."""
    meta = {"key_version": KEY_VERSION, "weights_sha256": weights_sha256, "file": file_name,
            "lowering": lowering, "device": device, "toolchain": toolchain(device["type"]),
            "program": program_sha256}
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


class GraphCache:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()

    def _entry(self, key: str) -> Path:
        return self.root / key[:2] / key

    def empty(self) -> bool:
        """No entry at all (e.g. a fresh machine): every graph will be compiled."""
        return next(self.root.glob("*/*/meta.json"), None) is None

    def fetch(self, key: str, dest: Path) -> bool:
        """Copy the package stored under `key` to dest -> True; False on a miss."""
        entry = self._entry(key)
        try:
            meta = json.loads((entry / "meta.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        if sha256_file(entry / "graph.pt2") != meta.get("sha256"):
            shutil.rmtree(entry, ignore_errors=True)        # damaged: compile again
            return False
        shutil.copyfile(entry / "graph.pt2", dest)
        return True

    def store(self, key: str, package: Path, compile_s: float, device_type: str) -> None:
        entry = self._entry(key)
        if entry.is_dir():
            return
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.parent / f".{key}.{os.getpid()}.{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            shutil.copyfile(package, tmp / "graph.pt2")
            (tmp / "meta.json").write_text(json.dumps({"sha256": sha256_file(tmp / "graph.pt2"),
                                                       "compile_s": compile_s, "file": package.name,
                                                       "toolchain": toolchain(device_type)}, indent=1))
            try:
                os.rename(tmp, entry)
            except OSError:                      # a concurrent export stored it first: keep theirs
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
