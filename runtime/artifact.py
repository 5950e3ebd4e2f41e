"""The artifact: a directory written once by `onegraph export`, loaded (never re-traced) by the runtime.

    manifest.json          format version, model config, dtype, device + descriptor, tool and op
                           versions, export options, each graph's signature/bucket/file, the state
                           layout, sha256 of every other file, and a self-hash of the manifest
    graphs/<name>.pt2      AOTInductor packages without weights (or graphs/<name>.onnx)
    weights.safetensors    the weights, once, bound to every graph at load; absent when the manifest's
                           `weights_reference` names the checkpoint files they are made from at load
                           instead (export --weights reference: runtime/weight_refs.py)
    fixture.safetensors    parity fixture: prompts -> greedy ids + logits recorded from eager
    tokenizer.json, tokenizer_config.json, chat_template.jinja   (when the checkpoint has them)

`Artifact.load` verifies everything once and fails closed with ArtifactError naming the cause; the
runtime builds its executor from the Artifact it returns.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from onegraph.models.state import STATE_KINDS

from .files import ArtifactError, sha256_file  # noqa: F401  (ArtifactError: re-exported)
from .weight_refs import check_files, rebuild, verify_files

FORMAT = "onegraph-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def _self_hash(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def tool_versions(backend: str) -> dict:
    import onegraph
    v = {"torch": torch.__version__, "onegraph": onegraph.__version__, "python": sys.version.split()[0]}
    if backend == "onnx":
        import onnxruntime
        v["onnxruntime"] = onnxruntime.__version__
    return v


def device_descriptor(device: torch.device) -> dict:
    """What the graphs were specialised for: recorded at export, checked at load (docs/design.md)."""
    import platform
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}",
                "multiprocessors": p.multi_processor_count, "total_memory": p.total_memory,
                "cuda": torch.version.cuda}
    return {"type": device.type, "machine": platform.machine()}


def is_artifact(path: str | Path) -> bool:
    """Whether `path` holds an artifact (a manifest); Artifact.load verifies it."""
    return (Path(path) / MANIFEST).is_file()


def manifest_unverified(path: str | Path) -> dict:
    """manifest.json as written, without Artifact.load's checks: for `inspect`, which reports on an artifact
    this machine may not be able to run (another device or torch)."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: no readable {MANIFEST} ({e})") from None


def tp_size(manifest: dict) -> int:
    """The tensor-parallel size a manifest was exported for (1: no `tp` entry)."""
    return manifest.get("tp", {}).get("size", 1)


@dataclasses.dataclass(frozen=True)
class StateEntry:
    """One state tensor every graph takes (slot dim "S" = slots + 1), as the manifest records it. kind: "kv"
    (attention KV cache [S, KVH, Tmax, D]: grows with max_seq_len), "conv" (GDN conv window [S, C, k-1]),
    "recurrent" (GDN state [S, HV, K, V], fp32), "spec" (speculative-round carry: the head's hidden, positions)."""
    name: str
    shape: tuple
    dtype: str
    kind: str

    @classmethod
    def from_manifest(cls, t: dict) -> "StateEntry":
        if t.get("kind") not in STATE_KINDS:
            raise ArtifactError(f"state tensor {t.get('name')!r}: kind {t.get('kind')!r} is not one of "
                                f"{STATE_KINDS} (an artifact from an older onegraph: re-export)")
        return cls(t["name"], tuple(t["shape"]), t["dtype"], t["kind"])


def write_manifest(out: Path, manifest: dict) -> None:
    """Write `manifest` (export's fields) as out/manifest.json with the format, every other file's sha256 and
    the manifest's own hash; its state entries must carry a known kind (StateEntry)."""
    for t in manifest.get("state", []):
        StateEntry.from_manifest(t)
    files = {}
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(out))] = sha256_file(p)
    manifest = dict(manifest, format=FORMAT, format_version=FORMAT_VERSION, files=files)
    manifest["manifest_sha256"] = _self_hash(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _verified(root: Path, files: bool = True) -> dict:
    """manifest.json of `root`, after checking its format, its self-hash and (files) every file's sha256."""
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{root} is not an onegraph artifact (no {MANIFEST})")
    try:
        m = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{mpath}: manifest is not valid JSON ({e})") from None
    if not isinstance(m, dict):
        raise ArtifactError(f"{mpath}: manifest is a JSON {type(m).__name__}, not an object")
    if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{mpath}: format {m.get('format')!r} v{m.get('format_version')!r}, this onegraph "
                            f"reads {FORMAT!r} v{FORMAT_VERSION}")
    if m.get("manifest_sha256") != _self_hash(m):
        raise ArtifactError(f"{mpath}: manifest hash mismatch (the manifest was modified after export)")
    for rel, digest in (m["files"] if files else {}).items():
        f = root / rel
        if not f.is_file():
            raise ArtifactError(f"artifact file {rel} is missing")
        if sha256_file(f) != digest:
            raise ArtifactError(f"artifact file {rel}: sha256 mismatch (corrupted or modified)")
    return m


def verify(path: str | Path, files: bool = True) -> dict:
    """manifest.json of the artifact at `path`, checked as Artifact.load checks it but for any machine (no
    device, torch or op-version check, no graph run): its format and self-hash, and with `files` every
    file's sha256 and a referenced checkpoint's files (sizes, then sha256). ArtifactError names the damage.
    `onegraph inspect` reads its manifest here (files=False: --no-verify)."""
    root = Path(path)
    m = _verified(root, files)
    if files and m.get("weights_reference") is not None:
        from .weight_refs import verify_files
        verify_files(m["weights_reference"])
    return m


def _usable(m: dict, device: str | torch.device | None) -> torch.device:
    """The device to run on (default: the artifact's), if the artifact can run there with this torch."""
    want = torch.device(device) if device is not None else torch.device(m["device"]["type"])
    if want.type != m["device"]["type"]:
        raise ArtifactError(f"artifact was exported for device {m['device']['type']!r}, cannot run on {want.type!r}")
    if want.type == "cuda" and not torch.cuda.is_available():
        raise ArtifactError("artifact was exported for 'cuda' but no CUDA device is available here")
    if m["versions"]["torch"] != torch.__version__ and m["backend"] == "aoti":
        raise ArtifactError(f"artifact was compiled with torch {m['versions']['torch']}, this is torch "
                            f"{torch.__version__}: AOTInductor packages need the same torch; re-export")
    from onegraph.custom_ops import schema_versions
    if m["ops"] != schema_versions():
        raise ArtifactError(f"artifact op schema versions {m['ops']} differ from this onegraph's "
                            f"{schema_versions()}; re-export")
    return want


def _field(key: str, doc: str, default=None):
    """A read-only property of Artifact: manifest[key] (`default` where an older manifest lacks it)."""
    return property(lambda self: self.manifest[key] if default is None else self.manifest.get(key, default),
                    doc=doc)


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A verified artifact (`Artifact.load`), to run on `device` as tensor-parallel rank `rank`.

    `manifest` is manifest.json as exported (read it, do not modify it); `graphs` and `weights` name this
    rank's files (a tensor-parallel manifest holds them as templates with {rank}); the properties are the
    manifest fields the runtime reads."""
    path: Path
    manifest: dict
    device: torch.device           # as asked (a CUDA device without an index means the current one)
    rank: int = 0
    graphs: dict = dataclasses.field(init=False, repr=False)     # name -> {kind, bucket, inputs, file, ...}
    weights: str | None = dataclasses.field(init=False)            # this rank's weights file, relative to path
                                                                   # (None: referenced, see weights_reference)
    # the referenced checkpoint files' sha256 were checked by load (False: load_weights checks them, in the
    # pass that reads them: Artifact.load(defer_sha256=True))
    checkpoint_hashed: bool = dataclasses.field(default=False, compare=False)
    # wall seconds of load's stages: artifact_files (manifest, sha256 of every artifact file), checkpoint_files
    # (the referenced checkpoint's files: present, sizes, list, and their sha256 unless deferred)
    load_timings_s: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        m, r = self.manifest, self.rank
        for t in m["state"]:                # every state tensor's kind known, or ArtifactError at load
            StateEntry.from_manifest(t)
        graphs, weights = m["graphs"], m["weights"]
        if self.tp > 1:
            graphs = {n: dict(g, file=g["file"].format(rank=r)) for n, g in graphs.items()}
            weights = weights and weights.format(rank=r)
        object.__setattr__(self, "graphs", graphs)
        object.__setattr__(self, "weights", weights)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device | None = None,
             defer_sha256: bool = False) -> "Artifact":
        """Read and verify an artifact directory (format, hashes of every file, torch and op versions);
        `device` (default: the artifact's) must be usable. Fails closed with ArtifactError. Referenced
        weights: their checkpoint files are checked too; defer_sha256 (for a caller that makes the weights
        next) checks their presence and sizes here and leaves their sha256 to load_weights, which hashes
        them while it reads them (runtime/weight_refs.py)."""
        t0 = time.perf_counter()
        root = Path(path)
        m = _verified(root)
        art = cls(root, m, _usable(m, device))
        art.load_timings_s["artifact_files"] = time.perf_counter() - t0
        if art.weights_reference is not None:          # the checkpoint files the weights are made from
            t1 = time.perf_counter()
            (check_files if defer_sha256 else verify_files)(art.weights_reference)
            object.__setattr__(art, "checkpoint_hashed", not defer_sha256)
            art.load_timings_s["checkpoint_files"] = time.perf_counter() - t1
        return art

    def for_rank(self, rank: int) -> "Artifact":
        """The same artifact as tensor-parallel rank `rank` (its graph files and weight shard)."""
        return dataclasses.replace(self, rank=rank)

    backend = _field("backend", "aoti | onnx")
    dtype = _field("dtype", "the float dtype exported, by name")
    model = _field("model", "the model config (models/qwen3_5/config.py ModelConfig.to_dict())")
    max_seq_len = _field("max_seq_len", "KV-cache length per slot")
    state = _field("state", 'the state tensors every graph takes last: [{name, shape ("S" = slots + 1), dtype, kind}] '
                           '(typed: state_tensors)')
    speculative_tokens = _field("speculative_tokens", "K of the speculative graphs (0: none)", 0)

    @property
    def options(self) -> dict:
        """The export options as recorded."""
        return self.manifest.get("options", {})

    @property
    def weights_reference(self) -> dict | None:
        """The checkpoint files, recipe and digests the weights are made from at load (runtime/weight_refs.py);
        None: the artifact holds its weights (`weights`)."""
        return self.manifest.get("weights_reference")

    @property
    def tp(self) -> int:
        return tp_size(self.manifest)

    @property
    def state_tensors(self) -> list[StateEntry]:
        """The state, typed: each tensor's name, shape, dtype and kind (kv / conv / recurrent / spec)."""
        return [StateEntry.from_manifest(t) for t in self.manifest["state"]]

    @property
    def quant(self) -> str:
        """The quantization scheme the weights were exported with (checkpoint/quant.py SCHEMES; "none")."""
        return self.options.get("quant", "none")

    @property
    def fixture(self) -> Path:
        return self.path / self.manifest["fixture"]

    def load_weights(self, device: torch.device | None = None, timings: dict | None = None) -> dict[str, torch.Tensor]:
        """This rank's weights, checked against the manifest's shapes, on `device` (default: self.device).
        Referenced weights are made from the checkpoint files by the export's recipe (and those files'
        sha256 checked as they are read, unless Artifact.load did). `timings` (optional) gets the wall
        seconds of the stages: weights_read (a weights file), or runtime/weight_refs.py rebuild's and
        weights_to_device (referenced)."""
        from safetensors.torch import load_file
        t = timings if timings is not None else {}
        if self.weights_reference is not None:
            dev = torch.device(device or self.device)
            made = rebuild(self.weights_reference, self.rank, self.checkpoint_hashed, t)
            t0 = time.perf_counter()
            w = {n: v.to(dev) for n, v in made.items()}
            t["weights_to_device"] = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            try:
                w = load_file(str(self.path / self.weights), device=str(device or self.device))
            except Exception as e:  # safetensors raises its own error types for truncated files
                raise ArtifactError(f"weights file {self.weights} cannot be read: {e}") from None
            t["weights_read"] = time.perf_counter() - t0
        for name, meta in self.manifest["weight_shapes"].items():
            if name not in w or list(w[name].shape) != meta:
                raise ArtifactError(f"weight {name}: expected shape {meta}, found "
                                    f"{list(w[name].shape) if name in w else 'nothing'}")
        return w


def load_manifest(path: str | Path, device: str | torch.device | None = None) -> dict:
    """manifest.json of a verified artifact (Artifact.load's checks)."""
    return Artifact.load(path, device).manifest
