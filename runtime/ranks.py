"""Tensor-parallel replay, the whole rank lifecycle: every rank replays its own graphs (its weight
shard, collectives inside the graph); rank 0 decides what runs and broadcasts each step to the others.
(models/qwen3_5/tp.py shards the model; this file runs the shards.)

    artifact = launch.lead_or_follow(path, ..)   # under torchrun: join the process group; ranks > 0
                                                    # follow rank 0 here until it stops -> None
    engine = Engine.from_artifact(artifact, ...)    # rank 0 (or a single process) runs the engine
    ...; engine.close(); leave()                    # close() releases the followers

Protocol, per graph call on rank 0 (the leader): ONE broadcast of a packed byte buffer holding a
header [graph index] (or [-1] = stop) and that graph's non-state inputs (tokens, slots, positions,
sampling). Ranks > 0 (followers) sit in `follow()`; the inputs they pass to the graph are views into
the received buffer (no copies), and they replay the same graph with their own state. Both sides
then meet in the graph's own all-reduces.

Why `native()` exists (without it 1 TP run in 6 deadlocked; py-spy: a `pt_gloo_runloop` thread in runLoop -> ~AsyncWork ->
TensorImpl::decref_pyobject -> gil_scoped_acquire, the main thread in loader.run -> all_reduce_ ->
ProcessGroupGloo::enqueue -> pthread_mutex_lock): a gloo worker thread needs the GIL whenever it drops the last C++ reference to a tensor that has a Python object (torch must
decref that object: TensorImpl::decref_pyobject), and it does so holding its group's work-queue
mutex, while torch's binding of AOTInductor's `run` holds the GIL for the whole graph, whose next
collective waits on that mutex: a deadlock. (At interpreter exit the same release aborts the process:
'terminate called without an active exception'.) Two kinds of tensor did it: the broadcast buffer,
and the all-gather's tensors, because the graph calls the all-gather through the dispatcher and torch
registers a *Python* autograd kernel for functional collectives (torch/_library/autograd.py ran on
every graph call, wrapping them in Python objects). `native()` builds a small C++ module that
removes every part of this:
- Loader.run runs the graph without the GIL and below autograd (no Python kernel, no Python objects
  on the collectives' tensors), and returns the outputs as fresh aliases, so a Python object never
  lands on a tensor that a collective's work may still hold;
- pin() keeps one extra C++ reference to the broadcast buffer, so no collective drops its last one.
NCCL's watchdog thread releases its works' tensors the same way, so CUDA runs the same code.

Launched by torchrun (`torchrun --nproc-per-node N -m onegraph generate|serve ARTIFACT ...`): the
process group comes from torchrun's environment; gloo on CPU, NCCL on CUDA. The collective timeout
(`--tp-timeout`) bounds how long a rank waits for a peer that stopped answering; a peer that exits
closes its connections and the others fail at their next collective.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300


class FollowerError(RuntimeError):
    """A rank > 0 lost its leader (rank 0 exited or stopped answering); the message names the rank."""


def launched_by_torchrun() -> bool:
    """True under torchrun (torch's own launcher check); the launch is the user's explicit choice."""
    return dist.is_torchelastic_launched()


def init_from_torchrun(device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join torchrun's process group (once) -> (rank, world size); (0, 1) outside torchrun."""
    if not launched_by_torchrun():
        return 0, 1
    if timeout_s <= 0:
        raise ValueError(f"the tensor-parallel collective timeout must be > 0 s, got {timeout_s}")
    if not dist.is_initialized():
        if device_type == "cuda":            # one GPU per rank on each node; "cuda" then means this one
            torch.cuda.set_device(dist.get_node_local_rank())
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def leave() -> None:
    """Destroy the process group before exit (no-op outside one)."""
    if dist.is_initialized():
        dist.destroy_process_group()


# The GIL-free runner and pin() (module docstring: why). Loader has torch._C._aoti.AOTIModelPackageLoader's
# interface (what AotiGraph uses of it).
_NATIVE_SRC = r"""
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/alias.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/utils/pybind.h>

using Loader = torch::inductor::AOTIModelPackageLoader;

// inputs are converted under the GIL; the graph runs without it, and below autograd: the ops it calls
// through the dispatcher (the all-gather) skip torch's Python autograd kernels for functional collectives
static std::vector<at::Tensor> run(Loader& self, const std::vector<at::Tensor>& inputs, void* stream) {
  py::gil_scoped_release no_gil;
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  std::vector<at::Tensor> out = self.run(inputs, stream);
  for (auto& t : out) t = at::alias(t);   // a new TensorImpl: a collective's work may hold the original
  return out;
}

PYBIND11_MODULE(onegraph_native, m) {
  py::class_<Loader>(m, "Loader", py::module_local())
      // (package path, model name, run_single_threaded, num_runners, device_index)
      .def(py::init<const std::string&, const std::string&, bool, size_t, c10::DeviceIndex>())
      .def("get_constant_fqns", &Loader::get_constant_fqns)
      .def("load_constants", [](Loader& self, std::unordered_map<std::string, at::Tensor>& constants,
                                bool use_inactive, bool check_full_update, bool user_managed) {
        self.load_constants(constants, use_inactive, check_full_update, user_managed);
      })
      .def("run", &run, py::arg("inputs"), py::arg("stream_handle") = nullptr);
  // one more C++ reference to t for the life of the process (called under the GIL)
  m.def("pin", [](const at::Tensor& t) { static auto* kept = new std::vector<at::Tensor>(); kept->push_back(t); });
}
"""


@functools.cache
def native():
    """The module above, built once with g++ (which AOTInductor needs anyway; about 10 s) into
    ~/.cache/onegraph, keyed by its source, torch and Python versions."""
    from torch.utils import cpp_extension
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    key = hashlib.sha256(f"{_NATIVE_SRC}{torch.__version__}{suffix}".encode()).hexdigest()[:16]
    out = Path.home() / ".cache" / "onegraph" / f"native-{key}" / f"onegraph_native{suffix}"
    if not out.is_file():
        if shutil.which("g++") is None:
            raise RuntimeError("tensor parallel needs g++ (as AOTInductor does) to build onegraph's native runner")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f"build-{os.getpid()}"            # ranks may build at once: each its own file
        tmp.with_suffix(".cpp").write_text(_NATIVE_SRC)
        cmd = ["g++", "-shared", "-fPIC", "-O1", "-std=c++17", "-w",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               str(tmp.with_suffix(".cpp")), "-o", str(tmp.with_suffix(".so")),
               *[f"-I{p}" for p in cpp_extension.include_paths()], f"-I{sysconfig.get_paths()['include']}",
               *[f"-L{p}" for p in cpp_extension.library_paths()],
               *[f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()],
               "-ltorch", "-ltorch_cpu", "-lc10", "-ltorch_python"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        tmp.with_suffix(".cpp").unlink()
        if r.returncode:
            raise RuntimeError("tensor parallel: building onegraph's native runner failed "
                               f"({' '.join(cmd)}):\n{r.stderr[-3000:]}")
        os.replace(tmp.with_suffix(".so"), out)                # atomic: a reader never sees half a file
    spec = importlib.util.spec_from_file_location("onegraph_native", out)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class StepBroadcast:
    """Rank 0 -> all: which graph runs next and its non-state inputs, as one broadcast per step."""

    def __init__(self, inputs: dict[str, list[tuple[torch.dtype, list[int]]]], device: torch.device):
        """inputs: per graph name, the (dtype, shape) of each input it takes from the leader."""
        self.names = sorted(inputs)
        # one persistent byte buffer [int64 header, padded to 16 bytes | inputs of the largest graph], every
        # input 16-byte aligned (AOTInductor compiles for 16-byte aligned inputs and copies any other one
        # on every call); self.inputs[name] are typed views into it (all shapes are static)
        layout, size = {}, 16
        for n in self.names:
            off, views = 16, []
            for dtype, shape in inputs[n]:
                nbytes = torch.Size(shape).numel() * dtype.itemsize
                views.append((off, nbytes, dtype, shape))
                off += -(-nbytes // 16) * 16
            layout[n], size = views, max(size, off)
        self.buf = torch.zeros(size, dtype=torch.uint8, device=device)
        native().pin(self.buf)                 # its broadcasts never drop the last C++ reference to it
        self.header = self.buf[:8].view(torch.int64)                           # [1]
        self.inputs = {n: [self.buf[o:o + nb].view(dt).view(shape) for o, nb, dt, shape in layout[n]]
                       for n in self.names}
        self.stopped = False

    def lead(self, name: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rank 0: send graph `name` and its inputs -> the same inputs, as views into the sent buffer."""
        if self.stopped:
            raise RuntimeError("tensor parallel: the other ranks were already released (stop())")
        self.header.fill_(self.names.index(name))
        views = self.inputs[name]
        for v, t in zip(views, inputs, strict=True):
            v.copy_(t)
        dist.broadcast(self.buf, 0)
        return views

    def stop(self) -> None:
        """Rank 0: release the followers (they return from follow()); once."""
        if not self.stopped:
            self.stopped = True
            self.header.fill_(-1)
            dist.broadcast(self.buf, 0)

    def receive(self) -> tuple[str | None, list[torch.Tensor]]:
        """Ranks > 0: the next call rank 0 broadcasts -> (graph name, its inputs as views into the buffer),
        or (None, []) once it stopped."""
        dist.broadcast(self.buf, 0)
        idx = int(self.header[0])
        if idx < 0:
            return None, []
        name = self.names[idx]
        return name, self.inputs[name]

    def follow(self, run) -> int:
        """Ranks > 0: replay what rank 0 broadcasts until it stops -> number of graph calls."""
        n = 0
        while True:
            name, inputs = self.receive()
            if name is None:
                return n
            run(name, inputs)
            n += 1


def artifact_rank(artifact) -> int:
    """This process's rank for a tensor-parallel Artifact; fails closed unless the process group
    matches what the graphs were exported for (size, and the group name baked into the collectives)."""
    from .artifact import ArtifactError
    m = artifact.manifest
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


def link(ex, artifact) -> "StepBroadcast":
    """The broadcast of a tensor-parallel executor over `artifact` (this rank's): what the followers need
    per call is an uncaptured graph's non-state inputs, or a captured bucket's staging bytes and which of
    its two graphs the leader replays ("captured_b{B}_{k}")."""
    from onegraph.graphs.signature import split_inputs, torch_dtype
    inputs = {n: [(torch_dtype(i["dtype"]), i["shape"]) for i in split_inputs(g["inputs"])[0]]
              for n, g in artifact.graphs.items()}
    inputs.update({f"captured_b{B}_{k}": [(torch.uint8, list(c.dev.shape))]
                   for B, c in ex.captured.items() for k in range(len(c.graphs))})
    return StepBroadcast(inputs, ex.device)
