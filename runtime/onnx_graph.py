"""The onnxruntime backend: an artifact's ONNX graphs as callables for GraphExecutor.

    onnx_graphs(artifact) -> {name: run(inputs) -> (next_ids, logits)}

`inputs` is the head inputs followed by the executor's state tensors. An ONNX graph cannot mutate
its inputs, so each graph returns the new state as extra outputs (`new.<state name>`, see
export/onnx.py); `run` binds them to scratch buffers and copies them back into the state tensors it
was passed, which is what the AOTInductor graphs do in place.

Weights: the graph files take every weight as a named input (the key in weights.safetensors). At
load each weight input becomes an initializer whose external-data reference points at its bytes in
weights.safetensors (so the model is valid as onnxruntime sees it), overridden by the tensor loaded
once and shared by every session (`SessionOptions.add_initializer`, no copy). onnxruntime treats
them as constants: it may fold weight-only subgraphs (e.g. an expert-weight transpose) per session.
CPU execution provider only; inputs and outputs go through I/O binding on the torch tensors' memory
(no numpy round trip). Every failure raises ArtifactError naming the graph and the cause.
"""
from __future__ import annotations

from pathlib import Path

import torch

from onegraph.graphs.signature import NEW_STATE_PREFIX, OUTPUTS, split_inputs

from .artifact import Artifact, ArtifactError

PROVIDER = "CPUExecutionProvider"
_NP = {torch.float32: "float32", torch.float16: "float16", torch.int64: "int64", torch.bool: "bool"}


def _ort():
    """onnxruntime (and onnx, which reads the graph files), or an ArtifactError naming what is missing."""
    try:
        import onnx  # noqa: F401
        import onnxruntime
    except ImportError as e:
        from .checks import install_hint
        raise ArtifactError(f"this artifact uses the onnx backend, but {e.name} cannot be imported: "
                            f"{install_hint('onnx')}") from None
    return onnxruntime


class OnnxGraph:
    """One ONNX graph in an onnxruntime session; `run(inputs)` updates the passed state in place."""

    def __init__(self, path: Path, meta: dict, weights: "SharedWeights", scratch: dict, threads: int):
        ort = _ort()
        if not path.is_file():
            raise ArtifactError(f"graph file {path.name} is missing")
        self.name = path.stem
        self.in_names = [i["name"] for i in meta["inputs"]]
        self.n_state = len(split_inputs(meta["inputs"])[1])
        self.out_names = list(OUTPUTS) + [NEW_STATE_PREFIX + n for n in self.in_names[-self.n_state:]]
        import onnx
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as e:
            raise ArtifactError(f"graph {path.name} is not a readable ONNX model: {e}") from None
        graph_inputs = [v.name for v in model.graph.input]
        if graph_inputs[:len(self.in_names)] != self.in_names:
            raise ArtifactError(f"graph {path.name}: inputs {graph_inputs[:len(self.in_names)]} differ from the "
                                f"manifest's {self.in_names}")
        # weight inputs -> initializers: an external-data reference into weights.safetensors (what
        # onnxruntime would read) overridden by the shared, already-loaded tensor (what it uses)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(weights.root))
        for vi in list(model.graph.input)[len(self.in_names):]:
            model.graph.initializer.append(weights.tensor_proto(vi, path.name))
            so.add_initializer(vi.name, weights.values[vi.name])
        del model.graph.input[len(self.in_names):]
        try:
            self.session = ort.InferenceSession(model.SerializeToString(), so, providers=[PROVIDER])
        except Exception as e:
            raise ArtifactError(f"cannot create an onnxruntime session for graph {path.name}: {e}") from None
        outs = [o.name for o in self.session.get_outputs()]
        if outs != self.out_names:
            raise ArtifactError(f"graph {path.name}: outputs {outs} differ from the expected {self.out_names}")
        shapes = [o.shape for o in self.session.get_outputs()[:2]]
        if not all(isinstance(d, int) for d in shapes[1]):
            raise ArtifactError(f"graph {path.name}: logits shape {shapes[1]} is not static")
        self.logits_shape = tuple(shapes[1])               # [B, vocab] (decode) or [1, vocab] (prefill)
        self.binding = self.session.io_binding()
        self.scratch = scratch       # new-state output buffers, shared by every graph (one runs at a time)

    @staticmethod
    def _bind(bind, name: str, t: torch.Tensor) -> None:
        bind(name, "cpu", 0, _NP[t.dtype], list(t.shape), t.data_ptr())

    def run(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if len(inputs) != len(self.in_names):
            raise ValueError(f"graph {self.name}: {len(inputs)} inputs, expected {len(self.in_names)}")
        state = inputs[-self.n_state:]
        inputs = [t.contiguous() for t in inputs]          # kept alive until the run returns
        key = tuple((tuple(t.shape), t.dtype) for t in state)
        new_state = self.scratch.get(key)
        if new_state is None:
            self.scratch.clear()
            new_state = self.scratch[key] = [torch.empty(t.shape, dtype=t.dtype) for t in state]
        b = self.binding
        for name, t in zip(self.in_names, inputs):
            self._bind(b.bind_input, name, t)
        ids = torch.empty(self.logits_shape[0], dtype=torch.int64)
        logits = torch.empty(self.logits_shape, dtype=torch.float32)
        for name, t in zip(self.out_names, [ids, logits] + new_state):
            self._bind(b.bind_output, name, t)
        self.session.run_with_iobinding(b)
        for s, new in zip(state, new_state):
            s.copy_(new)
        return ids, logits


class SharedWeights:
    """weights.safetensors loaded once; each tensor wrapped (no copy) in an OrtValue for every session."""

    def __init__(self, artifact: Artifact):
        import json
        import struct
        ort = _ort()
        self.root = artifact.path
        self.file = artifact.weights
        self.tensors = artifact.load_weights(torch.device("cpu"))       # verified against the manifest
        with open(self.root / self.file, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            self.header = json.loads(f.read(n))
        self.data_start = 8 + n
        self.values = {k: ort.OrtValue.ortvalue_from_numpy(t.numpy()) for k, t in self.tensors.items()}

    def tensor_proto(self, value_info, graph: str):
        """A TensorProto for weight input `value_info` referring to its bytes in weights.safetensors."""
        import onnx
        from onnx.external_data_helper import set_external_data
        name = value_info.name
        t = self.tensors.get(name)
        if t is None:
            raise ArtifactError(f"graph {graph} needs weight {name}, missing from the artifact's {self.file}")
        tt = value_info.type.tensor_type
        dims = [d.dim_value for d in tt.shape.dim]
        if dims != list(t.shape) or onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type) != t.numpy().dtype:
            raise ArtifactError(f"graph {graph}: weight {name} is {dims} "
                                f"{onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)} in the graph but "
                                f"{list(t.shape)} {t.dtype} in {self.file}")
        a, b = self.header[name]["data_offsets"]
        proto = onnx.TensorProto(name=name, data_type=tt.elem_type, dims=dims, raw_data=b"\0")
        set_external_data(proto, location=self.file, offset=self.data_start + a, length=b - a)
        proto.ClearField("raw_data")
        proto.data_location = onnx.TensorProto.EXTERNAL
        return proto


def onnx_graphs(artifact: Artifact) -> dict:
    """Every graph of a verified artifact (Artifact.load) as name -> run(inputs)."""
    if str(artifact.device) != "cpu":
        raise ArtifactError(f"onnx artifacts run on onnxruntime's CPU execution provider, not {str(artifact.device)!r}")
    if artifact.dtype != "float32":
        raise ArtifactError(f"onnx artifact has dtype {artifact.dtype!r}; the onnx backend runs float32 only")
    weights = SharedWeights(artifact)
    threads = torch.get_num_threads()
    graphs, scratch = {}, {}
    for name, g in artifact.graphs.items():
        graph = OnnxGraph(artifact.path / g["file"], g, weights, scratch, threads)
        graph.weights = weights       # the sessions use its memory: it lives as long as the graph
        graphs[name] = graph.run
    return graphs
